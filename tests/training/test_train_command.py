"""``attnlab train`` / ``attnlab eval`` / ``attnlab kv-size`` in process: what each flag
reaches (a recording stand-in where the effect is global: the distributed init, the XLA
cache option), the JSON line a run prints, a workdir that trains from its own config.gin,
the exits (2: bad input before anything is written; 1: a non-finite stop), the gin flag
forms and the byte units."""

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import types

import pytest

from attnlab import cli
from attnlab import config_gin as gin_config
from attnlab.commands import _common, kv_size
from attnlab.commands import train as train_command
from attnlab.data import pipeline
from tests.file_limits import failed_in_one_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "seq2seq_reverse.gin")
LM = os.path.join(REPO, "configs", "lm_stdlib_tiny.gin")
TINY = ["--gin.ModelConfig.d_model=32", "--gin.ModelConfig.d_ff=64",
        "--gin.ModelConfig.num_layers=1", "--gin.DataConfig.batch_size=4",
        "--gin.TrainConfig.steps=2", "--gin.TrainConfig.log_every=1",
        "--gin.TrainConfig.eval_every=0", "--gin.TrainConfig.progress=False"]
SEQ2SEQ = TINY + ["--gin.ModelConfig.num_encoder_layers=1", "--gin.DataConfig.max_len=6",
                  "--gin.DataConfig.seq_len=8"]


@pytest.fixture
def data_builds(monkeypatch):
  """The names of the tokenizer and source builds a run makes, in order (the real ones run)."""
  calls = []
  for name in ("make_tokenizer", "build_sources"):
    real = getattr(pipeline, name)
    monkeypatch.setattr(pipeline, name, lambda *a, _real=real, _name=name, **kw:
                        calls.append(_name) or _real(*a, **kw))
  return calls


@pytest.fixture
def recorded(monkeypatch, cache_dir_updates):
  """The distributed init and the compilation-cache folders, recorded instead of set."""
  calls = {"distributed": [], "cache_dirs": cache_dir_updates}
  monkeypatch.setattr(train_command.sharding, "initialize_distributed",
                      lambda *a: calls["distributed"].append(a) or False)
  return calls


@pytest.fixture(scope="module")
def seq2seq_run(tmp_path_factory):
  """A finished ``attnlab train`` run of SEQ2SEQ (2 steps, a checkpoint at 2), trained once:
  a test copies it (``_copy``) before changing anything."""
  workdir = tmp_path_factory.mktemp("seq2seq") / "run"
  assert cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(workdir)]) == 0
  return workdir


def _copy(run, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(run, workdir)
  return workdir


def test_train_prints_its_last_metrics_and_a_workdir_retrains_from_its_config(
    tmp_path, capsys, recorded, data_builds):
  workdir, cache = tmp_path / "run", tmp_path / "xla"
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(workdir),
                 "--compilation_cache", str(cache), "--coordinator_address", "host:9",
                 "--num_processes", "2", "--process_id", "1"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["workdir"] == str(workdir) and out["step"] == 2
  assert {"loss", "perplexity", "learning_rate", "grad_norm", "tokens_per_s"} <= set(out)
  assert recorded["distributed"] == [("host:9", 2, 1)]
  assert recorded["cache_dirs"] == [str(cache)] and cache.is_dir()
  # The checks build the tokenizer and the task's pairs; the run reuses both.
  assert data_builds == ["make_tokenizer", "build_sources"]
  text = (workdir / "config.gin").read_text()
  assert "ModelConfig.d_model = 32" in text and "TrainConfig.steps = 2" in text
  # No --gin_file: the workdir's config.gin, and --gin. flags still win over it.
  rc = cli.main(["train", "--workdir", str(workdir), "--gin.TrainConfig.steps", "3"])
  assert rc == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3
  assert recorded["distributed"][-1] == (None, None, None)


def test_a_resume_as_another_model_whose_arrays_fit_is_refused(seq2seq_run, tmp_path, capsys):
  """An activation or positions changed on a resume: the arrays fit, the model does not.
  One line naming the fields, exit 2, the workdir as it was. Until 2026-12-04 it resumed
  and wrote the new config.gin, so eval and decode ran the old checkpoints as a model
  they were not trained as (found by a review). The implementation, the compute dtype and
  dropout may change."""
  workdir = _copy(seq2seq_run, tmp_path)
  config = (workdir / "config.gin").read_text()
  capsys.readouterr()
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--gin.TrainConfig.steps=3",
                 "--gin.ModelConfig.mlp='gelu'", "--gin.ModelConfig.pos='rope'",
                 "--workdir", str(workdir)])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1, err
  assert err.startswith(
      f"attnlab train: error: the checkpoints in {workdir}/checkpoints were trained as another "
      "model (ModelConfig.pos: 'sinusoidal' -> 'rope', ModelConfig.mlp: 'relu' -> 'gelu'; "
      "a resume may change only ModelConfig.attention_impl, "), err
  assert err.endswith(f"ModelConfig.max_len). Nothing was changed in {workdir}; resume with the "
                      "workdir's own config.gin, or train in a new workdir\n"), err
  assert (workdir / "config.gin").read_text() == config
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
  # The implementation, the dtypes, dropout, and the biases spelled another way (explicit
  # False where the config said None under use_bias=False) may change.
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--gin.TrainConfig.steps=3",
                 "--gin.ModelConfig.attention_impl='chunked'", "--gin.ModelConfig.dtype='bfloat16'",
                 "--gin.ModelConfig.param_dtype='bfloat16'", "--gin.ModelConfig.qkv_bias=False",
                 "--gin.ModelConfig.dropout_rate=0.1", "--workdir", str(workdir)])
  assert rc == 0, capsys.readouterr().err
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3


