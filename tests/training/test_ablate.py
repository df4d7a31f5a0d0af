"""``attnlab ablate`` and ``attnlab convert-heads`` end to end on a micro sweep
(a 1-layer, 4-head decoder, 2 arms x 1 seed x 2 steps): every output with its
columns, exact KV bytes, skip / resume / failure handling, --arm + --report,
head conversion parity, and one-line errors on bad input."""

import contextlib
import csv
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import cli
from attnlab import config_gin as gin_config
from attnlab.commands import EXIT_STOPPED
from attnlab.data import pipeline
from attnlab.training import report as report_lib
from attnlab.training import sweep as sweep_lib
from attnlab.training import trainer
from attnlab.training.checkpoint import Checkpointer
from tests import random_arrays
from tests.file_limits import failed_in_one_line

MICRO = """
Sweep.base = ["lm_stdlib_tiny.gin"]
Sweep.num_kv_heads = [4, 1]
Sweep.seeds = [0]
Sweep.curve_points = 1
Sweep.decode_prompt_len = 3
Sweep.decode_new_tokens = 2
Sweep.decode_repeats = 1
ModelConfig.d_model = 16
ModelConfig.num_heads = 4
ModelConfig.d_ff = 32
ModelConfig.num_layers = 1
DataConfig.seq_len = 8
DataConfig.batch_size = 2
DataConfig.max_files = 2
TrainConfig.steps = 2
TrainConfig.warmup_steps = 1
TrainConfig.checkpoint_every = 1
TrainConfig.log_every = 1
TrainConfig.eval_batches = 1
"""
# Columns that do not depend on timing: equal between equivalent sweeps.
STABLE = ["arm", "kind", "method", "num_kv_heads", "seed", "status", "params",
          "attention_params", "d_ff", "kv_bytes_per_token", "steps", "train_tokens", "val_loss",
          "val_ppl", "best_val_loss", "best_val_ppl"]


def _ablate(*argv):
  return cli.main(["ablate", *argv])


def _rows(out, name="results.csv"):
  with open(os.path.join(out, name)) as f:
    return list(csv.DictReader(f))


def _read(*parts):
  with open(os.path.join(*parts)) as f:
    return f.read()


def _stable(out):
  return [{k: r[k] for k in STABLE} for r in _rows(out)]


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("sweep") / "micro.gin"
  path.write_text(MICRO)
  return str(path)


@pytest.fixture(scope="module")
def micro(sweep_file, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("micro") / "out")
  assert _ablate("--gin_file", sweep_file, "--out", out) == 0
  return out


@pytest.fixture
def undrawn_plots(monkeypatch):
  """The report's PNGs, not drawn (~1 s a report): for tests of an OUT whose runs are the
  micro sweep's (its rows and curves), whose plots ``test_micro_sweep_writes_every_output``
  checks. The outs each report asks plots for are recorded."""
  outs = []

  def plot(out, *args):
    outs.append(out)
    return [os.path.join(out, p) for p in report_lib.PLOTS]

  monkeypatch.setattr(report_lib, "plot", plot)
  return outs


