"""Training metrics: JSON lines and TensorBoard event files.

``workdir/metrics.jsonl`` gets one object per logged step
(``{"step": 10, "split": "train", "loss": ...}``); ``workdir/tensorboard``
gets the same scalars as ``train/loss``, ``eval/perplexity``, ... in an event
file written with tensorboardX's protocol buffers (no TensorFlow needed), each
call's record on disk when ``write`` returns. ``tensorboard --logdir
WORKDIR/tensorboard`` shows them.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import socket
import struct
import time
import types

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


def _tensorboardx() -> types.SimpleNamespace:
  """tensorboardX's ``Event`` and ``Summary`` protocol buffers and its ``masked_crc32c``,
  imported without torch.

  tensorboardX's package imports torch when it is installed (to accept torch tensors), which
  costs ~1.7 s at the start of every run on a CPU box and is never needed here: only Python
  floats are written. torch is hidden from that one import (an ImportError, which
  tensorboardX handles) and importable as usual afterwards.
  """
  import sys

  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError
  try:
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.record_writer import masked_crc32c
  finally:
    if hide:
      del sys.modules["torch"]
  return types.SimpleNamespace(Event=Event, Summary=Summary, masked_crc32c=masked_crc32c)


_EVENT_FILES = itertools.count()  # this process's event files, for their names


class EventFile:
  """A new TensorBoard event file in ``folder`` (made if missing): records of tensorboardX's
  ``Event`` protocol buffer, framed as TensorBoard reads them (length, its masked CRC32C, the
  bytes, theirs).

  Each record is written whole by ``add_scalars`` before it returns: no buffer, no thread and
  no exit hook (tensorboardX's ``SummaryWriter`` queued events for a thread and flushed them
  from an ``atexit`` hook of each writer, which kept every closed writer alive until the
  process exited and, on a full disk, printed an OSError traceback after the run's own
  line). A record that cannot be written whole (a full disk) is taken back off the file,
  so that the records before it stay readable, and the OSError raised.
  """

  def __init__(self, folder: str):
    self._fd = None
    self._tbx = _tensorboardx()
    try:
      os.makedirs(folder, exist_ok=True)
    except FileExistsError:  # a file in its place: say what is wrong with it
      raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), folder) from None
    now = time.time()
    # The time first, as tensorboard sorts a folder's files by name: a resumed run's file
    # comes after the first run's. The host, process and a count keep two writers apart.
    name = (f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}."
            f"{next(_EVENT_FILES)}")
    self.path = os.path.join(folder, name)
    self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o666)
    try:
      self._append(self._tbx.Event(wall_time=now, file_version="brain.Event:2"))
    except BaseException:
      self.close()
      raise

  def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
    """One record: ``scalars`` (tag -> value) at ``step``."""
    values = [self._tbx.Summary.Value(tag=tag, simple_value=float(value))
              for tag, value in scalars.items()]
    self._append(self._tbx.Event(wall_time=time.time(), step=int(step),
                                 summary=self._tbx.Summary(value=values)))

  def _append(self, event) -> None:
    if self._fd is None:
      raise ValueError(f"{self.path} is closed")
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    crc = self._tbx.masked_crc32c
    record = memoryview(header + struct.pack("<I", crc(header)) + data
                        + struct.pack("<I", crc(data)))
    start = os.lseek(self._fd, 0, os.SEEK_END)
    try:
      while record:
        record = record[os.write(self._fd, record):]
    except BaseException:
      with contextlib.suppress(OSError):
        os.ftruncate(self._fd, start)
      raise

  def close(self) -> None:
    if self._fd is not None:
      fd, self._fd = self._fd, None
      os.close(fd)

  def __del__(self):  # a writer dropped without close (a caller's own): its descriptor goes
    with contextlib.suppress(Exception):  # noqa: BLE001 - nothing to say at collection
      self.close()


class MetricsWriter:
  """Appends scalars to metrics.jsonl and TensorBoard (process 0 only)."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, METRICS_FILE)
    self.tb_dir = os.path.join(workdir, TENSORBOARD_DIR)
    self._events = None
    if enabled:
      self._events = EventFile(self.tb_dir)

  def write(self, step: int, split: str, scalars: dict, flags: dict | None = None) -> None:
    """``scalars`` to both; ``flags`` (JSON values describing the record, not plotted) to
    metrics.jsonl only. Both are on disk when it returns."""
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
    self._events.add_scalars(step, {f"{split}/{k}": v for k, v in scalars.items()})

  def flush(self) -> None:
    """Nothing to do: each ``write`` is on disk when it returns (kept for callers)."""

  def close(self) -> None:
    if self._events is not None:
      self._events.close()
      self._events = None


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