def test_a_seq2seq_eval_that_cannot_write_its_predictions_is_one_line(seq2seq_run, tmp_path,
                                                                     capsys, monkeypatch):
  """A read-only workdir (``os.access`` says so, as on a read-only mount, where even root
  cannot write): one line before any work, exit 2; until 2026-12-04 a traceback after the
  whole evaluation (found by a review)."""
  workdir = _copy(seq2seq_run, tmp_path)
  capsys.readouterr()
  access = os.access
  monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and not (
      mode & os.W_OK and str(path).startswith(str(workdir))))
  assert cli.main(["eval", "--workdir", str(workdir)]) == 2
  assert capsys.readouterr().err == (
      f"attnlab eval: error: {workdir}/eval cannot be written (a read-only workdir?): a seq2seq "
      "eval writes its decoded examples there; evaluate a writable copy\n")
  assert not (workdir / "eval").exists()
  # An eval folder that exists is the one checked (here it cannot be written, the workdir can).
  (workdir / "eval").mkdir()
  monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and not (
      mode & os.W_OK and str(path) == str(workdir / "eval")))
  assert cli.main(["eval", "--workdir", str(workdir)]) == 2
  assert capsys.readouterr().err.startswith(f"attnlab eval: error: {workdir}/eval cannot be")
  assert os.listdir(workdir / "eval") == []
  monkeypatch.setattr(os, "access", access)
  # A file in the eval folder's place: one line before any work (a FileExistsError traceback
  # after the whole eval until 2026-12-07, found by a review).
  os.rmdir(workdir / "eval")
  (workdir / "eval").write_text("")
  assert cli.main(["eval", "--workdir", str(workdir)]) == 2
  assert capsys.readouterr().err == (
      f"attnlab eval: error: {workdir}/eval is not a folder: a seq2seq eval writes its decoded "
      "examples there; move it away\n")
  os.remove(workdir / "eval")
  assert cli.main(["eval", "--workdir", str(workdir)]) == 0
  assert json.loads(capsys.readouterr().out)["step"] == 2 and (workdir / "eval").is_dir()


def test_a_save_that_fails_stops_the_run_in_one_line_naming_the_last_good_checkpoint(
    tmp_path, capsys, monkeypatch, warned, request):
  """A full disk at the save of step 2 (orbax's error, as seen on a full tmpfs): exit 1 with
  one line naming the checkpoint that failed, the reason and the one the rerun resumes
  from; the rerun does. The metrics flush fails on the full disk too, after it: logged, it
  does not replace the save's error (found by a review). Until 2026-12-04 ~350 lines of
  orbax thread tracebacks and ours."""
  from attnlab.training import trainer
  from attnlab.training.checkpoint import Checkpointer

  save = Checkpointer.save
  reason = ("RESOURCE_EXHAUSTED: Error writing local file \"w/_sharding\": Failed to write 8 "
            "bytes to file 14: No space left on device [os_error_code='28']")

  def full_disk(self, step, *args, **kw):
    if step == 2:
      raise ValueError(reason)
    return save(self, step, *args, **kw)

  monkeypatch.setattr(Checkpointer, "save", full_disk)
  close = trainer.MetricsWriter.close

  def close_on_a_full_disk(self):
    close(self)
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(trainer.MetricsWriter, "close", close_on_a_full_disk)
  workdir = tmp_path / "w"
  argv = ["train", "--gin_file", CONFIG, *SEQ2SEQ, "--gin.TrainConfig.checkpoint_every=1",
          "--workdir", str(workdir)]
  asyncio_log, root_level = logging.getLogger("asyncio"), logging.getLogger().level
  request.addfinalizer(lambda level=asyncio_log.level: asyncio_log.setLevel(level))
  asyncio_log.setLevel(logging.NOTSET)
  assert cli.main(argv) == 1
  # the loggers are left as they were: until 2026-12-07 asyncio's was set to CRITICAL for
  # good (orbax's reports of a failed save are filtered by checkpoint.py instead:
  # test_train.py's real failed save, test_checkpoint.py's filters)
  assert asyncio_log.level == logging.NOTSET and logging.getLogger().level == root_level
  err = capsys.readouterr().err.splitlines()
  assert err[-1] == (
      f"attnlab train: saving checkpoint 2 in {workdir}/checkpoints failed (ValueError: "
      f"{reason}); the run stopped. Last good checkpoint: 1; free the space (or mend the "
      "cause) and rerun the same command to resume from 1"), err
  assert "Traceback" not in "\n".join(err)
  assert any("closing the MetricsWriter failed too: OSError: [Errno 28]" in m for m in warned())
  monkeypatch.setattr(Checkpointer, "save", save)
  monkeypatch.setattr(trainer.MetricsWriter, "close", close)
  assert cli.main(argv) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["start_step"] == 1


def test_convert_heads_on_a_full_disk_is_one_line_and_leaves_no_to_folder(seq2seq_run,
                                                                          tmp_path, capsys):
  """convert-heads whose save fails on a real write (files capped at 4 KiB with
  RLIMIT_FSIZE, in a process of its own: EFBIG, as ENOSPC on a full disk): one line naming
  the checkpoint and the reason, exit 1, and the --to folder it made (and the parent made for
  it) gone, so the same command runs once the space is there. Until 2026-12-07 orbax's
  traceback, and a half-made --to that the rerun refused ("already exists and is not
  empty")."""
  pytest.importorskip("resource")
  limit = 4 * 1024
  dst = tmp_path / "new" / "mqa"
  argv = ["convert-heads", "--from", str(seq2seq_run), "--to", str(dst), "--num_kv_heads",
          "1", "--method", "mean"]
  line = failed_in_one_line(argv, limit)
  assert re.fullmatch(
      rf"attnlab convert-heads: error: saving checkpoint 0 in {re.escape(str(dst))}/checkpoints "
      r"failed \((ValueError|OSError): .*(\[os_error_code='27'\]|File too large)\); nothing "
      rf"was kept in --to {re.escape(str(dst))}: free the space \(or mend the cause\) and "
      r"rerun the same command", line), line
  assert os.listdir(tmp_path) == [], [os.path.join(d, n) for d, ds, fs in os.walk(tmp_path)
                                      for n in ds + fs]  # --to and its parent: made by it
  assert cli.main(argv) == 0
  assert os.path.isfile(dst / "config.gin")


def test_convert_heads_failing_to_save_into_an_empty_to_folder_keeps_the_folder(
    seq2seq_run, tmp_path, capsys, monkeypatch):
  """An existing empty --to (which convert-heads takes) is kept, emptied, when the save
  fails: a folder that existed before the command is never removed."""
  from attnlab.training.checkpoint import Checkpointer

  save = Checkpointer.save

  def full_disk(self, step, *args, **kw):
    os.makedirs(os.path.join(self.directory, "0.orbax-checkpoint-tmp"))
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(Checkpointer, "save", full_disk)
  dst = tmp_path / "mqa"
  dst.mkdir()
  argv = ["convert-heads", "--from", str(seq2seq_run), "--to", str(dst), "--num_kv_heads",
          "1", "--method", "first"]
  assert cli.main(argv) == 1
  err = capsys.readouterr().err.splitlines()
  assert err[-1] == (
      f"attnlab convert-heads: error: saving checkpoint 0 in {dst}/checkpoints failed "
      f"(OSError: [Errno 28] No space left on device); nothing was kept in --to {dst}: free "
      "the space (or mend the cause) and rerun the same command"), err
  assert dst.is_dir() and os.listdir(dst) == []
  monkeypatch.setattr(Checkpointer, "save", save)
  assert cli.main(argv) == 0


