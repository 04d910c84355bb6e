#!/usr/bin/env bash
# Everything one device call does: install carried wheels, build exllamav3 in the background while
# our kernels are tested and timed, then the exllamav3 comparison and the decode-step benchmark.
# Run from the repo root on the device: carry .whl and .gpucarry. Logs under $OUT; tables last.
#   bash bench/gpu_all.sh [tests] [bench] [e2e]     (default: all three)
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
STAGES=${*:-tests bench e2e}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 EXL3TOOLS_KERNEL_CACHE=/tmp/exl3k
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
# exl3tools without pip: pyproject maps exl3tools.{kernels,cli,schemas} to top-level folders; mirror
# that with links inside this (device) copy when the package is not importable as installed
if ! python3 -c "import exl3tools.kernels" 2>/dev/null; then
  for d in kernels cli schemas; do [ -e exl3tools/$d ] || ln -s ../$d exl3tools/$d; done
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"

# exllamav3: JIT build of its extension (~4 min cold); later imports in this machine reuse it
( MAX_JOBS=${EXL3_JOBS:-12} python3 -c "import exllamav3; from exllamav3.ext import exllamav3_ext; print('exllamav3 ok')" \
  > "$OUT/build.log" 2>&1; echo "build rc $?" >> "$OUT/build.log" ) &
BUILD=$!

if [[ $STAGES == *tests* ]]; then
  el "tests"
  EXL3TOOLS_FIXTURES=$PWD/.gpucarry/fixtures timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider \
    -n ${TEST_JOBS:-3} tests/gpu > "$OUT/tests.log" 2>&1
  el "tests rc $?"; tail -n 15 "$OUT/tests.log"
fi
el "waiting for exllamav3 build"; wait $BUILD; tail -n 3 "$OUT/build.log"; el "build done"
if [[ $STAGES == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-200} python3 bench/gpu_bench.py --codebooks mul1,mcg,3inst --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  el "bench all rc $?"
fi
if [[ $STAGES == *e2e* ]]; then
  timeout ${E2E_TIMEOUT:-120} python3 bench/gpu_e2e.py --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1; el "e2e rc $?"
fi
echo "=== tests"; grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -n 3
echo "=== bench"; sed -n '/in->out/,$p' "$OUT/bench.log" 
echo "=== e2e"; sed -n '/batch/,$p' "$OUT/e2e.log" 2>/dev/null | tail -n 4
