"""Training metrics: JSON lines and TensorBoard event files.

``workdir/metrics.jsonl`` gets one object per logged step
(``{"step": 10, "split": "train", "loss": ...}``); ``workdir/tensorboard``
gets the same scalars as ``train/loss``, ``eval/perplexity``, ... via
tensorboardX (no TensorFlow needed). ``tensorboard --logdir WORKDIR/tensorboard``
shows them.
"""

from __future__ import annotations

import json
import math
import os

TENSORBOARD_DIR = "tensorboard"
METRICS_FILE = "metrics.jsonl"
# The flag of a train record whose window holds the compilation: the first logged window of
# every process that trains (a new run or a resume).
WINDOW_HOLDS_COMPILE = "window_holds_compile"


def perplexity(nll: float) -> float:
  return math.exp(min(nll, 50.0))  # exp(50) already says "diverged"


def _summary_writer():
  """tensorboardX's ``SummaryWriter``, imported without torch.

  tensorboardX's writer module imports torch when it is installed (to accept
  torch tensors), which costs ~1.7 s at the start of every run on a CPU box
  and is never needed here: only Python floats are written. torch is hidden
  from that one import (an ImportError, which tensorboardX handles) and
  importable as usual afterwards.
  """
  import sys

  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError
  try:
    from tensorboardX import SummaryWriter
  finally:
    if hide:
      del sys.modules["torch"]
  return SummaryWriter


class MetricsWriter:
  """Appends scalars to metrics.jsonl and TensorBoard (process 0 only)."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, METRICS_FILE)
    self.tb_dir = os.path.join(workdir, TENSORBOARD_DIR)
    self._tb = None
    if enabled:
      self._tb = _summary_writer()(self.tb_dir, flush_secs=10)

  def write(self, step: int, split: str, scalars: dict, flags: dict | None = None) -> None:
    """``scalars`` to both; ``flags`` (JSON values describing the record, not plotted) to
    metrics.jsonl only."""
    if not self.enabled:
      return
    record = {"step": int(step), "split": split}
    record.update({k: float(v) for k, v in scalars.items()})
    record.update(flags or {})
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")
    for k, v in scalars.items():
      self._tb.add_scalar(f"{split}/{k}", float(v), int(step))

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def read_metrics(workdir: str) -> list[dict]:
  """The records of workdir/metrics.jsonl (for tests and plots)."""
  with open(os.path.join(workdir, METRICS_FILE), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
