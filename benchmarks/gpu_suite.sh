#!/usr/bin/env bash
# Everything a GPU session runs, in one go: tuning, correctness (with the tuned
# table), benchmark (ours and PyTorch), and the triton_kernels peer in a process
# of its own. Each step has a time limit and a failing step does not stop the next.
#   bash benchmarks/gpu_suite.sh OUT_DIR [TUNE_SHAPES] [TUNE_FORMATS] [TUNE_BUDGET_S]
# Env: PEER_PATH (folder holding triton_kernels), *_TIMEOUT per step.
set -u
OUT=${1:?output folder}
SHAPES=${2:-tp8,tp16}
FORMATS=${3:-mxfp4,int4}
BUDGET=${4:-600}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
dev_table=$(python3 -c "from kimi_k3_moe.configs import triton_table as t; import torch; print(t.table_path(t.device_key(torch.cuda.get_device_name())))")
if [ "$BUDGET" != 0 ]; then
  echo "== tune_triton ($SHAPES / $FORMATS, budget ${BUDGET}s)"
  timeout $((BUDGET + 40)) python3 benchmarks/tune_triton.py --shapes "$SHAPES" --formats "$FORMATS" \
      --budget-s "$BUDGET" --merge --quick-secondary --out "$dev_table" --log "$OUT/tune_log.json"; echo "tune rc=$?"
  cp "$dev_table" "$OUT/" 2>/dev/null
fi
echo "== check_gpu ($( [ -f "$dev_table" ] && echo tuned table || echo heuristic configs))"
timeout ${CHECK_TIMEOUT:-300} python3 benchmarks/check_gpu.py --out "$OUT/check_gpu.json"; echo "check_gpu rc=$?"
echo "== bench_moe (ours, PyTorch)"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_moe.py --peers torch --out "$OUT/bench_moe.json"; echo "bench rc=$?"
echo "== bench_moe (triton_kernels peer)"
timeout ${PEER_TIMEOUT:-120} python3 benchmarks/bench_moe.py --formats "" --peers triton_kernels \
    --peer-path "${PEER_PATH:-.peer}" --out "$OUT/bench_peer.json"; echo "peer rc=$?"
