"""The training loop's bookkeeping, in process and in seconds: where the eval
predictions go, an LM run's eval, how many checkpoints stay and what each records,
a mesh passed in, the signal flag (on and off the main thread), the progress
output, the logged throughput, skipped and stopping non-finite steps, the batch
layout check, a weights-only checkpoint as the start of a run, and
``evaluate_workdir``'s errors. ``test_train.py`` runs the kills and resumes end
to end."""

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab import config_gin as gin_config
from attnlab.training import trainer
from attnlab.training.checkpoint import Checkpointer
from attnlab.training.metrics import read_metrics
from tests.training.test_train import _steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ2SEQ = os.path.join(REPO, "configs", "seq2seq_reverse.gin")
LM = os.path.join(REPO, "configs", "lm_stdlib_tiny.gin")
TINY = ["ModelConfig.d_model = 32", "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 1",
        "DataConfig.batch_size = 4", "TrainConfig.steps = 4", "TrainConfig.log_every = 2",
        "TrainConfig.eval_every = 0", "TrainConfig.eval_batches = 1",
        "TrainConfig.checkpoint_every = 0", "TrainConfig.progress = False"]
SEQ2SEQ_TINY = TINY + ["ModelConfig.num_encoder_layers = 1", "DataConfig.max_len = 6",
                       "DataConfig.seq_len = 8"]
LM_TINY = TINY + ["DataConfig.seq_len = 16", "DataConfig.max_files = 4"]
# A learning rate of 1e30, unclipped: the parameters are huge after step 1, so every step
# from step 2 on is non-finite.
DIVERGE = ["TrainConfig.learning_rate = 1e30", "TrainConfig.schedule = 'constant'",
           "TrainConfig.warmup_steps = 0", "TrainConfig.grad_clip = 0.0"]


def _train(workdir, config, bindings, **kw):
  configs = gin_config.parse([config], bindings)
  mcfg, dcfg, tcfg = configs
  return trainer.train(mcfg, tcfg, dcfg, str(workdir),
                       config_text=gin_config.operative_config(*configs), **kw)


@pytest.fixture(scope="module")
def seq2seq_run(tmp_path_factory):
  """SEQ2SEQ_TINY trained once (4 steps, checkpoints at 2 and 4); ``_copy_run`` gives a test
  its own copy to change."""
  workdir = tmp_path_factory.mktemp("seq2seq_run")
  _train(workdir, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.checkpoint_every = 2"])
  return workdir


def _copy_run(run, workdir):
  shutil.copytree(run, workdir, dirs_exist_ok=True)


def test_seq2seq_eval_writes_its_predictions_to_workdir_eval(tmp_path, monkeypatch):
  """README: the decoded examples go to WORKDIR/eval/predictions_STEP.jsonl, one per
  evaluation; the metrics of each eval sit in metrics.jsonl under its step. The logged
  tokens/s counts the training steps only: an evaluation or a checkpoint save between two
  logs is not in the window's time (each is made to take 1000 s of a clock here)."""
  offset = [0.0]
  clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0],
                                sleep=time.sleep)
  monkeypatch.setattr(trainer, "time", clock)

  def slow(method):
    def run(*args, **kw):
      out = method(*args, **kw)
      offset[0] += 1000.0
      return out
    return run

  monkeypatch.setattr(trainer.Run, "evaluate", slow(trainer.Run.evaluate))
  monkeypatch.setattr(Checkpointer, "save", slow(Checkpointer.save))
  _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.eval_every = 2",
                                            "TrainConfig.checkpoint_every = 2"])
  train = [r for r in read_metrics(str(tmp_path)) if r["split"] == "train"]
  assert [r["step"] for r in train] == [2, 4] and offset[0] == 4000.0
  # 2 steps of 4 x 8 target tokens (or fewer) in well under 1000 s
  assert all(r["tokens_per_s"] > 64 / 1000 for r in train), train
  # The first window (the compilation) is flagged in metrics.jsonl.
  assert [r.get("window_holds_compile") for r in train] == [True, None]
  assert sorted(os.listdir(tmp_path / "eval")) == ["predictions_2.jsonl", "predictions_4.jsonl"]
  for step in (2, 4):
    assert trainer.predictions_path(str(tmp_path), step) == str(
        tmp_path / "eval" / f"predictions_{step}.jsonl")
    text = (tmp_path / "eval" / f"predictions_{step}.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert rows and all(set(r) == {"source", "reference", "prediction", "reference_ids",
                                   "prediction_ids"} for r in rows)
  evals = [r for r in read_metrics(str(tmp_path)) if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [2, 4]
  # Exact match, and no BLEU: that is translation's (task 'tsv'), not the reversal's.
  assert all(set(r) == {"step", "split", "loss", "perplexity", "tokens", "exact_match"}
             for r in evals)


def test_an_lm_run_evaluates_loss_and_perplexity_only(tmp_path, monkeypatch):
  """An LM task has nothing to decode: its evals report the validation loss, perplexity and
  token count, write no predictions, and ``evaluate_workdir`` of the last checkpoint gives
  the last in-training eval again (same parameters, same validation batches). Each eval
  reads eval_batches = 1 validation batch (the data holds more), its tokens its own."""
  from attnlab.training import evaluate as eval_lib

  seen = []  # (batches, tokens of their loss masks) of each eval

  def counted(eval_step, params, batches, put_batch):
    seen.append((len(batches), sum(float(np.sum(b["loss_mask_BT"])) for b in batches)))
    return validation_loss(eval_step, params, batches, put_batch)

  validation_loss = eval_lib.validation_loss
  monkeypatch.setattr(eval_lib, "validation_loss", counted)
  monkeypatch.setattr(trainer.pipeline, "validation_batches", functools.partial(
      _assert_more_batches, trainer.pipeline.validation_batches))
  _train(tmp_path, LM, LM_TINY + ["TrainConfig.eval_every = 2"])
  evals = [r for r in read_metrics(str(tmp_path)) if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [2, 4]
  assert [n for n, _ in seen] == [1, 1] and [r["tokens"] for r in evals] == [t for _, t in seen]
  assert all(set(r) == {"step", "split", "loss", "perplexity", "tokens"} for r in evals)
  assert not os.path.exists(tmp_path / "eval")
  # It writes nothing, so a read-only workdir evaluates (``os.access`` says so, as on a
  # read-only mount).
  access = os.access
  monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and not (
      mode & os.W_OK and str(path).startswith(str(tmp_path))))
  final = trainer.evaluate_workdir(str(tmp_path))
  monkeypatch.setattr(os, "access", access)
  assert set(final) == {"step", "loss", "perplexity", "tokens"} and final["step"] == 4
  assert final["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-6)
  assert final["perplexity"] == pytest.approx(np.exp(final["loss"]), rel=1e-6)
  assert final["tokens"] == evals[-1]["tokens"] > 0
  assert all(type(v) in (int, float) for v in final.values())  # JSON as is (`attnlab eval`)
  with pytest.raises(ValueError, match="^" + re.escape(
      f"beam search decodes the examples of a seq2seq task; {tmp_path} holds a language model "
      "(task='lm'), whose eval is its loss") + "$"):
    trainer.evaluate_workdir(str(tmp_path), beam_size=2)


def _assert_more_batches(validation_batches, sources, dcfg, num_batches, multiple_of=1):
  """``validation_batches``, checking that the data holds more than the batches asked for
  (else reading one batch too many would go unseen)."""
  more = validation_batches(sources, dcfg, num_batches + 1, multiple_of)
  assert len(more) == num_batches + 1, "the validation data is too small for this test"
  return more[:num_batches]


def test_checkpoints_kept_and_their_meta(tmp_path):
  """keep_checkpoints=2 of checkpoints every step: the last two stay. Each records its step,
  the seed and how the step's randomness derives from it, and the schedule it trained under
  (what a resume's warnings compare with)."""
  _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.checkpoint_every = 1",
                                           "TrainConfig.keep_checkpoints = 2",
                                           "TrainConfig.seed = 7"])
  assert _steps(tmp_path) == [3, 4]
  with open(tmp_path / "checkpoints" / "4" / "meta" / "metadata") as f:
    meta = json.load(f)
  assert sorted(meta.pop("checksums")) == ["data", "opt_state", "params"]
  tcfg = gin_config.read_workdir_config(str(tmp_path / "config.gin"))[2]
  assert meta == {"step": 4, "seed": 7, "rng": "fold_in(seed_key(seed), step)",
                  "schedule": {f: getattr(tcfg, f) for f in trainer.SCHEDULE_FIELDS}}


def test_train_runs_on_the_mesh_it_is_given(tmp_path, monkeypatch):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                           ("data", "fsdp", "tensor"))

  def no_mesh(*args, **kw):
    raise AssertionError("train built a mesh of its own")

  monkeypatch.setattr(trainer.shd, "make_mesh", no_mesh)
  assert _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY, mesh=mesh)["step"] == 4
  # It is checked as load_checkpoint checks one: explicit axes (jax.make_mesh's default) are
  # refused before anything is written.
  explicit = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  with pytest.raises(trainer.SetupError, match="^mesh has Explicit axes"):
    _train(tmp_path / "explicit", SEQ2SEQ, SEQ2SEQ_TINY, mesh=explicit)
  assert not (tmp_path / "explicit").exists()


