#!/bin/bash
# One GPU call for `kimi-k3-moe bench`: install the humming-kernels wheel (carried, never committed),
# then ours vs Humming (vLLM 0.33's SM90 path), triton_kernels and torch at one shape.
#   WHL=dir of humming_kernels-*.whl  PEER=dir holding triton_kernels  SHAPE=tp8  TOKENS=...  BENCH_S=timeout
set -u
out=${OUT:-/tmp/kimi_out}; mkdir -p "$out"
if ls "${WHL:-.whl}"/humming_kernels-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${WHL:-.whl}"/humming_kernels-*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import humming; print('humming-kernels', humming.__version__)" 2>&1 | tail -1
timeout "${BENCH_S:-330}" python3 -m kimi_k3_moe bench --shape "${SHAPE:-tp8}" \
  --tokens "${TOKENS:-1,4,16,64,256,1024,4096,16384}" --ours "${OURS:-triton}" \
  --peers "${PEERS:-humming,triton_kernels,torch}" --peer-path "${PEER:-.peer}" \
  --json "$out/bench_${SHAPE:-tp8}.json" 2>&1 | tail -c 20000
echo "bench rc=${PIPESTATUS[0]}"
