#!/usr/bin/env bash
# The H200 sessions after the first suite (gpu_suite.sh), in parts of one device call each,
# run back to back while the machine is warm. Every step has its own time limit and a
# failing step does not stop the next; results are written incrementally into OUT.
#   bash benchmarks/gpu_final.sh part2 OUT   # int4 search/asym check, asym cost, requant load, GPU requant tests
#   bash benchmarks/gpu_final.sh recheck OUT # after a kernel change: bf16 checks (both formats), int4 methods,
#                                            # the load-time self-check
#   bash benchmarks/gpu_final.sh int4bench OUT # asym cost and the MXFP4 / int4 timings
#   bash benchmarks/gpu_final.sh tp16 OUT    # retune the TP16 MXFP4 entry in full, check TP16 on it
#   bash benchmarks/gpu_final.sh retune_tp8 OUT # retune TP8 MXFP4 at 16-1024 tokens (candidate list grown),
#                                            # check TP8, time ours and the triton_kernels peer (PEER_PATH)
#   bash benchmarks/gpu_final.sh large OUT   # 4096+: what pair_variants.py generates there (the many-tile
#                                            # stage 2 on both kinds of block) beside the table's, per launch
#   bash benchmarks/gpu_final.sh s2tiles OUT # 4096+: swapped stage 2 taking 28 N tiles per program (tail
#                                            # blocks or its own 128-row ones) beside the table's, TP8 and
#                                            # TP16, MXFP4 and int4 (results/h200-2026-12-03-s2/ candidates)
#   bash benchmarks/gpu_final.sh s2final OUT # ours vs Humming and triton_kernels, the TP8 checks, then
#                                            # its TP8 MXFP4 step and the winners applied to the table
#   bash benchmarks/gpu_final.sh s2all OUT   # s2tiles' four steps with plain_inter, each applied at once,
#                                            # then ours vs Humming and triton_kernels at TP8, TP16 and
#                                            # EP16 on that table, and the TP8 / TP16 checks
#   bash benchmarks/gpu_final.sh s1tiles OUT # 4096+: the TP8 MXFP4 entries with each stage-1 tile that compiles
#                                            # for sm_90 without spills (results/h200-2026-12-03-s3/s1_tiles.json),
#                                            # winners applied, then ours vs the peers at TP8 and its check
# OUT holds at most 5 files per part (the device tool brings back 8); with TAR_TO set, every step
# also re-packs OUT into that one file, so a call cut short still brings back what finished.
set -u
PART=${1:?part2, recheck, int4bench, tp16, retune_tp8, large, s2tiles, s2final, s2all or s1tiles}
OUT=${2:?output folder}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
LOG="$OUT/$PART.log"
S3=benchmarks/results/h200-2026-12-03-s3  # where the s2all / s1tiles runs of 2026-12-03 are kept
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s) $(date +%T)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$secs" "$@" >> "$LOG" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0))s" | tee -a "$LOG"
  if [ -n "${TAR_TO:-}" ]; then tar -cf "$TAR_TO" -C "$OUT" .; fi
}
{
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >> "$LOG" 2>&1
case "$PART" in
  part2)
    step check_int4_methods ${INT4_S:-100} python3 benchmarks/check_gpu.py --sections int4-methods \
        --int4-methods search,asym --int4-tokens 3,64 --out "$OUT/check_int4_methods.json"
    step int4_asym_cost ${ASYM_S:-90} python3 benchmarks/int4_asym_cost.py --backend triton \
        --tokens 64 256 1024 --repeats 20 --json "$OUT/int4_asym_cost.json"
    step requant_load ${LOAD_S:-95} python3 benchmarks/requant_load.py --skip-cpu --repeats 1 \
        --json "$OUT/requant_load.json"
    step pytest_requant ${PYTEST_S:-50} python3 -m pytest -q -x tests/core/test_requant.py
    ;;
  recheck)
    step check_bf16 ${CHECK_S:-240} python3 benchmarks/check_gpu.py --sections bf16 \
        --tokens 1,3,16,64,257,1024,4096 --out "$OUT/check_bf16.json"
    step check_int4_methods ${INT4_S:-100} python3 benchmarks/check_gpu.py --sections int4-methods \
        --int4-methods search,asym --int4-tokens 3,64,1024 --out "$OUT/check_int4_methods.json"
    step self_check ${SELF_S:-120} python3 benchmarks/self_check_gpu.py --json "$OUT/self_check.json"
    ;;
  int4bench)
    step int4_asym_cost ${ASYM_S:-120} python3 benchmarks/int4_asym_cost.py --backend triton \
        --tokens 64 256 1024 --repeats 20 --json "$OUT/int4_asym_cost.json"
    step bench_formats ${BENCH_S:-240} python3 benchmarks/bench_moe.py --formats mxfp4,int4 --peers "" \
        --tokens 1,4,16,64,256,1024,4096,16384 --out "$OUT/bench_formats.json"
    ;;
  tp16)
    step tune_tp16 ${TUNE_S:-200} python3 benchmarks/tune_triton.py --shapes tp16 --formats mxfp4 \
        --budget-s 150 --merge --log "$OUT/tune_tp16_log.json"
    cp kimi_k3_moe/configs/tables/triton_nvidia_h200.json "$OUT/"
    step check_tp16 ${CHECK_S:-150} python3 benchmarks/check_gpu.py --sections bf16 --shape tp16 \
        --tokens 1,16,257,1024,4096 --out "$OUT/check_tp16.json"
    ;;
  retune_tp8)
    step tune_tp8 ${TUNE_S:-200} python3 benchmarks/tune_triton.py --shapes tp8 --formats mxfp4 \
        --tiers 16,64,256,1024 --budget-s 170 --merge --log "$OUT/tune_tp8_log.json"
    cp kimi_k3_moe/configs/tables/triton_nvidia_h200.json "$OUT/"
    step check_tp8 ${CHECK_S:-200} python3 benchmarks/check_gpu.py --sections bf16 \
        --tokens 1,3,16,64,257,1024,4096 --out "$OUT/check_bf16.json"
    step bench_ours ${BENCH_S:-150} python3 benchmarks/bench_moe.py --formats mxfp4,int4 --peers torch \
        --out "$OUT/bench_moe.json"
    step bench_peer ${PEER_S:-120} python3 benchmarks/bench_moe.py --formats "" --peers triton_kernels \
        --peer-path "${PEER_PATH:-.peer}" --out "$OUT/bench_peer.json"
    ;;
  large)
    step large_tp8 ${LARGE_S:-420} python3 benchmarks/pair_variants.py --shape tp8 --formats mxfp4 \
        --tokens 4096,16384 --per-launch --out "$OUT/large_tp8.json"
    ;;
  s2tiles)
    C=benchmarks/results/h200-2026-12-03-s2
    step s2_tp8 ${S2_S:-150} python3 benchmarks/pair_variants.py --shape tp8 --formats mxfp4 --tokens 4096,16384 \
        --per-launch --configs $C/s2_candidates_5.json --out "$OUT/s2_tp8_4.json"
    step s2_int4_tp8 ${S2_S:-150} python3 benchmarks/pair_variants.py --shape tp8 --formats int4 --tokens 4096,16384 \
        --configs $C/s2_candidates_int4_tp8.json --out "$OUT/s2_int4_tp8.json"
    step s2_tp16 ${S2_S:-150} python3 benchmarks/pair_variants.py --shape tp16 --formats mxfp4 --tokens 4096,16384 \
        --configs $C/s2_candidates_mxfp4_tp16.json --out "$OUT/s2_mxfp4_tp16.json"
    step s2_int4_tp16 ${S2_S:-150} python3 benchmarks/pair_variants.py --shape tp16 --formats int4 --tokens 4096,16384 \
        --configs $C/s2_candidates_int4_tp16.json --out "$OUT/s2_int4_tp16.json"
    ;;
  s2final)  # the side-by-side bench and checks on the table as committed, then s2tiles' TP8 MXFP4 step
    # (plain_inter beside each many-tile config) and its winners applied to a copy of the table
    C=benchmarks/results/h200-2026-12-03-s2
    OUT="$OUT" SHAPE=tp8 PEERS=${PEERS:-humming,triton_kernels} BENCH_S=${BENCH_S:-200} \
        step bench_tp8 $((${BENCH_S:-200} + 30)) bash benchmarks/gpu_bench.sh
    step check_tp8 ${CHECK_S:-120} python3 benchmarks/check_gpu.py --sections bf16 \
        --tokens ${CHECK_TOKENS:-1,3,16,64,257,1024,4096,16384} --out "$OUT/check_tp8.json"
    step s2_tp8 ${S2_S:-120} python3 benchmarks/pair_variants.py --shape tp8 --formats mxfp4 --tokens 4096,16384 \
        --per-launch --configs $C/s2_candidates_5.json --out "$OUT/s2_tp8_5.json"
    step apply ${APPLY_S:-20} python3 benchmarks/apply_variants.py "$OUT/s2_tp8_5.json" --source $C/
    cp kimi_k3_moe/configs/tables/triton_nvidia_h200.json "$OUT/"
    ;;
  s2all)
    C=benchmarks/results/h200-2026-12-03-s2
    APPLIED=${SOURCE:-$S3/}
    for run in "tp8 mxfp4 s2_candidates_5 --per-launch" "tp8 int4 s2_candidates_int4_tp8" \
               "tp16 mxfp4 s2_candidates_mxfp4_tp16" "tp16 int4 s2_candidates_int4_tp16"; do
      set -- $run
      step "s2_$1_$2" ${S2_S:-75} python3 benchmarks/pair_variants.py --shape $1 --formats $2 --tokens 4096,16384 \
          ${4:-} --configs $C/$3.json --out "$OUT/s2_$1_$2.json"
      step "apply_$1_$2" ${APPLY_S:-20} python3 benchmarks/apply_variants.py "$OUT/s2_$1_$2.json" --source "$APPLIED"
    done
    cp kimi_k3_moe/configs/tables/triton_nvidia_h200.json "$OUT/"
    for shape in tp8 tp16 ep16; do
      OUT="$OUT" SHAPE=$shape OURS=triton,triton:int4 PEERS=${PEERS:-humming,triton_kernels} \
          BENCH_S=${BENCH_S:-100} step bench_$shape $((${BENCH_S:-100} + 20)) bash benchmarks/gpu_bench.sh
    done
    for shape in tp8 tp16; do
      step check_$shape ${CHECK_S:-100} python3 benchmarks/check_gpu.py --sections bf16 --shape $shape \
          --tokens ${CHECK_TOKENS:-1,3,16,64,257,1024,4096,16384} --out "$OUT/check_$shape.json"
    done
    ;;
  s1tiles)
    step s1_tp8 ${S1_S:-240} python3 benchmarks/pair_variants.py --shape tp8 --formats mxfp4 --tokens 4096,16384 \
        --stage1-tiles $S3/s1_tiles.json --out "$OUT/s1_tp8.json"
    step apply ${APPLY_S:-20} python3 benchmarks/apply_variants.py "$OUT/s1_tp8.json" \
        --source "${SOURCE:-$S3/}"
    cp kimi_k3_moe/configs/tables/triton_nvidia_h200.json "$OUT/"
    OUT="$OUT" SHAPE=tp8 OURS=triton PEERS=${PEERS:-humming,triton_kernels} TOKENS=${TOKENS:-1024,4096,16384} \
        BENCH_S=${BENCH_S:-100} step bench_tp8 $((${BENCH_S:-100} + 20)) bash benchmarks/gpu_bench.sh
    step check_tp8 ${CHECK_S:-80} python3 benchmarks/check_gpu.py --sections bf16 \
        --tokens ${CHECK_TOKENS:-4096,16384} --out "$OUT/check_tp8.json"
    ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
echo "== done $(date +%T)" | tee -a "$LOG"
