"""The edges of a run: plain log lines without a TTY, a crash in eval keeps a
checkpoint of its step, a missing optional package stops before step 1."""

import json
import os
import re
import sys

import pytest

from attnlab import cli
from attnlab import config_gin as gin_config
from attnlab.extras import MissingDependencyError
from attnlab.training import trainer
from attnlab.training.checkpoint import Checkpointer
from attnlab.training.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "seq2seq_reverse.gin")
TINY = ["ModelConfig.d_model = 32", "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 1",
        "ModelConfig.num_encoder_layers = 1", "DataConfig.batch_size = 8",
        "DataConfig.max_len = 6", "DataConfig.seq_len = 8", "TrainConfig.steps = 6",
        "TrainConfig.checkpoint_every = 0", "TrainConfig.log_every = 2",
        "TrainConfig.eval_every = 0", "TrainConfig.eval_batches = 1"]


def _train(workdir, extra=()):
  mcfg, dcfg, tcfg = gin_config.parse([CONFIG], TINY + list(extra))
  return trainer.train(mcfg, tcfg, dcfg, str(workdir))


def test_without_a_tty_the_progress_is_one_plain_line_per_logged_step(tmp_path, monkeypatch):
  """Each line is flushed as it is printed: a log file read while the run goes on (here
  before the file is closed) holds every logged step so far."""
  log = tmp_path / "stderr.log"
  with open(log, "w") as f:
    assert not f.isatty()
    monkeypatch.setattr(sys, "stderr", f)
    _train(tmp_path / "w", ["TrainConfig.progress = True"])
    text = log.read_text()
  assert "\r" not in text  # no bar redrawing itself
  lines = [line for line in text.splitlines() if line.startswith("train step ")]
  assert [line.split(":")[0] for line in lines] == [
      "train step 2/6", "train step 4/6", "train step 6/6"]  # log_every=2
  logged = [r for r in read_metrics(str(tmp_path / "w")) if r["split"] == "train"]
  assert all(f"loss {r['loss']:.4f}" in line for r, line in zip(logged, lines, strict=True))


def test_an_exception_in_eval_leaves_a_checkpoint_of_its_step(tmp_path, monkeypatch, capsys):
  def broken_eval(self, predictions_path=None):
    raise RuntimeError("eval broke")

  monkeypatch.setattr(trainer.Run, "evaluate", broken_eval)
  workdir = tmp_path / "w"
  with pytest.raises(RuntimeError, match="eval broke"):
    _train(workdir, ["TrainConfig.eval_every = 4", "TrainConfig.progress = False"])
  assert Checkpointer(str(workdir)).steps() == [4]  # saved at the failing eval's step
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"attnlab train: checkpoint saved at step 4 in {workdir / 'checkpoints'} "
      "before the error below")
  with open(workdir / "checkpoints" / "4" / "meta" / "metadata") as f:
    meta = json.load(f)
  assert sorted(meta.pop("checksums")) == ["data", "opt_state", "params"]
  assert meta.pop("schedule").keys() == {"schedule", "learning_rate", "warmup_steps", "steps",
                                         "min_lr_ratio"}
  assert meta == {"step": 4, "seed": 0, "rng": "fold_in(seed_key(seed), step)"}
  # and a rerun resumes from it (then finishes: the eval works again)
  monkeypatch.undo()
  assert _train(workdir, ["TrainConfig.progress = False"])["step"] == 6


@pytest.mark.parametrize("missing,bindings,needle", [
    ("sentencepiece", ["DataConfig.tokenizer = 'sentencepiece'",
                       "DataConfig.tokenizer_model = 'sp.model'"], "attnlab[sentencepiece]"),
    ("sacrebleu", ["DataConfig.task = 'tsv'", "DataConfig.paths = ('{tsv}', '{tsv}')",
                   "DataConfig.max_len = 12"],  # TINY's synthetic length, which tsv refuses
     "pip install sacrebleu"),
    ("tokenizers", ["DataConfig.tokenizer = 'hf_json'", "DataConfig.tokenizer_model = 't.json'",
                    "DataConfig.bos_id = 1", "DataConfig.eos_id = 2"], "attnlab[tokenizers]"),
])
def test_a_missing_optional_package_stops_before_step_1(tmp_path, monkeypatch, capsys, missing,
                                                        bindings, needle):
  tsv = tmp_path / "pairs.tsv"
  tsv.write_text("".join(f"w{i} x y z\tv{i} x y z\n" for i in range(16)))  # trainable
  bindings = [b.format(tsv=tsv) for b in bindings]
  monkeypatch.setitem(sys.modules, missing, None)  # `import <missing>` raises ImportError
  workdir = tmp_path / "w"
  argv = ["train", "--gin_file", CONFIG, *[f"--gin.{b}" for b in TINY + bindings],
          "--workdir", str(workdir)]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and needle in err, err
  assert not workdir.exists()  # nothing written, nothing trained
  # The library stops as early: in Run, before the workdir or a step.
  mcfg, dcfg, tcfg = gin_config.parse([CONFIG], TINY + bindings)
  with pytest.raises(MissingDependencyError, match=missing):
    trainer.train(mcfg, tcfg, dcfg, str(workdir))
  assert not workdir.exists()


@pytest.mark.parametrize("kind, name, needle", [
    ("sentencepiece", "gone.model", "is not a readable sentencepiece model: NOT_FOUND"),
    ("hf_json", "gone.json", "is not a readable tokenizer.json: "),
])
def test_an_unreadable_tokenizer_model_stops_before_step_1(tmp_path, capsys, kind, name,
                                                           needle):
  """A tokenizer model file that is not there: one line naming it, exit 2, nothing written;
  the library raises the same ValueError before the workdir exists."""
  pytest.importorskip("sentencepiece" if kind == "sentencepiece" else "tokenizers")
  path = str(tmp_path / name)
  bindings = [f"DataConfig.tokenizer = '{kind}'", f"DataConfig.tokenizer_model = '{path}'"]
  if kind == "hf_json":  # its special ids come from the model's config
    bindings += ["DataConfig.bos_id = 1", "DataConfig.eos_id = 2"]
  workdir = tmp_path / "w"
  argv = ["train", "--gin_file", CONFIG, *[f"--gin.{b}" for b in TINY + bindings],
          "--workdir", str(workdir)]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"attnlab train: error: tokenizer_model={path!r} {needle}"), err
  assert len(err.splitlines()) == 1 and not workdir.exists()
  mcfg, dcfg, tcfg = gin_config.parse([CONFIG], TINY + bindings)
  with pytest.raises(ValueError, match=re.escape(f"tokenizer_model={path!r} {needle}")):
    trainer.train(mcfg, tcfg, dcfg, str(workdir))
  assert not workdir.exists()
