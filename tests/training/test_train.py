"""The training loop end to end on tiny configs (with dropout, whose keys
depend on the step): a resume after kill -9, after a kill in the middle of a
checkpoint save, after SIGTERM / SIGINT and past a corrupted checkpoint is
checked to have happened (the step it resumed from, no restore warning when
nothing is damaged, the metrics continuing from there) and to end bitwise
equal to an uninterrupted run; metrics reach JSONL and TensorBoard, eval and
load_checkpoint read the workdir back. A NaN that stops (or is skipped) is
``test_train_loop.py``'s.

A run that silently started over from step 0 would also end bitwise equal
(everything is deterministic): only the explicit resume checks catch it."""

import json
import logging
import os
import re
import shutil
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
from attnlab.commands import EXIT_STOPPED
from attnlab.training import checkpoint, trainer
from attnlab.training.checkpoint import Checkpointer
from attnlab.training.metrics import read_metrics
from tests.file_limits import failed_in_one_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "seq2seq_reverse.gin")
TINY = ["ModelConfig.d_model = 32", "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 1",
        "ModelConfig.num_encoder_layers = 1", "DataConfig.batch_size = 8",
        "DataConfig.max_len = 6", "DataConfig.seq_len = 8", "TrainConfig.steps = 12",
        "TrainConfig.checkpoint_every = 4", "TrainConfig.log_every = 2",
        "TrainConfig.eval_every = 6", "TrainConfig.eval_batches = 1",
        "TrainConfig.progress = False", "TrainConfig.keep_checkpoints = 5",
        "ModelConfig.dropout_rate = 0.1"]


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


def _steps(workdir):
  ckpt = Checkpointer(str(workdir), read_only=True)
  try:
    return ckpt.steps()
  finally:
    ckpt.close()


def _train_steps(workdir):
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return []
  return [r["step"] for r in read_metrics(str(workdir)) if r["split"] == "train"]


