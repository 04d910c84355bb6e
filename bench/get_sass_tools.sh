#!/usr/bin/env bash
# cuobjdump and nvdisasm for this CPU machine (nvcc's toolkit here lacks them), from NVIDIA's
# wheels on the package index, into .sass-tools/bin (git-ignored): read the SASS of a cubin nvcc
# builds here, no GPU needed, e.g. the instructions of a kernel's inner loop:
#   bash bench/get_sass_tools.sh && export PATH=$PWD/.sass-tools/bin:$PATH
#   nvcc -std=c++17 -O3 -cubin -gencode=arch=compute_90a,code=sm_90a -DK2=6 -DCB=0 kernels/csrc/exl3_gemv.cu -o /tmp/g.cubin
#   cuobjdump -sass -fun exl3_gemv_m8_t2 /tmp/g.cubin | less
set -eu
DEST=${DEST:-.sass-tools}
[ -x "$DEST/bin/cuobjdump" ] && [ -x "$DEST/bin/nvdisasm" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
"$PY" -m pip download -q --no-deps -d "$tmp" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
mkdir -p "$DEST/bin"
for w in "$tmp"/*.whl; do "$PY" -m zipfile -e "$w" "$tmp/x"; done
find "$tmp/x" -type f \( -name cuobjdump -o -name nvdisasm \) -exec cp {} "$DEST/bin/" \;
chmod +x "$DEST/bin/"*
"$DEST/bin/cuobjdump" --version | tail -n 1
