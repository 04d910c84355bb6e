#!/usr/bin/env bash
# The main job on the shipped demo checkpoint: inspect, validate, rank-slice for 2 GPUs, verify.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=demo/glm4_moe-3.0bpw-mcg/model
OUT=out/demo
rm -rf "$OUT"; mkdir -p "$OUT"
set -x
exl3tools inspect "$SRC" --tp 2