def test_micro_sweep_writes_every_output(micro):
  rows = _rows(micro)
  for col in ("arm", "num_kv_heads", "seed", "params", "kv_bytes_per_token", "val_loss",
              "val_ppl", "train_tokens_per_s", "decode_tokens_per_s_b1",
              "decode_tokens_per_s_b8", "status"):
    assert col in rows[0], col
  assert [(r["arm"], r["num_kv_heads"], r["status"]) for r in rows] == [
      ("mha", "4", "ok"), ("mqa", "1", "ok")]
  for r in rows:
    for col in ("val_loss", "train_tokens_per_s", "decode_tokens_per_s_b1",
                "decode_tokens_per_s_b8", "wall_time_s"):
      assert np.isfinite(float(r[col])) and float(r[col]) > 0, col
    assert float(r["val_ppl"]) == pytest.approx(np.exp(float(r["val_loss"])), rel=1e-4)
    # val_loss is the final evaluation of the run's own last checkpoint.
    ev = trainer.evaluate_workdir(sweep_lib.run_dir(micro, r["arm"], 0), 2)
    assert float(r["val_loss"]) == pytest.approx(ev["loss"], rel=1e-5)
  summary = _rows(micro, "summary.csv")
  assert list(summary[0]) == report_lib.SUMMARY_COLUMNS
  assert [s["arm"] for s in summary] == ["mha", "mqa"]
  assert summary[1]["exceeds_seed_noise"] == "n/a"  # one seed: no noise estimate
  report = _read(micro, "report.md")
  assert "| mqa | 1 |" in report and "2 x stdev(per-seed differences) / sqrt(n)" in report
  for png in report_lib.PLOTS:
    with open(os.path.join(micro, png), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    assert f"]({png})" in report
  # The operative sweep config reruns on its own.
  text = _read(micro, "sweep.gin")
  assert "Sweep.base = ()" in text and "ModelConfig.num_heads = 4" in text
  # Arms of a seed share data order and steps: the same first batch.
  cfgs = [gin_config.read_workdir_config(
      os.path.join(sweep_lib.run_dir(micro, a, 0), "config.gin")) for a in ("mha", "mqa")]
  assert cfgs[0][1] == cfgs[1][1] and cfgs[0][2] == cfgs[1][2]
  assert (cfgs[0][0].num_kv_heads, cfgs[1][0].num_kv_heads) == (4, 1)


def test_kv_bytes_per_token_scale_exactly_with_num_kv_heads(micro):
  rows = {r["arm"]: r for r in _rows(micro)}
  # 2 (K and V) x L=1 x K x H=4 x 4 bytes (float32)
  assert int(rows["mha"]["kv_bytes_per_token"]) == 2 * 1 * 4 * 4 * 4
  assert int(rows["mqa"]["kv_bytes_per_token"]) == 2 * 1 * 1 * 4 * 4


def test_rerun_skips_finished_runs(micro, sweep_file, capsys, undrawn_plots):
  before = _stable(micro)
  result = os.path.join(sweep_lib.run_dir(micro, "mha", 0), "result.json")
  mtime = os.path.getmtime(result)
  capsys.readouterr()
  assert _ablate("--gin_file", sweep_file, "--out", micro) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out == {"out": os.path.abspath(micro),
                 "this_invocation": {"ok": 0, "failed": 0, "skipped": 2},
                 "report": {"ok": 2, "failed": 0, "interrupted": 0, "pending": 0,
                            "outside_plan": 0}}
  assert os.path.getmtime(result) == mtime
  assert _stable(micro) == before


@pytest.mark.parametrize("arm", [[], ["--arm", "mha"]], ids=["sweep", "arm"])
def test_a_stopped_sweep_says_how_to_resume_exit_75_and_uses_the_compilation_cache(
    sweep_file, tmp_path, monkeypatch, capsys, cache_dir_updates, arm):
  """A signal that stops a run (``SweepInterrupted``) is one line on stderr, exit 75
  (EX_TEMPFAIL: rerun to resume; until 2026-12-04 exit 0, so a job array's uptraining
  arms, ``--dependency=afterok`` on the mha arm, started after a preempted mha job);
  ``--compilation_cache`` points JAX's cache at its folder before training."""
  seen = {}

  def stopped(out, sweep, arms, base, only=None):
    seen["set before the runs"] = list(cache_dir_updates)
    raise sweep_lib.SweepInterrupted("mha seed 0 stopped by SIGTERM at step 1; checkpoint saved")

  monkeypatch.setattr(sweep_lib, "run_sweep", stopped)
  out, cache = tmp_path / "out", tmp_path / "xla"
  capsys.readouterr()
  assert _ablate("--gin_file", sweep_file, "--out", str(out), "--compilation_cache",
                 str(cache), *arm) == EXIT_STOPPED
  captured = capsys.readouterr()
  assert captured.err == ("attnlab ablate: mha seed 0 stopped by SIGTERM at step 1; checkpoint "
                          "saved; rerun the same command to resume\n")
  assert captured.out == ""
  assert seen["set before the runs"] == cache_dir_updates == [str(cache)] and cache.is_dir()
  assert os.listdir(out) == ["sweep.gin"]


def test_a_signal_in_a_runs_last_step_or_its_measurement_stops_the_sweep(
    micro, sweep_file, tmp_path, monkeypatch, capsys, undrawn_plots):
  """SIGTERM in the last training step of mha: its checkpoint is saved, it is not measured
  (a preempted job's grace is short) and the sweep stops; the rerun measures it, and a
  SIGTERM during that measurement stops the sweep before mqa. Until 2026-12-04 a signal in
  a run's last step was ignored (the sweep trained the next arm), and one while a run was
  set up or measured killed the process (exit 143); then one while it was set up trained a
  step first. Then the OUT equals the uninterrupted sweep's."""
  make_train_step, measure = trainer.steps_lib.make_train_step, sweep_lib.measure

  def last_step_signalled(setup, tcfg):
    step_fn = make_train_step(setup, tcfg)

    def step(state, batch):
      if int(state["step"]) == tcfg.steps - 1:
        os.kill(os.getpid(), signal.SIGTERM)
      return step_fn(state, batch)

    return step

  out = str(tmp_path / "out")
  capsys.readouterr()
  # SIG_DFL, but not in mutmut's forked workers (mutmut's own handler): compared with it,
  # not with SIG_DFL, which failed there for every mutant that reached this test.
  sigterm_before = signal.getsignal(signal.SIGTERM)
  # A signal while mha is set up: it trains no step (it trained and saved one before).
  run_init = trainer.Run.__init__

  def setup_signalled(self, *args, **kw):
    os.kill(os.getpid(), signal.SIGTERM)
    run_init(self, *args, **kw)

  monkeypatch.setattr(trainer.Run, "__init__", setup_signalled)
  assert _ablate("--gin_file", sweep_file, "--out", out) == EXIT_STOPPED
  err = capsys.readouterr().err
  assert err.endswith("attnlab ablate: arm mha seed 0 stopped before training (signal 15), at "
                      "step 0; rerun the same command to resume\n"), err
  assert not os.listdir(os.path.join(sweep_lib.run_dir(out, "mha", 0), "checkpoints"))
  monkeypatch.setattr(trainer.Run, "__init__", run_init)
  monkeypatch.setattr(trainer.steps_lib, "make_train_step", last_step_signalled)
  assert _ablate("--gin_file", sweep_file, "--out", out) == EXIT_STOPPED
  err = capsys.readouterr().err
  assert err.endswith("attnlab ablate: arm mha seed 0 stopped at step 2 (signal 15); "
                      "checkpoint saved; rerun the same command to resume\n"), err
  assert sweep_lib.read_result(out, "mha", 0) is None
  assert not os.path.exists(sweep_lib.run_dir(out, "mqa", 0))
  monkeypatch.setattr(trainer.steps_lib, "make_train_step", make_train_step)

  def measure_signalled(*args, **kw):
    os.kill(os.getpid(), signal.SIGTERM)
    return measure(*args, **kw)

  monkeypatch.setattr(sweep_lib, "measure", measure_signalled)
  assert _ablate("--gin_file", sweep_file, "--out", out) == EXIT_STOPPED
  err = capsys.readouterr().err
  assert err.endswith("attnlab ablate: signal 15 before arm mqa seed 0; rerun the same "
                      "command to resume\n"), err
  assert sweep_lib.read_result(out, "mha", 0)["status"] == "ok"
  assert not os.path.exists(sweep_lib.run_dir(out, "mqa", 0))
  monkeypatch.setattr(sweep_lib, "measure", measure)
  assert signal.getsignal(signal.SIGTERM) == sigterm_before  # the sweep's handler is gone
  assert _ablate("--gin_file", sweep_file, "--out", out) == 0
  assert _stable(out) == _stable(micro)


def test_a_stopped_run_past_a_corrupted_checkpoint_names_the_step_it_resumed_from(
    micro, sweep_file, tmp_path, monkeypatch, capsys, caplog, warned, request):
  """mha's newest checkpoint (step 2) is corrupted and its result gone: the trainer resumes
  from step 1. A signal during setup stops it before training *at step 1*; one during the
  step saves step 2 and says so. Until 2026-12-04 the sweep compared with the newest
  checkpoint on disk: "before training, at step 2" both times. attnlab's INFO lines
  ("resumed from step 1") are logged, as by `attnlab train` (until 2026-12-04 WARNING up)."""
  attnlab_log = logging.getLogger("attnlab")  # as a fresh process has it
  request.addfinalizer(lambda level=attnlab_log.level: attnlab_log.setLevel(level))
  attnlab_log.setLevel(logging.NOTSET)
  out = str(tmp_path / "out")
  shutil.copytree(micro, out)
  workdir = sweep_lib.run_dir(out, "mha", 0)
  os.remove(os.path.join(workdir, sweep_lib.RESULT_FILE))
  for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "2", "params")):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  run_init = trainer.Run.__init__

  def setup_signalled(self, *args, **kw):
    os.kill(os.getpid(), signal.SIGTERM)
    run_init(self, *args, **kw)

  monkeypatch.setattr(trainer.Run, "__init__", setup_signalled)
  capsys.readouterr()
  assert _ablate("--gin_file", sweep_file, "--arm", "mha", "--out", out) == EXIT_STOPPED
  assert len([m for m in warned() if "checkpoints/2 could not be restored" in m]) == 1
  err = capsys.readouterr().err
  assert err.endswith("attnlab ablate: arm mha seed 0 stopped before training (signal 15), at "
                      "step 1; rerun the same command to resume\n"), err
  monkeypatch.setattr(trainer.Run, "__init__", run_init)
  make_train_step = trainer.steps_lib.make_train_step

  def step_signalled(setup, tcfg):
    step_fn = make_train_step(setup, tcfg)

    def step(state, batch):
      os.kill(os.getpid(), signal.SIGTERM)
      return step_fn(state, batch)

    return step

  monkeypatch.setattr(trainer.steps_lib, "make_train_step", step_signalled)
  caplog.clear()
  assert _ablate("--gin_file", sweep_file, "--arm", "mha", "--out", out) == EXIT_STOPPED
  assert len([m for m in warned() if "checkpoints/2 could not be restored" in m]) == 1
  assert "resumed from step 1" in caplog.messages
  err = capsys.readouterr().err
  assert err.endswith("attnlab ablate: arm mha seed 0 stopped at step 2 (signal 15); "
                      "checkpoint saved; rerun the same command to resume\n"), err
  monkeypatch.setattr(trainer.steps_lib, "make_train_step", make_train_step)
  assert _ablate("--gin_file", sweep_file, "--arm", "mha", "--out", out) == 0
  assert sweep_lib.read_result(out, "mha", 0)["status"] == "ok"


