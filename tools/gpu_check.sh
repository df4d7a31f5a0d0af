#!/usr/bin/env bash
# One prepared GPU check, at most 8 minutes (timeouts sum to 470 s): the gpu-marked tests (the Triton
# kernels compiled, interpret=False, against the reference), then the GPU
# benchmark. Needs jax[cuda], flax, optax, einops, chex and pytest; runs from
# a bare checkout (no install, no network).
#
#   bash tools/gpu_check.sh            # PYTHON=python3.12 bash tools/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# XLA's default optimization level: tests/conftest.py then adds none of its CPU
# compile-speed flags (a newer XLA may not know one, and the GPU tests time kernels).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=3"
status=0

echo "== environment"
timeout 30 "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" || exit 1
timeout 30 "$PY" -c "import attnlab.ops.pallas.flash, attnlab.ops.pallas.decode" || exit 1

echo "== gpu tests (<= 200 s)"
timeout 200 "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs \
  tests/ops/test_flash.py tests/ops/test_decode_kernels.py tests/ops/test_attention.py \
  || status=$?

# Two budgets, so that a slow throughput table cannot starve the decode one.
echo "== gpu benchmark: TFLOP/s (<= 150 s; rows print as measured)"
timeout 150 "$PY" tools/bench_attention.py --gpu --iters 3 --skip decode || status=$?
echo "== gpu benchmark: decode GB/s (<= 60 s)"
timeout 60 "$PY" tools/bench_attention.py --gpu --iters 5 --skip throughput || status=$?

echo "== exit status $status"
exit "$status"
