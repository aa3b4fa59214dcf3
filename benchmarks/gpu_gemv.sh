#!/usr/bin/env bash
# One H200 call for the small-batch tiers: given configs beside the table's (pair_variants.py
# --configs --per-launch: what each launch adds), then Humming and triton_kernels at the same token
# counts (kimi-k3-moe bench). Carry .whl (humming-kernels wheel) and .peer (triton_kernels from the
# vllm wheel); neither is committed.
#   bash benchmarks/gpu_gemv.sh OUT CONFIGS [SHAPE] [TOKENS]
set -u
OUT=${1:?output folder}; CONFIGS=${2:?configs json}; SHAPE=${3:-tp8}; TOKENS=${4:-1,4,16}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if ls .whl/humming_kernels-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/humming_kernels-*.whl && export PYTHONPATH=.:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout -k 5 "${VARIANTS_S:-330}" python3 benchmarks/pair_variants.py --shape "$SHAPE" --tokens "$TOKENS" \
  --configs "$CONFIGS" --per-launch --out "$OUT/variants_$SHAPE.json" 2>&1 | grep -v "^\s*$" | tail -c 9000
echo "variants rc=${PIPESTATUS[0]}"
timeout -k 5 "${BENCH_S:-150}" python3 -m kimi_k3_moe bench --shape "$SHAPE" --tokens "$TOKENS" --ours triton \
  --peers "${PEERS:-humming,triton_kernels}" --peer-path .peer --json "$OUT/bench_$SHAPE.json" 2>&1 | tail -c 3000
echo "bench rc=${PIPESTATUS[0]}"
