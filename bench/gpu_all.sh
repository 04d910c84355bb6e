#!/usr/bin/env bash
# Everything one device call does: install carried wheels, build exllamav3 in the background (or use
# a carried prebuilt extension) while our kernels are built, tested and timed, then the side-by-side
# linear benchmark and the end-to-end decode benchmark on a synthetic GLM-4.5-Air-shaped checkpoint.
# Run from the repo root on the device; carry .whl (wheels), .gpucarry (fixtures) and optionally
# .exl3so (exl3so.xz: exllamav3_ext.so from an earlier call) and .cudacache.txz (our cubins, packed by
# an earlier call: its $OUT/cudacache.txz). Logs under $OUT.
#   bash bench/gpu_all.sh [tests] [quick] [ab] [defs] [bench] [cublas] [paged] [e2e] [prefill] [series] [serve] [hostprof] [longctx] [mla] [attn] [absorb] [profile] [memory] [moe]
# (default: all but ab, defs, cublas, prefill, series, hostprof, longctx, mla, attn, absorb, profile, memory and moe)
# The exllamav3 build runs detached (setsid) and survives the call, so a second call on the same warm
# machine finds it built (/tmp/exl3build.log says "build rc 0").
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT" "$OUT/logs"
L=$OUT/logs
STAGES=${*:-tests quick bench paged e2e serve}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 EXL3TOOLS_KERNEL_CACHE=/tmp/exl3k
export EXL3TOOLS_CUDA_CACHE=${EXL3TOOLS_CUDA_CACHE:-$PWD/.cudacache} TORCH_EXTENSIONS_DIR=/tmp/torch_ext
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# The last line tars the logs into one file; a call's own `timeout` around this script once cut it
# before that line, the logs came back file by file and the call's file count left some out
# (2026-12-07 14:47, call 1), and the stage's pytest, in its own `timeout`'s process group which
# that TERM does not reach, ran on beside the call's next command. On TERM bash now runs this trap
# once the command it waits on has ended (a stage's own timeout bounds it): the logs tarred, no
# stage left running behind
tar_logs() {
  tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
}
on_term() {
  el "cut (TERM): logs tarred"; tar_logs; exit 143
}
trap on_term TERM

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$L/pip.log" 2>&1 || { cat "$L/pip.log"; exit 1; }
# exl3tools without pip: pyproject maps exl3tools.{kernels,cli,schemas} to top-level folders; mirror
# that with links inside this (device) copy when the package is not importable as installed
if ! python3 -c "import exl3tools.kernels" 2>/dev/null; then
  for d in kernels cli schemas; do [ -e exl3tools/$d ] || ln -s ../$d exl3tools/$d; done
fi
export PYTHONPATH=/tmp/site:$PWD
if [ -f .exl3so/exl3so.xz ]; then   # a carried prebuilt exllamav3 extension: no 4-minute build
  mkdir -p /tmp/exl3so && xz -dc .exl3so/exl3so.xz > /tmp/exl3so/exllamav3_ext.so && export PYTHONPATH=$PYTHONPATH:/tmp/exl3so
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$L/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" >> "$L/gpu.txt"
cat "$L/gpu.txt"

# exllamav3: a carried prebuilt extension imports at once; else its JIT build (~4 min cold)
# (EXL3_BUILD=0: no build, for calls whose stages never run exllamav3; its 12 jobs slow the tests)
if [ "${EXL3_BUILD:-1}" != 0 ] && ! grep -q "build rc 0" /tmp/exl3build.log 2>/dev/null && ! pgrep -f exl3build_marker >/dev/null; then
  # niced: the tests and benchmarks beside it keep the CPU (eager launches are host-bound)
  setsid nice -n 19 bash -c "MAX_JOBS=${EXL3_JOBS:-12} python3 -c \"import exllamav3; from exllamav3.ext import exllamav3_ext as e; print('exllamav3 ok', e.__file__)\" > /tmp/exl3build.log 2>&1; echo \"build rc \$?\" >> /tmp/exl3build.log # exl3build_marker" &