def test_the_stop_flag_catches_sigterm_and_sigint_and_restores_the_handlers():
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  for sig in (signal.SIGTERM, signal.SIGINT):
    with trainer.StopFlag() as stop:
      assert stop.signum is None
      os.kill(os.getpid(), sig)  # handled between bytecodes, in this (the main) thread
      assert stop.signum == sig
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_stop_flag_outside_the_main_thread_says_signals_do_not_stop_the_run(warned):
  """Training in another thread (a notebook's background run): Python delivers signals to the
  main thread alone, so SIGTERM / Ctrl-C cannot stop it at a step; the outermost flag of the
  thread says so, in one warning (a sweep's, not each run's again), and leaves the handlers
  alone (until 2026-12-07's review it said nothing)."""
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  seen = {}

  def run():
    for _ in range(2):  # a later sweep in the thread says it again
      with trainer.StopFlag() as stop:  # a sweep's flag around its runs' flags: one warning
        for _ in range(2):
          with trainer.StopFlag():
            seen["handlers"] = {s: signal.getsignal(s) for s in before}
        seen["signum"] = stop.signum

  thread = threading.Thread(target=run)
  thread.start()
  thread.join(60)
  assert seen == {"handlers": before, "signum": None}
  assert warned() == [
      "training in a thread other than the main one: SIGTERM and Ctrl-C do not stop it at a "
      "step with a checkpoint (exit 75) as they do in the main thread; it saves its "
      "checkpoints as TrainConfig.checkpoint_every says"] * 2


def test_nested_stop_flags_share_a_signal():
  """A sweep's flag around a run's: a signal during the run sets both; one that came
  before the run's flag was entered sets it from the start; the sweep's handler is back
  after the run's flag exits."""
  before = signal.getsignal(signal.SIGTERM)
  with trainer.StopFlag() as outer:
    with trainer.StopFlag() as inner:
      assert (outer.signum, inner.signum) == (None, None)
      os.kill(os.getpid(), signal.SIGTERM)
      assert (outer.signum, inner.signum) == (signal.SIGTERM, signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == outer._handle
  with trainer.StopFlag() as outer:
    os.kill(os.getpid(), signal.SIGINT)  # between two runs, during setup or a measurement
    with trainer.StopFlag() as inner:
      assert inner.signum == signal.SIGINT
  with trainer.StopFlag() as alone:  # no flag around it: a plain `attnlab train`
    assert alone.signum is None and alone._outer is None
  assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_before_the_first_step_trains_nothing(tmp_path, capsys):
  """A sweep's signal while a run was set up (its flag around train's): train stops before
  its first step, saves nothing new and says so (until 2026-12-04 it trained a step and
  saved it: a preempted job's grace period is short)."""
  bindings = SEQ2SEQ_TINY + ["TrainConfig.steps = 4", "TrainConfig.checkpoint_every = 2"]
  with trainer.StopFlag():
    os.kill(os.getpid(), signal.SIGTERM)  # during the setup of a sweep's run
    last = _train(tmp_path, SEQ2SEQ, bindings)
  # No step, so no metrics: metrics_step is None (the JSON line's null), not a step.
  assert last == {"metrics_step": None, "step": 0, "start_step": 0}
  assert _steps(tmp_path) == []
  assert capsys.readouterr().err.endswith(
      "attnlab train: received signal 15 before training; stopped at step 0, nothing new to "
      "save\n")
  # The config.gin it wrote has no checkpoint behind it: a run of another model there is no
  # resume of a model trained as another (nothing was trained).
  with trainer.StopFlag():
    os.kill(os.getpid(), signal.SIGTERM)
    assert _train(tmp_path, SEQ2SEQ, bindings + ["ModelConfig.d_ff = 32"])["step"] == 0
  _train(tmp_path, SEQ2SEQ, bindings + ["TrainConfig.steps = 2"])  # a checkpoint at 2
  with trainer.StopFlag():
    os.kill(os.getpid(), signal.SIGINT)
    last = _train(tmp_path, SEQ2SEQ, bindings)
  assert last == {"metrics_step": None, "step": 2, "start_step": 2}
  assert _steps(tmp_path) == [2]
  assert "received signal 2 before training; stopped at step 2" in capsys.readouterr().err


def test_the_stop_flag_off_the_main_thread_leaves_signals_alone():
  """Python lets only the main thread set handlers: elsewhere (a sweep's worker thread, a
  notebook's executor) the flag installs none and the loop runs without it."""
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  seen, errors = [], []

  def body():
    try:
      with trainer.StopFlag() as stop:
        seen.append({s: signal.getsignal(s) for s in before})
        seen.append(stop.signum)
    except Exception as e:  # noqa: BLE001  (reported below)
      errors.append(e)

  thread = threading.Thread(target=body)
  thread.start()
  thread.join()
  assert errors == [] and seen == [before, None]


def test_evaluate_workdir_names_what_is_missing(seq2seq_run, tmp_path, warned):
  """No config.gin, no such step, no checkpoint, none readable: each is named. It reads the
  checkpoints read-only, deleting and creating nothing (a half-saved checkpoint may be the
  save of a run still training in the workdir)."""
  with pytest.raises(FileNotFoundError, match="config.gin does not exist: not a training"):
    trainer.evaluate_workdir(str(tmp_path))
  _copy_run(seq2seq_run, tmp_path)
  half = tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp"
  (half / "params").mkdir(parents=True)
  (half / "params" / "x").write_bytes(b"half written")
  with pytest.raises(ValueError, match=r"step=3 has no checkpoint in .*checkpoints; "
                                       r"saved steps: \[2, 4\]"):
    trainer.evaluate_workdir(str(tmp_path), step=3)
  assert (half / "params" / "x").read_bytes() == b"half written"
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "config.gin").write_text((tmp_path / "config.gin").read_text())
  with pytest.raises(FileNotFoundError, match=r"empty/checkpoints holds no checkpoint"):
    trainer.evaluate_workdir(str(empty))
  assert sorted(os.listdir(empty)) == ["config.gin"]
  # Every checkpoint unreadable (its parameters' array files garbled: an eval reads nothing
  # else): an error, not the metrics of an untrained model at "step 0".
  for step in (2, 4):
    params = tmp_path / "checkpoints" / str(step) / "params"
    for path in [p for p in params.rglob("*") if p.is_file() and "/d/" in str(p)]:
      path.write_bytes(b"garbage")
  with pytest.raises(
      FileNotFoundError, match=r"no checkpoint in .*checkpoints could be read \(saved steps: "
                               r"\[2, 4\]\); an untrained model is not evaluated"):
    trainer.evaluate_workdir(str(tmp_path))
  assert len([m for m in warned() if "could not be restored" in m]) == 2
  assert not (tmp_path / "eval").exists()


