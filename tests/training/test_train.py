"""The training loop end to end on tiny configs: resume after kill -9 is
bitwise identical, a corrupted checkpoint falls back, SIGTERM checkpoints and
exits 0, NaN stops (or skips), metrics reach JSONL and TensorBoard, eval and
load_checkpoint read the workdir back."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import attnlab
from attnlab import cli
from attnlab import config_gin as gin_config
from attnlab.training import trainer
from attnlab.training.checkpoint import Checkpointer
from attnlab.training.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "seq2seq_reverse.gin")
TINY = ["ModelConfig.d_model = 32", "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 1",
        "ModelConfig.num_encoder_layers = 1", "DataConfig.batch_size = 8",
        "DataConfig.max_len = 6", "DataConfig.seq_len = 8", "TrainConfig.steps = 12",
        "TrainConfig.checkpoint_every = 4", "TrainConfig.log_every = 2",
        "TrainConfig.eval_every = 6", "TrainConfig.eval_batches = 1",
        "TrainConfig.progress = False", "TrainConfig.keep_checkpoints = 5"]


def _configs(extra=()):
  return gin_config.parse([CONFIG], TINY + list(extra))


def _run(workdir, extra=()):
  configs = _configs(extra)
  mcfg, dcfg, tcfg = configs
  return trainer.train(mcfg, tcfg, dcfg, str(workdir),
                       config_text=gin_config.operative_config(*configs))


def _params(workdir, step):
  model, _ = attnlab.load_checkpoint(str(workdir), step)
  from flax import nnx
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _spawn(workdir, extra=(), sleep="0.3"):
  argv = [sys.executable, "-m", "attnlab.cli", "train", "--gin_file", CONFIG,
          *[f"--gin.{b.replace(' ', '')}" for b in TINY + list(extra)], "--workdir", str(workdir)]
  env = dict(os.environ, **{trainer.STEP_SLEEP_ENV: sleep})
  return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _wait_for(path, proc, timeout=120):
  t0 = time.time()
  while not os.path.exists(path):
    assert proc.poll() is None, proc.communicate()
    assert time.time() - t0 < timeout
    time.sleep(0.05)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  """An uninterrupted run: 12 steps, checkpoints at 4, 8, 12."""
  workdir = tmp_path_factory.mktemp("ref")
  last = _run(workdir)
  return workdir, last


def test_metrics_jsonl_and_tensorboard(reference_run):
  workdir, last = reference_run
  assert last["step"] == 12
  records = read_metrics(str(workdir))
  train = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
  for key in ("loss", "perplexity", "tokens_per_s", "learning_rate", "grad_norm",
              "step_time_s"):
    assert all(np.isfinite(r[key]) for r in train), key
  evals = [r for r in records if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [6, 12]
  assert all(0.0 <= r["exact_match"] <= 1.0 and r["perplexity"] > 1 for r in evals)
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(os.path.join(str(workdir), "tensorboard"))
  acc.Reload()
  events = acc.Scalars("train/loss")
  assert [e.step for e in events] == [2, 4, 6, 8, 10, 12]
  np.testing.assert_allclose([e.value for e in events], [r["loss"] for r in train], rtol=1e-6)
  assert "eval/perplexity" in acc.Tags()["scalars"]


def test_kill_9_then_resume_is_bitwise_identical(reference_run, tmp_path):
  ref_dir, _ = reference_run
  proc = _spawn(tmp_path)
  _wait_for(os.path.join(tmp_path, "checkpoints", "4"), proc)
  proc.kill()  # SIGKILL: no handler runs
  proc.wait()
  steps = Checkpointer(str(tmp_path)).steps()
  assert 12 not in steps and 4 in steps
  last = _run(tmp_path)
  assert last["step"] == 12
  for a, b in zip(_params(ref_dir, 12), _params(tmp_path, 12)):
    np.testing.assert_array_equal(a, b)


def test_sigterm_checkpoints_current_step_and_exits_0(tmp_path):
  proc = _spawn(tmp_path, ["TrainConfig.steps = 1000", "TrainConfig.checkpoint_every = 500"])
  _wait_for(os.path.join(tmp_path, "metrics.jsonl"), proc)  # step 2 logged
  time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err
  steps = Checkpointer(str(tmp_path)).steps()
  assert len(steps) == 1 and 2 <= steps[0] < 500
  assert f"checkpoint saved at step {steps[0]}" in err
  assert json.loads(out.strip().splitlines()[-1])["step"] == steps[0]


def test_corrupted_latest_checkpoint_falls_back(reference_run, tmp_path):
  import shutil
  ref_dir, _ = reference_run
  shutil.copytree(ref_dir, tmp_path / "w")
  workdir = tmp_path / "w"
  ckdir = workdir / "checkpoints" / "12"
  for root, _, files in os.walk(ckdir / "params"):
    for f in files:
      if "manifest" in f or f.endswith(".ocdbt") or os.path.basename(root) == "d":
        with open(os.path.join(root, f), "wb") as fh:
          fh.write(b"garbage")
  with pytest.warns(UserWarning, match="could not be restored"):
    last = _run(workdir)
  assert last["step"] == 12
  assert Checkpointer(str(workdir)).steps() == [4, 8, 12]
  for a, b in zip(_params(ref_dir, 12), _params(workdir, 12)):
    np.testing.assert_array_equal(a, b)


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path):
  bad = ["TrainConfig.learning_rate = 1e30", "TrainConfig.schedule = 'constant'",
         "TrainConfig.warmup_steps = 0", "TrainConfig.checkpoint_every = 1",
         "TrainConfig.grad_clip = 0.0", "TrainConfig.eval_every = 0"]
  with pytest.raises(trainer.NonFiniteError, match="non-finite"):
    _run(tmp_path / "stop", bad)
  steps = Checkpointer(str(tmp_path / "stop")).steps()
  assert steps and all(np.isfinite(p).all() for p in _params(tmp_path / "stop", steps[-1]))
  last = _run(tmp_path / "skip", bad + ["TrainConfig.on_nonfinite = 'skip'"])
  assert last["step"] == 12 and last["skipped_steps"] >= 1


def test_eval_command_and_load_checkpoint_errors(reference_run, tmp_path, capsys):
  ref_dir, _ = reference_run
  assert cli.main(["eval", "--workdir", str(ref_dir)]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["step"] == 12 and out["perplexity"] > 1 and 0 <= out["exact_match"] <= 1
  assert cli.main(["eval", "--workdir", str(tmp_path)]) == 2
  assert "config.gin" in capsys.readouterr().err
  with pytest.raises(FileNotFoundError, match="config.gin"):
    attnlab.load_checkpoint(str(tmp_path))
  with pytest.raises(ValueError, match="step=5"):
    attnlab.load_checkpoint(str(ref_dir), step=5)
  model, cfg = attnlab.load_checkpoint(str(ref_dir), step=8)
  assert cfg.d_model == 32 and cfg == _configs()[0]


def test_compilation_cache_flag_sets_the_jax_option(tmp_path, monkeypatch):
  from attnlab.commands import _common as commands
  calls = []
  monkeypatch.setattr(jax.config, "update", lambda name, value: calls.append((name, value)))
  commands.use_compilation_cache(None)
  assert calls == []
  commands.use_compilation_cache(str(tmp_path / "xla_cache"))
  assert calls == [("jax_compilation_cache_dir", str(tmp_path / "xla_cache"))]
  assert os.path.isdir(tmp_path / "xla_cache")