def test_a_sweeps_bookkeeping_survives_stray_and_cut_off_files(micro, sweep_file, tmp_path,
                                                               capsys, caplog, undrawn_plots):
  """A note under OUT/arms/ is not an arm (a NotADirectoryError traceback before
  2026-12-04); a run's wall_time_s that a kill cut off (empty) counts from 0 with a warning
  (every rerun failed on it); OUT/prompts.json of other prompts than the sweep makes is
  refused (its runs were measured on them; a rerun with another decode_prompt_len took them
  silently); an OUT of another Sweep.decode_* is refused; --out a file is one line."""
  out = str(tmp_path / "out")
  shutil.copytree(micro, out)
  with open(os.path.join(out, sweep_lib.ARMS_DIR, "notes.txt"), "w") as f:
    f.write("rerun on the big box\n")
  assert _ablate("--gin_file", sweep_file, "--out", out, "--report") == 0
  shutil.rmtree(sweep_lib.run_dir(out, "mqa", 0))  # mqa runs again
  wall = os.path.join(sweep_lib.run_dir(out, "mha", 0), "wall_time_s")
  open(wall, "w").close()
  with caplog.at_level(logging.WARNING, logger=sweep_lib.__name__):
    assert sweep_lib._add_wall(sweep_lib.run_dir(out, "mha", 0), 1.5) == 1.5
  assert [r.getMessage() for r in caplog.records] == [
      f"{wall} holds '', not a number of seconds: the run's wall time counts from this "
      "invocation"]
  assert _read(wall) == "1.500"
  prompts = os.path.join(out, sweep_lib.PROMPTS_FILE)
  saved = json.loads(_read(prompts))
  with open(prompts, "w") as f:
    json.dump([p[:1] for p in saved], f)
  capsys.readouterr()
  assert _ablate("--gin_file", sweep_file, "--out", out) == 2
  err = capsys.readouterr().err.strip()
  assert err == (f"attnlab ablate: error: {prompts} holds other benchmark prompts than this "
                 "sweep makes (another Sweep.decode_prompt_len or data, or an edited file): its "
                 "runs were measured on them; use a new --out, or delete it if no run has "
                 "finished"), err
  assert not os.path.exists(sweep_lib.run_dir(out, "mqa", 0))
  with open(prompts, "w") as f:
    json.dump(saved, f)
  assert _ablate("--gin_file", sweep_file, "--out", out, "--gin.Sweep.decode_prompt_len=5") == 2
  err = capsys.readouterr().err.strip()
  (line,) = [x for x in _read(out, "sweep.gin").splitlines()
             if x.startswith("Sweep.decode_prompt_len")]
  assert err == (f"attnlab ablate: error: {out} holds a sweep of other settings "
                 f"({os.path.join(out, 'sweep.gin')} has {line!r} where this sweep gives "
                 "'Sweep.decode_prompt_len = 5'); use a new --out"), err
  assert _ablate("--gin_file", sweep_file, "--out", out) == 0
  assert _stable(out) == _stable(micro)
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  capsys.readouterr()
  assert _ablate("--gin_file", sweep_file, "--out", str(a_file)) == 2
  assert capsys.readouterr().err.strip() == (
      f"attnlab ablate: error: --out {a_file} is a file; give a directory (new, or a sweep's)")
  assert a_file.read_text() == "x"
  # A training run's workdir (the sweep and its report were written in among its files until
  # 2026-12-06), with or without --report: refused, nothing written.
  run = sweep_lib.run_dir(micro, "mha", 0)
  before = sorted(os.listdir(run))
  for extra in ((), ("--report",)):
    assert _ablate("--gin_file", sweep_file, "--out", run, *extra) == 2
    assert capsys.readouterr().err.strip() == (
        f"attnlab ablate: error: --out {run} holds a training run (config.gin), not a sweep: "
        "give a new directory")
  assert sorted(os.listdir(run)) == before
  # A file where a run of this invocation goes (its arm's folder, or its seed's): one line
  # before anything trains (until 2026-12-06 a NotADirectoryError traceback once the sweep
  # reached it, the runs after it not run); with --arm, only that arm's runs count.
  mqa_run = sweep_lib.run_dir(out, "mqa", 0)
  for stray in (mqa_run, os.path.dirname(mqa_run)):
    shutil.rmtree(os.path.dirname(mqa_run), ignore_errors=True)
    os.makedirs(os.path.dirname(stray), exist_ok=True)
    with open(stray, "w") as f:
      f.write("notes\n")
    assert _ablate("--gin_file", sweep_file, "--out", out) == 2
    assert capsys.readouterr().err.strip() == (
        f"attnlab ablate: error: {stray} is a file, not a folder: the sweep's run of arm 'mqa' "
        "seed 0 goes there; move it away")
    assert _ablate("--gin_file", sweep_file, "--out", out, "--arm", "mha") == 0  # finished
    capsys.readouterr()
  arms_dir = os.path.join(str(tmp_path / "arms_a_file"), sweep_lib.ARMS_DIR)  # OUT/arms itself
  os.makedirs(os.path.dirname(arms_dir))
  with open(arms_dir, "w") as f:
    f.write("notes\n")
  assert _ablate("--gin_file", sweep_file, "--out", os.path.dirname(arms_dir)) == 2
  assert capsys.readouterr().err.strip() == (
      f"attnlab ablate: error: {arms_dir} is a file, not a folder: the sweep's run of arm 'mha' "
      "seed 0 goes there; move it away")
  # Two --gin_file: one line (until 2026-12-06 the last replaced the others: another sweep ran)
  other = tmp_path / "other.gin"
  other.write_text("TrainConfig.steps = 7\n")
  assert _ablate("--gin_file", sweep_file, "--gin_file", str(other),
                 "--out", str(tmp_path / "n")) == 2
  assert capsys.readouterr().err.strip() == (
      f"attnlab ablate: error: --gin_file is given 2 times ({sweep_file}, {other}); a sweep is "
      "one file: name the others in its Sweep.base (read first), or bind with --gin.X=V")
  assert not os.path.exists(tmp_path / "n")


def test_a_sweeps_validation_batches_past_memory_are_one_line_before_anything_is_written(
    tmp_path, capsys, monkeypatch):
  """Every run of a sweep evaluates (eval_every at least 1, whatever the base says), so the
  bound on a synthetic task's validation batches is checked with the runs' TrainConfig: under
  a base with eval_every=0 every run failed on it, after sweep.gin and prompts.json were
  written (until 2026-12-06). On a machine made to have 64 KiB."""
  sweep = tmp_path / "s2s.gin"
  sweep.write_text("\n".join([
      'Sweep.base = ["seq2seq_reverse.gin"]', "Sweep.num_kv_heads = [4, 1]", "Sweep.seeds = [0]",
      "Sweep.decode_prompt_len = 3", "Sweep.decode_new_tokens = 2", "ModelConfig.d_model = 16",
      "ModelConfig.num_heads = 4", "ModelConfig.d_ff = 32", "ModelConfig.num_layers = 1",
      "ModelConfig.num_encoder_layers = 1", "DataConfig.batch_size = 2",
      "TrainConfig.steps = 2", "TrainConfig.eval_every = 0"]) + "\n")
  monkeypatch.setattr(pipeline, "physical_memory_bytes", lambda: 2**16)
  out = tmp_path / "out"
  assert _ablate("--gin_file", str(sweep), "--out", str(out),
                 "--gin.TrainConfig.eval_batches=1000") == 2
  err = capsys.readouterr().err.strip()
  assert re.fullmatch(r"attnlab ablate: error: TrainConfig.eval_batches=1000 validation batches "
                      r"of batch_size=2 x seq_len=\d+ take at least [\d.]+ GiB on the host "
                      r"\(int32 token ids and targets, kept for every evaluation\), more than "
                      r"this machine's memory \(0.0 GiB\): give fewer eval_batches", err), err
  assert not out.exists()


def test_failing_arm_is_reported_then_arm_and_report_equal_all_in_one(
    micro, sweep_file, tmp_path, monkeypatch, capsys):
  real = trainer.train

  def train(mcfg, tcfg, dcfg, workdir, **kw):
    if f"{os.sep}mha{os.sep}" in workdir:
      raise RuntimeError("injected failure")
    return real(mcfg, tcfg, dcfg, workdir, **kw)

  monkeypatch.setattr(trainer, "train", train)
  out = str(tmp_path / "out")
  # The failing arm comes first; the other still runs, exit code 1.
  assert _ablate("--gin_file", sweep_file, "--out", out) == 1
  rows = {r["arm"]: r for r in _rows(out)}
  assert rows["mha"]["status"] == "failed"
  assert rows["mha"]["error"] == "RuntimeError: injected failure"
  assert rows["mqa"]["status"] == "ok" and float(rows["mqa"]["val_loss"]) > 0
  assert "mha seed 0: failed (RuntimeError: injected failure)" in _read(out, "report.md")
  # The progress line of the failed run says how far it got (no checkpoint: step 0).
  (failed,) = [line for line in capsys.readouterr().err.splitlines() if "FAILED" in line]
  assert re.match(r"ablate \[1/2\] arm=mha seed=0 step=0/\d+ FAILED: RuntimeError: injected "
                  r"failure \(\d+ s\); sweep ETA ", failed), failed
  # A failed run is retried: here one arm at a time (--arm), then --report;
  # every run of this OUT came from a separate invocation.
  monkeypatch.setattr(trainer, "train", real)
  os.remove(os.path.join(out, "results.csv"))
  assert _ablate("--gin_file", sweep_file, "--out", out, "--arm", "mha") == 0
  assert not os.path.exists(os.path.join(out, "results.csv"))  # --arm: no report
  assert _ablate("--out", out, "--report") == 0  # reads OUT/sweep.gin
  assert _stable(out) == _stable(micro)
  for png in report_lib.PLOTS:
    assert os.path.getsize(os.path.join(out, png)) > 0


@pytest.mark.slow
def test_kill_mid_sweep_then_rerun_equals_uninterrupted(micro, sweep_file, tmp_path):
  out = str(tmp_path / "out")
  argv = [sys.executable, "-m", "attnlab.cli", "ablate", "--gin_file", sweep_file, "--out", out]
  env = dict(os.environ, **{trainer.STEP_SLEEP_ENV: "1.0"})
  proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  ckpt = os.path.join(sweep_lib.run_dir(out, "mqa", 0), "checkpoints", "1")
  try:
    t0 = time.time()
    while not os.path.exists(ckpt):
      assert proc.poll() is None, proc.communicate()
      assert time.time() - t0 < 1800, "no checkpoint after 30 minutes"
      time.sleep(0.05)
  finally:
    proc.kill()  # SIGKILL mid-run: the mqa run has step 1 of 2 saved
    proc.wait()
  assert sweep_lib.read_result(out, "mqa", 0) is None
  # The rerun, a process of its own: its stderr shows the trainer's INFO line as `attnlab
  # train` does (until 2026-12-04 "INFO:attnlab.training.trainer:resumed from step 1": absl,
  # imported with orbax before the command set up logging, had configured it).
  res = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "\nresumed from step 1\n" in res.stderr, res.stderr[-3000:]
  assert _stable(out) == _stable(micro)


# --------------------------------------------------------------------------- conversion