def test_a_resume_after_the_corpus_glob_matched_another_file_is_refused(tmp_path):
  """An LM corpus that gained a file since the checkpoint (a glob over a growing folder):
  the resume is refused naming the file, with the way out (the same config.gin cannot
  help); with the file gone again it resumes (until 2026-12-07 it read other batches
  without a word)."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(4):
    (corpus / f"m{i}.py").write_text(f"def m{i}(a, b):\n    return a + b * {i}\n" * 20)
  workdir = tmp_path / "run"
  tiny = LM_TINY + [f"DataConfig.paths = ('{corpus}/*.py',)", "DataConfig.max_files = 0",
                    "DataConfig.validation_percent = 25", "TrainConfig.checkpoint_every = 2"]
  _train(workdir, LM, tiny + ["TrainConfig.steps = 2"])
  config = (workdir / "config.gin").read_text()
  (corpus / "c.py").write_text("x = [1, 2, 3]\n" * 30)  # kept for training by the split
  with pytest.raises(trainer.ResumeError) as e:
    _train(workdir, LM, tiny + ["TrainConfig.steps = 4"])
  assert str(e.value) == (
      f"the checkpoints in {workdir}/checkpoints were saved by a run reading other training "
      "data: the saved data position belongs to another training stream (DataConfig.paths: "
      f"3 training files -> 4 (new: '{corpus}/c.py'; gone: none)). Nothing was changed in "
      f"{workdir}; put back the corpus files the checkpoints read (or give DataConfig.paths "
      "that match those alone), or train in a new workdir")
  assert (workdir / "config.gin").read_text() == config and _steps(workdir) == [2]
  (corpus / "c.py").unlink()
  _train(workdir, LM, tiny + ["TrainConfig.steps = 4"])
  assert _steps(workdir) == [2, 4]


def test_a_second_train_in_a_workdir_being_trained_is_refused(seq2seq_run, tmp_path, capsys):
  """While a process trains in a workdir (it holds an ``flock`` on the folder), a second
  ``train`` there is refused before it changes anything, one line through the command line
  (until 2026-12-07 it ran beside the first: it deleted the first's half-saved checkpoint as
  its own leftover, and both saved steps and wrote metrics.jsonl); once the lock is let go
  (the first run ended, or died: the kernel lets it go), it resumes."""
  import fcntl

  from attnlab import cli

  _copy_run(seq2seq_run, tmp_path)
  half = tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp"  # the first run's save going on
  half.mkdir()
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  held = os.open(tmp_path, os.O_RDONLY)  # the first run's lock (another descriptor: flock
  fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refuses it as another process's)
  try:
    with pytest.raises(trainer.WorkdirBusyError, match=re.escape(
        f"another attnlab train is running in {tmp_path} (it holds the workdir's lock): "
        "nothing was changed; wait for it to end, or train in another workdir")):
      _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 6"])
    assert cli.main(["train", "--gin_file", SEQ2SEQ, *[f"--gin.{b.replace(' ', '')}" for b in
                                                     SEQ2SEQ_TINY], "--workdir",
                     str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"attnlab train: error: another attnlab train is running in {tmp_path}")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
  finally:
    os.close(held)
  half.rmdir()
  assert _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 6"])["step"] == 6


def test_a_workdir_that_cannot_be_locked_is_trained_unlocked(tmp_path, monkeypatch, caplog):
  """A workdir the user may write but not list (mode 0o300: ``os.open`` of the folder is
  refused) or a file system without ``flock``: the run goes on without the lock, an INFO
  line saying so (the review of 2026-12-07 found the first a PermissionError)."""
  import fcntl

  real_open, real_flock = os.open, fcntl.flock

  def refused(path, flags, *args, **kwargs):
    if os.fspath(path) == str(tmp_path):
      raise PermissionError(13, "Permission denied", str(tmp_path))
    return real_open(path, flags, *args, **kwargs)

  monkeypatch.setattr(os, "open", refused)
  with caplog.at_level(logging.INFO, logger="attnlab.training.trainer"):
    assert trainer._lock_workdir(str(tmp_path)) is None
  monkeypatch.setattr(os, "open", real_open)
  monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(
      OSError(95, "Operation not supported")))
  with caplog.at_level(logging.INFO, logger="attnlab.training.trainer"):
    assert trainer._lock_workdir(str(tmp_path)) is None
  monkeypatch.setattr(fcntl, "flock", real_flock)
  lines = [r.getMessage() for r in caplog.records if "cannot be locked" in r.getMessage()]
  assert len(lines) == 2 and "Permission denied" in lines[0] and "not supported" in lines[1]
  fd = trainer._lock_workdir(str(tmp_path))  # and where it can: held until closed
  try:
    with pytest.raises(trainer.WorkdirBusyError):
      trainer._lock_workdir(str(tmp_path))
  finally:
    os.close(fd)
  os.close(trainer._lock_workdir(str(tmp_path)))


def test_a_resume_under_a_model_the_checkpoints_do_not_fit_changes_nothing(seq2seq_run,
                                                                           tmp_path, caplog):
  """The restore fails with the changed fields named, and the workdir keeps its config.gin
  (which still describes its checkpoints: eval reads them) and its checkpoints."""
  _copy_run(seq2seq_run, tmp_path)
  config = (tmp_path / "config.gin").read_text()
  with pytest.raises(trainer.ResumeError, match=re.escape(
      f"the checkpoints in {tmp_path}/checkpoints do not fit this run's model and optimizer "
      "(ModelConfig.d_model: 32 -> 48, ModelConfig.head_dim: 8 -> 12): checkpoint "
      f"{tmp_path}/checkpoints/4's params holds arrays of other shapes: ")) as e:
    _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["ModelConfig.d_model = 48",
                                              "TrainConfig.steps = 6"])
  assert str(e.value).endswith(f"Nothing was changed in {tmp_path}; resume with the "
                               "workdir's own config.gin, or train in a new workdir")
  assert (tmp_path / "config.gin").read_text() == config and _steps(tmp_path) == [2, 4]
  assert trainer.evaluate_workdir(str(tmp_path))["step"] == 4
  # Another optimizer: its state does not fit either.
  with pytest.raises(trainer.ResumeError, match=re.escape(
      "(TrainConfig.optimizer: 'adamw' -> 'sgd'): checkpoint ")):
    _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.optimizer = 'sgd'",
                                              "TrainConfig.steps = 6"])
  # Another training stream (the data seed, the synthetic lengths): refused the same way,
  # before anything is written.
  with pytest.raises(trainer.ResumeError, match=re.escape(
      f"the checkpoints in {tmp_path}/checkpoints were saved by a run reading other training "
      "data: the saved data position belongs to another training stream (DataConfig.max_len: "
      "6 -> 5, DataConfig.seed: 0 -> 1). Nothing was changed in ")) as e:
    _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["DataConfig.seed = 1", "DataConfig.max_len = 5",
                                              "TrainConfig.steps = 6"])
  assert str(e.value).endswith(f"Nothing was changed in {tmp_path}; resume with the workdir's "
                               "own DataConfig, or train in a new workdir")
  assert (tmp_path / "config.gin").read_text() == config and _steps(tmp_path) == [2, 4]
  # A resume that fits (more steps, another batch size, longer rows: none changes which
  # example comes next) writes its own config.gin, and the data goes on
  # from the example the checkpoint stopped at: 4 steps x 4 rows, then 2 x 8. The data
  # state of step 4 is rewritten as attnlab saved it before 2026-12-03 (a batch index):
  # its batches are those of the workdir's config.gin (4 rows), not of this run.
  (data_file,) = [p for p in (tmp_path / "checkpoints" / "4" / "data").iterdir()
                  if p.name == "metadata"]
  data_file.write_text('{"index": 4}')
  meta_file = tmp_path / "checkpoints" / "4" / "meta" / "metadata"  # nor checksums then
  meta_file.write_text(json.dumps({k: v for k, v in json.loads(meta_file.read_text()).items()
                                   if k != "checksums"}))
  caplog.clear()
  with caplog.at_level(logging.INFO, logger=trainer.__name__):
    assert _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + [
        "TrainConfig.steps = 6", "DataConfig.batch_size = 8",
        "DataConfig.seq_len = 10"])["step"] == 6
  # The new batch size is said, with the example the data goes on from (4 steps x 4 rows).
  assert "batch_size 4 -> 8: the data continues at example 16" in caplog.messages
  assert "TrainConfig.steps = 6" in (tmp_path / "config.gin").read_text()
  ckpt = Checkpointer(str(tmp_path), read_only=True)
  state = ckpt.restore_data(6)
  ckpt.close()
  assert (state["index"], state["example"], state["batch_size"]) == (6, 4 * 4 + 2 * 8, 8)
  assert state["stream"] == {"task": "reverse", "seed": 0, "min_len": 3, "max_len": 6,
                             "vocab_chars": 10}
  # An evaluation reads no training data: a config.gin naming another stream still
  # evaluates the checkpoint.
  path = tmp_path / "config.gin"
  path.write_text(path.read_text().replace("DataConfig.seed = 0", "DataConfig.seed = 4"))
  assert trainer.evaluate_workdir(str(tmp_path))["step"] == 6


def test_progress_off_prints_nothing_and_the_step_sleep_hook_sleeps_each_step(
    tmp_path, monkeypatch, capsys):
  """progress=False: no bar and no plain lines (stderr here is no TTY). The fault-injection
  hook (ATTNLAB_TEST_STEP_SLEEP, read by the kill tests) sleeps that long after every step."""
  naps = []
  # trainer's own view of the time module: orbax's threads keep the real sleep
  monkeypatch.setattr(trainer, "time", types.SimpleNamespace(sleep=naps.append,
                                                             perf_counter=time.perf_counter))
  monkeypatch.setenv(trainer.STEP_SLEEP_ENV, "0.25")
  _train(tmp_path / "a", SEQ2SEQ, SEQ2SEQ_TINY)
  assert naps == [0.25] * 4
  err = capsys.readouterr().err
  assert "train step" not in err and "train:" not in err, err  # no plain line, no bar
  naps.clear()
  monkeypatch.setenv(trainer.STEP_SLEEP_ENV, "")
  _train(tmp_path / "b", SEQ2SEQ, SEQ2SEQ_TINY)
  assert naps == []


class _Terminal:
  """A stderr that says it is a terminal and keeps what is written to it."""

  def __init__(self):
    self.text = ""

  def write(self, s):
    self.text += s
    return len(s)

  def flush(self):
    pass

  def isatty(self):
    return True


def test_on_a_terminal_the_progress_is_a_bar_from_the_resumed_step(tmp_path, monkeypatch):
  term = _Terminal()
  monkeypatch.setattr(trainer.sys, "stderr", term)
  _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.progress = True",
                                           "TrainConfig.checkpoint_every = 2"])
  frames = term.text.split("\r")
  assert "train step" not in term.text  # no plain lines
  assert frames[-1].startswith("train: 100%") and " 4/4 " in frames[-1]
  assert re.search(r"loss=\d+\.\d{3}\]", frames[-1])
  # The rate in steps: "2.51step/s", or "1.10s/step" when a step takes over a second.
  assert re.search(r"\d(step/s|s/step),", frames[-1])
  term.text = ""
  _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.progress = True",
                                           "TrainConfig.steps = 6"])
  assert " 4/6 " in term.text.split("\r")[1] and " 6/6 " in term.text.split("\r")[-1]


def test_on_a_terminal_a_crash_closes_the_bar_before_its_error_propagates(tmp_path,
                                                                         monkeypatch):
  """A step that raises: the bar is closed first (its last frame drawn and its line ended),
  so the traceback starts on a line of its own, not after the bar's carriage return; the bar
  is not left to be closed when the caller drops the error."""
  term = _Terminal()
  monkeypatch.setattr(trainer.sys, "stderr", term)
  make_train_step = trainer.steps_lib.make_train_step

  def make(setup, tcfg):
    step_fn, calls = make_train_step(setup, tcfg), []

    def breaks_at_3(state, batch):
      calls.append(1)
      if len(calls) == 3:
        raise RuntimeError("step 3 broke")
      return step_fn(state, batch)

    return breaks_at_3

  monkeypatch.setattr(trainer.steps_lib, "make_train_step", make)
  with pytest.raises(RuntimeError, match="^step 3 broke$") as e:
    _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.progress = True"])
  assert e.value.__traceback__ is not None  # the train frame (and its bar) still referenced
  assert term.text.endswith("\n"), term.text[-200:]
  assert " 2/4 " in term.text.split("\r")[-1]


def test_on_a_terminal_the_bar_is_as_wide_as_the_terminal_is_now(tmp_path, monkeypatch):
  """The bar reads the terminal's width each time it draws: a window widened from 60 to 100
  columns after step 1 gets bars 40 columns wider from then on (a pseudo-terminal here)."""
  termios = pytest.importorskip("termios")
  import fcntl
  import struct

  master, slave = os.openpty()

  def width(columns):
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))

  width(60)
  term = os.fdopen(slave, "w")
  monkeypatch.setattr(trainer.sys, "stderr", term)
  monkeypatch.setattr(trainer, "time", types.SimpleNamespace(sleep=lambda s: width(100),
                                                             perf_counter=time.perf_counter))
  monkeypatch.setenv(trainer.STEP_SLEEP_ENV, "0.01")
  try:
    _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.progress = True"])
    term.flush()
    os.set_blocking(master, False)
    out = b""
    with contextlib.suppress(BlockingIOError):
      while chunk := os.read(master, 1 << 16):
        out += chunk
  finally:
    term.close()
    os.close(master)
  frames = [f.rstrip("\n") for f in out.decode().replace("\r\n", "\n").split("\r") if f.strip()]
  # As wide as the terminal allows (tqdm leaves the last column free: 59 and 99 today).
  assert frames[0].startswith("train:   0%") and 50 <= len(frames[0]) <= 60, frames
  assert " 4/4 " in frames[-1] and len(frames[-1]) == len(frames[0]) + 40, frames


def test_logged_throughput_is_the_window_tokens_over_its_time(tmp_path, monkeypatch):
  """A logged step's tokens_per_s: the target tokens of the steps since the last log over
  the time since then; step_time_s: the logged step's own time. A clock that moves only
  inside the train step (0.5 s a step) makes both exact."""
  clock, tokens = [0.0], []
  make_train_step = trainer.steps_lib.make_train_step

  def make(setup, tcfg):
    step_fn = make_train_step(setup, tcfg)

    def timed(state, batch):
      state, m = step_fn(state, batch)
      clock[0] += 0.5
      tokens.append(float(m["tokens"]))
      return state, m

    return timed

  monkeypatch.setattr(trainer.steps_lib, "make_train_step", make)
  monkeypatch.setattr(trainer, "time", types.SimpleNamespace(sleep=time.sleep,
                                                             perf_counter=lambda: clock[0]))
  _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 5"])  # logs 2, 4 and 5
  logged = [r for r in read_metrics(str(tmp_path)) if r["split"] == "train"]
  assert [r["step"] for r in logged] == [2, 4, 5] and len(tokens) == 5
  assert [r["tokens_per_s"] for r in logged] == pytest.approx(
      [(tokens[0] + tokens[1]) / 1.0, (tokens[2] + tokens[3]) / 1.0, tokens[4] / 0.5], rel=1e-9)
  assert [r["step_time_s"] for r in logged] == [0.5, 0.5, 0.5]
  assert [r["skipped_steps"] for r in logged] == [0, 0, 0]


def test_skipped_non_finite_steps_are_counted(tmp_path, caplog):
  """on_nonfinite='skip': steps 2 on diverge (DIVERGE) and are skipped, each with a warning;
  each log reports the count so far, and the run trains to its last step."""
  with caplog.at_level(logging.WARNING, logger=trainer.__name__):
    last = _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + DIVERGE + [
        "TrainConfig.on_nonfinite = 'skip'", "TrainConfig.log_every = 1"])
  assert (last["step"], last["skipped_steps"]) == (4, 3)  # the run goes on to its end
  assert [r.getMessage() for r in caplog.records if r.name == trainer.__name__] == [
      f"step {n}: non-finite loss (nan) or gradient norm (nan), update skipped"
      for n in (2, 3, 4)]
  logged = [r for r in read_metrics(str(tmp_path)) if r["split"] == "train"]
  assert [r["skipped_steps"] for r in logged] == [0, 1, 2, 3]


def test_a_resumed_run_goes_on_counting_the_skipped_steps(tmp_path):
  """The count lives in the state (its steps less the optimizer's schedule count), so a run
  stopped at step 3 and resumed to 6 logs what a run straight to 6 logs (until 2026-12-04
  it started again at 0: 0, 1, 2, 1, 2, 3 and a final 3 for 5 skipped steps)."""
  bindings = SEQ2SEQ_TINY + DIVERGE + ["TrainConfig.on_nonfinite = 'skip'",
                                       "TrainConfig.log_every = 1",
                                       "TrainConfig.checkpoint_every = 3"]
  straight = _train(tmp_path / "straight", SEQ2SEQ, bindings + ["TrainConfig.steps = 6"])
  _train(tmp_path / "resumed", SEQ2SEQ, bindings + ["TrainConfig.steps = 3"])
  resumed = _train(tmp_path / "resumed", SEQ2SEQ, bindings + ["TrainConfig.steps = 6"])
  assert straight["skipped_steps"] == resumed["skipped_steps"] == 5
  for workdir in ("straight", "resumed"):
    logged = [r for r in read_metrics(str(tmp_path / workdir)) if r["split"] == "train"]
    assert [r["skipped_steps"] for r in logged] == [0, 1, 2, 3, 4, 5], workdir


def test_a_resume_that_moves_the_learning_rate_warns_and_one_past_steps_is_refused(
    tmp_path, caplog):
  """Training a cosine run further (TrainConfig.steps 3 -> 6) moves the rate at the
  checkpoint's update: a warning names both rates and the field; a change that moves no rate
  (steps of a constant schedule) says nothing. A rerun with fewer steps than the newest
  checkpoint is refused and leaves config.gin as it was (until 2026-12-04 it exited 0,
  trained nothing and wrote the smaller steps into config.gin)."""
  from attnlab.config import TrainConfig
  from attnlab.training import optim

  bindings = SEQ2SEQ_TINY + ["TrainConfig.warmup_steps = 1", "TrainConfig.checkpoint_every = 3",
                             "TrainConfig.steps = 3"]
  _train(tmp_path, SEQ2SEQ, bindings)
  with caplog.at_level(logging.WARNING, logger=trainer.__name__):
    _train(tmp_path, SEQ2SEQ, bindings + ["TrainConfig.steps = 6"])
  before, after = (float(optim.make_schedule(
      TrainConfig(warmup_steps=1, steps=steps), 32)(3)) for steps in (3, 6))
  assert after > before * 2
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == [
      f"the learning rate at update 3 is now {after:.4g}, not {before:.4g} (TrainConfig.steps: "
      "3 -> 6): the resumed run follows the new schedule from here, unlike a run of this config "
      "from step 0"], warnings
  text = (tmp_path / "config.gin").read_text()
  with pytest.raises(trainer.ResumeError) as e:
    _train(tmp_path, SEQ2SEQ, bindings + ["TrainConfig.steps = 4"])
  assert str(e.value) == (
      f"the newest checkpoint in {tmp_path / 'checkpoints'} is step 6, past TrainConfig.steps=4: "
      f"nothing to train. Nothing was changed in {tmp_path}; train to at least 6 steps, or in a "
      "new workdir")
  assert (tmp_path / "config.gin").read_text() == text
  # A rerun of the finished run under another rate trains nothing: no warning, and
  # config.gin keeps describing the checkpoints (it took the new rate before).
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger=trainer.__name__):
    last = _train(tmp_path, SEQ2SEQ, bindings + ["TrainConfig.steps = 6",
                                                 "TrainConfig.learning_rate = 0.5"])
  assert last["step"] == 6 and _steps(tmp_path) == [3, 6]
  assert last["metrics_step"] is None and last["start_step"] == 6  # it logged nothing
  assert [r for r in caplog.records if r.levelno == logging.WARNING] == []
  assert (tmp_path / "config.gin").read_text() == text
  caplog.clear()
  constant = bindings + ["TrainConfig.schedule = 'constant'"]
  _train(tmp_path / "constant", SEQ2SEQ, constant)
  # Two more workdirs of that run (seed 0, a checkpoint at 3), resumed below otherwise.
  for name in ("seeded", "died"):
    _copy_run(tmp_path / "constant", tmp_path / name)
  with caplog.at_level(logging.WARNING, logger=trainer.__name__):
    _train(tmp_path / "constant", SEQ2SEQ, constant + ["TrainConfig.steps = 6"])
  assert [r for r in caplog.records if r.levelno == logging.WARNING] == []
  # Another TrainConfig.seed on resume is named (it resumed without a word until 2026-12-06:
  # config.gin then named a seed the run did not start from).
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger=trainer.__name__):
    _train(tmp_path / "seeded", SEQ2SEQ, constant + ["TrainConfig.steps = 6",
                                                      "TrainConfig.seed = 7"])
  assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
      "TrainConfig.seed: 0 -> 7: the resumed run keeps the parameters that seed 0 began and "
      "draws its dropout from seed 7 from here, unlike a run of this config from step 0"]
  # A launch that dies before its first save leaves a config.gin no checkpoint was trained
  # under (a launch writes it as it starts): the warnings compare with the checkpoint's own
  # seed and schedule, kept in its meta (until 2026-12-06 with that config.gin: a false
  # warning, or none).
  died = tmp_path / "died"  # seed 0, a checkpoint at 3
  mcfg, dcfg, tcfg = gin_config.read_workdir_config(str(died / "config.gin"))

  def launch_that_died():
    (died / "config.gin").write_text(gin_config.operative_config(
        mcfg, dcfg, tcfg.replace(seed=7, steps=20, schedule="cosine"), workdir=str(died)))

  for more, seed, want in ((6, 0, []), (9, 7, [
      "TrainConfig.seed: 0 -> 7: the resumed run keeps the parameters that seed 0 began and "
      "draws its dropout from seed 7 from here, unlike a run of this config from step 0"])):
    launch_that_died()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=trainer.__name__):
      _train(died, SEQ2SEQ, constant + [f"TrainConfig.steps = {more}",
                                        f"TrainConfig.seed = {seed}"])
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == want
  # The bound: a rate moved by float32 rounding (2e-7 relative; the check allows 1e-6) is
  # no change, one moved by 0.2% is (rates below 1 are compared relatively, not as < 1).
  saved = gin_config.read_workdir_config(str(tmp_path / "constant" / "config.gin"))[2]
  count_3 = optax.scale_by_schedule(lambda c: c).init({})._replace(count=jnp.int32(3))
  for factor, warns in ((1 + 2e-7, False), (1 + 2e-3, True)):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=trainer.__name__):
      trainer._warn_schedule_change(saved, dataclasses.replace(
          saved, learning_rate=saved.learning_rate * factor), 32, count_3)
    assert [r.getMessage().startswith("the learning rate at update 3 is now")
            for r in caplog.records] == [True] * warns, factor


def test_a_non_finite_update_from_a_finite_gradient_is_not_applied(tmp_path):
  """float32's largest rate times AdamW's update (about 1 in the first step, plus the weight
  decay's share) passes float32's range: the loss and the gradient are finite, the update is
  not. It is skipped like a non-finite gradient (until 2026-12-04 it was applied: the
  parameters became inf / NaN)."""
  huge = [f"TrainConfig.learning_rate = {float(np.finfo(np.float32).max)!r}",
          "TrainConfig.optimizer = 'adamw'", "TrainConfig.weight_decay = 0.9",
          "TrainConfig.schedule = 'constant'",
          "TrainConfig.warmup_steps = 0", "TrainConfig.on_nonfinite = 'skip'",
          "TrainConfig.steps = 2", "TrainConfig.checkpoint_every = 0"]
  last = _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + huge)
  assert last["skipped_steps"] == 2 and np.isfinite(last["loss"])
  from flax import nnx

  from attnlab.training.checkpoint import load_checkpoint

  leaves = jax.tree.leaves(nnx.state(load_checkpoint(str(tmp_path)), nnx.Param))
  assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)


def test_a_non_finite_step_stops_the_run_naming_the_last_good_checkpoint(tmp_path, warned):
  with pytest.raises(trainer.NonFiniteError,
                     match=r"non-finite loss \(.*\) or gradient norm \(.*\) at step 2; stopped\. "
                           r"Last good checkpoint: 1 in .*checkpoints"):
    _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + DIVERGE + ["TrainConfig.checkpoint_every = 1"])
  assert _steps(tmp_path) == [1]
  # The last good checkpoint holds the finite parameters of step 1 (huge ones: lr 1e30).
  from flax import nnx

  from attnlab.training.checkpoint import load_checkpoint

  leaves = jax.tree.leaves(nnx.state(load_checkpoint(str(tmp_path), 1)[0], nnx.Param))
  assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)
  with pytest.raises(trainer.NonFiniteError, match=r"at step 2; stopped\. Last good checkpoint: "
                                                   r"none in .*none/checkpoints$"):
    _train(tmp_path / "none", SEQ2SEQ, SEQ2SEQ_TINY + DIVERGE)
  assert _steps(tmp_path / "none") == []
  # Past a corrupted newest checkpoint (2), which the resume skipped: the last good one is
  # the one it resumed from, 1 (until 2026-12-04 the message named 2, still on disk).
  resumed = tmp_path / "resumed"
  _train(resumed, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 2", "TrainConfig.grad_clip = 0.0",
                                           "TrainConfig.checkpoint_every = 1"])
  for root, _, files in os.walk(resumed / "checkpoints" / "2" / "params"):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  with pytest.raises(
      trainer.NonFiniteError, match=r"at step 3; stopped\. Last good checkpoint: 1 in "):
    _train(resumed, SEQ2SEQ, SEQ2SEQ_TINY + DIVERGE + ["TrainConfig.steps = 4",
                                                       "TrainConfig.checkpoint_every = 0"])
  assert len([m for m in warned() if "checkpoints/2 could not be restored" in m]) == 1


@pytest.mark.parametrize("batch, accum, data, fsdp, ok", [
    (16, 2, 2, 4, True), (8, 2, 2, 4, False), (8, 1, 2, 4, True), (12, 1, 2, 4, False),
    (6, 3, 1, 1, True), (6, 4, 1, 1, False)])
def test_the_batch_must_split_into_accumulation_steps_over_the_data_shards(batch, accum, data,
                                                                            fsdp, ok):
  """Rows split over the data x fsdp shards of the mesh, then into grad_accum micro-batches;
  a MeshShapeError otherwise (the mesh is what `attnlab eval --mesh_shape` changes), which
  names grad_accum where there is one."""
  from attnlab.config import DataConfig, TrainConfig
  from attnlab.training.sharding import MeshShapeError

  mesh = types.SimpleNamespace(shape={"data": data, "fsdp": fsdp, "tensor": 2})
  tcfg, dcfg = TrainConfig(grad_accum=accum), DataConfig(batch_size=batch)
  if ok:
    trainer.check_batch_layout(tcfg, dcfg, mesh)
  else:
    accum_text = f"grad_accum={accum} x " if accum > 1 else ""
    with pytest.raises(MeshShapeError) as e:
      trainer.check_batch_layout(tcfg, dcfg, mesh)
    assert str(e.value) == (f"batch_size={batch} must be a multiple of {accum_text}"
                            f"data*fsdp={data * fsdp}, the mesh's batch shards")


def test_a_weights_only_checkpoint_starts_the_run_from_its_weights(tmp_path):
  """A converted workdir (`attnlab convert`, `convert-heads`) holds weights only, at step 0:
  training starts from those weights with a fresh optimizer and the data from the start.
  With a learning rate of 1e-9 the first step leaves them where they were (a run that
  ignored them would start from a fresh init, 2 steps of lr 1e-2 away)."""
  from flax import nnx

  import attnlab

  constant = ["TrainConfig.schedule = 'constant'", "TrainConfig.warmup_steps = 0"]
  _train(tmp_path / "a", SEQ2SEQ, SEQ2SEQ_TINY + constant + [
      "TrainConfig.steps = 2", "TrainConfig.learning_rate = 1e-2"])
  model, _ = attnlab.load_checkpoint(str(tmp_path / "a"))
  saved = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
  (tmp_path / "b").mkdir()
  ckpt = Checkpointer(str(tmp_path / "b"))
  try:
    ckpt.save_params(0, nnx.state(model, nnx.Param))
  finally:
    ckpt.close()
  last = _train(tmp_path / "b", SEQ2SEQ, SEQ2SEQ_TINY + constant + [
      "TrainConfig.steps = 1", "TrainConfig.learning_rate = 1e-9"])
  assert last["step"] == 1 and _steps(tmp_path / "b") == [0, 1]
  got, _ = attnlab.load_checkpoint(str(tmp_path / "b"))
  got = [np.asarray(x) for x in jax.tree.leaves(nnx.state(got, nnx.Param))]
  assert len(got) == len(saved) > 0
  for a, b in zip(got, saved):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  # and the weights-only checkpoint itself evaluates (its optimizer state: a fresh one)
  assert trainer.evaluate_workdir(str(tmp_path / "b"), step=0)["step"] == 0


def test_a_resume_reads_its_checkpoint_without_a_fresh_state_beside_it(tmp_path,
                                                                       monkeypatch):
  """A resume initialized the whole train state (parameters and Adam's two moments), then
  read the checkpoint beside it, until 2026-12-07: twice the state's memory at the peak
  (a model that trained could not resume). Now nothing of the state is alive while the
  checkpoint is read."""
  import gc

  from flax import nnx

  import attnlab

  wide = SEQ2SEQ_TINY + ["ModelConfig.d_model = 128", "ModelConfig.d_ff = 512",
                         "TrainConfig.steps = 1"]
  _train(tmp_path, SEQ2SEQ, wide)
  model, _ = attnlab.load_checkpoint(str(tmp_path))
  state_bytes = 3 * sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert state_bytes > 5 * 2**20  # the parameters and the two moments, 5.9 MB
  del model
  restore, live = Checkpointer.restore, []

  def measured(self, *args, **kw):
    live.append(sum(x.nbytes for x in jax.live_arrays()))
    return restore(self, *args, **kw)

  monkeypatch.setattr(Checkpointer, "restore", measured)
  gc.collect()
  before = sum(x.nbytes for x in jax.live_arrays())
  last = _train(tmp_path, SEQ2SEQ, wide + ["TrainConfig.steps = 2"])
  assert last["start_step"] == 1 and last["step"] == 2 and len(live) == 1
  assert live[0] - before < state_bytes / 10, (live[0] - before, state_bytes)


def test_a_resume_that_reads_no_checkpoint_starts_as_a_fresh_run(tmp_path):
  """Where no checkpoint reads (every one damaged), a resume initializes its state only
  then (``Run.initialize``): the same parameters, optimizer state and steps as a fresh
  run's, bit for bit."""
  from flax import nnx

  import attnlab

  _train(tmp_path / "fresh", SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 3"])
  _train(tmp_path / "damaged", SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 2"])
  for root, _, files in os.walk(tmp_path / "damaged" / "checkpoints" / "2" / "params"):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  last = _train(tmp_path / "damaged", SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 3"])
  assert last["start_step"] == 0 and last["step"] == 3
  want, got = (nnx.state(attnlab.load_checkpoint(str(tmp_path / name), 3)[0], nnx.Param)
               for name in ("fresh", "damaged"))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  fresh, damaged = ([(m["step"], m["loss"]) for m in read_metrics(str(tmp_path / name))
                     if m["split"] == "train"] for name in ("fresh", "damaged"))
  assert fresh == damaged[-len(fresh):] and fresh[-1][0] == 3  # the rerun's steps


def test_a_resume_of_a_saved_run_with_b2_at_1_in_float32_warns(tmp_path, warned):
  """b2 = 0.99999999 (1 in float32) was taken before 2026-12-07: Adam's bias correction is 0
  there (here the update is non-finite and the run stops). Its config.gin is read as it is
  (the run trained so), and until 2026-12-07 a resume went on so without a word: it warns
  first, naming the field and the way out; a b2 below it trains."""
  _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 1"])
  path = tmp_path / "config.gin"
  path.write_text(path.read_text().replace("TrainConfig.b2 = 0.98", "TrainConfig.b2 = 0.99999999"))
  assert "TrainConfig.b2 = 0.99999999" in path.read_text()

  def resume(bindings):
    mcfg, dcfg, tcfg = gin_config.parse_saved(str(path), bindings)
    return trainer.train(mcfg, tcfg, dcfg, str(tmp_path), config_text=path.read_text())

  with pytest.raises(trainer.NonFiniteError, match="at step 2; stopped"):
    resume(["TrainConfig.steps = 2"])
  assert [m for m in warned() if "0.99999999" in m] == [
      "TrainConfig.b2=0.99999999 is 1 in float32, where the optimizer computes (Adam's bias "
      "correction 1 - b2**t would be 0): this run's config.gin holds it (taken before "
      "2026-12-07), and the resumed run goes on so (until 2026-12-07 without a word); resume "
      "with --gin.TrainConfig.b2=0.999 (or less) to train"]
  last = resume(["TrainConfig.steps = 3", "TrainConfig.b2 = 0.999"])
  assert last["start_step"] == 1 and last["step"] == 3
  assert len([m for m in warned() if "0.99999999" in m]) == 1


def test_a_refused_resume_names_the_train_config_fields_that_shape_the_optimizer_state(
    tmp_path):
  """The optimizer and whether gradients are clipped (a step of the optax chain) change
  the saved optimizer state's tree: a resume that changes them names them. The model's
  biases are named as the biases they give."""
  configs = gin_config.parse([SEQ2SEQ], SEQ2SEQ_TINY)
  (tmp_path / "config.gin").write_text(gin_config.operative_config(*configs))
  mcfg, _, tcfg = configs
  assert trainer._model_changes(str(tmp_path), mcfg, tcfg) == ""
  assert trainer._model_changes(str(tmp_path), mcfg, tcfg.replace(grad_clip=0.5)) == ""
  assert trainer._model_changes(str(tmp_path), mcfg.replace(d_ff=32), tcfg.replace(
      grad_clip=0.0, optimizer="sgd")) == (
      " (ModelConfig.d_ff: 64 -> 32, TrainConfig.optimizer: 'adamw' -> 'sgd', "
      "TrainConfig.grad_clip: 1.0 -> 0.0)")
  assert trainer._model_changes(str(tmp_path / "none"), mcfg, tcfg) == ""
  # Saved unclipped: unclipped again is no change, clipped is one.
  (tmp_path / "config.gin").write_text(gin_config.operative_config(
      mcfg, configs[1], tcfg.replace(grad_clip=0.0)))
  assert trainer._model_changes(str(tmp_path), mcfg, tcfg.replace(grad_clip=0.0)) == ""
  assert trainer._model_changes(str(tmp_path), mcfg, tcfg.replace(grad_clip=0.5)) == (
      " (TrainConfig.grad_clip: 0.0 -> 0.5)")
  # The biases are compared as the biases they give, each projection's under its own field,
  # use_bias never named: None under use_bias=False is an explicit False.
  assert (mcfg.use_bias, mcfg.qkv_bias, mcfg.o_bias, mcfg.mlp_bias) == (False, None, None, None)
  changes = trainer._model_field_changes
  assert changes(mcfg, mcfg.replace(qkv_bias=False, o_bias=False, mlp_bias=False)) == []
  assert changes(mcfg, mcfg.replace(use_bias=True)) == [
      f"ModelConfig.{b}_bias: False -> True" for b in ("qkv", "o", "mlp")]
  assert changes(mcfg, mcfg.replace(o_bias=True)) == ["ModelConfig.o_bias: False -> True"]


def test_the_logged_train_metrics_are_the_logged_steps_own(tmp_path, monkeypatch):
  """A train record of metrics.jsonl holds its step's loss, exp(unsmoothed NLL) as the
  perplexity, gradient norm and learning rate. Label smoothing 0.1 and a warmup set the
  four apart; catches the perplexity taken from the (smoothed) loss and one field logged
  from another's value (learning_rate from grad_norm, grad_norm from loss)."""
  seen = []
  make_train_step = trainer.steps_lib.make_train_step

  def make(setup, tcfg):
    step_fn = make_train_step(setup, tcfg)

    def recorded(state, batch):
      state, m = step_fn(state, batch)
      seen.append({k: float(v) for k, v in jax.device_get(m).items()})
      return state, m

    return recorded

  monkeypatch.setattr(trainer.steps_lib, "make_train_step", make)
  _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.label_smoothing = 0.1",
                                            "TrainConfig.warmup_steps = 2"])
  logged = [r for r in read_metrics(str(tmp_path)) if r["split"] == "train"]
  assert [r["step"] for r in logged] == [2, 4] and len(seen) == 4
  for r in logged:
    m = seen[r["step"] - 1]
    assert abs(m["loss"] - m["nll"]) > 1e-2  # the smoothing shows
    assert r["loss"] == pytest.approx(m["loss"], rel=1e-6)
    assert r["perplexity"] == pytest.approx(np.exp(m["nll"]), rel=1e-6)
    # The plain NLL beside the smoothed loss: what the eval loss measures (since 2026-12-04).
    assert r["nll"] == pytest.approx(m["nll"], rel=1e-6)
    assert r["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-6)
    assert r["learning_rate"] == pytest.approx(m["learning_rate"], rel=1e-6)
    assert len({m["loss"], m["grad_norm"], m["learning_rate"]}) == 3


def test_a_schedule_that_does_not_do_what_its_numbers_suggest_is_warned_about(caplog):
  """A warmup as long as the run (the rate never reaches its peak) and an inverse_sqrt peak
  1000x below the paper's (the default learning_rate multiplies its formula): silent until
  2026-12-04. A sound schedule says nothing."""
  from attnlab.config import TrainConfig

  def warned(**kw):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=trainer.__name__):
      trainer._warn_schedule_surprises(TrainConfig(**kw), 512)
    return [r.getMessage() for r in caplog.records if r.name == trainer.__name__]

  assert warned(steps=100, warmup_steps=100, learning_rate=1e-3) == [
      "TrainConfig.warmup_steps=100 with steps=100: the learning rate rises for the whole run "
      "and never reaches its peak (the last update's is 0.00099)"]
  # inverse_sqrt is read at count + 1: its last update is the peak when warmup == steps.
  assert warned(schedule="inverse_sqrt", steps=100, warmup_steps=100, learning_rate=1.0) == []
  assert warned(schedule="inverse_sqrt", steps=100, warmup_steps=101, learning_rate=1.0)[0] \
      .startswith("TrainConfig.warmup_steps=101 with steps=100: the learning rate rises")
  assert warned(schedule="inverse_sqrt", steps=10000, warmup_steps=4000,
                learning_rate=1e-3) == [
      "schedule='inverse_sqrt' peaks at 6.99e-07: TrainConfig.learning_rate=0.001 multiplies "
      "the paper's d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (1.0 is the paper's "
      "schedule, a peak of 0.000699 here)"]
  # A multiplier below 0.01 whatever the model and warmup; the peak named is the schedule's
  # at its peak count (warmup 1: the first update).
  assert warned(schedule="inverse_sqrt", steps=10, warmup_steps=1, learning_rate=1e-3) == [
      "schedule='inverse_sqrt' peaks at 4.42e-05: TrainConfig.learning_rate=0.001 multiplies "
      "the paper's d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (1.0 is the paper's "
      "schedule, a peak of 0.0442 here)"]
  assert warned(schedule="inverse_sqrt", steps=10000, warmup_steps=4000, learning_rate=0.01) == []
  trainer_warned = warned(schedule="inverse_sqrt", steps=1000, warmup_steps=100,
                          learning_rate=1e-3)
  assert len(trainer_warned) == 1 and "TrainConfig.learning_rate=0.001 multiplies" in (
      trainer_warned[0])
  for kw in (dict(steps=100, warmup_steps=10), dict(schedule="constant", steps=5,
                                                     warmup_steps=0),
             dict(steps=100, warmup_steps=99),
             dict(schedule="inverse_sqrt", steps=10000, warmup_steps=4000, learning_rate=1.0)):
    assert warned(**kw) == [], kw


class _FailingSave:
  """A Checkpointer whose save raises ``error`` (and records what it was asked to save)."""

  directory = "/w/checkpoints"

  def __init__(self, error):
    self.error, self.saved = error, []

  def save(self, step, state, data_state, meta):
    self.saved.append((step, state, data_state, meta))
    raise self.error


def test_a_failed_save_names_its_reason_on_one_line_and_where_a_rerun_starts():
  """The SaveError of a save that raised: the reason with its whitespace folded to single
  spaces (orbax's messages run over lines), the error's type where it says nothing, a reason
  over 300 characters cut to its first 150 and last 140 (the cause is at the end: "No space
  left on device"); the rerun resumes from the last good checkpoint, or starts over."""
  run = types.SimpleNamespace(state={"params": 1},
                              data=types.SimpleNamespace(get_state=lambda: {"index": 3}))

  def message(error, step, last_good):
    ckpt = _FailingSave(error)
    with pytest.raises(trainer.SaveError) as e:
      trainer._save(ckpt, step, run, {"seed": 0}, last_good)
    assert ckpt.saved == [(step, {"params": 1}, {"index": 3}, {"seed": 0})]
    assert e.value.__cause__ is error
    return str(e.value)

  assert message(OSError("disk\n   full\t"), 1, None) == (
      "saving checkpoint 1 in /w/checkpoints failed (OSError: disk full); the run stopped. "
      "Last good checkpoint: none; free the space (or mend the cause) and rerun the same "
      "command to start over")
  assert message(ValueError(""), 4, 2) == (
      "saving checkpoint 4 in /w/checkpoints failed (ValueError: ValueError); the run stopped. "
      "Last good checkpoint: 2; free the space (or mend the cause) and rerun the same command "
      "to resume from 2")
  kept = "k" * 300  # 300 characters are kept whole
  assert f"(ValueError: {kept});" in message(ValueError(kept), 4, 2)
  long = "a" * 150 + "b" * 10 + "c" * 141
  assert f"(ValueError: {'a' * 150} ... {'c' * 140});" in message(ValueError(long), 4, 2)


def test_closing_runs_every_close_and_raises_the_first_failure_unless_one_propagates(caplog):
  """_close_all: every close is called; after a normal end the first failure is raised once
  all ran; while an error propagates (``failing``) each failure is a warning naming what
  failed to close, and nothing is raised."""
  calls = []

  class Writer:
    def close(self):
      calls.append("writer")
      raise OSError("flush failed")

  class Saver:
    def close(self):
      calls.append("saver")
      raise ValueError("second")

  def bar():
    calls.append("bar")

  def broken():
    calls.append("broken")
    raise KeyError("k")

  trainer._close_all([bar], failing=False)
  with pytest.raises(OSError, match="^flush failed$"):
    trainer._close_all([bar, Writer().close, Saver().close], failing=False)
  assert calls == ["bar", "bar", "writer", "saver"]
  calls.clear()
  with caplog.at_level(logging.WARNING, logger=trainer.__name__):
    trainer._close_all([Writer().close, broken, Saver().close, bar], failing=True)
  assert calls == ["writer", "broken", "saver", "bar"]
  assert [r.getMessage() for r in caplog.records if r.name == trainer.__name__] == [
      f"while stopping after an error, closing the {name} failed too: {error}"
      for name, error in (("Writer", "OSError: flush failed"), ("function", "KeyError: 'k'"),
                          ("Saver", "ValueError: second"))]


def test_the_plain_progress_line_names_the_step_loss_perplexity_rate_and_throughput():
  assert trainer._log_line(3, 10, {"loss": 1.23456, "perplexity": 3.4567,
                                   "learning_rate": 0.00012345, "tokens_per_s": 1234.56}) == (
      "train step 3/10: loss 1.2346, perplexity 3.46, lr 0.000123, 1235 tokens/s")


def test_a_crash_whose_save_fails_too_says_what_was_kept_and_raises_the_crash(
    tmp_path, monkeypatch, capsys):
  """An error outside the step (the eval of step 2) whose checkpoint save fails too (a full
  disk): the save's failure is one stderr line naming the last good checkpoint, and the
  crash itself is what propagates."""
  def broken_eval(self, predictions_path=None):
    raise RuntimeError("eval broke")

  save = Checkpointer.save

  def full_disk(self, step, *args, **kw):
    if step == 2:
      raise OSError(28, "No space left on device")
    return save(self, step, *args, **kw)

  monkeypatch.setattr(trainer.Run, "evaluate", broken_eval)
  monkeypatch.setattr(Checkpointer, "save", full_disk)
  with pytest.raises(RuntimeError, match="^eval broke$"):
    _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.eval_every = 2",
                                              "TrainConfig.checkpoint_every = 1"])
  assert _steps(tmp_path) == [1]
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"attnlab train: saving checkpoint 2 in {tmp_path}/checkpoints failed (OSError: [Errno 28] "
      "No space left on device); the run stopped. Last good checkpoint: 1; free the space (or "
      "mend the cause) and rerun the same command to resume from 1")


def test_a_close_that_fails_after_a_run_that_did_not_is_raised(tmp_path, monkeypatch):
  """No error in flight: a metrics flush that fails at the end (a full disk) is raised, not
  only logged (the run's metrics may be lost); the last step's checkpoint is saved first."""
  close = trainer.MetricsWriter.close

  def close_on_a_full_disk(self):
    close(self)
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(trainer.MetricsWriter, "close", close_on_a_full_disk)
  with pytest.raises(OSError, match="No space left on device"):
    _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 1"])
  assert _steps(tmp_path) == [1]


def test_a_refused_resume_quotes_the_first_line_of_the_restore_error(seq2seq_run, tmp_path,
                                                                      monkeypatch):
  """The ResumeError quotes the restore's error (a ValueError, KeyError or TypeError: shapes
  or trees that differ) by its first line, at most 500 characters of it, without the '.', ':'
  and spaces it ends with (the message goes on after it); by the error's type when it says
  nothing."""
  _copy_run(seq2seq_run, tmp_path)
  prefix = f"the checkpoints in {tmp_path}/checkpoints do not fit this run's model and optimizer: "
  suffix = (f". Nothing was changed in {tmp_path}; resume with the workdir's own config.gin, or "
            "train in a new workdir")

  def quoted(error):
    def restore(self, *args, **kw):
      raise error

    monkeypatch.setattr(trainer.Run, "restore", restore)
    with pytest.raises(trainer.ResumeError) as e:
      _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 6"])
    assert e.value.__cause__ is error
    text = str(e.value)
    assert text.startswith(prefix) and text.endswith(suffix), text
    return text[len(prefix):-len(suffix)]

  assert quoted(TypeError("tree differs at key X.: \n  and more")) == "tree differs at key X"
  assert quoted(ValueError("")) == "ValueError"
  assert quoted(KeyError("a" * 600)) == "'" + "a" * 499
  # An operating-system error says nothing about the model: named as what it is (until
  # 2026-12-06 it went out as a traceback, and `attnlab train` exited 1, the code of a
  # non-finite loss). The workdir is left as it was.
  config = (tmp_path / "config.gin").read_text()
  for error in (PermissionError(13, "Permission denied", "/w/checkpoints/4/data"),
                OSError(5, "Input/output error")):
    def restore(self, *args, error=error, **kw):
      raise error

    monkeypatch.setattr(trainer.Run, "restore", restore)
    with pytest.raises(trainer.ResumeError) as e:
      _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 6"])
    assert e.value.__cause__ is error
    assert str(e.value) == (f"reading the checkpoints in {tmp_path}/checkpoints failed: "
                            f"{type(error).__name__}: {error}. Nothing was changed in "
                            f"{tmp_path}; rerun once they can be read")
    assert (tmp_path / "config.gin").read_text() == config and _steps(tmp_path) == [2, 4]


def test_validation_batches_are_read_once_in_multiples_of_the_batch_shards(monkeypatch):
  """Run.validation_batches: TrainConfig.eval_batches batches of the validation sources, in
  rows that split over the mesh's data x fsdp shards; read at the first call, then kept."""
  calls = []

  def batches(sources, dcfg, num_batches, multiple_of=1):
    calls.append((sources, dcfg, num_batches, multiple_of))
    return ["batch"]

  monkeypatch.setattr(trainer.pipeline, "validation_batches", batches)
  run = object.__new__(trainer.Run)  # the attributes validation_batches reads, no model
  run.sources, run.dcfg, run._val_batches = "sources", "dcfg", None
  run.tcfg = types.SimpleNamespace(eval_batches=3)
  run.mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 4, "tensor": 3})
  assert run.validation_batches() == ["batch"] and run.validation_batches() == ["batch"]
  assert calls == [("sources", "dcfg", 3, 8)] and type(calls[0][3]) is int