def test_orbax_lines_logged_during_a_save_are_shown_only_if_it_succeeds(caplog):
  """What orbax's threads log while a save runs is held: dropped when the save raises (the
  error says it once), logged after it when it returns. A record from any other file (another
  thread's own absl lines) is shown as it is logged, the save failing or not (until
  2026-12-07 those were held too, and dropped with orbax's)."""
  import logging

  import orbax.checkpoint

  from attnlab.training import checkpoint

  absl = logging.getLogger("absl")
  orbax_file = os.path.join(os.path.dirname(orbax.checkpoint.__file__), "checkpoint_manager.py")

  def orbax_logs(message):
    absl.handle(absl.makeRecord("absl", logging.ERROR, orbax_file, 1, message, (), None))

  with pytest.raises(ValueError, match="disk full"), checkpoint._held_library_errors():
    orbax_logs("a write failed")
    absl.warning("another thread's line")
    assert "another thread's line" in caplog.messages  # at once
    raise ValueError("disk full")
  assert "a write failed" not in caplog.messages
  with checkpoint._held_library_errors():
    orbax_logs("retried and written")
    assert "retried and written" not in caplog.messages
  assert "retried and written" in caplog.messages


def test_an_lm_workdir_evaluates_its_own_files_from_any_folder(tmp_path, capsys, monkeypatch):
  """Relative corpus paths are written absolute into config.gin: an eval run from a folder
  holding other files of the same names reads the run's validation text (until 2026-12-04
  it read that folder's, and reported another loss without a word; found by a review)."""
  for folder, seed in (("a", 0), ("b", 1)):
    corpus = tmp_path / folder / "corpus"
    corpus.mkdir(parents=True)
    for i in range(4):
      words = " ".join(f"w{(i * 7 + j * (seed + 3)) % 50}" for j in range(400))
      (corpus / f"f{i}.txt").write_text(words + "\n")
  monkeypatch.chdir(tmp_path / "a")
  workdir = tmp_path / "w"
  assert cli.main(["train", "--gin_file", LM, *TINY, "--gin.DataConfig.seq_len=16",
                   "--gin.DataConfig.paths=('corpus/*.txt',)",
                   "--gin.DataConfig.validation_percent=50", "--workdir", str(workdir)]) == 0
  assert f"DataConfig.paths = ('{tmp_path}/a/corpus/*.txt',)" in (
      workdir / "config.gin").read_text().splitlines()
  capsys.readouterr()
  losses = []
  for folder in ("a", "b"):
    monkeypatch.chdir(tmp_path / folder)
    assert cli.main(["eval", "--workdir", str(workdir)]) == 0
    losses.append(json.loads(capsys.readouterr().out)["loss"])
  assert losses[0] == losses[1]


def test_train_without_a_config_anywhere_exits_2(tmp_path, capsys):
  assert cli.main(["train", "--workdir", str(tmp_path / "w")]) == 2
  assert capsys.readouterr().err.strip() == (
      "attnlab train: error: at least one --gin_file is needed (or a --workdir with a "
      "config.gin)")
  assert not (tmp_path / "w").exists()


def test_a_resume_that_does_not_fit_is_one_error_line(tmp_path, capsys, monkeypatch):
  def refuse(*args, **kw):
    raise train_command.trainer.ResumeError("the checkpoints in w do not fit this run's model")

  monkeypatch.setattr(train_command.trainer, "train", refuse)
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w")])
  assert rc == 2
  assert capsys.readouterr().err.strip() == (
      "attnlab train: error: the checkpoints in w do not fit this run's model")


def test_a_run_short_of_its_steps_exits_75_and_a_finished_one_0(tmp_path, capsys, monkeypatch):
  """The trainer returns short of TrainConfig.steps only when a signal stopped the run (its
  step saved): exit 75 (EXIT_STOPPED; the same command resumes), the summary printed all
  the same."""
  from attnlab.commands import EXIT_STOPPED

  for step, rc in ((2, EXIT_STOPPED), (3, 0)):
    monkeypatch.setattr(train_command.trainer, "train",
                        lambda *args, step=step, **kw: {"step": step, "loss": 1.5})
    assert cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--gin.TrainConfig.steps=3",
                     "--workdir", str(tmp_path / "w")]) == rc
    assert json.loads(capsys.readouterr().out) == {"workdir": str(tmp_path / "w"),
                                                   "step": step, "loss": 1.5}
  # An unbuffered stdout that takes no line (a full disk): the line on stderr, 75 kept
  # (1 until 2026-12-07's review).
  import errno
  import io

  class Full(io.StringIO):
    def write(self, text):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(train_command.trainer, "train", lambda *args, **kw: {"step": 2})
  monkeypatch.setattr(sys, "stdout", Full())
  assert cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--gin.TrainConfig.steps=3",
                   "--workdir", str(tmp_path / "w")]) == EXIT_STOPPED
  assert "cannot write to standard output: [Errno 28]" in capsys.readouterr().err


def test_the_compilation_cache_is_the_commands_alone(tmp_path, monkeypatch):
  """``--compilation_cache`` sets JAX's process-wide cache folder: until 2026-12-07 it stayed
  set after the command, and every later command and jit of the process (a notebook's)
  wrote its programs there; and JAX, which opens its cache at the first compilation, kept
  the folder it had opened, so a process that had compiled before read and wrote no cache
  for the command. The folder is the command's while it runs (its programs are written
  there, in this process that compiled before), and the process's setting is back after."""
  import jax
  import jax.numpy as jnp

  from attnlab.training import trainer

  before = jax.config.jax_compilation_cache_dir
  during, train = [], trainer.train

  def recorded(*args, **kw):
    during.append(jax.config.jax_compilation_cache_dir)
    return train(*args, **kw)

  monkeypatch.setattr(trainer, "train", recorded)
  cache = tmp_path / "xla_cache"
  least = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every program written
  try:
    jax.jit(lambda x: x + 2)(jnp.arange(3))  # this process has compiled before the command
    assert cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w"),
                     "--compilation_cache", str(cache)]) == 0
    assert during == [str(cache)]
    written = sorted(os.listdir(cache))
    assert any("step" in name for name in written), written
    assert jax.config.jax_compilation_cache_dir == before
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))  # a program of the process's, after it
    assert sorted(os.listdir(cache)) == written
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", least)


