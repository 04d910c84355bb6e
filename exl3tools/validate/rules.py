"""The validate rule table: every code, its severity and a one-line description.

Codes are stable (CI configs and bug reports quote them): never renumber, only add. The severity
is the code's first letter (E = error, W = warning). docs/validate.md is checked against this table
by tests/test_validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rule:
    code: str
    title: str

    @property
    def severity(self) -> str:
        return "error" if self.code.startswith("E") else "warning"

    @property
    def group(self) -> str:
        return GROUPS.get(self.code[1], "other")


GROUPS = {"1": "structure", "2": "EXL3 linear", "3": "architecture", "4": "numeric", "5": "rank-sliced"}

_TABLE = [
    # ---- E1xx structure: files, headers, index, config
    ("E100", "config.json missing, not a readable JSON object, lacking a required key, or declaring an implausible count"),
    ("E101", "safetensors file missing, unreadable or not a regular file (FIFO, directory, device), or none at all"),
    ("E102", "safetensors header length bomb, or file truncated (shorter than its header says)"),
    ("E103", "safetensors header is not valid JSON (or not an object)"),
    ("E104", "bad header entry: unknown dtype, bad shape, bad data_offsets or __metadata__"),
    ("E105", "tensor data_offsets outside the file's data buffer"),
    ("E106", "tensors overlap in the data buffer"),
    ("E107", "hole (unreferenced bytes) between tensors"),
    ("E108", "dtype x shape does not match the tensor's byte length"),
    ("E109", "unreferenced bytes after the last tensor (file size vs header)"),
    ("E110", "index names a file that does not exist"),
    ("E111", "indexed tensor not in the file the index names"),
    ("E112", "tensor in a file but not in the index (loaders skip it)"),
    ("E113", "tensor name stored twice (in two files)"),
    ("E114", "model.safetensors.index.json invalid (not a readable JSON file, no weight_map, path outside the checkpoint)"),
    ("E115", "quantization_config.json is not valid JSON or not an object"),
    ("E116", "no quantization_config, or quant_method is not exl3"),
    ("E117", "quantization_config field invalid (bits, head_bits, mtp_bits, codebook)"),
    ("E118", "quantization_config disagrees with the tensors (head_bits vs lm_head K, mtp_bits vs MTP K)"),
    ("E119", "safetensors file not in the index holds an indexed tensor (exllamav3 loads every file: the later wins)"),
    ("W101", "safetensors file not referenced by the index (HF loaders and vLLM skip it, exllamav3 loads it)"),
    ("W102", "config.json quantization_config and quantization_config.json disagree"),
    ("W103", "no quantization_config.json / tensor_storage (vLLM's EXL3 backend requires it)"),
    # ---- E2xx EXL3 linears
    ("E201", "EXL3 linear incomplete: trellis without its sign vectors (suh/svh or su/sv)"),
    ("E202", "trellis dtype is not I16"),
    ("E203", "trellis is not rank 3 (and not a quantized embedding)"),
    ("E204", "EXL3 part (suh/svh/su/sv/marker/bias) without a trellis"),
    ("E205", "sign vector or legacy sign dtype/rank wrong (suh/svh F16 rank 1, su/sv I16 rank 1)"),
    ("E206", "trellis dims inconsistent with suh/svh (or su/sv) lengths"),
    ("E207", "padded dims not multiples of 128"),
    ("E208", "trellis dims inconsistent with config.json dims padded to 128"),
    ("E209", "illegal K (trellis last dim not 16..128 step 16, 24, 40 or 56)"),
    ("E210", "half-integer K without the mul1 marker"),
    ("E211", "codebook marker is not a 0-d I32"),
    ("E212", "codebook marker value is not the legal constant"),
    ("E213", "both mcg and mul1 markers"),
    ("E214", "linear codebook differs from quantization_config.codebook"),
    ("E215", "mixed codebooks within one layer (vLLM's EXL3 backend rejects the layer)"),
    ("E216", "experts of one layer have different K for the same projection (fused MoE paths assert it)"),
    ("E217", "bias dtype/shape wrong (F16 [n])"),
    ("E218", "legacy scale tensor present (exllamav3 1.6.5 would ignore it and mis-decode)"),
    ("E219", "legacy su/sv mixed with suh/svh on one linear"),
    ("E220", "quantization_config.json tensor_storage disagrees with the tensors"),
    ("W201", "EXL3 linear missing from tensor_storage (vLLM would treat it as unquantized)"),
    # ---- E3xx architecture completeness
    ("E301", "expected linear missing"),
    ("E302", "expected dense tensor missing (norm, router, embedding, kv_b_proj, indexer...)"),
    ("E303", "routed expert projection missing"),
    ("E304", "dense tensor (or unquantized linear) has the wrong shape"),
    ("E305", "dense tensor has a non-float dtype"),
    ("E307", "linear lacks the bias its config requires (attention_bias)"),
    ("E309", "MTP layer incomplete"),
    ("W301", "architecture unknown: completeness not checked"),
    ("W302", "unexpected tensor (no loader for this architecture reads it)"),
    ("W303", "num_nextn_predict_layers > 0 but the quant has no MTP layer (dropped)"),
    ("W304", "MTP layers present but not declared by num_nextn_predict_layers"),
    ("W305", "completeness check skipped for tensors of unreadable files"),
    # ---- E4xx numeric
    ("E401", "suh/svh/bias contains NaN or Inf"),
    ("E402", "suh zero inside the real dims, or svh all zero (dead linear)"),
    ("E403", "svh non-zero on padding columns (must be exactly 0)"),
    ("E404", "dense tensor contains NaN or Inf"),
    ("E405", "decoded weight sample not finite"),
    ("E406", "decoded weight sample overflows fp16 (|W| >= 65504)"),
    ("E409", "sampled trellis bytes are all zero (data never written: sparse or preallocated file?)"),
    ("E410", "I/O error while reading tensor data"),
    ("W401", "svh zero on some real output columns (all-zero output columns)"),
    ("W402", "decoded weight sample has implausible magnitude (rms > 100)"),
    ("W403", "norm weight is all zeros"),
    # ---- E5xx rank-sliced outputs (exl3tools rank-slice, docs/rank-slice.md)
    ("E501", "rank-slice output has no manifest.json: incomplete (never complete)"),
    ("E502", "manifest.json invalid (not JSON or not valid against schemas/rank_manifest.v1.json)"),
    ("E503", "file listed in the manifest missing, or size/sha256 differs"),
    ("E504", "rank directory missing, extra, or named inconsistently with tp"),
    ("E505", "rank config.json exl3tools block inconsistent (tp, rank, layout, moe, fingerprint)"),
    ("E506", "rank tensors differ from the manifest (missing, extra, shape vs slice)"),
    ("E507", "slices of one tensor inconsistent across ranks (gaps, overlap, not 128-aligned, wrong sum)"),
    ("E508", "rank dir validated alone has no manifest above it"),
    ("W501", "file under the output not listed in the manifest"),
]

RULES: dict[str, Rule] = {c: Rule(c, t) for c, t in _TABLE}


def rule(code: str) -> Rule:
    return RULES[code]
