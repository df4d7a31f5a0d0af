#!/usr/bin/env bash
# The main demo: train the tiny stdlib language model on the CPU (about 3
# minutes on 2 cores), checkpoint it, decode a sample greedily, and say where
# the TensorBoard logs are.
#
#   bash tools/demo.sh VENV          (make demo calls it after installing attnlab)
#   ATTNLAB_DEMO_STEPS=20 bash tools/demo.sh .venv     (a quick smoke run)
#   ATTNLAB_DEMO_WORKDIR=runs/mine ...                 (default: runs/demo)
set -euo pipefail
VENV="${1:-.venv}"
WORKDIR="${ATTNLAB_DEMO_WORKDIR:-runs/demo}"
STEPS_FLAG=()
if [[ -n "${ATTNLAB_DEMO_STEPS:-}" ]]; then
  STEPS_FLAG=("--gin.TrainConfig.steps=${ATTNLAB_DEMO_STEPS}")
fi
cd "$(dirname "$0")/.."
rm -rf "$WORKDIR"

echo "== training configs/lm_stdlib_tiny.gin in $WORKDIR"
"$VENV/bin/attnlab" train --gin_file configs/lm_stdlib_tiny.gin "${STEPS_FLAG[@]}" \
  --workdir "$WORKDIR"

echo "== greedy sample from the latest checkpoint"
"$VENV/bin/attnlab" decode --workdir "$WORKDIR" --prompt "def main(" --max_new_tokens 64

echo "== TensorBoard logs: $WORKDIR/tensorboard   (tensorboard --logdir $WORKDIR/tensorboard)"
echo "== metrics: $WORKDIR/metrics.jsonl; checkpoints: $WORKDIR/checkpoints"