def _model(num_kv_heads=4, **kw):
  cfg = attnlab.ModelConfig(vocab_size=32, d_model=16, num_heads=4, num_kv_heads=num_kv_heads,
                            num_layers=2, d_ff=32, use_bias=True, **kw)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(params=3, dropout=4))
  # Nonzero biases so that their conversion is checked too.
  for i, attn in enumerate(_attentions(model)):
    for j, proj in enumerate((attn.k_proj, attn.v_proj)):
      proj.b[...] = random_arrays.normal(10 * i + j, proj.b.shape, proj.b.dtype)
  return model


def _attentions(model):
  """Every attention module: encoder self-attention, decoder self- and cross-attention."""
  stacks = [model.encoder, model.decoder] if hasattr(model, "encoder") else [model.decoder]
  return [a for stack in stacks for layer in stack.layers
          for a in (layer.self_attn, layer.cross_attn) if a is not None]


def _merged_by_hand(x, axis, groups, method):
  """The K/V head merge in NumPy float64 (axis: the head axis)."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, 0)
  parts = np.split(x, groups, axis=0)
  out = np.stack([p.mean(0) if method == "mean" else p[0] for p in parts])
  return np.moveaxis(out, 0, axis)


TOKENS = np.array([[5, 7, 9, 11, 2, 3, 17, 4]], np.int32)


@nnx.jit
def _logits(model, tokens):
  """model(tokens), jitted (op-by-op execution compiles every op separately)."""
  return model(tokens)



def test_convert_to_the_same_heads_with_mean_is_the_identity():
  model = _model()
  same = attnlab.convert_heads(model, 4, "mean")
  np.testing.assert_array_equal(np.asarray(_logits(model, TOKENS)),
                                np.asarray(_logits(same, TOKENS)))


@pytest.mark.parametrize("method", ["mean", "first", "random"])
def test_convert_copies_every_other_parameter(method):
  """Only k_proj / v_proj change (``test_convert_merges_every_attention_by_hand``);
  every other parameter is the source's, bit for bit."""
  model = _model()
  new = attnlab.convert_heads(model, 2, method)
  assert new.cfg.num_kv_heads == 2 and new.cfg.num_heads == 4
  old = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  got = nnx.to_pure_dict(nnx.state(new, nnx.Param))
  for path, leaf in jax.tree_util.tree_flatten_with_path(old)[0]:
    if not any(getattr(k, "key", None) in ("k_proj", "v_proj") for k in path):
      node = got
      for k in path:
        node = node[getattr(k, "key", getattr(k, "idx", None))]
      np.testing.assert_array_equal(np.asarray(node), np.asarray(leaf))


def test_first_with_identical_group_heads_keeps_the_function():
  # If the heads of each group are equal, every method but random is exact.
  model = _model()
  for layer in model.decoder.layers:
    for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
      proj.w[...] = np.asarray(proj.w[...])[:, [0, 0, 2, 2]]
      proj.b[...] = np.asarray(proj.b[...])[[0, 0, 2, 2]]
  for method in ("mean", "first"):
    np.testing.assert_allclose(np.asarray(_logits(attnlab.convert_heads(model, 2, method), TOKENS)),
                               np.asarray(_logits(model, TOKENS)), rtol=1e-5, atol=1e-5)
  rnd = attnlab.convert_heads(model, 2, "random", rngs=nnx.Rngs(params=9, dropout=1))
  assert not np.allclose(np.asarray(_logits(rnd, TOKENS)), np.asarray(_logits(model, TOKENS)),
                         atol=1e-3)


def test_converted_cache_bytes_drop_by_the_head_ratio():
  model = _model()
  for k in (4, 2, 1):
    new = attnlab.convert_heads(model, k, "mean")
    assert new.cfg.kv_cache_bytes_per_token() * 4 // k == model.cfg.kv_cache_bytes_per_token()


def test_convert_rejects_bad_heads_and_methods():
  model = _model()
  with pytest.raises(ValueError, match=r"^num_kv_heads=3 must divide the source model's 4 KV "
                                       r"heads$"):
    attnlab.convert_heads(model, 3, "mean")
  with pytest.raises(ValueError, match=r"^num_kv_heads=8 is larger than the source model's 4 "
                                       r"KV heads: conversion only merges heads$"):
    attnlab.convert_heads(model, 8, "mean")
  with pytest.raises(ValueError, match=r"^method='avg' is not one of 'mean', 'first', "
                                       r"'random'$"):
    attnlab.convert_heads(model, 2, "avg")
  for bad in (0, -2, 2.0, True, "2", None, np.True_, np.int64(0)):
    with pytest.raises(ValueError, match=rf"^num_kv_heads={re.escape(repr(bad))} must be a "
                                         r"positive integer$"):
      attnlab.convert_heads(model, bad, "mean")
  # A NumPy int (a value read from an array) is the Python int it holds (refused until
  # 2026-12-04); the new model's config holds the Python int.
  for k in (2, np.int64(2), np.int32(2)):
    converted = attnlab.convert_heads(model, k, "first")
    assert converted.cfg.num_kv_heads == 2 and type(converted.cfg.num_kv_heads) is int
  np.testing.assert_array_equal(
      np.asarray(_logits(attnlab.convert_heads(model, np.int64(2), "mean"), TOKENS)),
      np.asarray(_logits(attnlab.convert_heads(model, 2, "mean"), TOKENS)))
  # The source's own K/V count bounds the target, not its query heads.
  with pytest.raises(ValueError, match="num_kv_heads=4 is larger than the source model's 2 KV"):
    attnlab.convert_heads(_model(num_kv_heads=2), 4, "mean")


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize("source_kv,arch", [(None, "decoder_only"), (4, "encoder_decoder"),
                                            (2, "decoder_only")], ids=str)
def test_convert_merges_every_attention_by_hand(method, source_kv, arch):
  """MHA given as num_kv_heads=None, a GQA source (2 -> 1), and an
  encoder-decoder, whose encoder self-attention and decoder cross-attention
  K/V are merged too; weights [D, K, H] and biases [K, H]."""
  model = _model(num_kv_heads=source_kv, arch=arch)
  new = attnlab.convert_heads(model, 1 if source_kv == 2 else 2, method)
  groups = new.cfg.num_kv_heads
  old_attn, new_attn = _attentions(model), _attentions(new)
  assert len(old_attn) == len(new_attn) == (6 if arch == "encoder_decoder" else 2)
  for old_a, new_a in zip(old_attn, new_attn):
    for name in ("k_proj", "v_proj"):
      old_p, new_p = getattr(old_a, name), getattr(new_a, name)
      np.testing.assert_allclose(new_p.w[...], _merged_by_hand(old_p.w[...], 1, groups, method),
                                 rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(new_p.b[...], _merged_by_hand(old_p.b[...], 0, groups, method),
                                 rtol=1e-6, atol=1e-7)


def test_convert_keeps_bfloat16_parameters_and_averages_in_float32():
  model = _model(param_dtype="bfloat16")
  new = attnlab.convert_heads(model, 1, "mean")
  for old_a, new_a in zip(_attentions(model), _attentions(new)):
    w_old, w_new = old_a.k_proj.w[...], new_a.k_proj.w[...]
    assert w_new.dtype == jnp.bfloat16
    want = jnp.asarray(_merged_by_hand(w_old.astype(jnp.float32), 1, 1, "mean"), jnp.float32)
    np.testing.assert_array_equal(np.asarray(w_new.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32)))
  leaves = jax.tree.leaves(nnx.state(new, nnx.Param))
  assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}


def test_a_parameter_whose_shape_changes_unexpectedly_is_named(monkeypatch):
  """Every parameter but k_proj / v_proj is copied, so its shape must not depend
  on K; one that did (here v_proj, no longer listed as a K/V projection) stops
  the conversion naming its path and both shapes."""
  from attnlab.convert import heads

  monkeypatch.setattr(heads, "KV_PROJECTIONS", ("k_proj",))
  with pytest.raises(AssertionError, match=r"^decoder/layers/0/self_attn/v_proj/b: \(4, 4\) vs "
                                           r"\(2, 4\)$"):
    attnlab.convert_heads(_model(), 2, "mean")


def test_random_draws_the_new_kv_from_rngs_and_defaults_to_params_0_dropout_1():
  """"random": the K/V projections of a model freshly built with ``rngs``
  (default ``nnx.Rngs(params=0, dropout=1)``), every other parameter copied;
  the new model's other state (dropout streams: a model with dropout, since one without
  holds none) is that fresh model's too."""
  model = _model(dropout_rate=0.1)
  for rngs, seeds in [(None, dict(params=0, dropout=1)),
                      (nnx.Rngs(params=9, dropout=5), dict(params=9, dropout=5))]:
    new = attnlab.convert_heads(model, 2, "random", rngs=rngs)
    fresh = attnlab.build_model(new.cfg, rngs=nnx.Rngs(**seeds))
    for new_a, fresh_a, old_a in zip(_attentions(new), _attentions(fresh), _attentions(model)):
      for name in ("k_proj", "v_proj"):
        np.testing.assert_array_equal(getattr(new_a, name).w[...], getattr(fresh_a, name).w[...])
      np.testing.assert_array_equal(new_a.q_proj.w[...], old_a.q_proj.w[...])
    rest = [nnx.state(m, nnx.Not(nnx.Param)) for m in (new, fresh)]
    keys = [[np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(r)] for r in rest]
    assert len(keys[0]) == len(keys[1]) > 0
    for a, b in zip(*keys):
      np.testing.assert_array_equal(a, b)


