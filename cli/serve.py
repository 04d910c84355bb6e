"""exl3tools serve: an OpenAI-compatible HTTP server over the EXL3 runtime."""

from __future__ import annotations

import codecs
import json
import os
import sys
from pathlib import Path

import click
from exl3tools.cli._device import run_device, run_options
from exl3tools.cli._runtime import LoadProgress, api_keys_option, preflight_plan

from exl3tools.errors import NotFoundError, UsageError
from exl3tools.plan import DEFAULT_MAX_NUM_SEQS
from exl3tools.server.reasoning import PARSERS

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo" / "glm4_moe-3.0bpw-mcg" / "model"
SHUTDOWN_MARGIN_S = 5.0   # uvicorn's own deadline past --shutdown-timeout: the ended streams' last bytes


def _pos(_ctx, _param, value: int) -> int:
    if value < 1:
        raise click.BadParameter("must be at least 1")
    return value


def _json_list(_ctx, _param, value: str | None) -> tuple[str, ...] | None:
    """vLLM's form of the CORS options: a JSON list of strings, e.g. '["https://a.example"]'."""
    if value is None:
        return None
    try:
        got = json.loads(value)
    except ValueError:
        got = None
    if not isinstance(got, list) or not all(isinstance(x, str) for x in got):
        raise click.BadParameter(f"must be a JSON list of strings, e.g. '[\"*\"]', not {value!r}")
    return tuple(got)


@click.command("serve")
@click.argument("path", required=False)
@click.option("--tp", "--tensor-parallel-size", "-tp", "tp", default=1, show_default=True, callback=_pos,
              help="Tensor-parallel ranks.")
@click.option("--moe", type=click.Choice(["tp", "ep"]), default="tp", show_default=True,
              help="With --tp on an unsliced checkpoint: split each expert (tp) or whole experts (ep).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind (0.0.0.0 exposes the server to the network).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", "api_keys", multiple=True, callback=api_keys_option,
              help="Accept this Bearer key (repeatable; never empty). Else EXL3TOOLS_SERVE_API_KEY "
                   "(one key) / EXL3TOOLS_SERVE_API_KEYS (several), then VLLM_API_KEY. Without any key the "
                   "API is open.")
@click.option("--metrics-require-key", is_flag=True, default=False,
              help="Keep /metrics behind the API key too. Default: open, as vLLM's (Prometheus scrapers "
                   "send no key); /health, /ping and /version are always open.")
@click.option("--max-num-seqs", "--max-batch", "max_batch", default=DEFAULT_MAX_NUM_SEQS, show_default=True, callback=_pos,
              help="Most sequences decoded together (one CUDA graph per batch bucket up to it).")
@click.option("--max-queue", default=256, show_default=True, callback=_pos,
              help="Most sequences waiting; beyond it requests get 429 + Retry-After.")
@click.option("--max-cache-tokens", type=int, default=None,
              help="KV-cache size in tokens (default: from --gpu-memory-utilization on CUDA, 32768 on the CPU).")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.9, show_default=True,
              help="Share of the GPU's memory the server may use: the KV cache gets what weights and the "
                   "measured activation peak leave of it.")
@click.option("--block-size", type=click.Choice(["8", "16", "32", "64"]), default="16", show_default=True,
              help="Tokens per KV-cache block (paged cache, prefix caching by whole blocks).")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto",
              show_default=True, help="KV-cache element type (auto: bf16 on CUDA, fp16 there for MLA/DSA models, "
                                      "whose split kernel's fp16 tensor-core dots are 4-11x faster; fp32 on the CPU).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "prefix_caching", default=True,
              show_default=True, help="Reuse cached KV blocks of a repeated prompt prefix.")
@click.option("--max-prefill-tokens", "--max-num-batched-tokens", "max_prefill_tokens", type=click.IntRange(1, None),
              default=None, help="Prompt tokens per engine step (long prompts are chunked so decoding goes on; "
                                 "default 2048 on CUDA, 512 on the CPU).")
@click.option("--prefill-wait-ms", type=click.FloatRange(0, 1000), default=0, show_default=True,
              help="When the engine is idle, wait up to this long after a request arrives for more to prefill "
                   "in the same step (a burst of N prompts then costs one prefill, not up to N); running "
                   "streams never wait. 0: start at once.")
@click.option("--speculative-tokens", type=click.IntRange(0, 8), default=0, show_default=True,
              help="MTP speculative decoding: draft this many tokens per step with the checkpoint's MTP head "
                   "(GLM-5, DeepSeek-V3), verify them in one forward; greedy output is unchanged, sampled "
                   "output keeps the model's distribution. 0: off.")
@click.option("--reasoning-parser", type=click.Choice(PARSERS), default="none", show_default=True,
              help="Chat answers' <think>...</think> as message.reasoning_content (streamed as "
                   "delta.reasoning_content) and the rest as content, where tool calls are read (GLM-4.5 and "
                   "later, DeepSeek-R1, Qwen3; deepseek_r1, qwen3 and glm45 are vLLM's names for the same "
                   "tags). none: answers stay whole.")
