#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine with a short lease (or any CUDA host):
#   1. the Triton kernels against their PyTorch references on CUDA (tests/unit/kernels, --runslow),
#   2. the engine's CUDA path against transformers, greedy fp32, with and without CUDA graphs
#      (tests/integration/test_engine_gpu.py), both at once (the GPU has room for both);
#   3. then, alone on the GPU, benchmarks/bench_gpu.py (kernels vs copy bandwidth and SDPA,
#      engine decode vs the weight-bandwidth floor and transformers).
# Logs go to $OUT (default /tmp/gpu-checks); the last lines printed are each step's summary.
# A host without this project's environment (a GPU box with only PyTorch/Triton/transformers)
# can be given wheels and tokenizer files in .whl/ (git-ignored): .whl/*.whl are installed to
# /tmp/site first and .whl/tok/ becomes PDSERVE_TEST_TOKENIZER_DIR.
#   OUT=/tmp/g STEP_S=200 BENCH_S=150 bash benchmarks/gpu_checks.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checks}
STEP_S=${STEP_S:-200}
BENCH_S=${BENCH_S:-150}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
[ -d .whl/tok ] && export PDSERVE_TEST_TOKENIZER_DIR=$PWD/.whl/tok
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    $PY -c "import torch, triton, transformers, sys; print(sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.log" 2>&1

t0=$(date +%s)
timeout "$STEP_S" $PY -m pytest -q -rfE --tb=short -p no:cacheprovider --runslow -n 4 \
    tests/unit/kernels >"$OUT/kernels.log" 2>&1 &
k=$!
timeout "$STEP_S" $PY -m pytest -q -rfE --tb=short -p no:cacheprovider -n 3 \
    tests/integration/test_engine_gpu.py >"$OUT/engine.log" 2>&1 &
e=$!
wait $k; krc=$?
wait $e; erc=$?
t1=$(date +%s)
timeout "$BENCH_S" $PY benchmarks/bench_gpu.py >"$OUT/bench.log" 2>&1
brc=$?
t2=$(date +%s)

echo "== env"; cat "$OUT/env.log"
echo "== kernels rc=$krc, engine rc=$erc ($((t1 - t0)) s); bench rc=$brc ($((t2 - t1)) s)"
echo "== kernels"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/kernels.log" | tail -15
echo "== engine"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/engine.log" | tail -15
echo "== bench"; tail -25 "$OUT/bench.log"
