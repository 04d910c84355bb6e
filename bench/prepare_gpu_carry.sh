#!/usr/bin/env bash
# What a device call carries, made here on the CPU (docs/gpu.md "How to run"):
#   .whl       exllamav3 1.6.5 and the wheels the device image lacks (fastapi, uvicorn, openai, ...)
#   .gpucarry  the five small fixtures' model folders and the goldens tests/gpu reads (~21 MB)
# Both are git-ignored; together with the repo they stay under the call's 64 MiB.
#   bash bench/prepare_gpu_carry.sh [FIXTURES_DIR]     (default ../shared/fixtures)
set -euo pipefail
cd "$(dirname "$0")/.."
FIX=${1:-../shared/fixtures}
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
mkdir -p .whl
# the dependency closure of what the GPU paths import, at the versions this venv runs (its tests
# passed with them), less what the device image has (torch, triton, numpy, CUDA libraries): a
# hand-kept list went stale (openai 3 needs httpx2, fastapi 0.165 needs opentelemetry-api); the
# call carries at most 64 MiB, so what the image has (tokenizers, huggingface_hub) stays out
PY=${PY:-.venv/bin/python}
PINS=$("$PY" - <<'PYEOF'
import re
from importlib import metadata
roots = ["fastapi", "uvicorn", "prometheus-client", "openai", "pydantic", "jsonschema", "orjson"]
skip = re.compile(r"^(torch|triton|numpy|nvidia-.*|cuda-.*|setuptools|pip|wheel|huggingface-hub|hf-xet|tokenizers|safetensors)$")
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
seen, todo = {}, [norm(r) for r in roots]
while todo:
    n = todo.pop()
    if n in seen or skip.match(n):
        continue
    try:
        d = metadata.distribution(n)
    except metadata.PackageNotFoundError:
        continue
    seen[n] = d.version
    for req in d.requires or []:
        if "extra ==" in req:
            continue
        todo.append(norm(re.match(r"[A-Za-z0-9_.-]+", req).group(0)))
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PYEOF
)
for w in exllamav3==1.6.5 "llguidance>=1.7" marisa_trie $PINS; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
    -d .whl "$w" 2>&1 | grep -v "^WARNING" || true
done
rm -rf .gpucarry && mkdir -p .gpucarry/fixtures
for f in llama-4.0bpw-mul1 qwen3_moe-2.5bpw-mul1 glm4_moe-3.0bpw-mcg deepseek_v3-3.0bpw-3inst glm5_moe_dsa-3.0bpw-mul1; do
  mkdir -p .gpucarry/fixtures/$f && cp -r "$FIX/$f/model" .gpucarry/fixtures/$f/
done
for f in deepseek_v3-3.0bpw-3inst glm5_moe_dsa-3.0bpw-mul1; do cp "$FIX/$f/goldens_logits.safetensors" .gpucarry/fixtures/$f/; done
chmod -R u+w .gpucarry
du -sh .whl .gpucarry
# our cubins as an earlier call packed them ($OUT/cudacache.txz, copied here as .cudacache.txz) and
# exllamav3's extension (.exl3so), where this checkout has them: each saves a fresh machine minutes
EXTRA=""; [ -f .cudacache.txz ] && EXTRA+=', ".cudacache.txz"'; [ -f .exl3so/exl3so.xz ] && EXTRA+=', ".exl3so"'
echo "carry: [\".whl\", \".gpucarry\"$EXTRA]; run: FIXTURES=.gpucarry bash bench/gpu_all.sh tests e2e serve"
