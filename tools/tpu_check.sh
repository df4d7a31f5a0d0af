#!/usr/bin/env bash
# One prepared TPU check, at most 8 minutes (timeouts sum to 460 s): the tpu-marked tests (the
# Mosaic-compiled flash kernel, interpret=None on a TPU, against the reference), a short
# TPU-interpret parity sample, then the TFLOP/s table of pallas-tpu vs XLA. Needs jax[tpu],
# flax, optax, einops, chex and pytest; runs from a bare checkout (no install, no network).
# There is no TPU decode kernel yet, so there is no decode GB/s table.
#
#   bash tools/tpu_check.sh            # PYTHON=python3.12 bash tools/tpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# XLA's default optimization level: tests/conftest.py then adds none of its CPU
# compile-speed flags (a newer XLA may not know one).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=3"
status=0

echo "== environment"
timeout 30 "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" || exit 1
timeout 30 "$PY" -c "import attnlab.ops.pallas.flash_tpu" || exit 1

echo "== tpu tests (<= 200 s)"
timeout 200 "$PY" -m pytest -m tpu -p no:cacheprovider -q -rs tests/ops/test_flash_tpu.py \
  || status=$?

echo "== lowering and interpret-mode sample (<= 80 s)"
timeout 80 "$PY" -m pytest -p no:cacheprovider -q -rs tests/ops/test_flash_tpu.py \
  -k "lowering or masked_blocks_are_not_visited" || status=$?

echo "== tpu benchmark: TFLOP/s (<= 120 s; rows print as measured)"
timeout 120 "$PY" tools/bench_tpu.py --tpu --iters 3 || status=$?

echo "== exit status $status"
exit "$status"
