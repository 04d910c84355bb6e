#!/usr/bin/env bash
# The main job on the shipped demo checkpoint (a tiny GLM-4.5-style MoE, 2.5 MB):
# inspect -> validate -> rank-slice for 2 GPUs -> verify -> validate the sliced set -> generate
# with 2 tensor-parallel CPU processes, each reading only its own rank directory.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=demo/glm4_moe-3.0bpw-mcg/model
OUT=out/demo
rm -rf "$OUT"; mkdir -p "$OUT"
set -x
exl3tools inspect "$SRC" --tp 2
exl3tools validate "$SRC"
exl3tools rank-slice "$SRC" "$OUT/tp2" --tp 2 --moe ep --dry-run
exl3tools rank-slice "$SRC" "$OUT/tp2" --tp 2 --moe ep
exl3tools verify "$SRC" "$OUT/tp2"
exl3tools validate "$OUT/tp2"
exl3tools generate "$OUT/tp2" --tp 2 --prompt "The quick brown fox" --max-tokens 16 --temperature 0
