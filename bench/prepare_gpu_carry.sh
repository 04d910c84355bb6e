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
for w in exllamav3==1.6.5 "llguidance>=1.7" marisa_trie pydantic pydantic_core annotated_types typing_inspection \
         fastapi starlette uvicorn openai httpx2 httpcore2 truststore h11 anyio idna certifi typing_extensions \
         distro jiter sniffio orjson jsonschema jsonschema_specifications \
         referencing rpds_py; do
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
echo "carry: [\".whl\", \".gpucarry\"]; run: FIXTURES=.gpucarry bash bench/gpu_all.sh tests e2e serve"