@click.option("--max-model-len", "--max-context", "max_context", type=click.IntRange(1, None), default=None,
              help="Cap the context length (default: the model's, and what the KV cache holds).")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="Model id clients send (default: the model's). Repeatable: answers report the first, "
                   "requests may name any, /v1/models lists them all.")
@click.option("--chat-template", default=None,
              help="A Jinja chat template that replaces the checkpoint's: a file, or the template text itself.")
@click.option("--generation-config", type=click.Choice(["auto", "vllm"]), default="auto", show_default=True,
              help="auto: generation_config.json's temperature, top_p, top_k, repetition_penalty, min_p and "
                   "max_new_tokens are the defaults of fields a request leaves out; vllm: ignore them.")
@click.option("--seed", type=int, default=None,
              help="Seed the server: requests without a seed sample alike after a restart (sent in the same "
                   "order). Default: a random seed per request.")
@click.option("--allowed-origins", callback=_json_list, default=None,
              help='CORS: origins browsers may call from, a JSON list (\'["*"]\' for any). Default: no CORS.')
@click.option("--allowed-methods", callback=_json_list, default=None,
              help='CORS: allowed methods, a JSON list (default \'["*"]\'; needs --allowed-origins).')
@click.option("--allowed-headers", callback=_json_list, default=None,
              help='CORS: allowed request headers, a JSON list (default \'["*"]\'; needs --allowed-origins).')
@click.option("--allow-credentials", is_flag=True, default=False,
              help="CORS: allow cookies / Authorization on cross-origin requests (needs --allowed-origins).")
@run_options
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Decode steps as CUDA graphs, one per batch-size bucket, over the paged KV cache. "
                   "Default: on with a CUDA device (if a capture fails on one GPU, eager decode).")
@click.option("--batch-invariant", is_flag=True, default=False,
              help="Compute every request exactly as if it ran alone (CUDA, GQA models, --tp 1): the same seed "
                   "gives the same text whatever else is served, and a prefix-cache hit equals a cold run. "
                   "Prompts then run through the decode kernels (slower TTFT; docs/serve.md).")
@click.option("--threads", "cpu_threads", type=click.IntRange(1, None), default=None,
              help="CPU threads for the model (default: all cores but one).")