def _resume(workdir, caplog, from_step, extra=(), warned=0):
  """Run again in this process and check that it resumed from ``from_step``:
  the loop logs it, ``warned`` restore warnings (none when nothing is
  damaged), and the metrics continue after ``from_step`` instead of starting
  again at step 2."""
  logged = len(_train_steps(workdir))
  caplog.clear()
  with caplog.at_level(logging.INFO, logger=trainer.__name__):
    last = _run(workdir, extra)
  resumed = [int(m.group(1)) for r in caplog.records
             if (m := re.fullmatch(r"resumed from step (\d+)", r.getMessage()))]
  assert resumed == [from_step]
  restore_warnings = [r.getMessage() for r in caplog.records
                      if r.levelno == logging.WARNING and "could not be restored" in r.getMessage()]
  assert len(restore_warnings) == warned, restore_warnings
  assert _train_steps(workdir)[logged:] == list(range(from_step // 2 * 2 + 2, 13, 2))
  assert last["step"] == 12
  return restore_warnings


def _assert_same_params(ref_dir, workdir, step=12):
  ref, got = _params(ref_dir, step), _params(workdir, step)
  assert len(ref) == len(got) > 0
  for a, b in zip(ref, got):
    np.testing.assert_array_equal(a, b)


def _spawn(workdir, extra=(), sleep="0.3", env=None):
  argv = [sys.executable, "-m", "attnlab.cli", "train", "--gin_file", CONFIG,
          *[f"--gin.{b.replace(' ', '')}" for b in TINY + list(extra)], "--workdir", str(workdir)]
  env = dict(os.environ, **{trainer.STEP_SLEEP_ENV: sleep}, **(env or {}))
  proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  _SPAWNED.append(proc)
  return proc


_SPAWNED = []


@pytest.fixture(autouse=True)
def _no_leftover_process():
  """A test that fails while its training process runs must not leave it behind."""
  yield
  while _SPAWNED:
    proc = _SPAWNED.pop()
    if proc.poll() is None:
      proc.kill()
      proc.communicate()


def _wait_for(path, proc, timeout=900):
  # The timeout only guards against a hang (a loaded machine compiles slowly).
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


def test_kill_9_then_resume_is_bitwise_identical(reference_run, tmp_path, caplog):
  ref_dir, _ = reference_run
  # 0.5 s a step: the kill lands ~4 s before the run could finish, on a loaded machine too.
  proc = _spawn(tmp_path, sleep="0.5")
  _wait_for(os.path.join(tmp_path, "checkpoints", "4"), proc)
  proc.kill()  # SIGKILL: no handler runs
  proc.wait()
  steps = _steps(tmp_path)
  assert 12 not in steps and 4 in steps
  _resume(tmp_path, caplog, steps[-1])
  _assert_same_params(ref_dir, tmp_path)


def test_kill_in_the_middle_of_a_save_then_resume_skips_it(reference_run, tmp_path, caplog):
  # The fault point kills the process after orbax wrote checkpoint 8 into its
  # temporary directory and before it committed it.
  ref_dir, _ = reference_run
  proc = _spawn(tmp_path, sleep="0", env={checkpoint.KILL_MID_SAVE_ENV: "8"})
  _, err = proc.communicate(timeout=900)
  assert proc.returncode == -signal.SIGKILL, err[-3000:]
  ckdir = tmp_path / "checkpoints"
  names = sorted(os.listdir(ckdir))
  assert names[0] == "4" and len(names) == 2 and names[1].startswith("8.") and "tmp" in names[1]
  assert {"params", "opt_state", "data"} <= set(os.listdir(ckdir / names[1]))
  assert _train_steps(tmp_path) == [2, 4, 6, 8]
  assert _steps(tmp_path) == [4]
  # Readers delete nothing: the half-saved directory could be a live run's save.
  attnlab.load_checkpoint(str(tmp_path))
  assert trainer.evaluate_workdir(str(tmp_path))["step"] == 4
  assert sorted(os.listdir(ckdir)) == names
  _resume(tmp_path, caplog, 4)
  assert _steps(tmp_path) == [4, 8, 12]
  assert sorted(os.listdir(ckdir)) == ["12", "4", "8"]
  _assert_same_params(ref_dir, tmp_path)
  _assert_same_params(ref_dir, tmp_path, step=8)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_checkpoints_current_step_exits_75_and_resumes_bitwise(reference_run, tmp_path,
                                                                     caplog, signum):
  ref_dir, _ = reference_run
  # Only the signal (and the last step) checkpoint; no evaluation (it
  # changes no parameter) to keep the run short.
  extra = ["TrainConfig.checkpoint_every = 0", "TrainConfig.eval_every = 0"]
  proc = _spawn(tmp_path, extra, sleep="0.5")  # the signal lands ~5 s before the end
  _wait_for(os.path.join(tmp_path, "metrics.jsonl"), proc)  # step 2 logged
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == EXIT_STOPPED, err  # 0 until 2026-12-04
  steps = _steps(tmp_path)
  assert len(steps) == 1 and 2 <= steps[0] < 12
  assert f"received signal {int(signum)}; checkpoint saved at step {steps[0]}" in err
  # orbax's INFO lines (~70 a checkpoint) stay out of `attnlab train`'s stderr.
  assert "Saving checkpoint at step" not in err and "CheckpointManager" not in err, err[-2000:]
  summary = json.loads(out.strip().splitlines()[-1])
  assert summary["step"] == steps[0]
  # The metrics are the last logged step's, and the line says which (since 2026-12-04).
  logged = [r for r in read_metrics(str(tmp_path)) if r["split"] == "train"]
  assert summary["metrics_step"] == logged[-1]["step"] <= steps[0]
  assert summary["loss"] == logged[-1]["loss"]
  _resume(tmp_path, caplog, steps[0], extra)
  _assert_same_params(ref_dir, tmp_path)


def test_corrupted_latest_checkpoint_falls_back(reference_run, tmp_path, caplog):
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
  warned = _resume(workdir, caplog, 8, warned=1)
  assert f"{os.path.join(ckdir)} could not be restored" in warned[0]
  assert _steps(workdir) == [4, 8, 12]
  _assert_same_params(ref_dir, workdir)


def test_eval_command_and_load_checkpoint_errors(reference_run, tmp_path, capsys):
  ref_dir, _ = reference_run
  assert cli.main(["eval", "--workdir", str(ref_dir)]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["step"] == 12 and out["perplexity"] > 1 and 0 <= out["exact_match"] <= 1
  # A run whose mesh needs more devices than this process has: refused with the way out,
  # then evaluated on one device with --mesh_shape (the same numbers).
  moved = tmp_path / "moved"
  shutil.copytree(ref_dir, moved)
  text = (moved / "config.gin").read_text()
  assert "TrainConfig.mesh_shape = (-1, 1, 1)" in text
  (moved / "config.gin").write_text(text.replace("TrainConfig.mesh_shape = (-1, 1, 1)",
                                                 "TrainConfig.mesh_shape = (64, 1, 1)"))
  assert cli.main(["eval", "--workdir", str(moved)]) == 2
  assert capsys.readouterr().err.strip() == (
      f"attnlab eval: error: mesh_shape=(64, 1, 1) needs 64 devices, only "
      f"{len(jax.devices())} exist (the run's TrainConfig.mesh_shape; evaluate on another "
      "mesh with --mesh_shape D,F,T, e.g. 1,1,1)")
  assert cli.main(["eval", "--workdir", str(moved), "--mesh_shape", "1,1,1"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
  assert cli.main(["eval", "--workdir", str(tmp_path)]) == 2
  assert capsys.readouterr().err.strip() == (
      f"attnlab eval: error: {tmp_path}/config.gin does not exist: not a training workdir")
  with pytest.raises(FileNotFoundError, match="config.gin"):
    attnlab.load_checkpoint(str(tmp_path))
  with pytest.raises(ValueError, match="step=5"):
    attnlab.load_checkpoint(str(ref_dir), step=5)
  model, cfg = attnlab.load_checkpoint(str(ref_dir), step=8)
  assert cfg.d_model == 32 and cfg == _configs()[0]
  # The parameters come from the checkpoint (restored into shapes, never initialized);
  # everything else is what building the model gives (the dropout RNG streams).
  from flax import nnx
  fresh = attnlab.build_model(cfg, rngs=nnx.Rngs(params=0, dropout=1))
  got_rest, want_rest = (nnx.state(m, nnx.Not(nnx.Param)) for m in (model, fresh))
  assert jax.tree.structure(got_rest) == jax.tree.structure(want_rest)
  for a, b in zip(jax.tree.leaves(got_rest), jax.tree.leaves(want_rest), strict=True):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  init = nnx.state(fresh, nnx.Param)
  ckpt = Checkpointer(str(ref_dir), read_only=True)
  try:
    saved = ckpt.restore_params(8, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                init))
  finally:
    ckpt.close()
  got = jax.tree.leaves(nnx.state(model, nnx.Param))
  for a, b in zip(got, jax.tree.leaves(saved), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.array_equal(a, b) for a, b in zip(got, jax.tree.leaves(init), strict=True))


def test_metrics_writer_does_not_import_torch(tmp_path):
  """tensorboardX imports torch when it can (~1.7 s a run); MetricsWriter keeps it out,
  and torch still imports afterwards."""
  pytest.importorskip("torch")
  code = ("import sys; from attnlab.training.metrics import MetricsWriter; "
          f"w = MetricsWriter({str(tmp_path)!r}); w.write(1, 'train', {{'loss': 1.0}}); "
          "w.close(); assert 'torch' not in sys.modules, 'torch imported'; import torch; "
          "print(torch.__name__)")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0 and res.stdout.strip() == "torch", res.stderr[-2000:]


@pytest.mark.parametrize("kib", [4, 32])  # orbax's own write fails first / tensorstore's
def test_a_save_failing_on_a_real_write_prints_one_line_and_no_library_teardown(tmp_path, kib):
  """A real orbax save that fails on its writes (files capped at 4 or 32 KiB with
  RLIMIT_FSIZE: a write past it fails with EFBIG, as one on a full disk with ENOSPC; at 4
  KiB orbax's own Python write fails first, an OSError, at 32 KiB tensorstore's), in a
  process of its own: stderr is attnlab's one line. Until 2026-12-07 orbax's threads of the
  other writes went on failing after the save raised, and their reports followed it:
  tensorstore's "Event loop is closed" tracebacks, asyncio's "Future exception was never
  retrieved", orbax's own "_SignalingThread.run() raised an exception" tracebacks, a
  "coroutine ... was never awaited" warning (170 to 690 lines a run)."""
  pytest.importorskip("resource")
  limit = kib * 1024
  argv = ["train", "--gin_file", CONFIG,
          *[f"--gin.{b.replace(' ', '')}" for b in TINY],
          "--gin.TrainConfig.checkpoint_every=1", "--gin.TrainConfig.steps=2",
          "--gin.TrainConfig.warmup_steps=0", "--gin.TrainConfig.eval_every=0",
          "--workdir", str(tmp_path / "w")]
  line = failed_in_one_line(argv, limit)
  assert re.fullmatch(
      r"attnlab train: saving checkpoint 1 in .*/checkpoints failed \((OSError: \[Errno 27\] "
      r"File too large|ValueError: [A-Z_]+: .*\[os_error_code='27'\])\); the run "
      r"stopped\. Last good checkpoint: none; free the "
      r"space \(or mend the cause\) and rerun the same command to start over", line), line