def test_what_cannot_run_or_be_written_is_refused_before_the_workdir(tmp_path, capsys):
  """A cudnn model off a GPU is refused by the run check (until 2026-12-04 it wrote the
  workdir, then the first step's trace raised); a workdir under a file is one line (a
  NotADirectoryError traceback). Exit 2 both."""
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w"),
                 "--gin.ModelConfig.attention_impl='cudnn'", "--compilation_cache",
                 str(tmp_path / "xla_cache")])
  # Nor the compilation cache's folder (made before the checks until 2026-12-04).
  assert rc == 2 and not (tmp_path / "w").exists() and not (tmp_path / "xla_cache").exists()
  assert capsys.readouterr().err.strip() == (
      "attnlab train: error: ModelConfig.attention_impl='cudnn' needs a CUDA GPU; the default "
      "backend is 'cpu'. Use 'xla', 'chunked' or 'reference'.")
  (tmp_path / "notes.txt").write_text("x\n")
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir",
                 str(tmp_path / "notes.txt" / "w")])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and err == (
      f"attnlab train: error: --workdir {tmp_path / 'notes.txt' / 'w'}: cannot make this "
      f"directory ({tmp_path / 'notes.txt'} is a file)"), err
  # An incomplete multi-host setting (trained alone without a word until 2026-12-04), before
  # anything is written, the compilation cache folder included.
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w"),
                 "--num_processes", "2", "--compilation_cache", str(tmp_path / "cache")])
  assert rc == 2 and not (tmp_path / "w").exists() and not (tmp_path / "cache").exists()
  assert capsys.readouterr().err.strip() == (
      "attnlab train: error: --num_processes 2 needs --coordinator_address HOST:PORT (or "
      "$JAX_COORDINATOR_ADDRESS): where process 0 listens")
  # A compilation cache that cannot be a folder (a FileExistsError traceback until then).
  notes = tmp_path / "notes.txt"
  link = tmp_path / "link"  # to nothing: a FileExistsError traceback until 2026-12-05
  link.symlink_to(tmp_path / "gone")
  for cache, message in (
      (link, f"--compilation_cache {link}: cannot make this directory ({link} is a symbolic "
             f"link to {tmp_path / 'gone'}, which does not exist)"),
      (notes, f"--compilation_cache {notes} is a file; give a directory"),
      (notes / "c", f"--compilation_cache {notes / 'c'}: cannot make this directory ({notes} "
                    "is a file)")):
    rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w"),
                   "--compilation_cache", str(cache)])
    assert rc == 2 and not (tmp_path / "w").exists()
    assert capsys.readouterr().err.strip() == f"attnlab train: error: {message}"
  # A workdir name the file system cannot hold: one line, nothing made (an OSError traceback,
  # ENAMETOOLONG, from making it until 2026-12-07).
  long = tmp_path / ("w" * 300) / "run"
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(long)])
  assert rc == 2 and sorted(os.listdir(tmp_path)) == ["link", "notes.txt"]
  assert capsys.readouterr().err.strip().startswith(
      f"attnlab train: error: --workdir {long}: cannot make this directory (its name 'wwww")


@pytest.mark.parametrize("param_dtype, nbytes", [("float32", 4 * 3), ("bfloat16", 2 + 4 * 2)])
def test_a_model_too_large_for_memory_is_one_line_naming_its_size(tmp_path, capsys,
                                                                  param_dtype, nbytes):
  """A training state that cannot be allocated (a vocabulary of 2**31 - 1 rows) was a
  RESOURCE_EXHAUSTED traceback from inside JAX until 2026-12-06: one line, exit 2, naming
  the parameters, their bytes with Adam's moments (float32 for bfloat16 parameters: counted
  in bfloat16 until 2026-12-07) and the sizes; the workdir is not made."""
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w"),
                 "--gin.ModelConfig.vocab_size=2147483647", "--gin.ModelConfig.d_model=16",
                 "--gin.ModelConfig.d_ff=16", "--gin.ModelConfig.num_layers=1",
                 f"--gin.ModelConfig.param_dtype='{param_dtype}'"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and not (tmp_path / "w").exists(), err
  assert re.fullmatch(
      r"attnlab train: error: the training state does not fit in memory \(RESOURCE_EXHAUSTED: "
      r"Out of memory allocating \d+ bytes\.\): (\d[\d,]+) parameters, ([\d.]+) GiB with the "
      r"optimizer's moments \(ModelConfig vocab_size=2147483647, d_model=16, d_ff=16, "
      r"num_layers=1, max_len=\d+\); make the model smaller or shard it over more devices "
      r"\(TrainConfig.mesh_shape\)", err), err
  count = int(re.search(r"\): ([\d,]+) parameters", err)[1].replace(",", ""))
  table = 16 * (2**31 - 1)  # the one embedding table (tied, shared by encoder and decoder)
  assert table < count < table + 10**5  # and the small layers
  assert float(re.search(r"([\d.]+) GiB", err)[1]) == round(count * nbytes / 2**30, 1)


@pytest.mark.parametrize("read, wrapped", [("restore", False), ("restore_params", False),
                                           ("restore", True)])
def test_a_resume_whose_state_does_not_fit_in_memory_is_one_line(tmp_path, capsys,
                                                                 monkeypatch, read, wrapped):
  """A resume reads its state from the checkpoint without initializing one first (since
  2026-12-07), so an allocation that fails does so in the read: the same one line as a
  fresh run's, exit 2, for a full checkpoint and a weights-only one, and for XLA's error
  as the cause of orbax's own; the workdir as it was."""
  import jax

  from attnlab.training.checkpoint import Checkpointer

  workdir = tmp_path / "w"
  assert cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(workdir)]) == 0
  if read == "restore_params":
    monkeypatch.setattr(Checkpointer, "has_train_state", lambda self, step: False)

  def out_of_memory(self, *args, **kw):
    e = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 64 bytes.")
    if not wrapped:
      raise e
    raise Exception("orbax: restoring failed") from e

  monkeypatch.setattr(Checkpointer, read, out_of_memory)
  files = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
  capsys.readouterr()
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(workdir),
                 "--gin.TrainConfig.steps=3"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and re.fullmatch(
      r"attnlab train: error: the training state does not fit in memory \(RESOURCE_EXHAUSTED: "
      r"Out of memory allocating 64 bytes\.\): [\d,]+ parameters, [\d.]+ GiB with the "
      r"optimizer's moments \(ModelConfig vocab_size=\d+, d_model=32, d_ff=64, num_layers=1, "
      r"max_len=\d+\); make the model smaller or shard it over more devices "
      r"\(TrainConfig.mesh_shape\)", err), err
  assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == files


