"""MetricsWriter, read_metrics and perplexity, on their own (test_train.py checks
what a training run logs through them)."""

import json
import math
import sys

import pytest

from attnlab.training import metrics


def _scalars(tb_dir):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  acc = EventAccumulator(str(tb_dir))
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_write_appends_one_json_object_per_call(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path))
  w.write(3, "train", {"loss": 1.5, "grad_norm": 2})
  w.write(4.0, "eval", {"perplexity": 7.25})
  w.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [
      {"step": 3, "split": "train", "loss": 1.5, "grad_norm": 2.0},
      {"step": 4, "split": "eval", "perplexity": 7.25},
  ]
  rec = json.loads(lines[0])
  assert type(rec["step"]) is int and type(rec["grad_norm"]) is float
  assert list(rec) == ["step", "split", "loss", "grad_norm"]
  # A second writer (a resumed run) appends to the same file.
  w2 = metrics.MetricsWriter(str(tmp_path))
  w2.write(5, "train", {"loss": 1.0})
  w2.close()
  assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [3, 4, 5]


def test_tensorboard_gets_the_same_scalars_under_split_slash_name(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path))
  assert w.path == str(tmp_path / "metrics.jsonl")
  assert w.tb_dir == str(tmp_path / "tensorboard")
  w.write(2, "train", {"loss": 1.5, "learning_rate": 0.25})
  w.write(4, "train", {"loss": 0.5, "learning_rate": 0.125})
  w.write(4, "eval", {"perplexity": 3.0})
  # A live run's scalars reach TensorBoard as they are written (tensorboardX's writer
  # flushed every 10 s here, from a thread, and the rest from an exit hook).
  want = {
      "train/loss": [(2, 1.5), (4, 0.5)],
      "train/learning_rate": [(2, 0.25), (4, 0.125)],
      "eval/perplexity": [(4, 3.0)],
  }
  assert _scalars(tmp_path / "tensorboard") == want
  w.close()
  assert _scalars(tmp_path / "tensorboard") == want


def test_close_is_idempotent_and_flush_after_close_is_a_no_op(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path))
  w.write(1, "train", {"loss": 1.0})
  w.close()
  assert w._events is None
  w.close()
  w.flush()


def test_a_disabled_writer_writes_nothing(tmp_path):
  """Processes other than 0 of a multi-host run: no file, no event directory."""
  w = metrics.MetricsWriter(str(tmp_path), enabled=False)
  w.write(1, "train", {"loss": 1.0})
  w.flush()
  w.close()
  assert list(tmp_path.iterdir()) == []


def test_read_metrics_skips_blank_lines(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
      '{"step": 1, "split": "train", "loss": 2.0}\n\n  \n{"step": 2, "split": "eval"}\n')
  assert metrics.read_metrics(str(tmp_path)) == [
      {"step": 1, "split": "train", "loss": 2.0}, {"step": 2, "split": "eval"}]


