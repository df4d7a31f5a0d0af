#!/usr/bin/env bash
# The main demo: train the tiny stdlib language model on the CPU (about 3
# minutes on 2 cores), checkpoint it, decode a sample greedily, and say where
# the TensorBoard logs are.
#
#   bash tools/demo.sh VENV          (make demo calls it after installing attnlab)
#   ATTNLAB_DEMO_STEPS=20 bash tools/demo.sh .venv     (a quick smoke run)
#   ATTNLAB_DEMO_WORKDIR=runs/mine ...                 (default: runs/demo in the repo)
#
# VENV and ATTNLAB_DEMO_WORKDIR are relative to the directory it is called from. The
# demo starts afresh: it deletes its workdir first, but only a workdir an earlier demo
# made (it holds the file .attnlab_demo; or the default runs/demo with its config.gin,
# made before that file was written); any other existing directory stops it.
set -euo pipefail
absolute() { [[ "$1" = /* ]] && echo "$1" || echo "$PWD/$1"; }
VENV="$(absolute "${1:-.venv}")"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORKDIR="$(absolute "${ATTNLAB_DEMO_WORKDIR:-$REPO/runs/demo}")"
STEPS_FLAG=()
if [[ -n "${ATTNLAB_DEMO_STEPS:-}" ]]; then
  STEPS_FLAG=("--gin.TrainConfig.steps=${ATTNLAB_DEMO_STEPS}")
fi
cd "$REPO"
if [[ -d "$WORKDIR" ]]; then
  WORKDIR="$(cd "$WORKDIR" && pwd)"  # ./runs/demo, runs/demo/ and runs/demo are one path
fi
if [[ -e "$WORKDIR" ]]; then
  if [[ -f "$WORKDIR/.attnlab_demo" ]] ||
     [[ "$WORKDIR" = "$REPO/runs/demo" && -f "$WORKDIR/config.gin" ]]; then
    rm -rf "$WORKDIR"
  else
    echo "tools/demo.sh: $WORKDIR exists and is not a workdir of an earlier demo (no" \
      ".attnlab_demo in it): not deleting it; set ATTNLAB_DEMO_WORKDIR to a new path" >&2
    exit 2
  fi
fi
mkdir -p "$WORKDIR"
touch "$WORKDIR/.attnlab_demo"

echo "== training configs/lm_stdlib_tiny.gin in $WORKDIR"
"$VENV/bin/attnlab" train --gin_file configs/lm_stdlib_tiny.gin "${STEPS_FLAG[@]}" \
  --workdir "$WORKDIR"

echo "== greedy sample from the latest checkpoint"
"$VENV/bin/attnlab" decode --workdir "$WORKDIR" --prompt "def main(" --max_new_tokens 64

echo "== TensorBoard logs: $WORKDIR/tensorboard   (pip install tensorboard; tensorboard --logdir $WORKDIR/tensorboard)"
echo "== metrics: $WORKDIR/metrics.jsonl; checkpoints: $WORKDIR/checkpoints"