def test_a_batch_larger_than_the_machines_memory_is_one_line(tmp_path, capsys):
  """batch_size=2**40 was a NumPy MemoryError traceback while the first batches were made
  (until 2026-12-06): refused before anything is written, naming batch_size and seq_len. The
  bound is the token ids and targets alone, int32 [B, T + 1] twice."""
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w"),
                 "--gin.DataConfig.batch_size=1099511627776"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and not (tmp_path / "w").exists(), err
  assert re.fullmatch(r"attnlab train: error: a batch of batch_size=1099511627776 rows of "
                      r"seq_len=\d+ takes at least [\d.]+ GiB on the host \(int32 token ids and "
                      r"targets\), more than this machine's memory \([\d.]+ GiB\): give a "
                      r"smaller DataConfig.batch_size", err), err
  dcfg = gin_config.parse([CONFIG], [])[1]
  need = 2 * 4 * dcfg.batch_size * (dcfg.seq_len + 1)
  train_command.check_batch_fits_memory(dcfg, memory=need)  # exactly enough
  with pytest.raises(ValueError, match=f"^a batch of batch_size={dcfg.batch_size} rows"):
    train_command.check_batch_fits_memory(dcfg, memory=need - 1)


def test_a_run_whose_config_gin_sets_fields_its_task_does_not_read_still_evaluates(
    seq2seq_run, tmp_path, capsys, warned):
  """A workdir trained before 2026-12-06 may name a DataConfig field its task did not read
  (taken, and ignored, then): eval (decode, resume and the conversions read config.gin the
  same way) reads it as the default, with a warning, where it refused the whole workdir."""
  run = tmp_path / "run"
  shutil.copytree(seq2seq_run, run)
  with open(run / "config.gin", "a") as f:
    f.write("\nDataConfig.validation_percent = 10\n")
  rc = cli.main(["eval", "--workdir", str(run)])
  out, err = capsys.readouterr()
  assert rc == 0 and "exact_match" in out, err
  assert any("DataConfig.validation_percent = 10, which task='reverse' with tokenizer='byte' "
             "does not read" in w for w in warned()), warned()
  # ... and resumes from its own config.gin (train --workdir alone, or --gin_file naming it),
  # where a binding of such a field is the user's and refused
  rc = cli.main(["train", "--workdir", str(run), "--gin.DataConfig.max_files=3"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and err.endswith("max_files=3 does not apply to task='reverse' (its examples "
                                  "are drawn from seed, min_len, max_len and vocab_chars); "
                                  "leave it at 0"), err
  for flags in ([], ["--gin_file", str(run / "config.gin")]):
    steps = 3 if not flags else 4
    rc = cli.main(["train", "--workdir", str(run), *flags, f"--gin.TrainConfig.steps={steps}"])
    out, err = capsys.readouterr()
    assert rc == 0 and f'"step": {steps}' in out, err
  assert "DataConfig.validation_percent = 5" in (run / "config.gin").read_text()


def test_a_validation_set_larger_than_the_machines_memory_is_one_line(seq2seq_run, tmp_path,
                                                                      capsys, monkeypatch):
  """A synthetic task's validation set has no end: eval_batches=10**9 built batches until
  memory ran out (until 2026-12-06), in train and in eval. Refused by name (train: before
  anything is written); the bound is eval_batches x a batch's int32 token ids and targets.
  The commands run on a machine made to have 64 KiB (so the code before fails fast)."""
  dcfg = gin_config.parse([CONFIG], [])[1]
  with pytest.raises(ValueError) as e:
    pipeline.check_validation_fits_memory(dcfg, 10**9)  # this machine's memory
  need = 10**9 * 2 * 4 * dcfg.batch_size * (dcfg.seq_len + 1)
  assert str(e.value) == (
      f"TrainConfig.eval_batches=1000000000 validation batches of batch_size={dcfg.batch_size} "
      f"x seq_len={dcfg.seq_len} take at least {need / 2**30:.1f} GiB on the host (int32 token "
      "ids and targets, kept for every evaluation), more than this machine's memory "
      f"({pipeline.physical_memory_bytes() / 2**30:.1f} GiB): give fewer eval_batches")
  monkeypatch.setattr(pipeline, "physical_memory_bytes", lambda: 2**16)
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w"),
                 "--gin.TrainConfig.eval_every=1", "--gin.TrainConfig.eval_batches=1000"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and not (tmp_path / "w").exists(), err
  pattern = (r"attnlab (train|eval): error: TrainConfig.eval_batches=1000 validation batches "
             r"of batch_size=4 x seq_len=\d+ take at least [\d.]+ GiB on the host \(int32 "
             r"token ids and targets, kept for every evaluation\), more than this machine's "
             r"memory \(0.0 GiB\): give fewer eval_batches")
  assert re.fullmatch(pattern, err), err
  # eval of a run whose config.gin asks for them (its training did not evaluate)
  run = tmp_path / "run"
  shutil.copytree(seq2seq_run, run)
  with open(run / "config.gin", "a") as f:
    f.write("\nTrainConfig.eval_batches = 1000\n")
  rc = cli.main(["eval", "--workdir", str(run)])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and re.fullmatch(pattern, err), err
  # the run check of train, ablate and convert-heads; also for a run that does not evaluate
  # as it trains (`attnlab eval` reads the same eval_batches: until 2026-12-06 such a run
  # trained to its end and then could not be evaluated)
  mcfg, dcfg, tcfg = gin_config.parse([CONFIG], [])
  for eval_every in (1, 0):
    many = dataclasses.replace(tcfg, eval_every=eval_every, eval_batches=1000)
    with pytest.raises(ValueError, match=r"^TrainConfig.eval_batches=1000 validation"):
      train_command.trainer_run_check(mcfg, many, dcfg)
  train_command.trainer_run_check(mcfg, dataclasses.replace(many, eval_batches=1), dcfg)
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w0"),
                 "--gin.TrainConfig.eval_every=0", "--gin.TrainConfig.eval_batches=1000"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and not (tmp_path / "w0").exists() and re.fullmatch(pattern, err), err
  # the bound, exactly
  need = 7 * 2 * 4 * dcfg.batch_size * (dcfg.seq_len + 1)
  pipeline.check_validation_fits_memory(dcfg, 7, memory=need)
  with pytest.raises(ValueError, match="^TrainConfig.eval_batches=7 validation batches"):
    pipeline.check_validation_fits_memory(dcfg, 7, memory=need - 1)


def test_an_eval_or_decode_past_memory_is_one_line(seq2seq_run, tmp_path, capsys):
  """A beam within the int32 bound of its candidates but past memory was XLA's
  RESOURCE_EXHAUSTED traceback in eval and decode (until 2026-12-06): one line, exit 2,
  naming the flags that size it. Any other exception is not taken for it."""
  workdir = _copy(seq2seq_run, tmp_path)
  capsys.readouterr()
  assert cli.main(["eval", "--workdir", str(workdir), "--beam_size", "8000000"]) == 2
  err = capsys.readouterr().err.strip()
  assert re.fullmatch(r"attnlab eval: error: out of memory evaluating \(RESOURCE_EXHAUSTED: "
                      r"Out of memory allocating \d+ bytes\.\): give a narrower --beam_size, or "
                      r"more devices with --mesh_shape", err), err
  assert cli.main(["decode", "--workdir", str(workdir), "--prompt", "abc",
                   "--beam_size", "8000000"]) == 2
  err = capsys.readouterr().err.strip()
  assert re.fullmatch(r"attnlab decode: error: out of memory decoding 1 prompt\(s\) at once "
                      r"\(RESOURCE_EXHAUSTED: Out of memory allocating \d+ bytes\.\): decode "
                      r"fewer at a time \(--slots N serves them N at a time\), with a narrower "
                      r"--beam_size or a smaller --max_new_tokens", err), err
  import jax

  assert _common.out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory"
                                                          "\nmore")) == (
      "RESOURCE_EXHAUSTED: Out of memory")
  assert _common.out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something")) is None
  assert _common.out_of_memory(MemoryError("RESOURCE_EXHAUSTED")) is None