fi
# No exllamav3 this call (EXL3_BUILD=0, no carried extension): the benchmarks leave its side out by
# default instead of importing it, which JIT-builds it for minutes (both serve runs of the 2026-12-04
# late session's mla call ended in that import, at their own time limit and at the call's); an
# explicit --exllamav3 (SERVE_EXTRA, MLA_SERVE_EXTRA) or *_IMPLS still wins
EXL3_IMPL=,exllamav3; EXL3_SERVE=""
if [ "${EXL3_BUILD:-1}" = 0 ] && [ ! -f .exl3so/exl3so.xz ]; then EXL3_IMPL=""; EXL3_SERVE="--exllamav3 off"; fi
# wait_build [SECONDS]: until the build ended (rc 1 if SECONDS passed first), its log copied to $L
wait_build() {
  local n=0
  # no build started (EXL3_BUILD=0, with or without a carried .exl3so): nothing to wait for (a
  # call with EXL3_BUILD=0 and .exl3so once waited here until its timeout)
  if [ ! -f /tmp/exl3build.log ] && ! pgrep -f exl3build_marker >/dev/null; then return 0; fi
  while ! grep -q "build rc" /tmp/exl3build.log 2>/dev/null; do
    sleep 2; n=$((n + 2)); [ -n "${1:-}" ] && [ $n -ge "$1" ] && return 1
  done
  cp /tmp/exl3build.log "$L/build.log"
}
# Our cubins travel packed: a fresh machine (every call whose machine idled out) spent ~50 s
# building all 28; .cudacache.txz (an earlier call's $OUT/cudacache.txz, ~2 MB against 56 MB
# unpacked) is unpacked first, so only what changed since (a source, a flag: the cache key) is
# built, and the cache goes back packed whenever this call built something
unpack_cubins() {
  [ -f .cudacache.txz ] || return 0
  mkdir -p "$EXL3TOOLS_CUDA_CACHE" && xz -dc .cudacache.txz | tar -x -C "$EXL3TOOLS_CUDA_CACHE"
}
cubin_list() {
  ls "$EXL3TOOLS_CUDA_CACHE" 2>/dev/null | grep '\.cubin$'
}
pack_cubins() {  # BEFORE NAMES: cubin_list's output before the build, the file of the names it built
  [ "$(cubin_list)" = "$1" ] && return 0
  # the build's own cubins (stale ones, of older sources, stay out); every cubin if it named none
  local what=(.); [ -s "${2:-}" ] && what=(-T "$2")
  tar -c -C "$EXL3TOOLS_CUDA_CACHE" --exclude='*.lock' "${what[@]}" | xz -6 -T0 > "$OUT/cudacache.txz.tmp" \
    && mv "$OUT/cudacache.txz.tmp" "$OUT/cudacache.txz"
}
# our cubins, all (K, codebook) in parallel (seconds; cached in .cudacache)
unpack_cubins; BEFORE=$(cubin_list)
python3 -m exl3tools.kernels.cuda_build --names > "$L/cubin_names.txt" 2> "$L/cubins.log"
el "cubins: $(tail -n 1 $L/cubins.log)"
pack_cubins "$BEFORE" "$L/cubin_names.txt"; [ -f "$OUT/cudacache.txz" ] && el "cubins packed: \$OUT/cudacache.txz (carry it as .cudacache.txz)"
# SYNTH_ARGS: synth_checkpoint.py options for the GLM-4.5-Air shape (e.g. "--codebook mcg": the
# serve stage on MCG), in a folder of their own: a warm machine's /tmp/air6 of another codebook is
# not taken for it
AIR=/tmp/air6${SYNTH_ARGS:+_$(printf %s "$SYNTH_ARGS" | tr -c 'A-Za-z0-9' _)}
( [ -d $AIR ] || python3 bench/synth_checkpoint.py $AIR ${SYNTH_ARGS:-} > "$L/synth.log" 2>&1 ) &
SYNTH=$!
# side_runs TAG VAR K2 ARGS...: the linear bench (bench/gpu_bench.py --graph ARGS) once for each
# value of the caller's array VALS in order, VAR=value in that run's environment (each run a new
# process, so a build define is read anew); with K2 (trellis widths / 8, "4,6,8"), the value's
# cubins for those widths and every codebook built before its run. Logs TAG_N.log, TAG_N_build.log
side_runs() {
  local tag=$1 var=$2 k2=$3 i=0 v; shift 3
  for v in "${VALS[@]}"; do
    i=$((i + 1))
    if [ -n "$k2" ]; then
      env "$var=$v" python3 -c "import sys; from exl3tools.kernels import cuda_build as c; c.prebuild([(int(k), cb) for k in sys.argv[1].split(',') for cb in (0, 1, 2)])" \
        "$k2" > "$L/${tag}_${i}_build.log" 2>&1
    fi
    env "$var=$v" timeout ${AB_TIMEOUT:-90} python3 bench/gpu_bench.py --graph "$@" > "$L/${tag}_$i.log" 2>&1
    el "$tag $var=[${v}] rc $?"; grep -E -- "->|rror" "$L/${tag}_$i.log"
  done
}
# ab_runs VAR ARGS...: VAR=0, 1, 1, 0 side by side (a run-time or build-time switch)
ab_runs() {
  local var=$1; shift
  local -a VALS=(0 1 1 0)
  side_runs ab "$var" "" "$@"
}

