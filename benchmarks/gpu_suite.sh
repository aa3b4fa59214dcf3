#!/usr/bin/env bash
# Everything a GPU session runs, in one go: correctness, tuning, benchmark.
#   bash benchmarks/gpu_suite.sh OUT_DIR [TUNE_SHAPES] [TUNE_FORMATS] [TUNE_BUDGET_S] [BENCH_FORMATS]
# Results (JSON) and the tuned table land in OUT_DIR; each step has its own time limit
# and a failing step does not stop the next.
set -u
OUT=${1:?output folder}
SHAPES=${2:-tp8}
FORMATS=${3:-mxfp4}
BUDGET=${4:-200}
BENCH_FORMATS=${5:-mxfp4,int4}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
dev_table=$(python3 -c "from kimi_k3_moe.configs import triton_table as t; import torch; print(t.table_path(t.device_key(torch.cuda.get_device_name())))")
echo "== check_gpu (before tuning: $( [ -f "$dev_table" ] && echo packaged table || echo heuristic configs))"
timeout ${CHECK_TIMEOUT:-220} python3 benchmarks/check_gpu.py --out "$OUT/check_gpu.json"; echo "check_gpu rc=$?"
echo "== tune_triton ($SHAPES / $FORMATS, budget ${BUDGET}s)"
timeout $((BUDGET + 90)) python3 benchmarks/tune_triton.py --shapes "$SHAPES" --formats "$FORMATS" \
    --budget-s "$BUDGET" --merge --out "$dev_table" --log "$OUT/tune_log.json"; echo "tune rc=$?"
cp "$dev_table" "$OUT/" 2>/dev/null
echo "== bench_moe"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_moe.py --formats "$BENCH_FORMATS" --peer-path "${PEER_PATH:-.peer}" --out "$OUT/bench_moe.json"; echo "bench rc=$?"