def test_train_exits_1_on_a_non_finite_stop(tmp_path, capsys):
  rc = cli.main(["train", "--gin_file", CONFIG, *SEQ2SEQ, "--workdir", str(tmp_path / "w"),
                 "--gin.TrainConfig.learning_rate=1e30", "--gin.TrainConfig.schedule='constant'",
                 "--gin.TrainConfig.warmup_steps=0", "--gin.TrainConfig.grad_clip=0.0"])
  assert rc == 1
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith("attnlab train: non-finite loss") and "at step 2; stopped" in err
  # A finite loss and gradient, an update past float32 (a rate of 1e39 is inf there): the
  # update is named (until 2026-12-05 the message named the loss and the norm, both finite).
  # The step flags it (test_train_loop.py); what the stop says of it:
  from attnlab.training import trainer

  m = {"loss": 5.71377, "grad_norm": 2.5, "learning_rate": float("inf")}
  assert trainer._nonfinite_what(m) == (
      "non-finite parameter update (the loss 5.71377 and gradient norm 2.5 are finite; "
      "learning rate inf)")
  assert trainer._nonfinite_what(dict(m, grad_norm=float("nan"))) == (
      "non-finite loss (5.71377) or gradient norm (nan)")


def test_an_lm_run_checks_its_corpus_before_writing(tmp_path, capsys, data_builds):
  """An LM task's files are listed before the workdir exists: none is one error line.
  A run reads its tokenizer once (the checks' is reused) and its corpus once."""
  empty = tmp_path / "nothing"
  empty.mkdir()
  argv = ["train", "--gin_file", LM, *TINY, "--gin.DataConfig.seq_len=16"]
  rc = cli.main([*argv, f"--gin.DataConfig.paths=('{empty}/*.py',)", "--workdir",
                 str(tmp_path / "w")])
  assert rc == 2 and not (tmp_path / "w").exists()
  assert capsys.readouterr().err.strip() == f"attnlab train: error: no files match '{empty}/*.py'"
  # A corpus shorter than one row: found by the run (which reads it), before it writes.
  (empty / "a.py").write_text("x = 1\n")
  rc = cli.main([*argv, f"--gin.DataConfig.paths=('{empty}/*.py',)",
                 "--gin.DataConfig.validation_percent=0", "--workdir", str(tmp_path / "w")])
  assert rc == 2 and not (tmp_path / "w").exists()
  assert capsys.readouterr().err.strip() == (
      f"attnlab train: error: the train split ({empty}/a.py; validation_percent=0) has 8 "
      "tokens, fewer than one row of seq_len=16 needs (17)")
  data_builds.clear()
  (empty / "a.py").write_text("print('hello')\n" * 200)
  (empty / "b.py").write_text("x = [i * i for i in range(10)]\n" * 200)
  rc = cli.main([*argv, f"--gin.DataConfig.paths=('{empty}/*.py',)",
                 "--gin.DataConfig.validation_percent=50", "--workdir", str(tmp_path / "w")])
  assert rc == 0 and json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 2
  assert data_builds == ["make_tokenizer", "build_sources"]


def test_the_run_check_reads_each_kind_of_source(tmp_path, monkeypatch):
  """LM: the file list only (reading a corpus is the run's job); TSV and synthetic tasks:
  their sources, built with the check's tokenizer and handed on with it to the run."""
  from attnlab import config_gin

  seen = []
  monkeypatch.setattr(train_command.text, "lm_files", lambda *a, **kw: seen.append("lm_files"))
  built = {"validation": types.SimpleNamespace(size=10)}  # a set with an end: nothing to bound
  monkeypatch.setattr(train_command.pipeline, "build_sources",
                      lambda dcfg, mcfg, tok: seen.append(("build_sources", dcfg.task, tok))
                      or (built, tok))
  returned = []
  for config in (LM, CONFIG):
    mcfg, dcfg, tcfg = config_gin.parse([config], [])
    returned.append(train_command.trainer_run_check(mcfg, tcfg, dcfg))
  (lm_sources, lm_tok), (sources, tok) = returned
  assert lm_sources is None and lm_tok.vocab_size == 259
  assert seen == ["lm_files", ("build_sources", "reverse", tok)] and sources is built
  # An hf_json tokenizer gets its file and DataConfig's special ids (the run trains with the
  # tokenizer the check built).
  from tests.data.hf_tokenizer import word_level_tokenizer_json

  path = word_level_tokenizer_json(tmp_path / "tokenizer.json", ["<pad>", "a", "b", "c"])
  mcfg, dcfg, tcfg = config_gin.parse([LM], [])
  dcfg = dataclasses.replace(dcfg, tokenizer="hf_json", tokenizer_model=path, bos_id=2,
                             eos_id=3)
  _, hf_tok = train_command.trainer_run_check(mcfg, tcfg, dcfg)
  assert (type(hf_tok).__name__, hf_tok.bos_id, hf_tok.eos_id, hf_tok.vocab_size) == (
      "HFJsonTokenizer", 2, 3, 4)


