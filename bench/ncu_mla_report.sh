#!/usr/bin/env bash
# Source-level ncu reports of one MLA decode kernel at a few shapes (bench/ncu_mla.py), each summed
# up on the device: speed of light, warp states, the memory chart's throughputs, then the SASS
# lines where its warps stall most (bench/ncu_source_top.py). Reports and summaries go to $OUT.
#   KERNEL=mla_decode_pp SHAPES="128 8 32768;128 1 32768" bash bench/ncu_mla_report.sh
# (the kernel's own switches come from the environment, e.g. EXL3TOOLS_MLA_PINGPONG=1)
set -u
OUT=${OUT:-/tmp/ncu_mla}; mkdir -p "$OUT"
KERNEL=${KERNEL:-mla_decode_pp}
IFS=';' read -ra shapes <<< "${SHAPES:-128 8 32768;128 1 32768}"
for shape in "${shapes[@]}"; do
  tag=$(echo "$shape" | tr ' ' '_')
  rep="$OUT/${KERNEL}_$tag"
  # shellcheck disable=SC2086  # the shape is three words
  ncu --set full --import-source yes --kernel-name "regex:^${KERNEL}\$" --launch-skip 2 --launch-count 1 \
    -f -o "$rep" python3 bench/ncu_mla.py $shape > "$rep.run.log" 2>&1
  echo "== $KERNEL $shape (rc $?)"
  ncu --import "$rep.ncu-rep" --page details --print-units base > "$rep.details.txt" 2>&1
  grep -E "^ +(Duration|Elapsed Cycles|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Issue Slots Busy|Issued Ipc Active|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Registers Per Thread|Achieved Occupancy|Max Bandwidth|L2 Hit Rate|Mem Busy|Executed Ipc Active) " \
    "$rep.details.txt" | sed 's/  */ /g' | head -n 30
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.src.csv" 2>/dev/null
  python3 bench/ncu_source_top.py "$rep.src.csv" "${TOP:-40}" | cut -c1-220
done