if [[ " $STAGES " == *" tests "* ]]; then
  # PREVIEW: the preview paths' switches, default every one in exl3tools/runtime/preview.py SWITCHES
  # on ("EXL3TOOLS_X=1 ..."), so tests/gpu checks them; tests that need a switch either way set it
  PREVIEW=${PREVIEW-$(python3 -c "from exl3tools.runtime.preview import SWITCHES as S; print(' '.join(v + '=1' for v in S.values()))")}
  el "tests/gpu with preview switches: ${PREVIEW:-none}"
  # CPU threads per test worker: the CPU reference halves of the tests (fixture forwards) ran with
  # torch's default of one thread per core in each of TEST_JOBS workers, every pool spinning
  # against the others (the Makefile's CPU suite: 62 s -> 24 s for two files when limited)
  NT=${TEST_THREADS:-$(( $(nproc) / ${TEST_JOBS:-3} > 0 ? $(nproc) / ${TEST_JOBS:-3} : 1 ))}
  # TEST_ENVS="A=1 B=2;C=3": the same tests once per entry (its variables beside PREVIEW), the
  # runs side by side, each with TEST_JOBS workers and logs tests_N.log (a switch's A/B in one call)
  # an entry's "paths=a.py,b.py" token limits that entry to those test files (the full suite once,
  # a define's own tests beside it: TEST_ENVS=";paths=tests/gpu/test_wgmma_kernels.py X=1")
  run_tests() {  # N EXTRA_ENV
    local paths=${TEST_PATHS:-tests/gpu tests/test_cuda_bit_logic.py} envs="" w
    for w in $2; do if [[ $w == paths=* ]]; then paths=${w#paths=}; paths=${paths//,/ }; else envs+="$w "; fi; done
    set -- "$1" "$envs"
    # the entry's own cubins first, once, not in every worker (a build-time preview or define in
    # PREVIEW / EXTRA_ENV names cubins of its own: EXL3TOOLS_GEMV_HALVES, EXL3TOOLS_GEMV_DEFINES)
    env ${PREVIEW:-} $2 python3 -m exl3tools.kernels.cuda_build > "$L/cubins_tests$1.log" 2>&1
    el "cubins for tests$1 [${2:-}]: $(tail -n 1 "$L/cubins_tests$1.log")"
    env ${PREVIEW:-} $2 OMP_NUM_THREADS=$NT MKL_NUM_THREADS=$NT OPENBLAS_NUM_THREADS=$NT EXL3TOOLS_TEST_LOG=$L/tests${1}_live.log \
    EXL3TOOLS_FIXTURES=$PWD/${FIXTURES:-.gpucarry}/fixtures timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider \
      -n ${TEST_JOBS:-3} $paths ${TEST_ARGS:---ignore=tests/gpu/test_triton_kernels.py} \
      > "$L/tests$1.log" 2>&1
    local rc=$?
    el "tests$1 [${2:-}] rc $rc"; grep -E "passed|failed|FAILED|Error" "$L/tests$1.log" | tail -n 25
    grep -E "^(FAILED|SLOW) " "$L/tests${1}_live.log" 2>/dev/null | head -n 60
    if [ $rc = 124 ]; then   # cut by TEST_TIMEOUT: the tests it left (tests/conftest.py writes *.done),
      # for the next call's TEST_PATHS="$(tr '\n' ' ' < tests_unrun.txt)"
      env ${PREVIEW:-} $2 EXL3TOOLS_FIXTURES=$PWD/${FIXTURES:-.gpucarry}/fixtures timeout 90 python3 -m pytest -q \
        --collect-only -p no:cacheprovider $paths $(printf '%s\n' ${TEST_ARGS:---ignore=tests/gpu/test_triton_kernels.py} | grep -vx -- -v) \
        2>/dev/null | grep "::" | sort -u > "$L/tests${1}_all.txt"
      sort -u "$L/tests${1}_live.log.done" 2>/dev/null | comm -23 "$L/tests${1}_all.txt" - > "$L/tests${1}_unrun.txt"
      el "tests$1: $(wc -l < "$L/tests${1}_unrun.txt") of $(wc -l < "$L/tests${1}_all.txt") not run: logs/tests${1}_unrun.txt"
    fi
  }
  if [ -n "${TEST_ENVS:-}" ]; then
    IFS=';' read -ra TENV <<< "$TEST_ENVS"
    for i in "${!TENV[@]}"; do run_tests "_$i" "${TENV[$i]}" > "$L/tests_summary_$i.txt" & done; wait
    cat "$L"/tests_summary_*.txt
  else
    run_tests "" ""
  fi
fi
if [[ " $STAGES " == *" quick "* ]]; then   # ours alone while exllamav3 builds
  timeout ${QUICK_TIMEOUT:-150} python3 bench/gpu_bench.py --graph --impls cuda,fp16 --rows 1,8,32,2048 \
    --json "$L/quick.json" > "$L/quick.log" 2>&1
  el "quick rc $?"; sed -n '/in->out/,$p' "$L/quick.log"
fi
if [[ " $STAGES " == *" ab "* ]]; then   # AB_VAR off / on / on / off, the linear bench (AB_ARGS) each time
  read -r -a AB_A <<< "${AB_ARGS:---impls cuda,cuda_pro --ks 3 --rows 1,8}"
  ab_runs "${AB_VAR:?the ab stage needs AB_VAR, e.g. EXL3TOOLS_GEMV_AFFINE}" "${AB_A[@]}"
fi
# defs_runs "SET;SET" ARGS...: build constants of exl3_gemv.cu side by side: the default build, each
# set as EXL3TOOLS_GEMV_DEFINES, the default again; each set's cubins for DEFS_K2 built first
defs_runs() {
  local -a dv; IFS=';' read -ra dv <<< "$1"; shift
  local -a VALS=("" "${dv[@]}" "")
  side_runs defs EXL3TOOLS_GEMV_DEFINES "${DEFS_K2:-4,6,8}" "$@"
}
if [[ " $STAGES " == *" defs "* ]]; then  # DEFS="-DXDUP_SMEM=1;-DPRO_P=2 -DPRO_MINB=9", the bench's DEFS_ARGS
  read -r -a DA <<< "${DEFS_ARGS:---impls cuda_pro --ks 2,3,4 --rows 1 --codebooks mul1,3inst}"
  defs_runs "${DEFS:?the defs stage needs DEFS, e.g. -DXDUP_SMEM=1}" "${DA[@]}"
fi
if [[ " $STAGES " == *" paged "* ]]; then
  timeout ${PAGED_TIMEOUT:-120} python3 bench/gpu_paged_attention.py --json "$L/paged.json" > "$L/paged.log" 2>&1
  el "paged rc $?"; grep -E "^\|" "$L/paged.log" | tail -n 40
fi
if [ "${EXL3_BUILD:-1}" != 0 ] || [ -f .exl3so/exl3so.xz ]; then HAVE_EXL3=1; else HAVE_EXL3=0; fi
# (a bench without exllamav3 in BENCH_IMPLS does not wait: a call once spent its stages' time here)
if [ $HAVE_EXL3 = 1 ] && [[ ( " $STAGES " == *" bench "* && ${BENCH_IMPLS:-exllamav3} == *exllamav3* ) || " $STAGES " == *" serve "* || ( " $STAGES " == *" e2e "* && ${E2E_IMPLS:-exllamav3} == *exllamav3* ) ]]; then
  el "waiting for exllamav3"; wait_build; tail -n 2 "$L/build.log" 2>/dev/null
fi
# built here: bring it back (once), so the next call carries it in .exl3so instead of building
bring_so() {
  local SO; SO=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -n 1)
  if [ -n "$SO" ] && ! ls "$OUT"/exl3so.xz.* >/dev/null 2>&1; then xz -T0 -3 -c "$SO" > /tmp/exl3so.xz \
    && split -b 15M /tmp/exl3so.xz "$OUT/exl3so.xz." \
    && el "exllamav3_ext.so $(stat -c %s "$SO") B -> $(stat -c %s /tmp/exl3so.xz) B xz, split into $OUT"; fi
}
bring_so
if [[ " $STAGES " == *" bench "* ]]; then
  timeout ${BENCH_TIMEOUT:-240} python3 bench/gpu_bench.py --graph --impls ${BENCH_IMPLS:-cuda${EXL3_IMPL},fp16} \
    ${BENCH_ARGS:---codebooks mul1,mcg,3inst} --json "$L/bench.json" > "$L/bench.log" 2>&1
  el "bench rc $?"