def test_a_run_warns_about_its_schedule_and_a_resume_about_the_rate_it_changed(tmp_path,
                                                                               caplog):
  """Before it trains, a run warns about a schedule that does not do what its numbers
  suggest (inverse_sqrt: a warmup of 3 in a run of 1 step, a learning_rate below 0.01); a
  resume under another rate warns about the rate at its checkpoint's update, then about its
  own schedule. inverse_sqrt's rates depend on d_model (32 here), on both sides."""
  from attnlab.config import TrainConfig
  from attnlab.training import optim

  def warnings(run):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=trainer.__name__):
      run()
    return [r.getMessage() for r in caplog.records
            if r.name == trainer.__name__ and r.levelno == logging.WARNING]

  def surprises(**kw):
    return warnings(lambda: trainer._warn_schedule_surprises(TrainConfig(**kw), 32))

  first = dict(schedule="inverse_sqrt", warmup_steps=3, steps=1)
  then = dict(first, steps=2, learning_rate=2e-3)
  bindings = SEQ2SEQ_TINY + ["TrainConfig.schedule = 'inverse_sqrt'",
                             "TrainConfig.warmup_steps = 3"]
  expected = surprises(**first)
  assert len(expected) == 2
  assert warnings(lambda: _train(tmp_path, SEQ2SEQ, bindings + ["TrainConfig.steps = 1"])) \
      == expected
  before, after = (float(optim.make_schedule(TrainConfig(**kw), 32)(1)) for kw in (first, then))
  expected = [
      f"the learning rate at update 1 is now {after:.4g}, not {before:.4g} (TrainConfig."
      "learning_rate: 0.001 -> 0.002, TrainConfig.steps: 1 -> 2): the resumed run follows the "
      "new schedule from here, unlike a run of this config from step 0", *surprises(**then)]
  assert len(expected) == 3
  assert warnings(lambda: _train(tmp_path, SEQ2SEQ, bindings + [
      "TrainConfig.steps = 2", "TrainConfig.learning_rate = 2e-3"])) == expected
  assert "resumed from step 1" in caplog.messages


