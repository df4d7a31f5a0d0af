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
  # A live run's scalars reach TensorBoard within 10 s (tensorboardX's default is 120).
  assert w._tb._flush_secs == 10
  w.flush()
  w.close()
  assert _scalars(tmp_path / "tensorboard") == {
      "train/loss": [(2, 1.5), (4, 0.5)],
      "train/learning_rate": [(2, 0.25), (4, 0.125)],
      "eval/perplexity": [(4, 3.0)],
  }


def test_close_is_idempotent_and_flush_after_close_is_a_no_op(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path))
  w.write(1, "train", {"loss": 1.0})
  w.close()
  assert w._tb is None
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


def test_summary_writer_hides_torch_only_while_importing_and_only_if_absent(monkeypatch,
                                                                            tmp_path):
  sentinel = object()
  monkeypatch.setitem(sys.modules, "torch", sentinel)
  metrics._summary_writer()
  assert sys.modules["torch"] is sentinel  # an imported torch is left alone
  monkeypatch.delitem(sys.modules, "torch")
  writer_cls = metrics._summary_writer()
  assert "torch" not in sys.modules  # not left as None: `import torch` works afterwards
  assert writer_cls.__name__ == "SummaryWriter"
  # What tensorboardX's import sees: `torch` set to None (an ImportError) while torch is
  # not imported, an imported torch as it is. A stand-in package records it.
  (tmp_path / "tensorboardX").mkdir()
  (tmp_path / "tensorboardX" / "__init__.py").write_text(
      "import sys\nSEEN = sys.modules.get('torch', 'absent')\nclass SummaryWriter:\n  pass\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  for present in (False, True):
    monkeypatch.delitem(sys.modules, "tensorboardX", raising=False)
    if present:
      monkeypatch.setitem(sys.modules, "torch", sentinel)
    stand_in = metrics._summary_writer()
    seen = sys.modules["tensorboardX"].SEEN
    assert stand_in is sys.modules["tensorboardX"].SummaryWriter
    assert seen is (sentinel if present else None), (present, seen)
    assert sys.modules.get("torch") is (sentinel if present else None)