@contextlib.contextmanager
def _checkpointer(workdir):
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    yield ckpt
  finally:
    ckpt.close()


def test_convert_heads_command_then_train_and_decode(micro, tmp_path, capsys):
  src = sweep_lib.run_dir(micro, "mha", 0)
  dst = str(tmp_path / "mqa_up")
  assert cli.main(["convert-heads", "--from", src, "--to", dst, "--num_kv_heads", "1",
                   "--method", "mean", "--gin.TrainConfig.steps=1"]) == 0
  model, cfg = attnlab.load_checkpoint(dst)
  assert cfg.num_kv_heads == 1
  src_model, _ = attnlab.load_checkpoint(src)
  want = attnlab.convert_heads(src_model, 1, "mean")
  np.testing.assert_array_equal(np.asarray(_logits(model, TOKENS)),
                                np.asarray(_logits(want, TOKENS)))
  capsys.readouterr()
  assert cli.main(["decode", "--workdir", dst, "--prompt", "def", "--max_new_tokens", "3"]) == 0
  assert capsys.readouterr().out.endswith("\n")  # the completion line
  assert cli.main(["train", "--workdir", dst]) == 0  # uptrains from config.gin
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
  # The uptraining reads on from the source's data position (data it had not seen).
  with _checkpointer(src) as s, _checkpointer(dst) as d:
    src_state, (start, after) = s.restore_data(s.steps()[-1]), (d.restore_data(0),
                                                                d.restore_data(1))
  _, dcfg, _ = gin_config.read_workdir_config(os.path.join(dst, "config.gin"))
  assert src_state["example"] > 0 and start["example"] == src_state["example"]
  assert start["stream"] == src_state["stream"] and start["index"] == 0
  assert after["example"] == src_state["example"] + dcfg.batch_size and after["index"] == 1