def test_eval_reads_the_step_and_cache_flags(tmp_path, capsys, monkeypatch, recorded):
  calls = []
  monkeypatch.setattr(train_command.trainer, "evaluate_workdir",
                      lambda workdir, step, **kw: calls.append((workdir, step, *kw.items()))
                      or {"step": step})
  monkeypatch.chdir(tmp_path)
  # A folder that is not a training workdir is named before the cache's folder is made
  # (until 2026-12-06 `--compilation_cache WORKDIR/xla_cache` made a mistyped WORKDIR).
  assert cli.main(["eval", "--workdir", "w", "--compilation_cache", "w/xla_cache"]) == 2
  assert capsys.readouterr().err.strip() == (
      "attnlab eval: error: w/config.gin does not exist: not a training workdir")
  assert not (tmp_path / "w").exists() and not calls and recorded["cache_dirs"] == []
  (tmp_path / "w").mkdir()
  (tmp_path / "w" / "config.gin").write_text("")
  assert cli.main(["eval", "--workdir", "w", "--step", "4", "--compilation_cache",
                   str(tmp_path / "c")]) == 0
  # the penalty unused without a beam; the run's own mesh
  greedy = (("beam_size", None), ("length_penalty", 0.6), ("mesh_shape", None))
  assert calls == [("w", 4, *greedy)] and json.loads(capsys.readouterr().out) == {"step": 4}
  assert recorded["cache_dirs"] == [str(tmp_path / "c")]
  assert cli.main(["eval", "--workdir", "w"]) == 0 and calls[-1] == ("w", None, *greedy)
  assert cli.main(["eval"]) == 2
  assert "the following arguments are required: --workdir" in capsys.readouterr().err
  # Beam search: its width, and the paper's alpha unless given.
  assert cli.main(["eval", "--workdir", "w", "--beam_size", "4"]) == 0
  assert calls[-1] == ("w", None, ("beam_size", 4), ("length_penalty", 0.6), ("mesh_shape", None))
  assert cli.main(["eval", "--workdir", "w", "--beam_size", "2", "--length_penalty", "1"]) == 0
  assert calls[-1] == ("w", None, ("beam_size", 2), ("length_penalty", 1.0), ("mesh_shape", None))
  capsys.readouterr()
  assert cli.main(["eval", "--workdir", "w", "--length_penalty", "1"]) == 2
  assert capsys.readouterr().err.strip() == (
      "attnlab eval: error: --length_penalty is the beam search's: give --beam_size too")
  # Another mesh than the run's (a run trained on 8 devices, evaluated on one).
  assert cli.main(["eval", "--workdir", "w", "--mesh_shape", "1,-1,1"]) == 0
  assert calls[-1] == ("w", None, *greedy[:2], ("mesh_shape", (1, -1, 1)))
  for bad in ("1,1", "1,x,1", "0,1,1"):
    assert cli.main(["eval", "--workdir", "w", "--mesh_shape", bad]) == 2
    assert capsys.readouterr().err.strip() == (
        f"attnlab eval: error: --mesh_shape={bad}: give 3 comma-separated positive ints (data, "
        "fsdp, tensor), at most one -1")
  assert len(calls) == 5


def test_gin_flags_take_both_forms_and_keep_equals_signs_in_values():
  bindings, rest = _common.split_gin_flags(
      ["--workdir", "w", "--gin.A.x=1", "--gin.B.y", "'a=b'", "--gin.C.z=f(k=2)", "-v"])
  assert bindings == ["A.x = 1", "B.y = 'a=b'", "C.z = f(k=2)"]
  assert rest == ["--workdir", "w", "-v"]
  with pytest.raises(_common.CommandError, match=r"^--gin.A.x needs a value: --gin.NAME=VALUE$"):
    _common.split_gin_flags(["--gin.A.x"])
  # The next flag is not its value (it bound A.x to "--workdir", and then named the
  # missing --workdir).
  with pytest.raises(_common.CommandError, match=r"^--gin.A.x needs a value: --gin.NAME=VALUE$"):
    _common.split_gin_flags(["--gin.A.x", "--workdir", "w"])
  assert _common.split_gin_flags(["--gin.A.x", "-1"])[0] == ["A.x = -1"]  # a negative value
  with pytest.raises(_common.CommandError, match=r"^at least one --gin_file is needed$"):
    _common.parse_gin([], [])


def test_the_compilation_cache_flag_sets_the_jax_option(tmp_path, monkeypatch, recorded):
  """None leaves the option alone; a path is made (or may exist already) and set, absolute."""
  _common.use_compilation_cache(None)
  assert recorded["cache_dirs"] == []
  monkeypatch.chdir(tmp_path)
  _common.use_compilation_cache("c")
  _common.use_compilation_cache("c")
  assert (tmp_path / "c").is_dir()
  assert recorded["cache_dirs"] == [str(tmp_path / "c")] * 2
  _common.restore_compilation_cache()  # as cli.main does after a command


def test_commands_running_at_once_in_threads_keep_the_compilation_cache_until_the_last_ends(
    tmp_path, monkeypatch):
  """A ``train --compilation_cache C`` and an ``eval`` without the flag in threads, the eval
  ending first: C stays JAX's cache folder until the train ends, then the caller's is back
  (until 2026-12-07 any command that ended put the folder back under a running one)."""
  import threading

  import jax

  before = jax.config.jax_compilation_cache_dir
  folder = str(tmp_path / "c")
  started, eval_done = threading.Event(), threading.Event()
  seen = {}
  fake = types.ModuleType("attnlab.commands.fake")

  def main(argv):
    if argv == ["train"]:
      _common.use_compilation_cache(folder)
      started.set()
      assert eval_done.wait(60)
      seen["train, the eval ended"] = jax.config.jax_compilation_cache_dir
    else:
      assert started.wait(60)
    return 0

  fake.main = main
  monkeypatch.setitem(sys.modules, "attnlab.commands.fake", fake)
  monkeypatch.setitem(cli.COMMANDS, "fake", ("fake", "a test command"))

  def run(which):
    assert cli.main(["fake", which]) == 0
    if which == "eval":
      eval_done.set()

  threads = [threading.Thread(target=run, args=(w,)) for w in ("train", "eval")]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert seen == {"train, the eval ended": folder}
  assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (1024 ** 2 * 3, "3.00 MiB"), (1024 ** 3, "1.00 GiB"), (1024 ** 4 * 2.5, "2.50 TiB"),
    (1024 ** 5, "1024.00 TiB"),
    # The unit after rounding (until 2026-12-04 "1024.00 KiB" and "1024 B").
    (1024 ** 2 - 1, "1.00 MiB"), (1024 ** 2 - 6, "1023.99 KiB"), (1024 ** 3 - 1, "1.00 GiB"),
    (1023.6, "1.00 KiB"), (1023.4, "1023 B")])