def test_a_signal_during_the_steps_saves_that_step_and_stops(tmp_path, monkeypatch, capsys):
  """SIGTERM during step 2 (sent here by the step-sleep hook): the run saves step 2, says so on
  stderr and returns at step 2 with the metrics logged at step 2, training nothing more
  (``test_train.py`` checks a real signal to a real process, and the resume)."""
  naps = []

  def nap(seconds):
    naps.append(seconds)
    if len(naps) == 2:
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(trainer, "time", types.SimpleNamespace(sleep=nap,
                                                             perf_counter=time.perf_counter))
  monkeypatch.setenv(trainer.STEP_SLEEP_ENV, "0.01")
  last = _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY)  # 4 steps, a log every 2, no checkpoint_every
  assert (last["step"], last["metrics_step"], last["start_step"]) == (2, 2, 0)
  assert _steps(tmp_path) == [2] and len(naps) == 2
  assert capsys.readouterr().err.endswith(
      f"attnlab train: received signal 15; checkpoint saved at step 2 in {tmp_path}/checkpoints\n")


def test_an_old_data_position_without_a_config_gin_counts_batches_of_this_run(seq2seq_run,
                                                                              tmp_path, caplog):
  """A data state saved before 2026-12-03 (a batch index, no checksums then) in a workdir
  without config.gin (a library run given no config_text): nothing says which batch size it
  counted, so its index counts this run's batches and no batch size change is reported."""
  _copy_run(seq2seq_run, tmp_path)
  os.remove(tmp_path / "config.gin")
  (data_file,) = [p for p in (tmp_path / "checkpoints" / "4" / "data").iterdir()
                  if p.name == "metadata"]
  data_file.write_text('{"index": 4}')
  meta_file = tmp_path / "checkpoints" / "4" / "meta" / "metadata"
  meta_file.write_text(json.dumps({k: v for k, v in json.loads(meta_file.read_text()).items()
                                   if k != "checksums"}))
  with caplog.at_level(logging.INFO, logger=trainer.__name__):
    assert _train(tmp_path, SEQ2SEQ, SEQ2SEQ_TINY + ["TrainConfig.steps = 5"])["step"] == 5
  assert "resumed from step 4" in caplog.messages
  assert not [m for m in caplog.messages if m.startswith("batch_size")]
  ckpt = Checkpointer(str(tmp_path), read_only=True)
  state = ckpt.restore_data(5)
  ckpt.close()
  assert (state["index"], state["example"], state["batch_size"]) == (5, 5 * 4, 4)