def test_a_line_cut_short_is_skipped_with_a_warning_and_the_next_record_starts_a_line(
    tmp_path, caplog):
  """A write cut short (a full disk, a kill mid-write) left a line every reader stopped at
  (a sweep failed the run on every retry) and the next record glued to it, until
  2026-12-05."""
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "split": "train", "loss": 2.0}\n{"step": 2, "split": "tr')
  w = metrics.MetricsWriter(str(tmp_path))
  w.write(2, "train", {"loss": 1.5})
  w.close()
  lines = path.read_text().splitlines()
  assert lines[1] == '{"step": 2, "split": "tr' and json.loads(lines[2])["loss"] == 1.5
  with caplog.at_level("WARNING"):
    records = metrics.read_metrics(str(tmp_path))
  assert records == [{"step": 1, "split": "train", "loss": 2.0},
                     {"step": 2, "split": "train", "loss": 1.5}]
  assert [(r.name, r.getMessage()) for r in caplog.records] == [
      ("attnlab.training.metrics",
       f"{path}: skipped 1 line(s) that are not metrics records (line 2): a write cut short?")]
  # A line that is JSON but no record (an edit) is skipped alike; a file ending in a
  # newline gets none added.
  path.write_text('[1, 2]\n{"step": 3}\n')
  w = metrics.MetricsWriter(str(tmp_path))
  w.write(4, "eval", {"loss": 1.0})
  w.close()
  assert path.read_text().splitlines()[2] == '{"step": 4, "split": "eval", "loss": 1.0}'
  assert metrics.read_metrics(str(tmp_path)) == [{"step": 4, "split": "eval", "loss": 1.0}]


def test_a_file_of_one_torn_byte_gets_the_record_on_a_line_of_its_own(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("{")
  w = metrics.MetricsWriter(str(tmp_path), enabled=True)
  w.write(1, "train", {"loss": 2.0})
  w.close()
  assert path.read_text() == '{\n{"step": 1, "split": "train", "loss": 2.0}\n'


def test_bytes_that_are_not_utf8_only_cost_their_line(tmp_path, caplog):
  """A write cut inside a character, or a stray byte: that line is skipped, not the file."""
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"step": 1, "split": "train", "loss": 2.0}\n{"step": 2, "sp\xe2\x82\n'
                   b'\xff\xfe\n{"step": 3, "split": "eval", "loss": 1.0}\n')
  with caplog.at_level("WARNING"):
    records = metrics.read_metrics(str(tmp_path))
  assert records == [{"step": 1, "split": "train", "loss": 2.0},
                     {"step": 3, "split": "eval", "loss": 1.0}]
  assert [r.getMessage() for r in caplog.records] == [
      f"{path}: skipped 2 line(s) that are not metrics records (line 2, 3): a write cut short?"]


@pytest.mark.parametrize("bad, listed", [(10, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"),
                                         (11, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ..."),
                                         (12, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ...")])
def test_the_warning_lists_the_first_ten_skipped_lines(tmp_path, caplog, bad, listed):
  path = tmp_path / "metrics.jsonl"
  path.write_text("x\n" * bad + '{"step": 1, "split": "train"}\n')
  with caplog.at_level("WARNING"):
    assert metrics.read_metrics(str(tmp_path)) == [{"step": 1, "split": "train"}]
  assert [r.getMessage() for r in caplog.records] == [
      f"{path}: skipped {bad} line(s) that are not metrics records (line {listed}): "
      "a write cut short?"]


@pytest.mark.parametrize("nll", [0.0, 1.25, 49.5, 50.0])
def test_perplexity_is_exp_of_the_nll(nll):
  assert metrics.perplexity(nll) == math.exp(nll)


@pytest.mark.parametrize("nll", [50.5, 1e4, float("inf")])
def test_perplexity_is_capped_at_exp_50(nll):
  """A diverged run logs exp(50), not an overflow."""
  assert metrics.perplexity(nll) == math.exp(50.0)


def test_tensorboardx_is_imported_without_torch_only_if_absent(monkeypatch, tmp_path):
  # tensorboardX imported first, as it is: its import reads torch.Tensor from a torch it
  # finds, which the stand-in below has not (run alone, or first in an xdist worker, the
  # test failed in that import until 2026-12-07's fifth session)
  metrics._tensorboardx()
  sentinel = object()
  monkeypatch.setitem(sys.modules, "torch", sentinel)
  metrics._tensorboardx()
  assert sys.modules["torch"] is sentinel  # an imported torch is left alone
  monkeypatch.delitem(sys.modules, "torch")
  tbx = metrics._tensorboardx()
  assert "torch" not in sys.modules  # not left as None: `import torch` works afterwards
  assert tbx.Event.__name__ == "Event" and tbx.Summary.__name__ == "Summary"
  # What tensorboardX's import sees: `torch` set to None (an ImportError) while torch is
  # not imported, an imported torch as it is. A stand-in package records it.
  package = tmp_path / "tensorboardX"
  (package / "proto").mkdir(parents=True)
  (package / "__init__.py").write_text("import sys\nSEEN = sys.modules.get('torch', 'absent')\n")
  (package / "proto" / "__init__.py").write_text("")
  (package / "proto" / "event_pb2.py").write_text("class Event:\n  pass\n")
  (package / "proto" / "summary_pb2.py").write_text("class Summary:\n  pass\n")
  (package / "record_writer.py").write_text("def masked_crc32c(data):\n  return 0\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  for present in (False, True):
    for name in [m for m in sys.modules if m == "tensorboardX" or m.startswith("tensorboardX.")]:
      monkeypatch.delitem(sys.modules, name)
    if present:
      monkeypatch.setitem(sys.modules, "torch", sentinel)
    stand_in = metrics._tensorboardx()
    seen = sys.modules["tensorboardX"].SEEN
    assert stand_in.Event is sys.modules["tensorboardX.proto.event_pb2"].Event
    assert seen is (sentinel if present else None), (present, seen)
    assert sys.modules.get("torch") is (sentinel if present else None)


def test_a_record_that_cannot_be_written_whole_is_taken_back_off_the_file(tmp_path,
                                                                         monkeypatch):
  """A full disk in the middle of a record (half of it written, then ENOSPC): the OSError is
  raised and the half record taken off, so the records before it, and those written once
  there is room again, are what TensorBoard reads (a torn record ends its reading of the
  file)."""
  import errno
  import os

  w = metrics.MetricsWriter(str(tmp_path))
  w.write(1, "train", {"loss": 2.0})
  real_write, calls = os.write, []

  def half_then_full(fd, data):
    calls.append(len(data))
    if len(calls) == 1:
      return real_write(fd, bytes(data[:len(data) // 2]))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  [events] = (tmp_path / "tensorboard").iterdir()
  size = events.stat().st_size
  monkeypatch.setattr(metrics.os, "write", half_then_full)
  with pytest.raises(OSError, match="No space left"):
    w.write(2, "train", {"loss": 1.0})
  assert len(calls) == 2 and events.stat().st_size == size
  monkeypatch.setattr(metrics.os, "write", real_write)
  w.write(3, "train", {"loss": 0.5})
  w.close()
  assert _scalars(tmp_path / "tensorboard") == {"train/loss": [(1, 2.0), (3, 0.5)]}


def test_writers_leave_no_exit_hook_and_are_freed_when_closed(tmp_path, monkeypatch):
  """tensorboardX's ``SummaryWriter`` registered an ``atexit`` hook per writer: every
  writer a process made (each ``train`` in a notebook, each arm of an ablation) stayed in
  memory until exit, and on a full disk the hook's flush printed an OSError traceback after
  the run's own line. Two writers of one folder in one second write two files."""
  import atexit
  import gc
  import os
  import weakref

  hooks = atexit._ncallbacks()
  writers = [metrics.MetricsWriter(str(tmp_path)) for _ in range(2)]
  for step, w in enumerate(writers):
    w.write(step, "train", {"loss": float(step)})
  assert len(list((tmp_path / "tensorboard").iterdir())) == 2
  alive = [weakref.ref(w._events) for w in writers]
  for w in writers:
    w.close()
  del writers, w
  gc.collect()
  assert [ref() for ref in alive] == [None, None]
  assert atexit._ncallbacks() == hooks
  # One dropped without close: its descriptor is closed when it is collected.
  events = metrics.EventFile(str(tmp_path / "dropped"))
  fd, closed, close = events._fd, [], os.close
  monkeypatch.setattr(os, "close", lambda n: (closed.append(n), close(n))[1])
  del events
  gc.collect()
  assert closed == [fd]
  assert _scalars(tmp_path / "tensorboard") == {"train/loss": [(0, 0.0), (1, 1.0)]}


def test_a_non_finite_value_is_written_as_it_is_and_nothing_is_printed(tmp_path, capfd):
  """A skipped step's NaN loss: tensorboardX's ``add_scalar`` printed "NaN or Inf found in
  input tensor." on stderr; the value reaches TensorBoard as it is."""
  w = metrics.MetricsWriter(str(tmp_path))
  w.write(1, "train", {"loss": float("nan"), "grad_norm": float("inf")})
  w.close()
  got = _scalars(tmp_path / "tensorboard")
  assert math.isnan(got["train/loss"][0][1]) and got["train/grad_norm"] == [(1, math.inf)]
  assert capfd.readouterr() == ("", "")


def _records(path):
  """The events of a file, read by hand: (length, its CRC, the bytes, theirs) per record."""
  import struct

  tbx, data, events = metrics._tensorboardx(), path.read_bytes(), []
  while data:
    header = data[:8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[8:12])[0] == tbx.masked_crc32c(header)
    body = data[12:12 + length]
    assert struct.unpack("<I", data[12 + length:16 + length])[0] == tbx.masked_crc32c(body)
    events.append(tbx.Event.FromString(body))
    data = data[16 + length:]
  return events


def test_an_event_file_opens_with_its_version_and_stamps_each_record(tmp_path):
  """TensorBoard reads the first record's ``file_version`` ("brain.Event:2") to know the
  format, and every record's ``wall_time`` (the run's start, its relative-time axis). The
  file is made as any file is (0666 less the umask: not executable, not writable by others),
  and a closed writer says which file it was."""
  import os
  import re
  import time

  old = os.umask(0o022)
  try:
    t0 = time.time()
    events = metrics.EventFile(str(tmp_path / "tb"))
    events.add_scalars(7, {"train/loss": 0.5})
    t1 = time.time()
  finally:
    os.umask(old)
  path = tmp_path / "tb" / os.path.basename(events.path)
  assert os.stat(path).st_mode & 0o777 == 0o644
  first, scalars = _records(path)
  assert first.file_version == "brain.Event:2" and not first.HasField("summary")
  assert scalars.step == 7 and [(v.tag, v.simple_value) for v in scalars.summary.value] == [
      ("train/loss", 0.5)]
  for event in (first, scalars):
    assert t0 <= event.wall_time <= t1
  events.close()
  with pytest.raises(ValueError, match=f"^{re.escape(events.path)} is closed$"):
    events.add_scalars(8, {"train/loss": 0.25})


def test_a_folder_that_is_a_file_is_named_as_not_a_directory(tmp_path):
  import errno

  (tmp_path / "tb").write_text("")
  with pytest.raises(NotADirectoryError) as e:
    metrics.EventFile(str(tmp_path / "tb"))
  assert (e.value.errno, e.value.filename) == (errno.ENOTDIR, str(tmp_path / "tb"))
  assert str(e.value) == f"[Errno 20] Not a directory: '{tmp_path / 'tb'}'"


def test_a_take_back_that_fails_too_keeps_the_writes_own_error(tmp_path, monkeypatch):
  """The full disk's ENOSPC is what the caller learns, not an error of the truncation that
  tries to take the half record back (an I/O error there is let go)."""
  import errno
  import os

  events = metrics.EventFile(str(tmp_path))

  def fail(code, real):  # on this writer's descriptor only
    def call(fd, *args):
      if fd == events._fd:
        raise OSError(code, os.strerror(code))
      return real(fd, *args)
    return call

  monkeypatch.setattr(metrics.os, "write", fail(errno.ENOSPC, os.write))
  monkeypatch.setattr(metrics.os, "ftruncate", fail(errno.EIO, os.ftruncate))
  with pytest.raises(OSError) as e:
    events.add_scalars(1, {"train/loss": 1.0})
  assert e.value.errno == errno.ENOSPC
  monkeypatch.undo()
  events.close()


def test_a_writer_collected_after_its_descriptor_failed_says_nothing(tmp_path, monkeypatch):
  """Collection closes the descriptor; an error there (EBADF: someone closed it already)
  is dropped, not printed as "Exception ignored in ..."."""
  import errno
  import gc
  import os

  events = metrics.EventFile(str(tmp_path))
  fd, unraisable, close = events._fd, [], os.close

  def ebadf(n):  # on this writer's descriptor only: other objects collected meanwhile
    if n != fd:  # close theirs as ever
      return close(n)
    raise OSError(errno.EBADF, os.strerror(errno.EBADF))

  gc.collect()
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  monkeypatch.setattr(metrics.os, "close", ebadf)
  del events
  gc.collect()
  monkeypatch.undo()
  os.close(fd)
  assert unraisable == []