def test_byte_units(n, text):
  assert kv_size.format_bytes(n) == text


def test_kv_size_defaults_to_bfloat16_and_counts_bytes_per_token(capsys):
  assert cli.main(["kv-size", "--layers", "2", "--seq", "6", "--kv_heads", "3",
                   "--head_dim", "8", "--batch", "5"]) == 0
  # 2 (K and V) x 2 layers x 3 heads x 8 dims x 2 bytes = 192 bytes a token; x 30 tokens
  assert capsys.readouterr().out.strip() == (
      "5.62 KiB (5760 bytes; 192 bytes per token; batch 5 x 6 tokens)")
  assert cli.main(["kv-size", "--layers", "2", "--seq", "6", "--kv_heads", "3",
                   "--head_dim", "8", "--dtype", "bf16"]) == 2
  assert "invalid choice: 'bf16'" in capsys.readouterr().err
  # float8: no cache attnlab builds (until 2026-12-04 it was offered and counted 1 byte)
  assert cli.main(["kv-size", "--layers", "2", "--seq", "6", "--kv_heads", "3",
                   "--head_dim", "8", "--dtype", "float8"]) == 2
  err = capsys.readouterr().err  # argparse quotes the choices or not, by Python version
  assert "invalid choice: 'float8' (choose from " in err
  assert re.sub("'", "", err).endswith("(choose from bfloat16, float16, float32, int8)\n"), err


def test_commands_log_attnlab_at_info_and_the_libraries_from_warning(tmp_path, capsys):
  """``attnlab train`` logs its own lines (progress, checkpoints) at INFO and orbax's and
  JAX's from WARNING up: at INFO orbax wrote ~70 lines a checkpoint to stderr, burying the
  progress lines (before 2026-12-04). A --workdir that is a file is one line, exit 2."""
  import logging

  root, ours = logging.getLogger(), logging.getLogger("attnlab")
  saved = (list(root.handlers), root.level, ours.level)
  root.handlers[:] = []
  try:
    # Parsing a file whose include misses the first folder gin searches (gin logs the miss
    # through logging's module functions) leaves the root logger without a handler, so the
    # command's own format holds: until 2026-12-06 gin's basicConfig came first, and lines
    # read "WARNING:attnlab.training.trainer: ...".
    (tmp_path / "mine.gin").write_text("include 'models/llama_tiny.gin'\n")
    gin_config.parse([str(tmp_path / "mine.gin")], [])
    assert root.handlers == []
    _common.log_attnlab_info()
    assert [h.formatter._fmt for h in root.handlers] == ["%(message)s"]
    assert logging.getLogger("attnlab.training.trainer").isEnabledFor(logging.INFO)
    for library in ("orbax.checkpoint", "absl", "jax._src.xla_bridge"):
      assert not logging.getLogger(library).isEnabledFor(logging.INFO), library
      assert logging.getLogger(library).isEnabledFor(logging.WARNING), library
  finally:
    _common.restore_logging()  # as cli.main does after a command
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    ours.setLevel(saved[2])
  afile = tmp_path / "afile"
  afile.write_text("")
  assert cli.main(["train", "--gin_file", CONFIG, "--workdir", str(afile)]) == 2
  assert capsys.readouterr().err.strip() == (
      f"attnlab train: error: --workdir {afile} is a file, not a directory")


def test_a_run_that_cannot_write_its_other_files_stops_in_one_line(tmp_path, capsys,
                                                                   monkeypatch):
  """A full disk under metrics.jsonl at step 2's log (the step saved first, as for any crash
  outside the step), a directory in config.gin's place, a file in the TensorBoard folder's:
  exit 1 with one line naming the error and the checkpoint the rerun resumes from; the rerun
  does. Until 2026-12-07 each was a traceback (found by a review)."""
  from attnlab.training import trainer

  workdir = tmp_path / "w"
  argv = ["train", "--gin_file", CONFIG, *SEQ2SEQ, "--gin.TrainConfig.steps=3",
          "--gin.TrainConfig.checkpoint_every=0", "--workdir", str(workdir)]
  write = trainer.MetricsWriter.write

  def full_disk(self, step, *args, **kw):
    if step == 2:
      raise OSError(28, "No space left on device")
    return write(self, step, *args, **kw)

  monkeypatch.setattr(trainer.MetricsWriter, "write", full_disk)
  assert cli.main(argv) == 1
  err = capsys.readouterr().err
  assert err.splitlines()[-1] == (
      "attnlab train: logging or evaluating step 2 failed (OSError: [Errno 28] No space left "
      "on device); the run stopped. Checkpoint 2 saved; free the space (or mend the cause) and "
      "rerun the same command to resume from 2"), err
  assert "Traceback" not in err and "before the error below" not in err
  monkeypatch.setattr(trainer.MetricsWriter, "write", write)
  os.remove(workdir / "config.gin")
  os.mkdir(workdir / "config.gin")
  assert cli.main(argv) == 1
  err = capsys.readouterr().err
  assert err.splitlines()[-1].startswith(
      "attnlab train: writing the run's files failed (IsADirectoryError: [Errno 21] Is a "
      "directory: "), err
  assert err.splitlines()[-1].endswith(
      "the run stopped. Last good checkpoint: 2; free the space (or mend the cause) and rerun "
      "the same command to resume from 2"), err
  os.rmdir(workdir / "config.gin")
  shutil.rmtree(workdir / "tensorboard")
  (workdir / "tensorboard").write_text("")
  assert cli.main(argv) == 1
  assert "(NotADirectoryError: [Errno 20] Not a directory: " in capsys.readouterr().err
  os.remove(workdir / "tensorboard")
  assert cli.main(argv) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["start_step"] == 2