fi
if [[ " $STAGES " == *" cublas "* ]]; then   # our dense paths and fp16 cuBLAS interleaved (bench/gpu_gemm_ab.py)
  timeout ${CUBLAS_TIMEOUT:-200} python3 bench/gpu_gemm_ab.py ${CUBLAS_ARGS:-} --json "$L/cublas.json" > "$L/cublas.log" 2>&1
  el "cublas rc $?"; cat "$L/cublas.log"
fi
wait $SYNTH; tail -n 2 "$L/synth.log" 2>/dev/null
if [[ " $STAGES " == *" e2e "* ]]; then
  timeout ${E2E_TIMEOUT:-240} python3 bench/gpu_e2e_model.py $AIR --batch ${E2E_BATCH:-1,8,32} --steps 64 --rounds ${E2E_ROUNDS:-1} \
    --impls ${E2E_IMPLS:-ours:cuda,ours:cuda:chained${EXL3_IMPL}} --profile ${E2E_PROFILE:-0} --json "$L/e2e_model.json" \
    > "$L/e2e_model.log" 2>&1
  el "e2e rc $?"
fi
if [[ " $STAGES " == *" longctx "* ]]; then   # ours vs exllamav3 on 4k/16k/32k-token prompts (docs/gpu.md)
  wait_build; tail -n 1 "$L/build.log" 2>/dev/null
  timeout ${LONGCTX_TIMEOUT:-300} python3 bench/gpu_long_context.py air6=$AIR \
    glm5=$PWD/${FIXTURES:-.gpucarry}/fixtures/glm5_moe_dsa-3.0bpw-mul1/model ${LONGCTX_ARGS:-} \
    --json "$L/longctx.json" > "$L/longctx.log" 2>&1
  el "longctx rc $?"