def test_convert_heads_falls_back_past_a_damaged_newest_checkpoint(micro, tmp_path, capsys,
                                                                   warned):
  """The source's newest checkpoint garbled: convert-heads converts the newest that reads,
  with one warning; asked for the damaged step, one line naming it. Until 2026-12-04 both
  were tracebacks (found by a review)."""
  import shutil

  src = str(tmp_path / "src")
  shutil.copytree(sweep_lib.run_dir(micro, "mha", 0), src)
  with _checkpointer(src) as s:
    assert s.steps() == [1, 2]
  for root, _, files in os.walk(os.path.join(src, "checkpoints", "2")):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  capsys.readouterr()
  dst = str(tmp_path / "mqa_up")
  assert cli.main(["convert-heads", "--from", src, "--to", dst, "--num_kv_heads", "1",
                   "--method", "mean"]) == 0
  assert json.loads(capsys.readouterr().out)["source_step"] == 1
  assert len([m for m in warned() if f"{src}/checkpoints/2 could not be restored" in m]) == 1
  want = attnlab.convert_heads(attnlab.load_checkpoint(src, 1)[0], 1, "mean")
  np.testing.assert_array_equal(np.asarray(_logits(attnlab.load_checkpoint(dst)[0], TOKENS)),
                                np.asarray(_logits(want, TOKENS)))
  assert cli.main(["convert-heads", "--from", src, "--to", str(tmp_path / "x"),
                   "--num_kv_heads", "1", "--method", "mean", "--step", "2"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"attnlab convert-heads: error: checkpoint {src}/checkpoints/2 could not "
                        "be restored (") and err.count("\n") == 1, err
  assert not os.path.exists(tmp_path / "x")


def test_convert_heads_command_bindings_seed_and_summary(micro, tmp_path, capsys):
  """TrainConfig / DataConfig bindings reach the new run's config.gin (the rest is the
  source's); a ModelConfig binding or a bad value is refused before anything is written;
  --seed seeds the random method; the summary line names source, step and heads."""
  src = sweep_lib.run_dir(micro, "mha", 0)
  base = ["convert-heads", "--from", src, "--num_kv_heads", "2", "--method", "random"]
  for binding, message in (("--gin.ModelConfig.d_model=8", "--gin.ModelConfig.d_model: only "
                            "TrainConfig.* and DataConfig.* bindings apply (the model is the "
                            "converted source)"),
                           ("--gin.TrainConfig.steps=0", "steps=0"),
                           ("--gin.DataConfig.bogus=1", "bogus"),
                           # a seed past int64 was an OverflowError inside model_rngs
                           (f"--seed={2**63}", f"seed={2**63} must be an integer in "
                            "[0, 2**63 - 1]"),
                           ("--seed=-1", "seed=-1 must be an integer in [0, 2**63 - 1]")):
    dst = str(tmp_path / "refused")
    err = _one_line_exit_2(capsys, [*base, "--to", dst, binding], dst)
    assert message in err, err
  dst = str(tmp_path / "gqa")
  capsys.readouterr()
  assert cli.main([*base, "--to", dst, "--seed", "7", "--gin.DataConfig.batch_size=3",
                   "--gin.TrainConfig.learning_rate=0.005"]) == 0
  summary = json.loads(capsys.readouterr().out)
  _, _, src_tcfg = gin_config.read_workdir_config(os.path.join(src, "config.gin"))
  src_model, src_cfg = attnlab.load_checkpoint(src)
  assert summary == {"workdir": os.path.abspath(dst), "source": os.path.abspath(src),
                     "source_step": src_tcfg.steps, "method": "random", "num_kv_heads": 2,
                     "source_num_kv_heads": src_cfg.num_kv_heads}
  mcfg, dcfg, tcfg = gin_config.read_workdir_config(os.path.join(dst, "config.gin"))
  _, src_dcfg, _ = gin_config.read_workdir_config(os.path.join(src, "config.gin"))
  assert mcfg == src_cfg.replace(num_kv_heads=2)
  assert dcfg == dataclasses.replace(src_dcfg, batch_size=3)
  # progress shown (a sweep's run, the source, has it off: the sweep prints its own)
  assert not src_tcfg.progress and tcfg == src_tcfg.replace(learning_rate=0.005, progress=True)
  # Another batch size reads on from the source's data position; another data seed is
  # another stream, which the new run starts at its first example.
  with _checkpointer(src) as s, _checkpointer(dst) as d:
    src_example, state = s.restore_data(s.steps()[-1])["example"], d.restore_data(0)
  assert (state["example"], state["batch_size"]) == (src_example, 3) and src_example > 0
  reseeded = str(tmp_path / "reseeded")
  assert cli.main([*base, "--to", reseeded, "--gin.DataConfig.seed=5",
                   "--gin.TrainConfig.progress=False"]) == 0
  with _checkpointer(reseeded) as d:
    state = d.restore_data(0)
  assert state["example"] == 0 and state["stream"]["seed"] == 5
  assert not gin_config.read_workdir_config(os.path.join(reseeded, "config.gin"))[2].progress
  model, _ = attnlab.load_checkpoint(dst)
  want = attnlab.convert_heads(src_model, 2, "random", rngs=nnx.Rngs(params=7, dropout=8))
  other = attnlab.convert_heads(src_model, 2, "random", rngs=nnx.Rngs(params=0, dropout=1))
  np.testing.assert_array_equal(np.asarray(_logits(model, TOKENS)),
                                np.asarray(_logits(want, TOKENS)))
  assert not np.array_equal(np.asarray(_logits(want, TOKENS)),
                            np.asarray(_logits(other, TOKENS)))
  # Without --seed: seed 0.
  np.testing.assert_array_equal(
      np.asarray(_logits(attnlab.load_checkpoint(reseeded)[0], TOKENS)),
      np.asarray(_logits(other, TOKENS)))


def test_match_params_arms_are_within_one_percent():
  mcfg = attnlab.ModelConfig(d_model=128, num_heads=8, num_layers=2, d_ff=352)
  arms = sweep_lib.plan(sweep_lib.Sweep(match_params=True), mcfg)
  assert [a.num_kv_heads for a in arms] == [8, 4, 2, 1]
  mha = sweep_lib.param_counts(mcfg)[0]
  plain = sweep_lib.param_counts(mcfg.replace(num_kv_heads=1))[0]
  assert abs(plain - mha) > 0.05 * mha  # without matching MQA is much smaller
  for a in arms:
    got = sweep_lib.param_counts(mcfg.replace(num_kv_heads=a.num_kv_heads, d_ff=a.d_ff))[0]
    assert abs(got - mha) <= 0.01 * mha, (a, got, mha)
  assert arms[-1].d_ff > arms[0].d_ff


# --------------------------------------------------------------------------- bad input


def _one_line_exit_2(capsys, argv, must_not_exist):
  capsys.readouterr()
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert not os.path.exists(must_not_exist)
  return err


@pytest.mark.parametrize("k, method, extra, message", [
    ("3", "mean", [], "num_kv_heads=3 must divide"),
    ("8", "mean", [], "num_kv_heads=8 is larger"),
    ("2", "avg", [], "method='avg' is not one of"),
    ("2", "mean", ["--step", "99"], "step=99 has no checkpoint"),
    # The way out named (2026-12-04): a source trained on more devices than this machine's.
    ("2", "mean", ["--gin.TrainConfig.mesh_shape=(64,1,1)"],
     "mesh_shape=(64, 1, 1) needs 64 devices, only 1 exist (the new run's "
     "TrainConfig.mesh_shape, the source's unless bound: give --gin.TrainConfig.mesh_shape=(D, "
     "F, T) for this machine's devices)"),
    # The new run's data against its model, as train checks them (written, then refused by
    # train, until 2026-12-06).
    ("2", "mean", ["--gin.DataConfig.seq_len=4096"],
     "seq_len=4096 is longer than ModelConfig.max_len="),
])
def test_convert_heads_bad_input(micro, tmp_path, capsys, k, method, extra, message):
  src = sweep_lib.run_dir(micro, "mha", 0)
  dst = str(tmp_path / "dst")
  err = _one_line_exit_2(capsys, ["convert-heads", "--from", src, "--to", dst,
                                  "--num_kv_heads", k, "--method", method, *extra], dst)
  assert message in err


def test_convert_heads_to_a_file_is_refused(micro, tmp_path, capsys):
  dst = tmp_path / "dst"
  dst.write_text("notes\n")
  capsys.readouterr()
  assert cli.main(["convert-heads", "--from", sweep_lib.run_dir(micro, "mha", 0), "--to",
                   str(dst), "--num_kv_heads", "2", "--method", "mean"]) == 2
  assert capsys.readouterr().err.strip() == (
      f"attnlab convert-heads: error: --to {dst} already exists and is a file: give a new "
      "directory")
  assert dst.read_text() == "notes\n"


def test_an_out_of_a_benchmark_past_max_len_can_still_be_reported(micro, tmp_path, capsys,
                                                                   undrawn_plots):
  """The benchmark check refuses a new sweep, not the report of an OUT written before it."""
  out = tmp_path / "out"
  shutil.copytree(micro, out)
  text = (out / "sweep.gin").read_text()
  (out / "sweep.gin").write_text(text.replace("Sweep.decode_new_tokens = 2",
                                              "Sweep.decode_new_tokens = 1023"))
  assert "decode_new_tokens = 1023" in (out / "sweep.gin").read_text()
  capsys.readouterr()
  assert _ablate("--out", str(out), "--report") == 0, capsys.readouterr().err


def test_an_out_whose_sweep_gin_sets_a_field_its_task_does_not_read_is_reported(
    micro, tmp_path, capsys, warned, undrawn_plots):
  """An OUT written before 2026-12-06 may name a DataConfig field its task did not read
  (taken, and ignored, then): --report reads it as the default, with a warning, where the
  strict check refused the folder; a new sweep with it is refused."""
  out = tmp_path / "out"
  shutil.copytree(micro, out)
  with open(out / "sweep.gin", "a") as f:
    f.write("\nDataConfig.vocab_chars = 5\n")
  capsys.readouterr()
  assert _ablate("--out", str(out), "--report") == 0, capsys.readouterr().err
  assert any("DataConfig.vocab_chars = 5, which task='lm'" in w for w in warned()), warned()
  err = _one_line_exit_2(capsys, ["ablate", "--gin_file", str(out / "sweep.gin"), "--out",
                                  str(tmp_path / "new")], tmp_path / "new")
  assert err.endswith("vocab_chars=5 does not apply to task='lm' (a language model reads the "
                      "text files of paths); leave it at 10"), err


def test_an_output_folder_under_a_file_is_one_line(micro, sweep_file, tmp_path, capsys):
  """--to / --out inside a file: one line naming the flag, exit 2 (a NotADirectoryError
  traceback until 2026-12-04)."""
  note = tmp_path / "notes.txt"
  note.write_text("x\n")
  for argv, flag in (
      (["convert-heads", "--from", sweep_lib.run_dir(micro, "mha", 0), "--num_kv_heads", "2",
        "--method", "mean", "--to"], "--to"),
      (["ablate", "--gin_file", sweep_file, "--arm", "mha", "--out"], "--out")):
    err = _one_line_exit_2(capsys, [*argv, str(note / "sub" / "deeper")], note / "sub")
    assert err == (f"attnlab {argv[0]}: error: {flag} {note / 'sub' / 'deeper'}: cannot make "
                   f"this directory ({note} is a file)"), err
  assert note.read_text() == "x\n"


@pytest.mark.parametrize("extra", [[], ["--gin.TrainConfig.steps=3"]])
def test_convert_heads_missing_source_run(tmp_path, capsys, extra):
  dst = str(tmp_path / "dst")
  err = _one_line_exit_2(capsys, ["convert-heads", "--from", str(tmp_path / "nope"), "--to",
                                  dst, "--num_kv_heads", "1", "--method", "mean", *extra], dst)
  assert "nope/config.gin does not exist: --from is not a training run" in err, err


@pytest.mark.parametrize("binding, message", [
    ("--gin.Sweep.num_kv_heads=[]", "empty arm list"),
    ("--gin.Sweep.bogus=1", "bogus"),
    ("--gin.Sweep.num_kv_heads=[3]", "num_kv_heads=3 must divide num_heads=4"),
    ("--gin.Sweep.uptrain_methods=['avg']", "'avg' is not one of"),
    ("--gin.Sweep.uptrain_learning_rate=0.0", "uptrain_learning_rate=0.0 must be a positive"),
    # the benchmark past max_len: every run trained, then failed when measured (2026-12-04)
    ("--gin.Sweep.decode_new_tokens=1023", "the decode benchmark needs 1025 positions (prompts "
     "of 3 tokens (Sweep.decode_prompt_len, at most DataConfig.seq_len) and "
     "Sweep.decode_new_tokens=1023), more than ModelConfig.max_len=1024"),
])
def test_ablate_bad_input(sweep_file, tmp_path, capsys, binding, message):
  out = str(tmp_path / "out")
  err = _one_line_exit_2(capsys, ["ablate", "--gin_file", sweep_file, "--out", out, binding],
                         out)
  assert message in err


@pytest.mark.parametrize("argv, message", [
    (["--gin.DecodeConfig.beam_size=2"], "--gin.DecodeConfig.beam_size: only Sweep., "
     "ModelConfig., DataConfig., TrainConfig. bindings apply to a sweep"),
    ([], None),  # no --gin_file: named below
    (["--report"], "holds no runs yet (no arms/ folder)"),
    (["--gin.TrainConfig.steps=0"], "steps=0"),
    (["--gin.DataConfig.paths=('/no/such/corpus*.txt',)"], "/no/such/corpus"),
])
def test_ablate_refusals_before_anything_is_written(sweep_file, tmp_path, capsys, argv,
                                                     message):
  out = str(tmp_path / "out")
  if message is None:  # without --gin_file only --report of an existing OUT can run
    err = _one_line_exit_2(capsys, ["ablate", "--out", out], out)
    assert "--gin_file is needed (only --report of an existing --out reads OUT/sweep.gin)" in err
    assert cli.main(["ablate", "--out", out, "--report"]) == 2
    assert capsys.readouterr().err.strip() == (
        "attnlab ablate: error: --gin_file is needed (only --report of an existing --out reads "
        f"OUT/sweep.gin; {out} does not exist)")
    os.makedirs(out)
    capsys.readouterr()
    assert cli.main(["ablate", "--out", out, "--report"]) == 2
    assert capsys.readouterr().err.strip() == (
        "attnlab ablate: error: --gin_file is needed (only --report of an existing --out reads "
        f"OUT/sweep.gin; {out} has none: not a sweep directory)")
    return
  err = _one_line_exit_2(capsys, ["ablate", "--gin_file", sweep_file, "--out", out, *argv],
                         out)
  assert message in err, err


def test_an_out_of_another_base_config_is_refused(micro, sweep_file, tmp_path, capsys,
                                                    undrawn_plots):
  """A sweep's OUT holds one base config: a binding that changes the model (not a Sweep.*
  setting) needs a new --out, and nothing in the old one changes."""
  out = str(tmp_path / "out")
  shutil.copytree(micro, out)
  before = {name: _read(out, name) for name in ("results.csv", "sweep.gin")}
  capsys.readouterr()
  assert _ablate("--gin_file", sweep_file, "--out", out, "--gin.ModelConfig.d_ff=48") == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1
  (d_ff,) = [line for line in before["sweep.gin"].splitlines()
             if line.startswith("ModelConfig.d_ff")]
  assert (f"{out} holds a sweep of other settings "
          f"({os.path.join(out, 'sweep.gin')} has {d_ff!r} where this sweep gives "
          "'ModelConfig.d_ff = 48'); use a new --out") in err, err
  assert {name: _read(out, name) for name in before} == before
  # A note or a blank line added to OUT/sweep.gin changes no setting: not refused.
  with open(os.path.join(out, "sweep.gin"), "a") as f:
    f.write("\n# rerun on the big box\n\n")
  assert _ablate("--gin_file", sweep_file, "--out", out, "--report") == 0
  # A sweep.gin an older attnlab wrote lacks the fields added since (their defaults): the
  # configs are compared, not the text, so its OUT is still reported, with or without the
  # sweep file (before 2026-12-04 both were refused as "a different base config").
  for field in ("ModelConfig.remat = False", "ModelConfig.o_bias = None"):
    text = _read(out, "sweep.gin")
    assert field in text
    with open(os.path.join(out, "sweep.gin"), "w") as f:
      f.write("\n".join(line for line in text.splitlines() if not line.startswith(field)))
  assert _ablate("--out", out, "--report") == 0
  assert _ablate("--gin_file", sweep_file, "--out", out, "--report") == 0
  # A binding this attnlab does not know: refused, naming it.
  with open(os.path.join(out, "sweep.gin"), "a") as f:
    f.write("\nModelConfig.from_the_future = 3\n")
  assert _ablate("--gin_file", sweep_file, "--out", out, "--report") == 2
  err = capsys.readouterr().err
  assert "holds a sweep of other settings" in err and "from_the_future" in err, err
  assert err.strip().endswith("where this sweep gives 'a sweep file this attnlab reads'); use "
                              "a new --out"), err


def test_an_existing_out_its_report_and_its_arms(micro, sweep_file, tmp_path, capsys,
                                                   undrawn_plots):
  """Only --report reads OUT/sweep.gin without --gin_file; --report prints where and what it
  reported; an OUT without runs is not reported; --arm checks only its own runs' configs."""
  out = str(tmp_path / "out")
  shutil.copytree(micro, out)
  before = {name: _read(out, name) for name in ("results.csv", "sweep.gin")}
  capsys.readouterr()
  assert _ablate("--out", out) == 2  # a rerun needs the sweep file, even with sweep.gin there
  assert "--gin_file is needed" in capsys.readouterr().err
  assert _ablate("--out", out, "--report") == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed == {"out": os.path.abspath(out), "ok": 2, "failed": 0, "interrupted": 0,
                     "pending": 0, "outside_plan": 0}
  assert {name: _read(out, name) for name in before} == before
  # The mqa run made stale by hand: --arm mha is not held up by it; --arm mqa is.
  path = os.path.join(sweep_lib.run_dir(out, "mqa", 0), sweep_lib.CONFIG_FILE)
  with open(path) as f:
    text = f.read()
  with open(path, "w") as f:
    f.write(re.sub(r"(?m)^TrainConfig\.seed = .*$", "TrainConfig.seed = 99", text))
  assert _ablate("--gin_file", sweep_file, "--out", out, "--arm", "mha") == 0
  assert json.loads(capsys.readouterr().out)["this_invocation"]["skipped"] == 1
  assert _ablate("--gin_file", sweep_file, "--out", out, "--arm", "mqa") == 2
  assert "arms/mqa/seed_0" in capsys.readouterr().err
  empty = tmp_path / "empty"
  empty.mkdir()
  assert _ablate("--gin_file", sweep_file, "--out", str(empty), "--report") == 2
  assert "holds no runs yet (no arms/ folder)" in capsys.readouterr().err
  assert os.listdir(empty) == []


def test_a_report_on_a_full_disk_is_one_line_and_leaves_every_file_whole(micro, tmp_path):
  """``ablate --report`` whose plot write fails for real (files capped at 16 KiB with
  RLIMIT_FSIZE, in a process of its own: EFBIG, as ENOSPC on a full disk): one line naming
  the file, exit 1, each earlier report file as it was (or rewritten whole) and no temporary
  left. Until 2026-12-07 savefig wrote the PNG in place: the previous plot was cut to the
  cap, with a traceback."""
  pytest.importorskip("resource")
  limit = 16 * 1024
  out = tmp_path / "out"
  shutil.copytree(micro, out)
  before = {name: (out / name).read_bytes() for name in os.listdir(out)
            if os.path.isfile(out / name)}
  assert all(len(before[p]) > limit for p in report_lib.PLOTS)  # a PNG's write must fail
  line = failed_in_one_line(["ablate", "--out", out, "--report"], limit)
  assert re.fullmatch(
      rf"attnlab ablate: error: writing {re.escape(str(out))}/{report_lib.PLOTS[0]} failed "
      r"\(OSError: \[Errno 27\] File too large\); the report's other files are whole: free "
      r"the space \(or mend the cause\) and rerun with --report", line), line
  after = {name: (out / name).read_bytes() for name in os.listdir(out)
           if os.path.isfile(out / name)}
  assert after == before  # the PNGs whole; the CSVs and report.md rewritten alike


def test_ablate_without_matplotlib_stops_before_training(sweep_file, tmp_path, capsys,
                                                         monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
  out = str(tmp_path / "out")
  err = _one_line_exit_2(capsys, ["ablate", "--gin_file", sweep_file, "--out", out], out)
  assert "attnlab ablate (its plots) needs the matplotlib package: pip install " \
         "'attnlab[bench]'" in err, err


def test_ablate_unknown_arm(sweep_file, tmp_path, capsys):
  out = str(tmp_path / "out")
  err = _one_line_exit_2(capsys, ["ablate", "--gin_file", sweep_file, "--out", out, "--arm",
                                  "gqa2"], out)
  assert "mha, mqa" in err


@pytest.mark.parametrize("binding, differs", [
    ("--gin.Sweep.match_params=True", "ModelConfig.d_ff = 32"),  # the mqa arm widens
    ("--gin.Sweep.curve_points=2", "TrainConfig.eval_every = 2"),  # both arms
])
def test_a_rerun_with_other_run_settings_reuses_no_run(micro, sweep_file, tmp_path, capsys,
                                                       binding, differs):
  """A finished run is skipped only if this sweep would train it alike: changed settings
  name the runs (exit 2) before anything is written or trained."""
  out = str(tmp_path / "out")
  shutil.copytree(micro, out)
  before = {name: _read(out, name) for name in ("results.csv", "sweep.gin")}
  capsys.readouterr()
  assert _ablate("--gin_file", sweep_file, "--out", out, binding) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert "trained with another config than this sweep's" in err and "use a new --out" in err
  assert os.path.join("arms", "mqa", "seed_0") in err and repr(differs) in err, err
  assert {name: _read(out, name) for name in before} == before
  # Nor are they reported under the new settings.
  assert _ablate("--gin_file", sweep_file, "--out", out, "--report", binding) == 2
  assert "trained with another config" in capsys.readouterr().err
  assert {name: _read(out, name) for name in before} == before
  # The library call refuses too; the same sweep skips every finished run.
  sweep, mcfg, dcfg, tcfg = gin_config.parse_sweep(sweep_file, [binding[len("--gin."):]])
  arms = sweep_lib.plan(sweep, mcfg)
  with pytest.raises(ValueError, match="arms/mqa/seed_0"):
    sweep_lib.run_sweep(out, sweep, arms, (mcfg, dcfg, tcfg))
  # A run cut short (checkpoints past step 0, no result) would be resumed: named too.
  os.remove(os.path.join(sweep_lib.run_dir(out, "mqa", 0), sweep_lib.RESULT_FILE))
  assert any(line.startswith(os.path.join("arms", "mqa", "seed_0"))
             for line in sweep_lib.stale_runs(out, sweep, arms, (mcfg, dcfg, tcfg)))
  sweep, mcfg, dcfg, tcfg = gin_config.parse_sweep(sweep_file, [])
  assert sweep_lib.stale_runs(out, sweep, sweep_lib.plan(sweep, mcfg), (mcfg, dcfg, tcfg)) == []


def test_runs_written_by_another_attnlab_version_are_reused_when_their_config_is_the_same(
    micro, sweep_file, tmp_path, capsys, undrawn_plots):
  """config.gin written by an older attnlab (a field added since is missing, lines in
  another order, other comments) still describes the same run: reused, not stale. A field
  that does differ is named; a field this attnlab does not know makes the run stale."""
  sweep, mcfg, dcfg, tcfg = gin_config.parse_sweep(sweep_file, [])
  arms = sweep_lib.plan(sweep, mcfg)
  base = (mcfg, dcfg, tcfg)
  out = str(tmp_path / "out")
  shutil.copytree(micro, out)
  paths = [os.path.join(sweep_lib.run_dir(out, a.name, s), sweep_lib.CONFIG_FILE)
           for s in sweep.seeds for a in arms]
  # An "older" file: a ModelConfig field at its default dropped, the rest reversed.
  default = next(f for f in dataclasses.fields(attnlab.ModelConfig)
                 if f.default is not dataclasses.MISSING and getattr(mcfg, f.name) == f.default)
  for path in paths:
    lines = [line for line in _read(path).splitlines()
             if not line.startswith(f"ModelConfig.{default.name} =")]
    assert len(lines) == len(_read(path).splitlines()) - 1
    with open(path, "w") as f:
      f.write("# written by attnlab 0.0\n" + "\n".join(reversed(lines)) + "\n")
  assert sweep_lib.stale_runs(out, sweep, arms, base) == []
  before = {name: _read(out, name) for name in ("results.csv", "sweep.gin")}
  capsys.readouterr()
  assert _ablate("--gin_file", sweep_file, "--out", out) == 0  # nothing to train
  printed = json.loads(capsys.readouterr().out)
  assert printed["this_invocation"] == {"ok": 0, "failed": 0, "skipped": len(paths)}
  assert _read(out, "results.csv") == before["results.csv"]
  # One value changed: named by field, in gin's own spelling.
  with open(paths[0]) as f:
    text = f.read()
  with open(paths[0], "w") as f:
    f.write(re.sub(r"(?m)^TrainConfig\.seed = .*$", "TrainConfig.seed = 99", text))
  (line,) = sweep_lib.stale_runs(out, sweep, arms, base)
  assert "has 'TrainConfig.seed = 99' where this sweep gives 'TrainConfig.seed = " in line
  # A field this attnlab does not know (a newer version's): stale, by its text.
  with open(paths[1], "a") as f:
    f.write("ModelConfig.bogus_field = 3\n")
  stale = sweep_lib.stale_runs(out, sweep, arms, base)
  assert len(stale) == 2 and stale[1].startswith(os.path.relpath(os.path.dirname(paths[1]), out))
  # A damaged result.json: one line naming it, exit 2, from the staleness check (a run
  # with its config.gin) and from the report itself (without one).
  result = os.path.join(os.path.dirname(paths[0]), sweep_lib.RESULT_FILE)
  with open(result, "w") as f:
    f.write('{"status": "ok"')
  for report in (["--report"], ["--report"], []):  # the last: a run, not only the report
    assert _ablate("--gin_file", sweep_file, "--out", out, *report) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{result} is not a JSON run result" in err, err
    for path in paths:
      if os.path.exists(path):
        os.remove(path)
  # A folder in its place: named as the damaged file is, by the report and by a run (until
  # 2026-12-07 the report counted the run unfinished, exit 0, and the run trained it again,
  # then stopped on an IsADirectoryError traceback).
  os.remove(result)
  os.mkdir(result)
  for report in (["--report"], []):
    assert _ablate("--gin_file", sweep_file, "--out", out, *report) == 2
    assert capsys.readouterr().err == (
        f"attnlab ablate: error: {result} is a folder, not a run result (attnlab writes a file "
        "there); delete it to run that arm and seed again\n")
  assert os.listdir(result) == []


def test_sweep_validates_its_fields():
  with pytest.raises(ValueError, match="seeds=()"):
    sweep_lib.Sweep(seeds=())
  with pytest.raises(ValueError, match="uptrain_fraction=0"):
    sweep_lib.Sweep(uptrain_fraction=0.0)
  for lr, message in ((0, "must be a positive number"), (-1e-3, "must be a positive number"),
                      (float("nan"), "must be a finite number"),
                      (float("inf"), "must be a finite number"),
                      ("1e-3", "must be a number or None"), (True, "must be a number or None")):
    with pytest.raises(ValueError, match=f"uptrain_learning_rate=.* {message}"):
      sweep_lib.Sweep(uptrain_learning_rate=lr)
  assert sweep_lib.Sweep(uptrain_learning_rate=2).uptrain_learning_rate == 2
  with pytest.raises(ValueError, match="needs the MHA arm"):
    sweep_lib.plan(sweep_lib.Sweep(num_kv_heads=(2, 1), uptrain_num_kv_heads=(1,)),
                   attnlab.ModelConfig(num_heads=4, d_model=16))


def test_uptrain_arm_converts_the_mha_run(micro, sweep_file, tmp_path):
  # Finished runs copied into another OUT (a shared filesystem) count as
  # finished; adding an uptraining arm runs only that arm.
  out = str(tmp_path / "out")
  shutil.copytree(micro, out)
  assert _ablate("--gin_file", sweep_file, "--out", out, "--gin.Sweep.uptrain_num_kv_heads=[1]",
                 "--gin.Sweep.uptrain_methods=['first']") == 0
  rows = {r["arm"]: r for r in _rows(out)}
  assert _stable(out)[:2] == _stable(micro)
  up = rows["uptrain-first-mqa"]
  assert up["status"] == "ok" and up["steps"] == "1" and up["num_kv_heads"] == "1"
  # The loss right after conversion is that of the converted MHA checkpoint.
  conv = json.loads(_read(sweep_lib.run_dir(out, "uptrain-first-mqa", 0), "conversion.json"))
  assert conv["source_step"] == 2 and conv["method"] == "first"
  assert float(up["val_loss_converted"]) == pytest.approx(conv["val_loss_converted"], rel=1e-5)
  assert "## Uptraining" in _read(out, "report.md")
  # Uptraining that makes the loss worse (two steps at a peak lr of 10): the best loss is
  # the converted checkpoint's, the run's step 0 (until 2026-12-05 the best was taken over
  # the trained steps only).
  worse = str(tmp_path / "worse")
  shutil.copytree(micro, worse)
  assert _ablate("--gin_file", sweep_file, "--out", worse, "--gin.Sweep.uptrain_num_kv_heads=[1]",
                 "--gin.Sweep.uptrain_methods=['first']", "--gin.Sweep.uptrain_fraction=1.0",
                 "--gin.Sweep.uptrain_learning_rate=10.0") == 0
  up = {r["arm"]: r for r in _rows(worse)}["uptrain-first-mqa"]
  assert up["steps"] == "2" and float(up["val_loss"]) > float(up["val_loss_converted"])
  assert up["best_val_loss"] == up["val_loss_converted"]
  assert float(up["best_val_ppl"]) == pytest.approx(math.exp(float(up["val_loss_converted"])),
                                                 rel=1e-4)  # the CSV's rounding


def test_seed_noise_criterion_by_hand():
  """Paired over seeds: d = (0.1, 0.2, 0.3) has mean 0.2 and se 0.1 / sqrt(3) = 0.0577."""
  mha = {0: 1.9, 1: 1.2, 2: 2.5}  # seeds differ a lot; the per-seed differences do not
  arm = {0: 2.0, 1: 1.4, 2: 2.8}
  diff, se, verdict = report_lib.noise_test(arm, mha)
  assert diff == pytest.approx(0.2) and se == pytest.approx(0.1 / np.sqrt(3))
  assert verdict == "yes"  # 0.2 > 2 x 0.0577; an unpaired test would say "no"
  # d = (0.1, -0.2, 0.3): mean 0.0667, se 0.153: inside the noise
  assert report_lib.noise_test({0: 2.0, 1: 1.0, 2: 2.8}, mha)[2] == "no"
  # Only the seeds both finished count; one common seed is not enough.
  assert report_lib.noise_test({0: 2.0, 5: 1.0}, mha) == (pytest.approx(0.1), None, "n/a")
  assert report_lib.noise_test({}, mha) == (None, None, "n/a")
  # "Exceeds" is strict: d = (3, 1) has mean 2 and se sqrt(2) / sqrt(2) = 1, exactly the
  # bound (2 x se), so it is inside the noise.
  assert report_lib.noise_test({0: 3.0, 1: 1.0}, {0: 0.0, 1: 0.0}) == (2.0, 1.0, "no")
  assert report_lib.noise_test({0: 3.0, 1: 1.5}, {0: 0.0, 1: 0.0})[2] == "yes"
