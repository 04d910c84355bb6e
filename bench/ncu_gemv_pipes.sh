#!/usr/bin/env bash
# Where the 1-row gemv's issue slots go, under ncu, for each value of a switch side by side (default
# EXL3TOOLS_GEMV_AFFINE 0 and 1: MUL1's pair against its AFF kernel): duration, issue and occupancy
# lines, ncu's pipeline rules, each pipe's share of its peak (sm__inst_executed_pipe_* and
# sm__pipe_*_cycles_active) and the stall reasons (cycles a warp waits per issued instruction),
# highest first. Reports and logs go to $OUT (not gpu_all.sh's). SWITCH=EXL3TOOLS_GEMV_DEFINES
# VALUES="-DXDUP_SMEM=0 -DXDUP_SMEM=1" compares build defines the same way. KERNEL: another kernel of
# the same call, e.g. the output Hadamard pass of a 2048-row linear (the dense path):
#   SWITCH=EXL3TOOLS_GEMV_AFFINE VALUES="0 1" SHAPE="3 4096 14336 1" bash bench/ncu_gemv_pipes.sh
#   KERNEL=^exl3_had_out VALUES=1 SHAPE="3 4096 14336 2048" bash bench/ncu_gemv_pipes.sh
#   KERNEL='^exl3_decode_t$' VALUES=1 SHAPE="3 4096 14336 2048" bash bench/ncu_gemv_pipes.sh   # + L2 / DRAM bytes
set -u
OUT=${OUT:-/tmp/ncu_gemv}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD}   # gpu_all.sh's install (run it first, or set PYTHONPATH)
SWITCH=${SWITCH:-EXL3TOOLS_GEMV_AFFINE}
KERNEL=${KERNEL:-^exl3_gemv}
for v in ${VALUES:-0 1}; do
  rep="$OUT/gemv_$v"
  # shellcheck disable=SC2086  # SHAPE is four words
  env "$SWITCH=$v" ncu --set full --kernel-name "regex:$KERNEL" --launch-skip 2 --launch-count 1 -f -o "$rep" \
    python3 bench/ncu_gemv.py ${SHAPE:-3 4096 14336 1} > "$rep.run.log" 2>&1
  echo "== $SWITCH=$v (rc $?): $(grep -o 'exl3_[a-z0-9_]*' "$rep.run.log" | sort -u | tr '\n' ' ')"
  ncu --import "$rep.ncu-rep" --page details --print-units base > "$rep.details.txt" 2>&1
  grep -E "^ +(Duration|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Issued Ipc Active|No Eligible|Eligible Warps Per Scheduler|Active Warps Per Scheduler|DRAM Throughput|Compute \(SM\) Throughput) |pipeline|[Pp]ipe " \
    "$rep.details.txt" | sed 's/  */ /g' | head -n 24
  ncu --import "$rep.ncu-rep" --page raw --print-units base 2>/dev/null \
    | grep -E "(sm__inst_executed_pipe_[a-z0-9_]+|sm__pipe_[a-z0-9_]+_cycles_active)\.avg\.pct_of_peak_sustained_active " \
    | awk '{print $NF, $1}' | sort -rn | head -n 14
  # where the warps wait: cycles a warp spends in each stall state per issued instruction, highest first
  ncu --import "$rep.ncu-rep" --page raw --print-units base 2>/dev/null \
    | grep -E "smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio " \
    | awk '{print $NF, $1}' | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | sort -rn | head -n 10
  # the memory side (a memory-bound kernel, e.g. KERNEL='^exl3_decode_t$'): bytes through L2 and
  # DRAM against what the kernel must move (a partial-line write shows as DRAM reads beyond its inputs)
  ncu --import "$rep.ncu-rep" --page raw --print-units base 2>/dev/null \
    | grep -E "^ +(lts__t_sectors_op_(read|write)\.sum|dram__bytes_(read|write)\.sum|lts__t_sector_hit_rate\.pct|lts__t_sectors_srcunit_tex_op_(read|write)_lookup_(hit|miss)\.sum) " \
    | awk '{print $1, $NF}'
done