fi
if [[ " $STAGES " == *" serve "* ]]; then
  if [ -n "${SERVE_ARGS:-}" ]; then eval "CONFIGS=($SERVE_ARGS)"; else
    OFF="EXL3TOOLS_FUSED=0 EXL3TOOLS_ROW_STEPS=0"   # the former previews off (runtime/preview.py OPT_OUTS)
    CONFIGS=(--config "ml32k:--max-model-len 32768" --config "ml128k:--max-model-len 131072"
             --config "ml32k_unfused:$OFF --max-model-len 32768"); fi
  timeout ${SERVE_TIMEOUT:-540} python3 bench/gpu_serve.py $AIR --device cuda "${CONFIGS[@]}" $EXL3_SERVE ${SERVE_EXTRA:-} \
    --json "$L/serve.json" --out "$L/serve" > "$L/serve.log" 2>&1
  el "serve rc $?"
  for f in "$L"/serve/*.prof; do [ -f "$f" ] && python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(25)" "$f" > "$f.txt" 2>&1; done
fi
if [[ " $STAGES " == *" hostprof "* ]]; then   # the served N-stream decode's host side (bench/gpu_serve_profile.py)
  # HOSTPROF_CONFIGS="NAME:ARGS;...": one server each; HOSTPROF_PROCS: client processes per round (1,4:
  # one asyncio openai client, then four, on the same server)
  IFS=';' read -r -a HPC <<< "${HOSTPROF_CONFIGS:-default:--max-model-len 32768;ml4k:--max-model-len 4096}"
  for c in "${HPC[@]}"; do
    f="$L/hostprof_${c%%:*}.log"
    timeout ${HOSTPROF_TIMEOUT:-180} python3 bench/gpu_serve_profile.py $AIR --config "$c" --streams ${HOSTPROF_STREAMS:-32} \
      --tokens ${HOSTPROF_TOKENS:-384} --procs ${HOSTPROF_PROCS:-1,4} --py-spy /tmp/site/bin/py-spy --out "$L/hostprof" > "$f" 2>&1
    el "hostprof ${c%%:*} rc $?"; grep -v "^20..-" "$f" | head -n ${HOSTPROF_LINES:-90}
  done
fi
# mla_spec_configs ARCH VARIANTS: append to CFG the --speculative-tokens configs (MLA_SPEC) for the mla
# stage's shape ARCH: glm5 and deepseek_v3 (and their _flat variants) have an MTP head, others none
mla_spec_configs() {
  [[ $1 == glm5* || $1 == deepseek_v3* ]] || return 0
  local k
  for k in ${MLA_SPEC-1 2 3}; do
    CFG+=(--config "${1}_mtp$k:--max-model-len 32768 --speculative-tokens $k")
    [[ $2 == *mtp_paged* ]] && CFG+=(--config "${1}_mtp${k}_eager_head:EXL3TOOLS_MTP_PAGED=0 --max-model-len 32768 --speculative-tokens $k")
  done
  return 0
}
if [[ " $STAGES " == *" mla "* ]]; then   # issue 14: MLA/DSA shapes (bench/synth_checkpoint.py --arch), ours vs exllamav3
  # MLA_PARTS: which of "kernel e2e serve" run; MLA_SPEC: --speculative-tokens values served beside 0
  # on the shapes with an MTP head (glm5, deepseek_v3; empty: none)
  if [[ ${MLA_PARTS:-kernel e2e serve} == *kernel* ]]; then
    # the paged MLA decode kernel alone first (Triton ieee/tf32x3, DSA selection, indexer, torch, roofline)
    timeout ${MLA_KERNEL_TIMEOUT:-240} python3 bench/gpu_mla_attention.py ${MLA_KERNEL_ARGS:---quick --sweep 64,8,16384} \
      --json "$L/mla_attention.json" > "$L/mla_attention.log" 2>&1
    el "mla kernel rc $?"; grep -E "^\||^best|Error" "$L/mla_attention.log"
  fi
  # ARCH_flat (glm5_flat, deepseek_v3_flat): the ARCH shape with --flat-logits (every MTP draft
  # accepted: MTP's upper bound); ARCH_hN (deepseek_v3_h32, glm5_h16): the ARCH shape with N attention
  # heads (--heads N: a tensor-parallel rank's attention on one GPU)
  [[ ${MLA_PARTS:-kernel e2e serve} == *e2e* || ${MLA_PARTS:-kernel e2e serve} == *serve* ]] || MLA_ARCHES=none
  for arch in ${MLA_ARCHES:-glm5 deepseek_v3}; do
    [ $arch = none ] && continue       # the kernel part alone: no checkpoint to make
    d=/tmp/synth_$arch
    # MLA_SYNTH_EXTRA: more synth_checkpoint.py options (e.g. "--layers 24": MTP's worth on a deeper shape)
    SYN="--arch $arch ${MLA_SYNTH_EXTRA:-}"; [[ $arch == *_flat ]] && SYN="--arch ${arch%_flat} --flat-logits ${MLA_SYNTH_EXTRA:-}"
    [[ $arch =~ ^(.+)_h([0-9]+)$ ]] && SYN="--arch ${BASH_REMATCH[1]} --heads ${BASH_REMATCH[2]} ${MLA_SYNTH_EXTRA:-}"
    [ -d $d ] || python3 bench/synth_checkpoint.py $d $SYN > "$L/synth_$arch.log" 2>&1
    el "synth $arch: $(tail -n 1 "$L/synth_$arch.log")"
    if [[ ${MLA_PARTS:-kernel e2e serve} == *e2e* ]]; then
      timeout ${MLA_E2E_TIMEOUT:-200} python3 bench/gpu_e2e_model.py $d --batch ${MLA_BATCH:-1,8,32} --steps 32 \
        --impls ${MLA_IMPLS:-ours:cuda${EXL3_IMPL}} --json "$L/e2e_$arch.json" > "$L/e2e_$arch.log" 2>&1
      el "mla e2e $arch rc $?"; grep -E "^\|" "$L/e2e_$arch.log"
    fi
    if [[ ${MLA_PARTS:-kernel e2e serve} == *serve* ]]; then
      # MLA_VARIANTS: which of "eager graphs fp16 fma gemv dsa_prefill dsa_sparse flash_pad prompt_steps mla_rows fused_mla tile widths mtp_paged"
      # serve beside the MTP configs
      # (fp16: --kv-cache-dtype fp16, what auto picks for MLA on CUDA; widths: at --max-model-len
      # 131072, with and without the sparse graphs per table width; fma: the indexer's scores on the
      # FMA kernel (EXL3TOOLS_DSA_SCORES_TC=0); gemv: MoE prefill tiles on the gemv kernel
      # (EXL3TOOLS_PREFILL_TILES=0); dsa_prefill: the prompts' DSA selection by torch (the
      # EXL3TOOLS_DSA_PREFILL_KERNELS=0 opt-out); dsa_sparse: prompt rows densely under the selection
      # mask (the EXL3TOOLS_DSA_SPARSE_PREFILL=0 opt-out, not over their selected keys); flash_pad: its opt-out
      # EXL3TOOLS_MLA_FLASH_PAD=0 (DeepSeek-V3's prompt attention off flash); prompt_steps: its opt-out
      # EXL3TOOLS_PROMPT_GRAPHS=0 (short prompts beside decoding rows through the eager forward); mla_rows: the
      # EXL3TOOLS_MLA_EAGER_ROWS=1 preview (an eager step's decode rows through the decode kernels); fused_mla: its
      # opt-out EXL3TOOLS_FUSED_MLA=0 (the MLA decode step's torch loop, not FusedMlaStep); tile: the
      # MLA decode kernel's tiles EXL3TOOLS_MLA_TILE=$MLA_TILE (HB,TN,WARPS; default 32,32,8); mtp_paged: each MTP config again
      # with the head's own cache and eager drafts, the EXL3TOOLS_MTP_PAGED=0 opt-out)
      CFG=(); V=${MLA_VARIANTS:-eager graphs fp16}
      [[ $V == *eager* ]] && CFG+=(--config "${arch}_eager:--no-cuda-graphs --max-model-len 32768")
      [[ $V == *graphs* ]] && CFG+=(--config "$arch:--max-model-len 32768")
      [[ $V == *fp16* ]] && CFG+=(--config "${arch}_fp32:--max-model-len 32768 --kv-cache-dtype fp32")   # the old auto
      [[ $V == *fma* ]] && CFG+=(--config "${arch}_scores_fma:EXL3TOOLS_DSA_SCORES_TC=0 --max-model-len 32768")
      [[ $V == *gemv* ]] && CFG+=(--config "${arch}_gemv_tiles:EXL3TOOLS_PREFILL_TILES=0 --max-model-len 32768")
      [[ $V == *dsa_prefill* ]] && CFG+=(--config "${arch}_dsa_torch_select:EXL3TOOLS_DSA_PREFILL_KERNELS=0 --max-model-len 32768")
      [[ $V == *dsa_sparse* ]] && CFG+=(--config "${arch}_dsa_dense:EXL3TOOLS_DSA_SPARSE_PREFILL=0 --max-model-len 32768")
      [[ $V == *flash_pad* ]] && CFG+=(--config "${arch}_no_flash_pad:EXL3TOOLS_MLA_FLASH_PAD=0 --max-model-len 32768")
      [[ $V == *prompt_steps* ]] && CFG+=(--config "${arch}_no_prompt_graphs:EXL3TOOLS_PROMPT_GRAPHS=0 --max-model-len 32768")
      [[ $V == *mla_rows* ]] && CFG+=(--config "${arch}_mla_rows:EXL3TOOLS_MLA_EAGER_ROWS=1 --max-model-len 32768")
      [[ $V == *fused_mla* ]] && CFG+=(--config "${arch}_no_fused_mla:EXL3TOOLS_FUSED_MLA=0 --max-model-len 32768")
      # MLA_EXTRA_CONFIG="NAME:ARGS[;NAME:ARGS...]": more configs, each served as ${arch}_NAME (e.g.
      # "seqs64:--max-model-len 32768 --max-num-seqs 64")
      if [ -n "${MLA_EXTRA_CONFIG:-}" ]; then
        IFS=';' read -r -a XCFG <<< "$MLA_EXTRA_CONFIG"
        for x in "${XCFG[@]}"; do CFG+=(--config "${arch}_$x"); done
      fi
      T=${MLA_TILE:-32,32,8}
      [[ $V == *tile* ]] && CFG+=(--config "${arch}_tile_${T//,/x}:EXL3TOOLS_MLA_TILE=$T --max-model-len 32768")
      [[ $V == *widths* ]] && CFG+=(--config "${arch}_ml128k:--max-model-len 131072"
                                    --config "${arch}_ml128k_one_width:EXL3TOOLS_DSA_WIDTHS=0 --max-model-len 131072")
      mla_spec_configs $arch "$V"
      timeout ${MLA_SERVE_TIMEOUT:-300} python3 bench/gpu_serve.py $d --device cuda "${CFG[@]}" $EXL3_SERVE \
        ${MLA_SERVE_EXTRA:---streams 8,32 --ctx-streams 1 --repeats 1 --ttft-prompts 1 --tokens 64} \
        --json "$L/serve_$arch.json" --out "$L/serve_$arch" > "$L/serve_$arch.log" 2>&1
      el "mla serve $arch rc $?"; tail -n 14 "$L/serve_$arch.log"
    fi
  done
fi
if [[ " $STAGES " == *" attn "* ]]; then   # the MLA decode kernels side by side: Triton's, the CUDA ones
  timeout ${ATTN_TIMEOUT:-240} python3 bench/gpu_mla_cuda.py ${ATTN_ARGS:-} > "$L/mla_cuda.log" 2>&1
  el "attn rc $?"; grep -E "^\|" "$L/mla_cuda.log"
fi
if [[ " $STAGES " == *" absorb "* ]]; then   # MLA's absorbed products: float32 W_UK / W_UV against fp16 (mla_w16)
  timeout ${ABSORB_TIMEOUT:-120} python3 bench/gpu_mla_absorb.py ${ABSORB_ARGS:-} --json "$L/absorb.json" > "$L/absorb.log" 2>&1
  el "absorb rc $?"; grep -E "^\||copy|^sweep|rror" "$L/absorb.log"
fi
if [[ " $STAGES " == *" profile "* ]]; then   # where a decode step's time goes at a long context (top kernels)
  # PROFILE_ARCHES: synthetic shapes (air6 = GLM-4.5-Air; glm5, deepseek_v3 via --arch); PROFILE_RUNS:
  # prompt tokens:cache length per row (the block tables' width: is a 4k context slower at 32k?)
  for arch in ${PROFILE_ARCHES:-glm5 deepseek_v3}; do
    d=/tmp/synth_$arch; [ $arch = air6 ] && d=$AIR
    [ -d $d ] || python3 bench/synth_checkpoint.py $d --arch $arch > "$L/synth_$arch.log" 2>&1
    for run in ${PROFILE_RUNS:-32:256 4096:4352 4096:32768}; do
      f="$L/profile_${arch}_${run/:/_}.log"
      timeout ${PROFILE_TIMEOUT:-90} python3 bench/gpu_e2e_model.py $d --batch 1 --prompt-len ${run%%:*} \
        --max-len ${run##*:} --steps 16 --impls ours:cuda --profile 8 > "$f" 2>&1
      el "profile $arch $run rc $?"; grep -E "^\| ours" "$f"; sed -n '/^--- profile/,+16p' "$f"
    done
  done
fi
if [[ " $STAGES " == *" memory "* ]]; then   # issue 13: what serve holds beyond weights and KV, by owner
  # MEMORY_RUNS="CKPT|VARS|ARGS;...": one gpu_memory.py run per entry, one after another (VARS: variables
  # such as EXL3TOOLS_X=1, ARGS: its options; /tmp/synth_ARCH is written first where missing)
  IFS=';' read -r -a MRUNS <<< "${MEMORY_RUNS:-$AIR||}"
  for i in "${!MRUNS[@]}"; do
    IFS='|' read -r mck mvars margs <<< "${MRUNS[$i]}"
    [[ -d $mck || $mck != /tmp/synth_* ]] || python3 bench/synth_checkpoint.py $mck --arch ${mck#/tmp/synth_} > "$L/synth_mem_$i.log" 2>&1
    el "memory $i: $mck ${mvars:-(defaults)} $margs"
    env $mvars timeout ${MEMORY_TIMEOUT:-120} python3 bench/gpu_memory.py $mck $margs --json "$L/memory_$i.json" \
      > "$L/memory_$i.log" 2>&1
    el "memory $i rc $?"; grep -v "^20..-" "$L/memory_$i.log" | tail -n 45
  done
fi
if [[ " $STAGES " == *" moe "* ]]; then   # issue 15: one MoE projection of a prompt, path by path (bench/gpu_moe_prefill.py)
  timeout ${MOE_TIMEOUT:-240} python3 bench/gpu_moe_prefill.py ${MOE_ARGS:-} --json "$L/moe_prefill.json" \
    > "$L/moe_prefill.log" 2>&1
  el "moe prefill rc $?"; grep -E "^\||Error" "$L/moe_prefill.log" | head -n 12
fi
if [[ " $STAGES " == *" prefill "* ]]; then   # PREFILL_CKPT: another synthetic shape (e.g. /tmp/synth_glm5, made by the mla stage)
  timeout ${PREFILL_TIMEOUT:-240} python3 bench/gpu_prefill.py ${PREFILL_CKPT:-$AIR} ${PREFILL_ARGS:-} \
    --json "$L/prefill.json" > "$L/prefill.log" 2>&1
  el "prefill rc $?"; grep -E "^\|" "$L/prefill.log" | head -n 30; sed -n '/Self CUDA/,+24p' "$L/prefill.log" | head -n 26
  sed -n '/^--- profile 8 x 32/,+20p' "$L/prefill.log" | cut -c1-60,100-200
  sed -n '/^--- profile of the mixed step/,+20p' "$L/prefill.log" | cut -c1-60,100-200
  sed -n '/^total /p; /^--- profile of the last chunk/,+24p' "$L/prefill.log" | cut -c1-60,100-200   # PREFILL_ARGS="--long N"
fi
if [[ " $STAGES " == *" series "* ]]; then   # a long prompt's forward again and again: clocks, allocator, kernels (bench/gpu_prefill_series.py)
  timeout ${SERIES_TIMEOUT:-240} python3 bench/gpu_prefill_series.py ${PREFILL_CKPT:-$AIR} ${SERIES_ARGS:-} \
    > "$L/series.log" 2>&1
  el "series rc $?"; grep -vE "^\s*$" "$L/series.log" | grep -E "^\||^idle|clusters|Error" | head -n 90
fi
# SO_WAIT: seconds to wait at the end for a build still running (stages that never needed exllamav3)
if [ "${SO_WAIT:-0}" -gt 0 ] && ! ls "$OUT"/exl3so.xz.* >/dev/null 2>&1; then
  wait_build "$SO_WAIT" && tail -n 1 "$L/build.log"; bring_so
fi
echo "=== bench"; sed -n '/in->out/,$p' "$L/bench.log" 2>/dev/null
echo "=== e2e"; grep -E "^\|" "$L/e2e_model.log" 2>/dev/null
echo "=== serve"; tail -n 30 "$L/serve.log" 2>/dev/null
echo "=== longctx"; grep -E "^\||error|failed" "$L/longctx.log" 2>/dev/null
tar_logs
