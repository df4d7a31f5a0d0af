"""Training metrics: JSON lines and TensorBoard event files.

``workdir/metrics.jsonl`` gets one object per logged step
(``{"step": 10, "split": "train", "loss": ...}``); ``workdir/tensorboard``
gets the same scalars as ``train/loss``, ``eval/perplexity``, ... via
tensorboardX (no TensorFlow needed). ``tensorboard --logdir WORKDIR/tensorboard``
shows them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket

TENSORBOARD_DIR = "tensorboard"
METRICS_FILE = "metrics.jsonl"
# The flag of a train record whose window holds the compilation: the first logged window of
# every process that trains (a new run or a resume).
WINDOW_HOLDS_COMPILE = "window_holds_compile"


def write_text_atomically(path: str, text: str) -> None:
  """``text`` into ``path`` as UTF-8 (whatever the locale) through a temporary file of this
  process and a rename: a reader sees the old file or the new one, never half of it, and two
  processes writing one file (two ``ablate --arm`` jobs) do not mix their temporaries: its
  name holds the host's name beside the pid (two hosts on one filesystem may share a pid).
  A failed write (a full disk) removes its temporary and leaves ``path`` as it was."""
  tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


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
    with open(self.path, "a+b") as f:
      # A line cut short (a full disk, a kill mid-write) is ended first: the record starts
      # a line of its own (until 2026-12-05 it was glued to the torn one).
      torn = f.tell() > 0 and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n"
      f.write((("\n" if torn else "") + json.dumps(record) + "\n").encode("utf-8"))
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
  """The records of workdir/metrics.jsonl (for tests, plots and a sweep's measures).

  A line that is not a record (a write cut short by a full disk or a kill, an edit) is
  skipped with one warning naming the file and its line numbers: until 2026-12-05 it
  stopped every reader, and a sweep failed the run on every retry."""
  path = os.path.join(workdir, METRICS_FILE)
  records, bad = [], []
  with open(path, encoding="utf-8", errors="replace") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        record = None
      if isinstance(record, dict) and "step" in record and "split" in record:
        records.append(record)
      else:
        bad.append(number)
  if bad:
    logging.getLogger(__name__).warning(
        "%s: skipped %d line(s) that are not metrics records (line %s): a write cut short?",
        path, len(bad), ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else ""))
  return records
