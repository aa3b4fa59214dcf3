#!/bin/bash
# One GPU call for `kimi-k3-moe tune`: tune into a fresh table folder under $OUT, then bench ours with it.
#   SHAPE=tp8  TIERS=1,64,1024  BUDGET_MIN=1.2  QUICK=--quick  BENCH_TOKENS=$TIERS
set -u
out=${OUT:-/tmp/kimi_out}; mkdir -p "$out/tables"
export KIMI_K3_MOE_TABLES="$out/tables"
timeout "${TUNE_S:-200}" python3 -m kimi_k3_moe tune --backend triton --shape "${SHAPE:-tp8}" ${QUICK---quick} \
  --tiers "${TIERS:-1,64,1024}" --budget-min "${BUDGET_MIN:-1.2}" --reps "${REPS:-15}" 2>&1 | grep -v "━" | tail -c 8000
echo "tune rc=${PIPESTATUS[0]}"
timeout "${BENCH_S:-120}" python3 -m kimi_k3_moe bench --shape "${SHAPE:-tp8}" --tokens "${BENCH_TOKENS:-${TIERS:-1,64,1024}}" \
  --ours triton --peers "" --reps "${REPS:-15}" --json "$out/bench_user_table.json" 2>&1 | tail -c 6000
echo "bench rc=${PIPESTATUS[0]}"