@click.option("--shutdown-timeout", type=click.FloatRange(0, None), default=5.0, show_default=True,
              help="On SIGTERM / SIGINT: stop accepting connections, then give requests in flight (streams "
                   "too) up to this many seconds to finish; those still running then end with a 503 "
                   "server_shutting_down error (a rolling restart's drain).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve_cmd(path: str | None, tp: int, moe: str, host: str, port: int, api_keys: tuple[str, ...],
              max_batch: int, max_queue: int, max_cache_tokens: int | None, gpu_memory_utilization: float,
              block_size: str, kv_cache_dtype: str, prefix_caching: bool, max_prefill_tokens: int | None,
              prefill_wait_ms: float, speculative_tokens: int, reasoning_parser: str, max_context: int | None,
              served_model_names: tuple[str, ...], chat_template: str | None, generation_config: str,
              seed: int | None, allowed_origins: tuple[str, ...] | None, allowed_methods: tuple[str, ...] | None,
              allowed_headers: tuple[str, ...] | None, allow_credentials: bool, device: str, backend: str,
              cuda_graphs: bool | None, batch_invariant: bool, cpu_threads: int | None, shutdown_timeout: float,
              log_level: str, metrics_require_key: bool) -> None:
    """Serve PATH (a checkpoint, a rank-slice output or a hub repo id) over the OpenAI API.

    Without PATH, serves the demo checkpoint shipped with exl3tools. Binds early: /health
    answers 503 + Retry-After while the model loads, 200 once it answered a first forward pass.
    """
    import logging

    import uvicorn

    from exl3tools.server.app import ServeConfig, create_app

    if path is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise NotFoundError(f"no PATH given and the demo checkpoint is missing ({DEMO_MODEL})")
        path = str(DEMO_MODEL)
    _check_path(path, tp)
    if allowed_origins is None and (allowed_methods is not None or allowed_headers is not None or allow_credentials):
        raise UsageError("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins "
                         "(without it the server sends no CORS headers)")
    if metrics_require_key and not api_keys:   # refused rather than ignored, as the CORS options are
        raise UsageError("--metrics-require-key needs an API key (--api-key, EXL3TOOLS_SERVE_API_KEY(S) or "
                         "VLLM_API_KEY); without one every endpoint is open")
    if any(not n.strip() for n in served_model_names):
        raise UsageError("--served-model-name must not be empty")
    template = _chat_template(chat_template)
    asked, device = device, run_device(device, tp)
    interval = os.environ.get("EXL3TOOLS_SWITCH_INTERVAL_MS")   # the GIL's (docs/serve.md "Diagnostics")
    if interval:
        try:
            sys.setswitchinterval(float(interval) / 1e3)
        except ValueError:
            raise UsageError(f"EXL3TOOLS_SWITCH_INTERVAL_MS must be a positive number of ms, got {interval!r}") from None
    if os.environ.get("EXL3TOOLS_MLA_TILE"):     # parsed at import: a bad value is one line, exit 2
        import exl3tools.kernels.mla_attention  # noqa: F401
    if os.environ.get("EXL3TOOLS_MLA_ABSORB_DOT"):
        import exl3tools.kernels.mla_absorb  # noqa: F401
    if max_cache_tokens is not None and max_cache_tokens < 1:
        raise UsageError("--max-cache-tokens must be at least 1")
    if max_prefill_tokens is None:
        max_prefill_tokens = 2048 if device.startswith("cuda") else 512
    if batch_invariant:
        from exl3tools.runtime import invariance

        if not device.startswith("cuda") or tp != 1 or cuda_graphs is False:
            raise UsageError("--batch-invariant needs --device cuda, --tp 1 and the fixed-shape decode step "
                             "(not --no-cuda-graphs)")
        os.environ[invariance.VARIABLE] = "1"      # read where the kernels and the runner are built
        max_prefill_tokens = invariance.prefill_tokens(max_prefill_tokens, max_batch)   # for the preflight too
    if max_cache_tokens is None:  # refuse in one line before reading a weight (docs/plan.md)
        preflight_plan(path, device=device, tp=tp, moe=moe, util=gpu_memory_utilization, block_size=int(block_size),
                       kv_dtype=kv_cache_dtype, max_num_seqs=max_batch, batched_tokens=max_prefill_tokens,
                       max_model_len=max_context)
    cfg = ServeConfig(model_path=path, served_model_name=served_model_names or None, tp=tp, moe=moe, device=device,
                      backend=backend, api_keys=tuple(api_keys), metrics_require_key=metrics_require_key,
                      max_batch=max_batch, max_queue=max_queue, max_cache_tokens=max_cache_tokens,
                      max_prefill_tokens=max_prefill_tokens, max_context=max_context,
                      cpu_threads=cpu_threads, cuda_graphs=cuda_graphs,
                      gpu_memory_utilization=gpu_memory_utilization, block_size=int(block_size),
                      kv_cache_dtype=kv_cache_dtype, prefix_caching=prefix_caching,
                      speculative_tokens=speculative_tokens, prefill_wait_s=prefill_wait_ms / 1e3,
                      reasoning_parser=reasoning_parser, chat_template=template,
                      generation_config=generation_config, seed=seed, allowed_origins=allowed_origins,
                      allowed_methods=allowed_methods or ("*",), allowed_headers=allowed_headers or ("*",),
                      allow_credentials=allow_credentials)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if asked == "auto":
        logging.getLogger("exl3tools.serve").info("--device auto: serving on %s", device)
    if not api_keys and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("exl3tools.serve").warning(
            "binding %s without --api-key: anyone who can reach it can use it", host)
    app = create_app(cfg)
    engine = app.state.server.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            # uvicorn stops accepting connections; the engine ends what is still running at the
            # deadline with an error event in each API's shape, before uvicorn would cut them
            engine.drain(shutdown_timeout)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_MARGIN_S))

    progress = LoadProgress(logging.getLogger("exl3tools.serve"))  # a bar while the weights load

    def on_state(state: str) -> None:  # a server that can never load should not linger
        progress.close()
        if state == "failed":
            server.should_exit = True

    engine.on_state = on_state
    with progress:
        server.run()
    if engine.load_exception is not None:
        raise engine.load_exception


def _check_path(path: str, tp: int) -> None:
    """Fail in one line before binding: a missing path, a layout that does not fit --tp, or no
    tokenizer.json (the server answers in text; a hub checkpoint's is checked once downloaded)."""
    from exl3tools.hub import looks_like_repo_id
    from exl3tools.runtime.loader import resolve
    from exl3tools.server.prepare import check_tokenizer

    if Path(path).exists():
        check_tokenizer(resolve(path, tp).rank_dir(0))   # (a rank-slice output: each rank's folder has one)
    elif not looks_like_repo_id(path):
        raise NotFoundError(f"{path}: no such checkpoint directory (and not a hub repo id)")


def _chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: an existing file's text; else the value itself when it
    looks like Jinja (braces or a newline; backslash escapes such as \\n decoded); else an error.
    Either way it must compile, so a broken template is one line here, not a 400 on every chat."""
    if value is None:
        return None
    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        if not any(c in value for c in "{}\n"):
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise UsageError(f"--chat-template {value!r}: not a readable file ({why}) nor a Jinja template") from None
        try:    # backslashreplace first: characters past latin-1 survive unicode_escape
            text = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
        except UnicodeDecodeError:   # a lone trailing backslash: the text as given
            text = value
    if not text.strip():
        raise UsageError(f"--chat-template {value!r}: the template is empty")
    from jinja2 import TemplateSyntaxError

    from exl3tools.server.template import ChatTemplate

    try:
        ChatTemplate(text)
    except TemplateSyntaxError as exc:
        raise UsageError(f"--chat-template: not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
    return text