@pytest.mark.parametrize("where", ["make_train_step", "event file"])
def test_an_interrupt_while_the_step_is_made_closes_the_event_file_and_the_checkpointer(
    tmp_path, monkeypatch, where):
  """A Ctrl-C (or any error) after the checkpointer is open but before the first step (the
  event file's import, the train step being made and compiled): what was opened is closed on
  the way out (until 2026-12-07 that setup ran outside the try that closes them: each such
  run left both open for the life of the process, a notebook's)."""
  from attnlab.training import metrics

  closed = []
  for cls, name in ((metrics.EventFile, "events"), (Checkpointer, "checkpointer")):
    close = cls.close

    def recording(self, close=close, name=name):
      if getattr(self, "_fd", "open") is not None:  # an event file never opened: not counted
        closed.append(name)
      return close(self)

    monkeypatch.setattr(cls, "close", recording)

  def interrupted(*args, **kw):
    raise KeyboardInterrupt

  if where == "make_train_step":
    monkeypatch.setattr(trainer.steps_lib, "make_train_step", interrupted)
  else:
    monkeypatch.setattr(metrics, "_tensorboardx", interrupted)
  with pytest.raises(KeyboardInterrupt):
    _train(tmp_path, LM, LM_TINY)
  opened = ["checkpointer", "events"] if where == "make_train_step" else ["checkpointer"]
  assert sorted(set(closed)) == opened
