"""The sweep's bookkeeping by hand, without training: the arms a sweep plans, the configs of
each run, the result files and wall-time counter, the progress line's durations.
(`test_ablate.py` runs sweeps end to end.)"""

import dataclasses
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attnlab import config_gin
from attnlab.config import DataConfig, ModelConfig, Sweep, TrainConfig
from attnlab.data.tokenizer import ByteTokenizer
from attnlab.training import sweep as sweep_lib
from attnlab.training.sweep import Arm
from tests.data.hf_tokenizer import word_level_tokenizer_json
from tests.fifos import released_after

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def base(num_heads=8, **kw):
  return ModelConfig(vocab_size=40, d_model=32, num_layers=1, num_heads=num_heads,
                     head_dim=4, d_ff=64, **kw)


@pytest.mark.parametrize("num_heads, ks", [(8, [8, 4, 2, 1]), (6, [6, 3, 1]), (12, [12, 6, 3, 1]),
                                           (1, [1]), (5, [5, 1])])
def test_default_arms_halve_the_kv_heads_down_to_mqa(num_heads, ks):
  arms = sweep_lib.plan(Sweep(), base(num_heads))
  assert [a.num_kv_heads for a in arms] == ks
  names = ["mha"] + [f"gqa{k}" for k in ks[1:-1]] + ["mqa"] if len(ks) > 1 else ["mha"]
  assert [a.name for a in arms] == names
  assert {(a.kind, a.method, a.d_ff) for a in arms} == {("scratch", "", 64)}


def test_uptrain_arms_follow_the_scratch_arms_one_per_k_and_method():
  """Uptraining arms keep the MHA arm's d_ff (they are converted from it), also when the
  scratch arms are matched; K = N converts MHA to itself (a sanity arm)."""
  arms = sweep_lib.plan(Sweep(num_kv_heads=(8, 2), uptrain_num_kv_heads=(2, 1, 8),
                              uptrain_methods=("mean", "first"), match_params=True), base())
  assert [(a.name, a.num_kv_heads, a.kind, a.method) for a in arms] == [
      ("mha", 8, "scratch", ""), ("gqa2", 2, "scratch", ""),
      ("uptrain-mean-gqa2", 2, "uptrain", "mean"), ("uptrain-first-gqa2", 2, "uptrain", "first"),
      ("uptrain-mean-mqa", 1, "uptrain", "mean"), ("uptrain-first-mqa", 1, "uptrain", "first"),
      ("uptrain-mean-mha", 8, "uptrain", "mean"), ("uptrain-first-mha", 8, "uptrain", "first")]
  assert arms[1].d_ff > 64 and [a.d_ff for a in arms[2:]] == [64] * 6
  assert sweep_lib.mha_arm(arms, base()) == arms[0]
  assert sweep_lib.mha_arm(arms[1:], base()) is None


@pytest.mark.parametrize("sweep, message", [
    (Sweep(num_kv_heads=(3,)), "num_kv_heads=3 must divide num_heads=8 of the base model"),
    (Sweep(num_kv_heads=(16,)), "num_kv_heads=16 must divide num_heads=8 of the base model"),
    (Sweep(num_kv_heads=(4, 2), uptrain_num_kv_heads=(1,)),
     "uptrain_num_kv_heads=(1,) needs the MHA arm (num_kv_heads=8) in num_kv_heads=(4, 2): "
     "it is the source"),
    (Sweep(num_kv_heads=(8,), uptrain_num_kv_heads=(3,)),
     "uptrain_num_kv_heads=3 must divide num_heads=8 of the base model"),
    (Sweep(num_kv_heads=(8,), uptrain_num_kv_heads=(16,)),
     "uptrain_num_kv_heads=16 must divide num_heads=8 of the base model"),
])
def test_plan_refuses_arms_it_cannot_build(sweep, message):
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    sweep_lib.plan(sweep, base())


def test_matched_arms_widen_the_ffn_to_the_mha_parameter_count():
  mcfg = base()
  arms = sweep_lib.plan(Sweep(num_kv_heads=(8, 2, 1), match_params=True), mcfg)
  mha = sweep_lib.param_counts(mcfg)[0]
  assert arms[0].d_ff == 64
  for arm in arms[1:]:
    assert arm.d_ff > 64
    got = sweep_lib.param_counts(mcfg.replace(num_kv_heads=arm.num_kv_heads, d_ff=arm.d_ff))[0]
    # The closest d_ff: one more or one less is no closer.
    for other in (arm.d_ff - 1, arm.d_ff + 1):
      near = sweep_lib.param_counts(mcfg.replace(num_kv_heads=arm.num_kv_heads, d_ff=other))[0]
      assert abs(got - mha) <= abs(near - mha)
  with pytest.raises(ValueError, match=re.escape(
      "match_params: num_kv_heads=1 cannot match the MHA arm's 100 parameters within 1% by "
      "d_ff (best d_ff=1: ")):
    sweep_lib.matched_d_ff(mcfg.replace(num_kv_heads=1), 100)
  # Below what d_ff=1 gives, by 30%: refused too (the best is 43% off).
  smallest = sweep_lib.param_counts(mcfg.replace(num_kv_heads=1, d_ff=1))[0]
  with pytest.raises(ValueError, match="cannot match the MHA arm's"):
    sweep_lib.matched_d_ff(mcfg.replace(num_kv_heads=1), int(0.7 * smallest))


def test_param_counts_split_out_the_attention():
  """(all, attention): per layer q / o are D x N x H, k / v D x K x H; the rest is the
  embedding, the MLP and the norms."""
  D, N, K, H, F, V = 32, 8, 2, 4, 64, 40
  attn = D * N * H * 2 + D * K * H * 2
  rest = V * D + 3 * D * F + 2 * D + D  # tied embedding, SwiGLU, two norms, the final norm
  assert sweep_lib.param_counts(base(num_kv_heads=K)) == (attn + rest, attn)


def test_param_counts_build_each_config_once(monkeypatch):
  """A report counts every arm on each call: an equal config is counted from the first
  count (each traced a whole model build until 2026-12-05), another config anew."""
  built = []
  abstract = sweep_lib.abstract_model
  monkeypatch.setattr(sweep_lib, "abstract_model", lambda m: built.append(m) or abstract(m))
  cfg = base(num_kv_heads=2).replace(d_ff=77)
  want = sweep_lib.param_counts(cfg)
  assert sweep_lib.param_counts(base(num_kv_heads=2).replace(d_ff=77)) == want and len(built) == 1
  assert sweep_lib.param_counts(cfg.replace(d_ff=78))[0] == want[0] + 3 * 32
  assert len(built) == 2


def train(**kw):
  return TrainConfig(**{"steps": 1000, "warmup_steps": 100, "log_every": 50, **kw})


def test_a_scratch_run_keeps_the_base_schedule_and_takes_the_seed():
  sweep = Sweep(curve_points=8)
  arm = Arm("gqa2", 2, d_ff=96)
  m, d, t = sweep_lib.run_configs(sweep, arm, 3, base(), DataConfig(seed=0), train())
  assert (m.num_kv_heads, m.d_ff, d.seed, t.seed) == (2, 96, 3, 3)
  assert (t.steps, t.warmup_steps, t.log_every, t.progress) == (1000, 100, 50, False)
  assert t.eval_every == 1000 // 8
  _, _, t = sweep_lib.run_configs(sweep, arm, 3, base(), DataConfig(), train(eval_every=7))
  assert t.eval_every == 7
  _, _, t = sweep_lib.run_configs(Sweep(curve_points=50), arm, 0, base(), DataConfig(),
                                  train(steps=20, warmup_steps=2))
  assert t.eval_every == 1
  _, _, t = sweep_lib.run_configs(sweep, arm, 0, base(), DataConfig(),
                                  train(steps=20, warmup_steps=2, log_every=10))
  assert t.log_every == 10  # a scratch run logs as the base says


def test_an_uptrain_run_is_a_fraction_of_the_steps_and_warmup():
  sweep = Sweep(uptrain_fraction=0.05, curve_points=10)
  arm = Arm("uptrain-mean-mqa", 1, "uptrain", "mean", 64)
  _, _, t = sweep_lib.run_configs(sweep, arm, 0, base(), DataConfig(), train())
  assert (t.steps, t.warmup_steps, t.eval_every) == (50, 5, 5)
  assert t.log_every == 50 // 4  # a few throughput windows after the first
  _, _, t = sweep_lib.run_configs(sweep, arm, 0, base(), DataConfig(), train(log_every=3))
  assert t.log_every == 3
  _, _, t = sweep_lib.run_configs(sweep, arm, 0, base(), DataConfig(), train(log_every=0))
  assert t.log_every == 0
  _, _, t = sweep_lib.run_configs(Sweep(uptrain_fraction=0.005), arm, 0, base(), DataConfig(),
                                  train(log_every=3))
  assert (t.steps, t.log_every) == (5, 1)
  # The warmup leaves at least one step after it; inverse_sqrt needs one warmup step.
  _, _, t = sweep_lib.run_configs(Sweep(uptrain_fraction=0.5), arm, 0, base(), DataConfig(),
                                  train(steps=10, warmup_steps=20))
  assert (t.steps, t.warmup_steps) == (5, 4)
  _, _, t = sweep_lib.run_configs(Sweep(uptrain_fraction=0.001), arm, 0, base(), DataConfig(),
                                  train(steps=1000, warmup_steps=100, schedule="inverse_sqrt"))
  assert (t.steps, t.warmup_steps) == (1, 1)
  _, _, t = sweep_lib.run_configs(Sweep(uptrain_fraction=0.001), arm, 0, base(), DataConfig(),
                                  train(steps=1000, warmup_steps=100))
  assert (t.steps, t.warmup_steps) == (1, 0)
  assert sweep_lib.uptrain_steps(Sweep(uptrain_fraction=0.001), train(steps=100)) == 1


def test_uptrain_learning_rate_is_the_uptrain_runs_alone():
  base_lr = train(learning_rate=3e-3)
  up = Arm("uptrain-mean-mqa", 1, "uptrain", "mean", 64)
  scratch = Arm("mqa", 1, d_ff=64)
  sweep = Sweep(uptrain_learning_rate=1e-4)
  assert sweep_lib.run_configs(sweep, up, 0, base(), DataConfig(), base_lr)[2].learning_rate == 1e-4
  assert sweep_lib.run_configs(sweep, scratch, 0, base(), DataConfig(),
                               base_lr)[2].learning_rate == 3e-3
  # None (the default): the base run's rate.
  assert sweep_lib.run_configs(Sweep(), up, 0, base(), DataConfig(),
                               base_lr)[2].learning_rate == 3e-3


def test_results_live_under_arms_name_seed(tmp_path):
  out = str(tmp_path)
  assert sweep_lib.run_dir(out, Arm("mqa", 1), 2) == os.path.join(out, "arms", "mqa", "seed_2")
  assert sweep_lib.run_dir(out, "mqa", 2) == sweep_lib.run_dir(out, Arm("mqa", 1), 2)
  assert sweep_lib.read_result(out, "mqa", 2) is None
  os.makedirs(sweep_lib.run_dir(out, "mqa", 2))
  path = os.path.join(sweep_lib.run_dir(out, "mqa", 2), "result.json")
  sweep_lib._write_json(path, {"status": "failed", "b": 1, "a": [2]})
  assert sweep_lib.read_result(out, "mqa", 2) == {"a": [2], "b": 1, "status": "failed"}
  assert os.listdir(os.path.dirname(path)) == ["result.json"]  # no temporary left
  with open(path) as f:
    assert f.read() == json.dumps({"a": [2], "b": 1, "status": "failed"}, indent=1,
                                  sort_keys=True)


def test_an_atomic_write_names_its_temporary_by_host_and_pid_and_a_failed_one_leaves_none(
    tmp_path, monkeypatch):
  """write_text_atomically's temporary holds the host's name and the pid (pid alone until
  2026-12-06: two hosts of one job on a shared filesystem could write one temporary); a write
  that fails removes it and leaves the file as it was (a temporary was left behind)."""
  from attnlab.training import metrics, trainer

  assert trainer.write_text_atomically is metrics.write_text_atomically  # one home, two names
  path = tmp_path / "config.gin"
  path.write_text("old")
  monkeypatch.setattr(metrics.socket, "gethostname", lambda: "node7")
  replaced = []
  real_replace = os.replace
  monkeypatch.setattr(metrics.os, "replace", lambda a, b: replaced.append(a) or real_replace(a, b))
  trainer.write_text_atomically(str(path), "new")
  assert replaced == [f"{path}.tmp.node7.{os.getpid()}"] and path.read_text() == "new"

  def full_disk(a, b):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(metrics.os, "replace", full_disk)
  with pytest.raises(OSError, match="No space left"):
    trainer.write_text_atomically(str(path), "newer")
  assert os.listdir(tmp_path) == ["config.gin"] and path.read_text() == "new"
  # A temporary that could not be made (no such folder) is not removed: the open's own error.
  with pytest.raises(FileNotFoundError, match="gone"):
    trainer.write_text_atomically(str(tmp_path / "gone" / "x.gin"), "text")


def test_run_files_are_utf8_under_an_ascii_locale(tmp_path):
  """write_text_atomically, which writes a run's config.gin, error.txt and the sweep's JSON
  files, writes UTF-8 whatever the locale: under LC_ALL=C without Python's UTF-8 mode a
  path with an "é" raised UnicodeEncodeError writing config.gin until 2026-12-04 (error.txt
  too: the sweep lost the failure)."""
  code = (
      "import json, locale, os, sys\n"
      "assert locale.getpreferredencoding(False) != 'UTF-8'\n"
      "from attnlab.training import sweep, trainer\n"
      "d = sys.argv[1]\n"
      "trainer.write_text_atomically(os.path.join(d, 'config.gin'), 'p = \"caf\\u00e9\"')\n"
      "sweep._write_json(os.path.join(d, 'result.json'), {'error': 'caf\\u00e9'})\n"
      "print(sweep.read_result(os.path.dirname(d), 'x', 0) is None)\n")
  env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
  res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=REPO,
                       capture_output=True, text=True, encoding="utf-8", timeout=300)
  assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-2000:]
  assert (tmp_path / "config.gin").read_bytes() == 'p = "café"'.encode()
  assert json.loads((tmp_path / "result.json").read_bytes().decode("utf-8")) == {"error": "café"}


def test_wall_time_adds_up_over_resumed_invocations(tmp_path):
  workdir = str(tmp_path / "new" / "run")
  assert sweep_lib._add_wall(workdir, 1.5) == 1.5
  assert sweep_lib._add_wall(workdir, 2.25) == 3.75
  with open(os.path.join(workdir, "wall_time_s")) as f:
    assert f.read() == "3.750"


@pytest.mark.parametrize("content, shown", [
    (b"", ""), (b"-5", "-5"), (b"nan", "nan"), (b"inf", "inf"), (b"3 s", "3 s"),
    (b"\xff2", "\ufffd2"), (b"9" * 30 + b"x" * 30, "9" * 30 + "x" * 10)])
def test_a_wall_time_file_without_a_number_of_seconds_counts_from_0(tmp_path, caplog, content,
                                                                     shown):
  """A run's wall_time_s that a kill cut off, or that holds no finite count of seconds >= 0,
  counts from this invocation, with a warning naming it and (the first 40 characters of) what
  it holds; 0 seconds is a count."""
  import logging

  path = tmp_path / "wall_time_s"
  path.write_bytes(content)
  with caplog.at_level(logging.WARNING, logger=sweep_lib.__name__):
    assert sweep_lib._add_wall(str(tmp_path), 1.5) == 1.5
  assert [r.getMessage() for r in caplog.records] == [
      f"{path} holds {shown!r}, not a number of seconds: the run's wall time counts from this "
      "invocation"]
  assert path.read_text() == "1.500"
  path.write_text("0.000")
  caplog.clear()
  assert sweep_lib._add_wall(str(tmp_path), 2.0) == 2.0 and caplog.records == []


@pytest.mark.parametrize("seconds, text", [(0, "0m00s"), (59.4, "0m59s"), (59.6, "1m00s"),
                                           (61, "1m01s"), (3599, "59m59s"), (3600, "1h00m"),
                                           (3661, "1h01m"), (7140, "1h59m"),
                                           (90061, "25h01m")])
def test_durations_print_as_minutes_or_hours(seconds, text):
  assert sweep_lib._fmt_s(seconds) == text


def test_eval_records_keep_the_last_record_of_each_step(tmp_path):
  assert sweep_lib._run_records(str(tmp_path)) == []
  lines = [{"step": 10, "split": "eval", "loss": 3.0}, {"step": 10, "split": "train", "loss": 9},
           {"step": 20, "split": "eval", "loss": 2.0}, {"step": 10, "split": "eval", "loss": 2.5}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  got = sweep_lib._eval_records(sweep_lib._run_records(str(tmp_path)))
  assert sorted(got) == [10, 20]
  assert (got[10]["loss"], got[20]["loss"]) == (2.5, 2.0)


@pytest.mark.parametrize("text, problem", [
    ("{", "is not JSON (Expecting property name"),
    ('{"source_step": 2}', "is not a conversion record attnlab wrote"),
    ('{"val_loss_converted": "3.1", "source_step": 2}', "is not a conversion record"),
    ('{"val_loss_converted": 3.1, "source_step": 2.5}', "is not a conversion record"),
    ('[3.1, 2]', "is not a conversion record"),
])
def test_an_uptraining_runs_damaged_conversion_record_is_named(tmp_path, text, problem):
  """An uptraining run whose conversion.json attnlab did not write fails with the file named
  (the sweep records the run as failed with that line), not a KeyError; a good record is
  what the run goes on from, without converting again."""
  out, up = str(tmp_path), Arm("uptrain-mean-mqa", 1, "uptrain", "mean", 64)
  workdir = sweep_lib.run_dir(out, up, 0)
  os.makedirs(workdir)
  path = os.path.join(workdir, sweep_lib.CONVERSION_FILE)
  with open(path, "w") as f:
    f.write(text)
  with pytest.raises(ValueError) as e:
    sweep_lib._prepare_uptrain(out, up, 0, Arm("mha", 4), configs=None)
  assert str(e.value).startswith(f"{path} {problem}"), str(e.value)
  assert str(e.value).endswith(f"; delete {workdir} to convert and uptrain that run again")
  good = {"val_loss_converted": 3.25, "source_step": 2, "method": "mean"}
  with open(path, "w") as f:
    json.dump(good, f)
  assert sweep_lib._prepare_uptrain(out, up, 0, Arm("mha", 4), configs=None) == good


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_prompt_set_is_the_first_validation_rows_cycled_to_8(tmp_path, arch, monkeypatch):
  """The decode benchmark's prompts: every validation example in order (none of the rows
  that fill up the last batch), cut to decode_prompt_len tokens, cycled to 8 rows (the
  first 8 of more), from the batches that hold 8 rows (8 batches until 2026-12-06)."""
  asked = []
  real = sweep_lib.pipeline.validation_batches
  monkeypatch.setattr(sweep_lib.pipeline, "validation_batches",
                      lambda sources, dcfg, n, *a: asked.append(n) or real(sources, dcfg, n, *a))
  val = tmp_path / "val.tsv"
  val.write_text("".join(f"{c * 3}\tx\n" for c in "ABCD"))  # 4 rows, batches of 3
  dcfg = DataConfig(task="tsv", paths=(str(val), str(val)), seq_len=16, batch_size=3)
  mcfg = base(arch=arch, **({"num_encoder_layers": 1} if arch == "encoder_decoder" else {}))
  mcfg = mcfg.replace(vocab_size=ByteTokenizer().vocab_size)
  got = sweep_lib.prompt_set(Sweep(decode_prompt_len=3), mcfg, dcfg)
  tok = ByteTokenizer()
  if arch == "decoder_only":  # [bos] source [eos] x [eos], cut to 3 tokens
    rows = [[tok.bos_id, *tok.encode(c * 2)] for c in "ABCD"]
  else:  # the source, pad tokens dropped, cut to 3
    rows = [list(tok.encode(c * 3)) for c in "ABCD"]
  assert got == rows * 2
  # Prompts longer than the rows: a decoder-only prompt is the whole row, its padding kept
  # (every prompt decode_prompt_len tokens, at most a row's, as check_benchmark counts); an
  # encoder-decoder's the source with its eos, no padding. 10 examples: the first 8.
  val.write_text("".join(f"{c * 3}\tx\n" for c in "ABCDEFGHIJ"))
  got = sweep_lib.prompt_set(Sweep(decode_prompt_len=20), mcfg, dcfg)
  if arch == "decoder_only":
    rows = [[tok.bos_id, *tok.encode(c * 3), tok.eos_id, *tok.encode("x"), tok.eos_id]
            + [tok.pad_id] * 9 for c in "ABCDEFGH"]
  else:
    rows = [[*tok.encode(c * 3), tok.eos_id] for c in "ABCDEFGH"]
  assert got == rows
  assert asked == [3, 3]  # 8 rows in batches of 3


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_the_decode_benchmark_must_fit_max_len(arch):
  """A decoder-only prompt is decode_prompt_len tokens at most a row's (seq_len); its
  decode_new_tokens - 1 follow. An encoder-decoder's decoder holds decode_new_tokens."""
  mcfg = ModelConfig(arch=arch, max_len=64)
  dcfg = DataConfig(seq_len=16)
  fits = 64 - 16 + 1 if arch == "decoder_only" else 64  # prompts cut to 16 by seq_len
  sweep_lib.check_benchmark(Sweep(decode_prompt_len=100, decode_new_tokens=fits), mcfg, dcfg)
  what = ("prompts of 16 tokens (Sweep.decode_prompt_len, at most DataConfig.seq_len) and "
          "Sweep.decode_new_tokens=50" if arch == "decoder_only" else "Sweep.decode_new_tokens")
  with pytest.raises(ValueError) as e:
    sweep_lib.check_benchmark(Sweep(decode_prompt_len=100, decode_new_tokens=fits + 1), mcfg,
                              dcfg)
  assert str(e.value) == (
      f"the decode benchmark needs 65 positions ({what}), more than ModelConfig.max_len=64: "
      "lower Sweep.decode_new_tokens or Sweep.decode_prompt_len")


def test_a_run_another_process_trains_is_not_recorded_as_failed(tmp_path, monkeypatch):
  """Two sweeps over the same runs (two jobs of one array): the second meets the first's
  lock on a run's workdir (``trainer.WorkdirBusyError``) and stops, one line through
  ``attnlab ablate``, without writing a failed result over the run in progress."""
  out = str(tmp_path)
  sweep = Sweep(num_kv_heads=(8, 1), seeds=(0,))
  base_cfgs = (base(), DataConfig(task="copy", seq_len=16, batch_size=2),
               TrainConfig(steps=20, warmup_steps=2))
  mqa = sweep_lib.plan(sweep, base_cfgs[0])[1]

  def busy(mcfg, tcfg, dcfg, workdir, **kw):
    raise sweep_lib.trainer.WorkdirBusyError(f"another attnlab train is running in {workdir}")

  monkeypatch.setattr(sweep_lib.trainer, "train", busy)
  with pytest.raises(sweep_lib.trainer.WorkdirBusyError):
    sweep_lib.run_one(out, sweep, mqa, 0, base_cfgs, prompts=None)
  assert sweep_lib.read_result(out, mqa, 0) is None
  assert not os.path.exists(os.path.join(sweep_lib.run_dir(out, mqa, 0), sweep_lib.ERROR_FILE))


def test_a_failed_run_whose_retry_is_stopped_reads_as_interrupted(tmp_path, monkeypatch):
  """A rerun retries a failed run; a signal that stops the retry before it writes a result
  leaves it interrupted (resumable from its newer checkpoint), naming the failure before,
  not failed: the stale result.json is moved aside when the retry starts. Until 2026-12-04
  it stayed, and --report showed the run as failed. A retry that fails writes its own."""
  from attnlab.training import report as report_lib

  out = str(tmp_path)
  sweep = Sweep(num_kv_heads=(8, 1), seeds=(0,))
  base_cfgs = (base(), DataConfig(task="copy", seq_len=16, batch_size=2),
               TrainConfig(steps=20, warmup_steps=2))
  arms = sweep_lib.plan(sweep, base_cfgs[0])
  mqa = arms[1]
  workdir = sweep_lib.run_dir(out, mqa, 0)
  os.makedirs(os.path.join(workdir, "checkpoints", "5"))
  failed = {"status": "failed", "error": "RuntimeError: boom", "wall_time_s": 1.0}
  sweep_lib._write_json(os.path.join(workdir, sweep_lib.RESULT_FILE), failed)

  def stopped(mcfg, tcfg, dcfg, workdir, **kw):  # resumed from 5, saved 7, then a signal
    os.makedirs(os.path.join(workdir, "checkpoints", "7"))
    return {"step": 7, "start_step": 5}

  monkeypatch.setattr(sweep_lib.trainer, "train", stopped)
  with pytest.raises(sweep_lib.SweepInterrupted, match="arm mqa seed 0 stopped at step 7"):
    sweep_lib.run_one(out, sweep, mqa, 0, base_cfgs, prompts=None)
  assert sweep_lib.read_result(out, mqa, 0) is None
  with open(os.path.join(workdir, sweep_lib.PREVIOUS_FAILURE_FILE)) as f:
    assert json.load(f) == failed
  report_lib.write_report(out, sweep, arms, base_cfgs, plots=False)
  with open(os.path.join(out, "results.csv")) as f:
    row = [r for r in f.read().splitlines() if r.startswith("mqa,")][0]
  assert ",interrupted," in row and ",failed," not in row
  with open(os.path.join(out, "report.md")) as f:
    assert ("- mqa seed 0: interrupted (checkpoint at step 7 of 20; rerun to resume; the "
            "attempt before failed: RuntimeError: boom)\n") in f.read()

  def fails(*args, **kw):
    raise RuntimeError("boom again")

  monkeypatch.setattr(sweep_lib.trainer, "train", fails)
  assert sweep_lib.run_one(out, sweep, mqa, 0, base_cfgs, prompts=None)["status"] == "failed"
  assert sweep_lib.read_result(out, mqa, 0)["error"] == "RuntimeError: boom again"


def test_a_prompts_file_that_is_not_utf8_is_named(tmp_path):
  """OUT/prompts.json that is not UTF-8 is refused as one that is not JSON is, naming the
  file (until 2026-12-04 a bare "'utf-8' codec can't decode byte 0xff ..." line)."""
  val = tmp_path / "val.tsv"
  val.write_text("".join(f"{c * 3}\tx\n" for c in "ABCD"))
  dcfg = DataConfig(task="tsv", paths=(str(val), str(val)), seq_len=16, batch_size=3)
  mcfg = base().replace(vocab_size=ByteTokenizer().vocab_size)
  out = tmp_path / "out"
  out.mkdir()
  path = out / sweep_lib.PROMPTS_FILE
  for text in (b"\xff\xfe[[1]]", b"[[1"):
    path.write_bytes(text)
    sweep = Sweep(num_kv_heads=(8,), seeds=(0,))
    with pytest.raises(ValueError) as e:
      sweep_lib.run_sweep(str(out), sweep, sweep_lib.plan(sweep, mcfg),
                          (mcfg, dcfg, TrainConfig(steps=2, warmup_steps=1)))
    assert str(e.value) == (
        f"{path} holds other benchmark prompts than this sweep makes (another "
        "Sweep.decode_prompt_len or data, or an edited file): its runs were measured on them; "
        "use a new --out, or delete it if no run has finished"), str(e.value)
  assert os.listdir(out) == [sweep_lib.PROMPTS_FILE]


@pytest.mark.parametrize("arch,bias", [("decoder_only", False), ("encoder_decoder", True)])
def test_param_counts_are_the_built_models_and_attention_by_hand(arch, bias):
  """The report's "params" is every parameter of the built model; "attention_params" the
  Q, K, V and O projections (and their biases) of every attention: the decoder's
  self-attention, and for an encoder-decoder the encoder's and the decoder's cross-attention
  too (counted by hand here; the report tests take param_counts' own numbers)."""
  import math

  import jax
  from flax import nnx

  from attnlab.nn.transformer import build_model

  D, N, K, H, L, E = 32, 4, 2, 8, 2, 3
  mcfg = ModelConfig(arch=arch, d_model=D, num_heads=N, num_kv_heads=K, num_layers=L,
                     num_encoder_layers=E if arch == "encoder_decoder" else None, d_ff=64,
                     use_bias=bias, vocab_size=50, max_len=64)
  per_attention = D * N * H + 2 * D * K * H + N * H * D + bias * (N * H + 2 * K * H + D)
  attentions = L + (E + L if arch == "encoder_decoder" else 0)
  state = nnx.state(build_model(mcfg, rngs=nnx.Rngs(0)), nnx.Param)
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
  assert sweep_lib.param_counts(mcfg) == (total, attentions * per_attention)


def _sweep_of_3_arms_2_seeds():
  """mha, mqa and uptrain-mean-mqa (5 steps of 20) over seeds 0 and 1, on a tiny copy task."""
  sweep = Sweep(num_kv_heads=(8, 1), seeds=(0, 1), uptrain_num_kv_heads=(1,),
                uptrain_methods=("mean",), uptrain_fraction=0.25)
  cfgs = (base(), DataConfig(task="copy", seq_len=16, batch_size=2),
          TrainConfig(steps=20, warmup_steps=2))
  return sweep, sweep_lib.plan(sweep, cfgs[0]), cfgs


def _ok(loss=1.5):
  return {"status": "ok", "val_loss": loss, "curve": [[20, loss]], "wall_time_s": 1.0}


def test_a_sweep_run_names_its_data_files_absolute_in_its_config_gin(tmp_path, monkeypatch):
  """A run's config.gin names relative ``DataConfig.paths`` from the sweep's working
  directory, as ``attnlab train``'s does (until 2026-12-06 a sweep wrote them as given, so
  ``attnlab eval`` of the run from another folder read that folder's files of those names),
  and the sweep does not call the run stale for it. As there, a tokenizer inside the run's
  folder is named relative to it (found beside config.gin wherever the run moves)."""
  import math

  from attnlab import config_gin

  monkeypatch.chdir(tmp_path)
  (tmp_path / "a.tsv").write_text("x\ty\n")
  out = str(tmp_path / "out")
  sweep, arms, (mcfg, _, tcfg) = _sweep_of_3_arms_2_seeds()
  mha = arms[0]
  tokenizer = os.path.join(sweep_lib.run_dir(out, mha, 0), "tok", "t.model")
  os.makedirs(os.path.dirname(tokenizer))
  with open(tokenizer, "w") as f:
    f.write("not read here")
  cfgs = (mcfg, DataConfig(task="tsv", paths=("a.tsv",), seq_len=16, batch_size=2,
                           tokenizer="sentencepiece", tokenizer_model=tokenizer), tcfg)

  def train(mcfg_, tcfg_, dcfg_, workdir, *, config_text):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.gin"), "w") as f:
      f.write(config_text)
    return {"step": tcfg_.steps, "start_step": 0}

  monkeypatch.setattr(sweep_lib.trainer, "train", train)
  monkeypatch.setattr(sweep_lib, "measure", lambda *a: {
      "val_loss": 1.0, "best_val_loss": 1.0, "best_val_ppl": math.e, "curve": [[20, 1.0]]})
  sweep_lib.run_one(out, sweep, mha, 0, cfgs, [[7]] * 8)
  path = os.path.join(sweep_lib.run_dir(out, mha, 0), "config.gin")
  with open(path) as f:
    lines = f.read().splitlines()
  assert f"DataConfig.paths = ('{tmp_path / 'a.tsv'}',)" in lines
  assert "DataConfig.tokenizer_model = 'tok/t.model'" in lines
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (elsewhere / "a.tsv").write_text("other\tfile\n")
  monkeypatch.chdir(elsewhere)
  assert config_gin.read_workdir_config(path)[1].paths == (str(tmp_path / "a.tsv"),)
  monkeypatch.chdir(tmp_path)
  assert sweep_lib._config_difference(path, sweep_lib.run_configs(sweep, mha, 0, *cfgs)) is None
  assert sweep_lib.stale_runs(out, sweep, arms, cfgs) == []


def test_run_sweep_runs_each_unfinished_run_seed_by_seed_and_prints_its_progress(
    tmp_path, monkeypatch, capsys):
  """Finished runs ("ok") are skipped and counted; the rest run in seed order, each arm of a
  seed in the plan's order, measured on prompts made once (OUT/prompts.json), the MHA arm
  their uptraining source; every run prints a line before (the step it resumes from) and
  after (how far it got, its loss or failure, the sweep's ETA from the steps done so far) on
  stderr. ``only`` runs one arm's seeds."""
  import types

  out = str(tmp_path)
  sweep, arms, cfgs = _sweep_of_3_arms_2_seeds()
  mha, mqa, up = arms
  for arm, seed, r in ((mha, 0, _ok()), (mqa, 0, {"status": "failed", "error": "E: x"})):
    os.makedirs(sweep_lib.run_dir(out, arm, seed))
    sweep_lib._write_json(os.path.join(sweep_lib.run_dir(out, arm, seed), "result.json"), r)
  os.makedirs(os.path.join(sweep_lib.run_dir(out, mqa, 0), "checkpoints", "5"))
  clock, calls = [1000.0], []
  prompts = [[1, 2, 3]] * 8
  monkeypatch.setattr(sweep_lib, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  monkeypatch.setattr(sweep_lib, "prompt_set",
                      lambda s, m, d: calls.append(("prompts", s, m, d)) or prompts)

  def run_one(out_, sweep_, arm, seed, base_, prompts_, source=None, stop=None):
    assert (out_, sweep_, base_, prompts_, stop.signum) == (out, sweep, cfgs, prompts, None)
    calls.append((arm.name, seed, source.name))
    clock[0] += 4.0 * (5 if arm.kind == "uptrain" else 20)  # 4 s a step
    if (arm.name, seed) == ("mha", 1):  # failed past its checkpoint at step 3
      os.makedirs(os.path.join(sweep_lib.run_dir(out, arm, seed), "checkpoints", "3"),
                  exist_ok=True)
      return {"status": "failed", "error": "RuntimeError: boom", "wall_time_s": 7.4}
    return {**_ok(0.25 * seed + 1.0), "wall_time_s": 59.6}

  monkeypatch.setattr(sweep_lib, "run_one", run_one)
  assert sweep_lib.run_sweep(out, sweep, arms, cfgs) == {"ok": 4, "failed": 1, "skipped": 1}
  assert calls == [("prompts", sweep, cfgs[0], cfgs[1]), ("mqa", 0, "mha"),
                   ("uptrain-mean-mqa", 0, "mha"), ("mha", 1, "mha"), ("mqa", 1, "mha"),
                   ("uptrain-mean-mqa", 1, "mha")]
  with open(os.path.join(out, sweep_lib.PROMPTS_FILE)) as f:
    assert json.load(f) == prompts
  captured = capsys.readouterr()
  assert captured.out == ""
  # 70 steps to run (20 + 5 + 20 + 20 + 5), 4 s each: the ETA is 4 s a step left.
  assert captured.err.splitlines() == [
      "ablate [1/5] arm=mqa seed=0 step=5/20 resuming; sweep ETA ?",
      "ablate [1/5] arm=mqa seed=0 step=20/20 val_loss=1.0000 (60 s); sweep ETA 3m20s",
      "ablate [2/5] arm=uptrain-mean-mqa seed=0 step=0/5 starting; sweep ETA 3m20s",
      "ablate [2/5] arm=uptrain-mean-mqa seed=0 step=5/5 val_loss=1.0000 (60 s); "
      "sweep ETA 3m00s",
      "ablate [3/5] arm=mha seed=1 step=0/20 starting; sweep ETA 3m00s",
      "ablate [3/5] arm=mha seed=1 step=3/20 FAILED: RuntimeError: boom (7 s); "
      "sweep ETA 1m40s",
      "ablate [4/5] arm=mqa seed=1 step=0/20 starting; sweep ETA 1m40s",
      "ablate [4/5] arm=mqa seed=1 step=20/20 val_loss=1.2500 (60 s); sweep ETA 0m20s",
      "ablate [5/5] arm=uptrain-mean-mqa seed=1 step=0/5 starting; sweep ETA 0m20s",
      "ablate [5/5] arm=uptrain-mean-mqa seed=1 step=5/5 val_loss=1.2500 (60 s); "
      "sweep ETA 0m00s"]
  # Written by the runs now: a rerun skips them; one arm's seeds alone.
  for arm, seed in ((mqa, 0), (mqa, 1)):
    os.makedirs(sweep_lib.run_dir(out, arm, seed), exist_ok=True)
    sweep_lib._write_json(os.path.join(sweep_lib.run_dir(out, arm, seed), "result.json"), _ok())
  calls.clear()

  class Stream(io.StringIO):  # each progress line is flushed (a job's log shows it at once)
    def __init__(self):
      super().__init__()
      self.flushed = []

    def flush(self):
      self.flushed.append(self.getvalue())

  stream = Stream()
  assert sweep_lib.run_sweep(out, sweep, arms, cfgs, only="mqa", stream=stream) == {
      "ok": 0, "failed": 0, "skipped": 2}
  assert calls == [] and stream.getvalue() == ""
  assert sweep_lib.run_sweep(out, sweep, arms, cfgs, only="mha", stream=stream) == {
      "ok": 0, "failed": 1, "skipped": 1}  # mha seed 1 fails again
  assert calls == [("prompts", sweep, cfgs[0], cfgs[1]), ("mha", 1, "mha")]
  assert stream.getvalue().splitlines()[0] == (
      "ablate [1/1] arm=mha seed=1 step=3/20 resuming; sweep ETA ?")
  lines = stream.getvalue().splitlines(keepends=True)
  assert len(lines) == 2 and stream.flushed == [lines[0], lines[0] + lines[1]]


def test_the_sweep_eta_after_one_step_runs_is_the_time_a_step_times_the_steps_left(
    tmp_path, monkeypatch, capsys):
  """Runs of one step each (steps=1; uptraining rounds up to one step): after the first, the
  ETA is its time times the steps left (6 runs, 10 s each: 50 s, then 40 s, ...)."""
  import types

  sweep, arms, (mcfg, dcfg, _) = _sweep_of_3_arms_2_seeds()
  cfgs = (mcfg, dcfg, TrainConfig(steps=1, warmup_steps=0))
  assert sweep_lib.uptrain_steps(sweep, cfgs[2]) == 1
  clock = [0.0]
  monkeypatch.setattr(sweep_lib, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  monkeypatch.setattr(sweep_lib, "prompt_set", lambda s, m, d: [[1, 2]] * 8)

  def run_one(out_, sweep_, arm, seed, base_, prompts_, source=None, stop=None):
    clock[0] += 10.0
    return {**_ok(), "wall_time_s": 10.0}

  monkeypatch.setattr(sweep_lib, "run_one", run_one)
  assert sweep_lib.run_sweep(str(tmp_path), sweep, arms, cfgs) == {
      "ok": 6, "failed": 0, "skipped": 0}
  etas = [line.rsplit("sweep ETA ", 1)[1] for line in capsys.readouterr().err.splitlines()]
  assert etas == ["?", "0m50s", "0m50s", "0m40s", "0m40s", "0m30s", "0m30s", "0m20s",
                  "0m20s", "0m10s", "0m10s", "0m00s"]


def test_a_signal_while_a_run_is_measured_stops_the_sweep_before_the_next(tmp_path,
                                                                          monkeypatch):
  """The sweep's own flag: a SIGTERM that came in a run's measuring (after its trainer's
  flag) stops the sweep before the next run starts; the handler is gone after."""
  import signal

  out = str(tmp_path)
  sweep, arms, cfgs = _sweep_of_3_arms_2_seeds()
  monkeypatch.setattr(sweep_lib, "prompt_set", lambda s, m, d: [[1]] * 8)
  ran = []

  def run_one(out_, sweep_, arm, seed, base_, prompts_, source=None, stop=None):
    ran.append(arm.name)
    os.kill(os.getpid(), signal.SIGTERM)
    return _ok()

  monkeypatch.setattr(sweep_lib, "run_one", run_one)
  before = signal.getsignal(signal.SIGTERM)  # SIG_DFL; not under mutmut's forked workers
  with pytest.raises(sweep_lib.SweepInterrupted) as e:
    sweep_lib.run_sweep(out, sweep, arms, cfgs, stream=io.StringIO())
  assert str(e.value) == f"signal {signal.SIGTERM} before arm mqa seed 0" and ran == ["mha"]
  assert signal.getsignal(signal.SIGTERM) == before


def test_stale_runs_are_those_trained_with_another_config_named_by_the_first_difference(
    tmp_path):
  """A run counts once it finished or saved a checkpoint past step 0; it is stale when its
  config.gin is not what this sweep gives it, named by the first differing binding (field by
  field when the file parses, line by line when it holds a field this attnlab lacks).
  ``only`` checks that arm's runs; check_not_stale (and run_sweep, before any run) names
  them all in one refusal."""
  from attnlab import config_gin

  out = str(tmp_path)
  sweep, arms, cfgs = _sweep_of_3_arms_2_seeds()
  mha, mqa, up = arms

  def write(arm, seed, text, result=None, step=None):
    workdir = sweep_lib.run_dir(out, arm, seed)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.gin"), "w") as f:
      f.write(text)
    if result is not None:
      sweep_lib._write_json(os.path.join(workdir, "result.json"), result)
    if step is not None:
      os.makedirs(os.path.join(workdir, "checkpoints", str(step)))

  def text(arm, seed, old=None, new=None):
    t = config_gin.operative_config(*sweep_lib.run_configs(sweep, arm, seed, *cfgs))
    return t if old is None else t.replace(old, new)

  for seed in (0, 1):  # as this sweep trains them
    write(mha, seed, text(mha, seed), _ok())
  write(mqa, 0, text(mqa, 0, "TrainConfig.steps = 20", "TrainConfig.steps = 30"), _ok())
  # Started, without a step past 0 (an uptraining run's converted checkpoint): not counted.
  write(up, 0, text(up, 0, "TrainConfig.seed = 0", "TrainConfig.seed = 9"), step=0)
  # Cut short past step 1: counted. A field this attnlab lacks: the first differing line.
  write(mqa, 1, text(mqa, 1) + "ModelConfig.bogus = 3\n", step=1)
  lines = len(text(mqa, 1).splitlines())
  assert sweep_lib.stale_runs(out, sweep, arms, cfgs) == [
      f"{os.path.join('arms', 'mqa', 'seed_0')} has 'TrainConfig.steps = 30' where this "
      "sweep gives 'TrainConfig.steps = 20'",
      f"{os.path.join('arms', 'mqa', 'seed_1')} has '{lines + 1} lines' where this sweep "
      f"gives '{lines} lines'"]  # every line the same up to the extra one
  assert sweep_lib.stale_runs(out, sweep, arms, cfgs, only="mha") == []
  assert len(sweep_lib.stale_runs(out, sweep, arms, cfgs, only="mqa")) == 2
  # An empty checkpoints/ is no step either; a save in progress (another job's run, its
  # --arm) is only read: left where it is.
  up_checkpoints = os.path.join(sweep_lib.run_dir(out, up, 0), "checkpoints")
  os.rmdir(os.path.join(up_checkpoints, "0"))
  saving = os.path.join(sweep_lib.run_dir(out, mqa, 1), "checkpoints", "2.orbax-checkpoint-tmp")
  os.makedirs(os.path.join(saving, "params"))
  assert len(sweep_lib.stale_runs(out, sweep, arms, cfgs)) == 2
  assert os.listdir(up_checkpoints) == [] and os.listdir(saving) == ["params"]
  write(up, 1, text(up, 1, "TrainConfig.learning_rate = 0.001", "TrainConfig.learning_rate = 0.5"),
        _ok())
  assert sweep_lib.stale_runs(out, sweep, arms, cfgs, only="uptrain-mean-mqa") == [
      f"{os.path.join('arms', 'uptrain-mean-mqa', 'seed_1')} has "
      "'TrainConfig.learning_rate = 0.5' where this sweep gives "
      "'TrainConfig.learning_rate = 0.001'"]
  sweep_lib.check_not_stale(out, sweep, arms, cfgs, only="mha")
  stale = sweep_lib.stale_runs(out, sweep, arms, cfgs)
  assert len(stale) == 3
  # A run without config.gin (not started) before the stale ones: the rest still checked.
  os.remove(os.path.join(sweep_lib.run_dir(out, mha, 0), "config.gin"))
  assert sweep_lib.stale_runs(out, sweep, arms, cfgs) == stale
  message = (f"{out} holds 3 run(s) trained with another config than this sweep's "
             f"({'; '.join(stale)}); use a new --out, or delete those runs to train them again")
  with pytest.raises(ValueError) as e:
    sweep_lib.check_not_stale(out, sweep, arms, cfgs)
  assert str(e.value) == message
  with pytest.raises(ValueError) as e:
    sweep_lib.run_sweep(out, sweep, arms, cfgs, only="mqa")
  assert str(e.value).startswith(f"{out} holds 2 run(s)")
  assert not os.path.exists(os.path.join(out, sweep_lib.PROMPTS_FILE))  # nothing ran


def test_a_config_gin_of_another_attnlab_or_not_utf8_is_compared_as_it_reads(tmp_path,
                                                                             monkeypatch):
  """_config_difference: a config.gin that an older attnlab wrote (a field at its default
  missing, the lines in another order, another comment, the data paths and tokenizer_model
  the sweep names relative to the working directory written absolute) describes the same
  run: not stale (the configs are compared, not the text). One that is not UTF-8 does not
  stop the sweep: it is compared line by line, the byte shown as U+FFFD."""
  from attnlab import config_gin

  monkeypatch.chdir(tmp_path)
  for name in ("a.tsv", "tok.model"):
    (tmp_path / name).write_text("x\ty\n")
  out = str(tmp_path / "out")
  sweep, arms, (mcfg, _, tcfg) = _sweep_of_3_arms_2_seeds()
  cfgs = (mcfg, DataConfig(task="tsv", paths=("a.tsv",), tokenizer="sentencepiece",
                           tokenizer_model="tok.model", seq_len=16, batch_size=2), tcfg)
  mha = arms[0]
  workdir = sweep_lib.run_dir(out, mha, 0)
  os.makedirs(workdir)
  sweep_lib._write_json(os.path.join(workdir, "result.json"), _ok())
  configs = sweep_lib.run_configs(sweep, mha, 0, *cfgs)
  default = next(f for f in dataclasses.fields(ModelConfig) if f.default is not
                 dataclasses.MISSING and getattr(configs[0], f.name) == f.default)
  text = config_gin.operative_config(*configs, workdir=workdir)
  assert f"DataConfig.paths = ('{tmp_path / 'a.tsv'}',)" in text.splitlines()
  assert f"DataConfig.tokenizer_model = '{tmp_path / 'tok.model'}'" in text.splitlines()
  lines = [line for line in text.splitlines()
           if not line.startswith(f"ModelConfig.{default.name} =")]
  path = os.path.join(workdir, "config.gin")
  with open(path, "w") as f:
    f.write("# written by attnlab 0.0\n" + "\n".join(reversed(lines)) + "\n")
  assert sweep_lib.stale_runs(out, sweep, arms, cfgs) == []
  text = config_gin.operative_config(*configs).replace("TrainConfig.steps = 20",
                                                       "TrainConfig.steps = 20  # caf\xe9")
  with open(path, "wb") as f:
    f.write(text.encode("latin-1"))
  assert sweep_lib.stale_runs(out, sweep, arms, cfgs) == [
      f"{os.path.join('arms', 'mha', 'seed_0')} has 'TrainConfig.steps = 20  # caf\ufffd' "
      "where this sweep gives 'TrainConfig.steps = 20'"]


def test_run_one_trains_measures_and_records_the_run(tmp_path, monkeypatch):
  """run_one with the trainer, the conversion and the measuring stood in for: the run trains
  its own configs (config.gin their operative text) in OUT/arms/NAME/seed_S, is measured on
  the sweep's prompts, and its result (the measurements, "ok", its wall time, the arm) is
  result.json. An uptraining run's curve starts at its converted checkpoint (step 0), the
  best loss over all of it; a failing run records its error on one line (500 characters at
  most) and error.txt its traceback; a stopped one records no result, only its wall time."""
  import math
  import types

  from attnlab import config_gin

  out = str(tmp_path)
  sweep, arms, cfgs = _sweep_of_3_arms_2_seeds()
  mha, mqa, up = arms
  clock, calls = [100.0], []
  monkeypatch.setattr(sweep_lib, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  measured = {"val_loss": 2.5, "best_val_loss": 2.25, "best_val_ppl": math.exp(2.25),
              "curve": [[0, 3.5], [2, 2.25], [5, 2.5]]}

  def train(mcfg, tcfg, dcfg, workdir, *, config_text):
    calls.append(("train", (mcfg, dcfg, tcfg), workdir, config_text))
    clock[0] += 12.5
    return {"step": tcfg.steps, "start_step": 0}

  def measure(workdir, mcfg, dcfg, tcfg, sweep_, prompts):
    calls.append(("measure", workdir, (mcfg, dcfg, tcfg), sweep_, prompts))
    return json.loads(json.dumps(measured))

  monkeypatch.setattr(sweep_lib.trainer, "train", train)
  monkeypatch.setattr(sweep_lib, "measure", measure)
  configs = sweep_lib.run_configs(sweep, mqa, 1, *cfgs)
  workdir = sweep_lib.run_dir(out, mqa, 1)
  r = sweep_lib.run_one(out, sweep, mqa, 1, cfgs, [[7]] * 8)
  assert calls == [("train", configs, workdir, config_gin.operative_config(*configs)),
                   ("measure", workdir, configs, sweep, [[7]] * 8)]
  want = {**measured, "status": "ok", "wall_time_s": 12.5, "arm": "mqa", "kind": "scratch",
          "method": "", "seed": 1, "num_kv_heads": 1}
  assert r == want and sweep_lib.read_result(out, mqa, 1) == want
  # An uptraining run: converted (once, by _prepare_uptrain) from the source's run.
  prepared = []

  def prepare(out_, arm, seed, source, configs_):
    prepared.append((out_, arm, seed, source, configs_))
    return {"val_loss_converted": converted, "source_step": 20, "method": "mean"}

  monkeypatch.setattr(sweep_lib, "_prepare_uptrain", prepare)
  for converted, best in ((2.0, 2.0), (3.0, 2.25), (float("nan"), 2.25)):
    r = sweep_lib.run_one(out, sweep, up, 0, cfgs, [[7]] * 8, source=mha)
    assert prepared[-1] == (out, up, 0, mha, sweep_lib.run_configs(sweep, up, 0, *cfgs))
    assert r["curve"][1:] == [[2, 2.25], [5, 2.5]] and r["curve"][0][0] == 0
    got = np.array([r["curve"][0][1], r["val_loss_converted"]])
    np.testing.assert_array_equal(got, [converted, converted])  # NaN equals NaN here
    assert (r["best_val_loss"], r["best_val_ppl"]) == (best, math.exp(best))
    assert r["source_step"] == 20
    assert (r["status"], r["arm"], r["kind"], r["method"], r["num_kv_heads"]) == (
        "ok", "uptrain-mean-mqa", "uptrain", "mean", 1)
  # A failing run: the error on one line, cut to 500 characters; its traceback in error.txt.
  def failing(message):
    def train(*args, **kw):
      clock[0] += 2.0
      raise RuntimeError(message)

    return train

  for message, error in (("no\n  such   file", "RuntimeError: no such file"),
                         ("", "RuntimeError: RuntimeError"),
                         ("x" * 600, ("RuntimeError: " + "x" * 600)[:500])):
    monkeypatch.setattr(sweep_lib.trainer, "train", failing(message))
    r = sweep_lib.run_one(out, sweep, mha, 0, cfgs, None)
    assert r == {"status": "failed", "error": error, "wall_time_s": r["wall_time_s"],
                 "arm": "mha", "kind": "scratch", "method": "", "seed": 0, "num_kv_heads": 8}
    assert sweep_lib.read_result(out, mha, 0) == r
    with open(os.path.join(sweep_lib.run_dir(out, mha, 0), "error.txt")) as f:
      assert f.read().startswith("Traceback (most recent call last):")
  assert r["wall_time_s"] == 6.0  # its three attempts, 2 s each
  # Stopped: before training, or after a step (a signal in the last step too): no result.
  workdir = sweep_lib.run_dir(out, mqa, 0)
  for last, signum, message in (
      ({"step": 3, "start_step": 3}, None, "arm mqa seed 0 stopped before training, at step 3"),
      ({"step": 3, "start_step": 3}, 15,
       "arm mqa seed 0 stopped before training (signal 15), at step 3"),
      ({"step": 7, "start_step": 3}, None, "arm mqa seed 0 stopped at step 7; checkpoint saved"),
      ({"step": 20, "start_step": 3}, 2,
       "arm mqa seed 0 stopped at step 20 (signal 2); checkpoint saved")):
    monkeypatch.setattr(sweep_lib.trainer, "train",
                        lambda *a, last=last, **kw: clock.__setitem__(0, clock[0] + 1) or last)
    with pytest.raises(sweep_lib.SweepInterrupted) as e:
      sweep_lib.run_one(out, sweep, mqa, 0, cfgs, None, stop=types.SimpleNamespace(
          signum=signum))
    assert str(e.value) == message
    assert sweep_lib.read_result(out, mqa, 0) is None
  with open(os.path.join(workdir, "wall_time_s")) as f:
    assert f.read() == "4.000"


def test_an_uptraining_run_converts_its_seeds_finished_mha_run_once(tmp_path, monkeypatch):
  """_prepare_uptrain, the conversion and its evaluation stood in for: the seed's MHA run
  must have finished ("ok"); its final checkpoint (TrainConfig.steps) is converted to the
  arm's K and method with the run's seed and its whole TrainConfig and DataConfig.seed bound,
  in a folder of its own that replaces the run's (a workdir a cut-short conversion left is
  cleared) with the records of earlier attempts, evaluated at step 0, and the record
  (conversion.json) is what a rerun goes on from without converting again."""
  out = str(tmp_path)
  sweep, arms, cfgs = _sweep_of_3_arms_2_seeds()
  mha, _, up = arms
  configs = sweep_lib.run_configs(sweep, up, 1, *cfgs)
  workdir = sweep_lib.run_dir(out, up, 1)
  tmp = os.path.join(os.path.dirname(workdir), ".seed_1.converting")
  replaced = os.path.join(os.path.dirname(workdir), ".seed_1.replaced")
  calls = []

  def convert(src, dst, num_kv_heads, method, **kw):
    calls.append(("convert", src, dst, num_kv_heads, method, kw, os.path.exists(dst)))
    os.makedirs(os.path.join(dst, "checkpoints", "0"))
    return {"source": src, "source_step": kw["step"], "method": method,
            "num_kv_heads": num_kv_heads}

  def evaluate(workdir_, step):
    calls.append(("evaluate", workdir_, step, sorted(os.listdir(workdir_))))
    return {"loss": 2.75, "exact_match": 0.5}

  monkeypatch.setattr(sweep_lib, "write_converted_run", convert)
  monkeypatch.setattr(sweep_lib.trainer, "evaluate_workdir", evaluate)
  src = sweep_lib.run_dir(out, mha, 1)
  message = ("arm 'uptrain-mean-mqa' converts the finished 'mha' run of seed 1, which has not "
             "finished (run --arm mha first)")
  for result in (None, {"status": "failed", "error": "E: x"}, {"status": "interrupted"}):
    if result is not None:
      os.makedirs(src, exist_ok=True)
      sweep_lib._write_json(os.path.join(src, "result.json"), result)
    with pytest.raises(RuntimeError) as e:
      sweep_lib._prepare_uptrain(out, up, 1, mha, configs)
    assert str(e.value) == message and calls == []
  sweep_lib._write_json(os.path.join(src, "result.json"), _ok())
  mha_configs = sweep_lib.run_configs(sweep, mha, 1, *cfgs)
  final = mha_configs[2].steps
  with open(os.path.join(src, "config.gin"), "w") as f:
    f.write(config_gin.operative_config(*mha_configs, workdir=src))
  os.makedirs(os.path.join(workdir, "checkpoints", "0.orbax-checkpoint-tmp"))  # cut short
  # ... beside the records of an earlier attempt that failed (moved aside by run_one), which
  # stay (until 2026-12-06 they went with the folder: the report lost the failure, the wall
  # time that attempt's seconds).
  records = {sweep_lib.PREVIOUS_FAILURE_FILE: b'{"status": "failed", "error": "E: x"}',
             sweep_lib.WALL_FILE: b"4.250", sweep_lib.ERROR_FILE: b"Traceback ..."}

  def assert_records(folder, also=()):
    assert sorted(os.listdir(folder)) == sorted([*also, *records])
    for name, data in records.items():
      with open(os.path.join(folder, name), "rb") as f:
        assert f.read() == data, name

  for name, data in records.items():
    with open(os.path.join(workdir, name), "wb") as f:
      f.write(data)
  # A kill during the conversion (here the conversion raising past every handler) leaves the
  # run's folder as it was, records included (until 2026-12-06 it was emptied first).
  class Kill(BaseException):
    pass

  def killed(src, dst, *args, **kw):
    os.makedirs(os.path.join(dst, "checkpoints"))
    raise Kill

  monkeypatch.setattr(sweep_lib, "write_converted_run", killed)
  with pytest.raises(Kill):
    sweep_lib._prepare_uptrain(out, up, 1, mha, configs)
  assert_records(workdir, also=["checkpoints"])
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["0.orbax-checkpoint-tmp"]
  monkeypatch.setattr(sweep_lib, "write_converted_run", convert)
  want = {"source": src, "source_step": final, "method": "mean", "num_kv_heads": 1,
          "val_loss_converted": 2.75}
  assert sweep_lib._prepare_uptrain(out, up, 1, mha, configs) == want
  assert_records(workdir, also=["checkpoints", sweep_lib.CONVERSION_FILE])
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["0"]  # the cut-short one gone
  assert sorted(os.listdir(os.path.dirname(workdir))) == ["seed_1"]  # no tmp / replaced left
  tcfg = configs[2]
  bindings = {"TrainConfig": {f.name: getattr(tcfg, f.name) for f in dataclasses.fields(tcfg)},
              "DataConfig": {"seed": 1}}
  assert calls == [("convert", src, tmp, 1, "mean",
                    {"step": final, "seed": 1, "bindings": bindings}, False),
                   ("evaluate", workdir, 0, sorted(["checkpoints", *records]))]
  with open(os.path.join(workdir, sweep_lib.CONVERSION_FILE)) as f:
    assert json.load(f) == want
  calls.clear()
  assert sweep_lib._prepare_uptrain(out, up, 1, mha, configs) == want and calls == []
  # A conversion that fails keeps them too; what it left stays out of the run's folder.
  os.remove(os.path.join(workdir, sweep_lib.CONVERSION_FILE))

  def failing(src, dst, *args, **kw):
    os.makedirs(os.path.join(dst, "checkpoints"))
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(sweep_lib, "write_converted_run", failing)
  with pytest.raises(OSError, match="No space left"):
    sweep_lib._prepare_uptrain(out, up, 1, mha, configs)
  assert_records(workdir, also=["checkpoints"])
  # A kill between the two renames (the run's folder moved aside, the new one not yet in
  # place): the records are found in the new one; then a kill in the conversion after that
  # still loses none (they are back in the run's folder first).
  os.replace(workdir, replaced)
  os.makedirs(os.path.join(tmp, "checkpoints", "0"))
  for name, data in records.items():
    with open(os.path.join(tmp, name), "wb") as f:
      f.write(data)
  monkeypatch.setattr(sweep_lib, "write_converted_run", killed)
  with pytest.raises(Kill):
    sweep_lib._prepare_uptrain(out, up, 1, mha, configs)
  assert_records(workdir, also=["checkpoints"])
  monkeypatch.setattr(sweep_lib, "write_converted_run", convert)
  assert sweep_lib._prepare_uptrain(out, up, 1, mha, configs) == want
  assert_records(workdir, also=["checkpoints", sweep_lib.CONVERSION_FILE])
  assert sorted(os.listdir(os.path.dirname(workdir))) == ["seed_1"]
  # The MHA run's final checkpoint does not read: the run fails naming it and the way to
  # train that step again (until 2026-12-06 the checkpoint before was converted silently).
  os.remove(os.path.join(workdir, sweep_lib.CONVERSION_FILE))

  def unreadable(src, dst, *args, step, **kw):
    raise sweep_lib.UnreadableCheckpointError(f"checkpoint {step} does not read")

  monkeypatch.setattr(sweep_lib, "write_converted_run", unreadable)
  with pytest.raises(RuntimeError) as e:
    sweep_lib._prepare_uptrain(out, up, 1, mha, configs)
  assert str(e.value) == (
      f"arm 'uptrain-mean-mqa' converts the final checkpoint (step {final}) of the 'mha' run "
      f"of seed 1, which does not read (checkpoint {final} does not read); to train that step "
      f"again, delete {os.path.join(src, 'result.json')} and "
      f"{os.path.join(src, 'checkpoints', str(final))} and rerun")
  assert_records(workdir, also=["checkpoints"])
  # A first conversion: no run folder yet (nothing to move aside)
  shutil.rmtree(os.path.dirname(workdir))
  monkeypatch.setattr(sweep_lib, "write_converted_run", convert)
  assert sweep_lib._prepare_uptrain(out, up, 1, mha, configs) == want
  assert sorted(os.listdir(workdir)) == ["checkpoints", sweep_lib.CONVERSION_FILE]
  assert sorted(os.listdir(os.path.dirname(workdir))) == ["seed_1"]


# --------------------------------------------------------------------------- conversion


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
  """A 4-KV-head run with checkpoints at steps 2 and 4 (no training: the init states of two
  seeds), its data position 4 and 8 examples in, and step 6 half-saved; and a weights-only
  copy of it at step 3 (``attnlab convert --from-hf``'s layout). (src, weights_only, (mcfg,
  dcfg, tcfg))."""
  from attnlab import config_gin
  from attnlab.data import pipeline
  from attnlab.training import sharding as shd
  from attnlab.training import steps as steps_lib
  from attnlab.training.checkpoint import Checkpointer

  root = tmp_path_factory.mktemp("source")
  cfgs = (base(4), DataConfig(task="copy", seq_len=16, batch_size=2, seed=3),
          TrainConfig(steps=4, warmup_steps=1, seed=3))
  src, weights = str(root / "mha"), str(root / "weights")
  for workdir in (src, weights):
    os.makedirs(workdir)
    with open(os.path.join(workdir, "config.gin"), "w") as f:
      f.write(config_gin.operative_config(*cfgs, workdir=workdir))
  mesh = shd.make_mesh()
  ckpt = Checkpointer(src)
  for step, seed in ((2, 11), (4, 12)):
    _, state = steps_lib.init_train(cfgs[0], cfgs[2].replace(seed=seed), mesh)
    ckpt.save(step, state, {"index": step, "example": 2 * step, "batch_size": 2,
                            "stream": pipeline.stream_fields(cfgs[1])}, {"seed": 3})
  ckpt.close()
  # A save in progress (the run may still be training): the conversion only reads the run.
  os.makedirs(os.path.join(src, "checkpoints", "6.orbax-checkpoint-tmp", "params"))
  ckpt = Checkpointer(weights)
  ckpt.save_params(3, state["params"])
  ckpt.close()
  return src, weights, cfgs


def _param_state(model):
  from flax import nnx

  return nnx.state(model, nnx.Param)


def _assert_trees_equal(a, b):
  """Two ``checkpoint.flatten``s: the same names, bitwise equal arrays."""
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def _saved(workdir, step):
  """(data state, meta) of checkpoint ``step`` of ``workdir``, and its saved steps."""
  import orbax.checkpoint as ocp

  from attnlab.training.checkpoint import Checkpointer

  ckpt = Checkpointer(workdir, read_only=True)
  try:
    meta = ckpt.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    return ckpt.restore_data(step), dict(meta), ckpt.steps()
  finally:
    ckpt.close()


def test_write_converted_run_makes_a_run_at_step_0_of_the_converted_checkpoint(source_run,
                                                                                tmp_path):
  """The newest checkpoint converted (the random method seeded by ``seed``), saved as step 0
  with a fresh optimizer state and the source's data position (the bindings' batch size);
  config.gin is a header naming the conversion, then the source's configs with the new K and
  the bindings; meta holds the run's seed and the conversion record, which is returned."""
  import jax
  from flax import nnx

  import attnlab
  from attnlab import config_gin
  from attnlab.data import pipeline
  from attnlab.training import sharding as shd
  from attnlab.training import steps as steps_lib
  from attnlab.training.checkpoint import Checkpointer, flatten

  src, _, (mcfg, dcfg, tcfg) = source_run
  dst = str(tmp_path / "gqa")
  info = sweep_lib.write_converted_run(
      src, dst, 2, "random", seed=7,
      bindings={"TrainConfig": {"learning_rate": 0.005, "steps": 3},
                "DataConfig": {"batch_size": 4}})
  want = {"source": os.path.abspath(src), "source_step": 4, "method": "random",
          "num_kv_heads": 2, "source_num_kv_heads": 4}
  assert info == want and type(info["source_step"]) is int
  new = (mcfg.replace(num_kv_heads=2), dataclasses.replace(dcfg, batch_size=4),
         tcfg.replace(learning_rate=0.005, steps=3))
  with open(os.path.join(dst, "config.gin")) as f:
    assert f.read() == (
        f"# Converted by `attnlab convert-heads` from {src} step 4 (4 -> 2 KV heads, method "
        "random).\n" + config_gin.operative_config(*new, workdir=dst))
  data, meta, steps = _saved(dst, 0)
  assert steps == [0]
  assert data == {"index": 0, "example": 8, "batch_size": 4,
                  "stream": pipeline.stream_fields(new[1])}
  assert (meta["step"], meta["seed"], meta["converted"]) == (0, 3, want)
  source = attnlab.load_checkpoint(src, 4)[0]
  converted = attnlab.convert_heads(source, 2, "random", rngs=steps_lib.model_rngs(7))
  setup, fresh = steps_lib.init_train(new[0], new[2], shd.make_mesh())
  ckpt = Checkpointer(dst, read_only=True)
  try:
    state, _ = ckpt.restore(0, fresh)
  finally:
    ckpt.close()
  params = nnx.state(converted, nnx.Param)
  _assert_trees_equal(flatten(state["params"]), flatten(params))
  _assert_trees_equal(flatten(state["opt_state"]), flatten(jax.jit(setup.tx.init)(params)))
  assert int(state["step"]) == 0
  assert os.listdir(os.path.join(src, "checkpoints", "6.orbax-checkpoint-tmp")) == ["params"]


def test_write_converted_run_takes_the_step_asked_for_and_the_data_position_it_can(source_run,
                                                                                   tmp_path):
  """``step`` picks an older checkpoint; a run under another data stream (another
  DataConfig.seed bound) starts at its first example; a weights-only source (no data state
  saved) at the first too, in batches of its size."""
  import attnlab
  from attnlab.data import pipeline
  from attnlab.training import steps as steps_lib
  from attnlab.training.checkpoint import flatten

  src, weights, (_, dcfg, _) = source_run
  dst = str(tmp_path / "mqa")
  info = sweep_lib.write_converted_run(src, dst, 1, "first", step=2)
  assert (info["source_step"], info["method"], info["num_kv_heads"]) == (2, "first", 1)
  want = attnlab.convert_heads(attnlab.load_checkpoint(src, 2)[0], 1, "first")
  _assert_trees_equal(*(flatten(_param_state(m)) for m in (attnlab.load_checkpoint(dst, 0)[0],
                                                           want)))
  assert _saved(dst, 0)[0] == {"index": 0, "example": 4, "batch_size": 2,
                               "stream": pipeline.stream_fields(dcfg)}
  reseeded = str(tmp_path / "reseeded")  # and the random method's seed, 0 by default
  sweep_lib.write_converted_run(src, reseeded, 2, "random", bindings={"DataConfig": {"seed": 5}})
  assert _saved(reseeded, 0)[0] == {"index": 0, "example": 0, "batch_size": 2, "stream":
                                    pipeline.stream_fields(dataclasses.replace(dcfg, seed=5))}
  want = attnlab.convert_heads(attnlab.load_checkpoint(src, 4)[0], 2, "random",
                               rngs=steps_lib.model_rngs(0))
  _assert_trees_equal(*(flatten(_param_state(m)) for m in (
      attnlab.load_checkpoint(reseeded, 0)[0], want)))
  from_weights = str(tmp_path / "from_weights")
  os.makedirs(from_weights)  # an empty folder is a new run's
  info = sweep_lib.write_converted_run(weights, from_weights, 2, "mean")
  assert info["source_step"] == 3
  assert _saved(from_weights, 0)[0] == {"index": 0, "example": 0, "batch_size": 2,
                                        "stream": pipeline.stream_fields(dcfg)}


@pytest.mark.parametrize("make, what", [(os.mkdir, "a folder"), (os.mkfifo, "a FIFO")])
def test_a_rerun_refuses_a_folder_or_a_fifo_for_a_result_json(tmp_path, monkeypatch, make,
                                                              what):
  """A run's result.json that is a folder (or a FIFO): the rerun stops on it before anything
  runs, naming it as a damaged result.json is named (until 2026-12-07 a folder read as no
  result: the run trained again and its result's write failed with IsADirectoryError)."""
  out = str(tmp_path / "out")
  sweep, arms, base = _sweep_of_3_arms_2_seeds()
  path = os.path.join(sweep_lib.run_dir(out, arms[1], 1), sweep_lib.RESULT_FILE)
  os.makedirs(os.path.dirname(path))
  make(path)
  ran = []
  monkeypatch.setattr(sweep_lib, "prompt_set", lambda *a: [[7]] * 8)
  monkeypatch.setattr(sweep_lib, "run_one", lambda *a, **k: ran.append(a) or _ok())
  with released_after(10, path), pytest.raises(ValueError) as e:
    sweep_lib.run_sweep(out, sweep, arms, base, stream=io.StringIO())
  assert str(e.value) == (f"{path} is {what}, not a run result (attnlab writes a file there); "
                          "delete it to run that arm and seed again")
  assert ran == [] and sorted(os.listdir(out)) == [sweep_lib.ARMS_DIR]


def _run_with_its_own_tokenizer(source_run, own: str) -> str:
  """A copy of the source run at ``own`` whose config.gin names a tokenizer.json inside it
  (own/tok/, with a tokenizer_config.json beside it), as ``attnlab convert --from-hf`` makes
  one; the tokenizer.json's path."""
  from attnlab import config_gin

  src, _, (mcfg, dcfg, tcfg) = source_run
  shutil.copytree(src, own)
  os.makedirs(os.path.join(own, "tok"))
  path = word_level_tokenizer_json(os.path.join(own, "tok", "tokenizer.json"),
                                   ["<pad>", "a", "b"])
  with open(os.path.join(own, "tok", "tokenizer_config.json"), "w") as f:
    f.write('{"pad_token": "<pad>"}')
  hf = dataclasses.replace(dcfg, tokenizer="hf_json", tokenizer_model=path)
  with open(os.path.join(own, "config.gin"), "w") as f:
    f.write(config_gin.operative_config(mcfg, hf, tcfg, workdir=own))
  return path


def test_write_converted_run_copies_a_tokenizer_inside_the_source_run(source_run, tmp_path):
  """A run made by ``attnlab convert --from-hf`` holds its tokenizer.json (and the
  transformers files beside it): the new run gets copies, named relative to it, so it does
  not depend on the source's folder (``_copy_own_tokenizer``)."""
  own = str(tmp_path / "own")
  _run_with_its_own_tokenizer(source_run, own)
  dst = str(tmp_path / "own_mqa")
  sweep_lib.write_converted_run(own, dst, 1, "mean", step=2)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (Path(dst) / "tok" / name).read_bytes() == (Path(own) / "tok" / name).read_bytes()
  with open(os.path.join(dst, "config.gin")) as f:
    assert "DataConfig.tokenizer_model = 'tok/tokenizer.json'" in f.read().splitlines()


def test_write_converted_run_refuses_a_tokenizer_file_the_new_run_could_not_read(source_run,
                                                                                 tmp_path):
  """The run's own tokenizer.json empty, cut off, a folder, a FIFO or gone, or a folder or a
  FIFO for the tokenizer_config.json beside it: a ValueError naming the file and what is
  wrong, from the checks alone too, and nothing written. Until 2026-12-07 an empty or cut-off
  file was copied without a word (the new run's decode failed on it), and for a folder or a
  FIFO the new config.gin named the source's path."""
  own = str(tmp_path / "own")
  path = _run_with_its_own_tokenizer(source_run, own)
  whole = Path(path).read_bytes()
  config = os.path.join(own, "tok", "tokenizer_config.json")
  why = f" (the tokenizer of --from {own}, which the new run gets a copy of)"
  unreadable = f"tokenizer_model={path!r} is not a readable tokenizer.json: "
  cases = [
      (path, lambda p: Path(p).write_bytes(b""), unreadable + "EOF while parsing a value at "
       "line 1 column 0" + why),
      (path, lambda p: Path(p).write_bytes(whole[:40]), unreadable + "EOF while parsing"),
      (path, os.remove, unreadable + "No such file or directory"),
      (path, os.mkdir, f"tokenizer_model={path!r} is a folder, not a regular file: give the "
       "tokenizer.json file itself" + why),
      (path, os.mkfifo, f"tokenizer_model={path!r} is a FIFO, not a regular file: give the "
       "tokenizer.json file itself" + why),
      (config, os.mkfifo, f"{config} is a FIFO, not a regular file: put the file back or "
       "move it away" + why[:-1] + ", this file with it)"),
      (config, os.mkdir, f"{config} is a folder, not a regular file: put the file back or "
       "move it away" + why[:-1] + ", this file with it)"),
  ]
  dst = str(tmp_path / "new")
  for broken, make, message in cases:
    kept = Path(broken).read_bytes()
    os.remove(broken)
    if make is not os.remove:
      make(broken)
    for check_only in (True, False):
      with released_after(10, broken), pytest.raises(ValueError) as e:
        sweep_lib.write_converted_run(own, dst, 1, "mean", step=2, check_only=check_only)
      assert str(e.value).startswith(message), str(e.value)
      assert str(e.value).endswith(why if broken == path else ", this file with it)")
      assert not os.path.exists(dst)
    if os.path.isdir(broken):
      os.rmdir(broken)
    elif os.path.lexists(broken):
      os.remove(broken)
    Path(broken).write_bytes(kept)


def test_without_the_tokenizers_package_convert_heads_checks_what_it_can(source_run, tmp_path,
                                                                        monkeypatch):
  """The conversion needs no tokenizer package: where ``tokenizers`` is not installed, the
  run's own tokenizer.json is checked without it (a regular file, not empty, a JSON object)
  and a whole one goes through (the first version of the check refused every hf_json run
  there, naming the missing package)."""
  from attnlab.extras import MissingDependencyError

  own = str(tmp_path / "own")
  path = _run_with_its_own_tokenizer(source_run, own)
  whole = Path(path).read_bytes()

  def missing(*args, **kw):
    raise MissingDependencyError("tokenizer='hf_json' needs the tokenizers package")

  monkeypatch.setattr(sweep_lib, "make_tokenizer", missing)
  dst = str(tmp_path / "new")
  sweep_lib.write_converted_run(own, dst, 1, "mean", step=2, check_only=True)
  why = f" (the tokenizer of --from {own}, which the new run gets a copy of)"
  for bad, message in ((b"", f"tokenizer_model={path!r} is empty"),
                       (whole[:40], f"tokenizer_model={path!r} is not a readable "
                                    "tokenizer.json: not a JSON object"),
                       (None, f"tokenizer_model={path!r} is a folder, not a regular file: give "
                              "the tokenizer.json file itself")):
    os.remove(path)
    if bad is None:
      os.mkdir(path)
    else:
      Path(path).write_bytes(bad)
    with pytest.raises(ValueError) as e:
      sweep_lib.write_converted_run(own, dst, 1, "mean", step=2, check_only=True)
    assert str(e.value) == message + why
    if bad is None:
      os.rmdir(path)
    Path(path).write_bytes(whole)
  assert not os.path.exists(dst)
  # A sentencepiece model is checked the same way, and named as one.
  from attnlab import config_gin

  src, _, (mcfg, dcfg, tcfg) = source_run
  spm = os.path.join(own, "tok", "spm.model")
  os.mkdir(spm)
  with open(os.path.join(own, "config.gin"), "w") as f:
    f.write(config_gin.operative_config(
        mcfg, dataclasses.replace(dcfg, tokenizer="sentencepiece", tokenizer_model=spm), tcfg,
        workdir=own))
  with pytest.raises(ValueError) as e:
    sweep_lib.write_converted_run(own, dst, 1, "mean", step=2, check_only=True)
  assert str(e.value) == (f"tokenizer_model={spm!r} is a folder, not a regular file: give the "
                          "sentencepiece .model file itself" + why)


def test_a_tokenizer_outside_the_source_run_is_the_users_and_left_as_it_is(source_run,
                                                                          tmp_path):
  """A tokenizer file outside the source run (the user's data) is neither copied nor read by
  the conversion: the new run names it where it is, whatever it holds (the checks are for
  the copies the new run gets)."""
  from attnlab import config_gin

  src, _, (mcfg, dcfg, tcfg) = source_run
  own = str(tmp_path / "own")
  shutil.copytree(src, own)
  users = tmp_path / "data" / "tokenizer.json"
  users.parent.mkdir()
  users.write_bytes(b"")
  hf = dataclasses.replace(dcfg, tokenizer="hf_json", tokenizer_model=str(users))
  with open(os.path.join(own, "config.gin"), "w") as f:
    f.write(config_gin.operative_config(mcfg, hf, tcfg, workdir=own))
  dst = str(tmp_path / "new")
  sweep_lib.write_converted_run(own, dst, 1, "mean", step=2)
  with open(os.path.join(dst, "config.gin")) as f:
    assert f"DataConfig.tokenizer_model = {str(users)!r}" in f.read().splitlines()
  assert not [name for _, _, names in os.walk(dst) for name in names if name == "tokenizer.json"]


def test_write_converted_run_refuses_before_writing_anything(source_run, tmp_path):
  """Each refusal names what to fix; none writes ``dst``. ``check_only`` (what
  ``convert-heads`` calls first) runs every check, a step that was not saved and the new
  run's mesh too, and writes nothing either."""
  import jax

  from attnlab.training import sharding as shd

  src, _, _ = source_run
  dst = str(tmp_path / "new")
  not_a_run = str(tmp_path / "not_a_run")
  os.makedirs(not_a_run)
  no_checkpoint = str(tmp_path / "no_checkpoint")
  os.makedirs(no_checkpoint)
  shutil.copyfile(os.path.join(src, "config.gin"), os.path.join(no_checkpoint, "config.gin"))
  for args, kw, error, message in (
      ((not_a_run, dst, 2, "mean"), {}, FileNotFoundError,
       f"{not_a_run}/config.gin does not exist: --from is not a training run"),
      ((src, dst, 3, "mean"), {}, ValueError,
       "num_kv_heads=3 must divide the source model's 4 KV heads"),
      ((src, dst, 2, "median"), {}, ValueError,
       "method='median' is not one of 'mean', 'first', 'random'"),
      ((src, dst, 2, "mean"), {"seed": -1}, ValueError,
       "seed=-1 must be an integer in [0, 2**63 - 1]"),
      ((no_checkpoint, dst, 2, "mean"), {}, FileNotFoundError,
       f"{no_checkpoint}/checkpoints does not exist: the source run saved no checkpoint"),
      ((src, dst, 2, "mean"), {"step": 3}, ValueError,
       f"step=3 has no checkpoint in {src}/checkpoints; saved steps: [2, 4]"),
      ((src, dst, 2, "mean"), {"bindings": {"TrainConfig": {"steps": 0}}}, ValueError, None)):
    for check_only in (False, True):  # the same refusal from the checks alone
      with pytest.raises(error) as e:
        sweep_lib.write_converted_run(*args, **kw, check_only=check_only)
      assert message is None or str(e.value) == message, str(e.value)
      assert not os.path.exists(dst)
  # The checks alone return the new run's configs (the CLI checks its data against them).
  mcfg, dcfg, tcfg = config_gin.read_workdir_config(os.path.join(src, "config.gin"))
  new = {"configs": (mcfg.replace(num_kv_heads=2), dcfg, tcfg)}
  assert sweep_lib.write_converted_run(src, dst, 2, "mean", check_only=True) == new
  assert not os.path.exists(dst)
  os.makedirs(dst)  # an empty folder is a new run's
  assert sweep_lib.write_converted_run(src, dst, 2, "mean", check_only=True) == new
  assert os.listdir(dst) == []
  too_many = (len(jax.devices()) + 1, 1, 1)
  with pytest.raises(ValueError) as want:
    shd.make_mesh(too_many)
  with pytest.raises(ValueError) as e:
    sweep_lib.write_converted_run(src, dst, 2, "mean", check_only=True,
                                  bindings={"TrainConfig": {"mesh_shape": too_many}})
  assert str(e.value) == (
      f"{want.value} (the new run's TrainConfig.mesh_shape, the source's unless bound: give "
      "--gin.TrainConfig.mesh_shape=(D, F, T) for this machine's devices)")
  with open(os.path.join(dst, "x"), "w") as f:
    f.write("x")
  file = str(tmp_path / "file")
  with open(file, "w") as f:
    f.write("x")
  for path, what in ((dst, "is not empty"), (file, "is a file")):
    with pytest.raises(ValueError) as e:
      sweep_lib.write_converted_run(src, path, 2, "mean")
    assert str(e.value) == f"--to {path} already exists and {what}: give a new directory"
  assert os.listdir(dst) == ["x"]


def test_copy_own_tokenizer_copies_a_tokenizer_inside_the_source_run(tmp_path):
  """A tokenizer file inside ``src`` (a folder below it too) is copied to the same place in
  ``dst`` and named there; with tokenizer="hf_json" the transformers files beside it that
  exist are copied too. None named, a missing file or one outside ``src``: ``dcfg`` as it
  is."""
  src, dst, elsewhere = tmp_path / "src", tmp_path / "dst", tmp_path / "data"
  for folder in (src / "tok", dst, elsewhere):
    folder.mkdir(parents=True)
  files = {"tokenizer.json": b"{\"t\": 1}", "tokenizer_config.json": b"{\"c\": 2}",
           "special_tokens_map.json": b"{\"s\": 3}", "vocab.txt": b"v"}
  for name, content in files.items():
    (src / "tok" / name).write_bytes(content)
    (elsewhere / name).write_bytes(content)
  for dcfg in (DataConfig(), DataConfig(tokenizer="hf_json",
                                        tokenizer_model=str(src / "tok" / "missing.json")),
               DataConfig(tokenizer="hf_json", tokenizer_model=str(elsewhere / "tokenizer.json"))):
    assert sweep_lib._copy_own_tokenizer(dcfg, str(src), str(dst)) is dcfg
  assert os.listdir(dst) == []

  def copied():
    return {os.path.relpath(os.path.join(root, n), dst): (Path(root) / n).read_bytes()
            for root, _, names in os.walk(dst) for n in names}

  got = sweep_lib._copy_own_tokenizer(
      DataConfig(tokenizer="hf_json", tokenizer_model=str(src / "tok" / "tokenizer.json")),
      str(src), str(dst))
  assert got == DataConfig(tokenizer="hf_json",
                           tokenizer_model=os.path.join(str(dst), "tok", "tokenizer.json"))
  assert copied() == {os.path.join("tok", n): files[n] for n in
                      ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")}
  shutil.rmtree(dst)
  os.remove(src / "tok" / "special_tokens_map.json")
  sweep_lib._copy_own_tokenizer(  # named by its other file: the tokenizer.json beside it too
      DataConfig(tokenizer="hf_json", tokenizer_model=str(src / "tok" / "tokenizer_config.json")),
      str(src), str(dst))
  assert copied() == {os.path.join("tok", n): files[n]
                      for n in ("tokenizer_config.json", "tokenizer.json")}
  shutil.rmtree(dst)
  got = sweep_lib._copy_own_tokenizer(
      DataConfig(tokenizer="sentencepiece", tokenizer_model=str(src / "tok" / "vocab.txt")),
      str(src), str(dst))  # not hf_json: the file alone
  assert got.tokenizer_model == os.path.join(str(dst), "tok", "vocab.txt")
  assert copied() == {os.path.join("tok", "vocab.txt"): b"v"}


# --------------------------------------------------------------------------- measuring


def test_measure_reads_the_runs_records_and_times_both_decode_batches(tmp_path, monkeypatch,
                                                                     caplog):
  """measure with the checkpoint load and the decode timing stood in for: the curve is the
  last eval record of each step (a resume logs a step again), the final and best losses and
  perplexities come from it, the train rate is train_rate's, the sizes are the configs' (the
  parameters counted by hand), the final step's exact_match / bleu are copied, and the
  newest checkpoint is timed at batches 1 and 8 on the prompts. A run without an eval record
  of its last step is evaluated there; a nan loss is never the best."""
  import math

  workdir = str(tmp_path)
  mcfg = base(num_kv_heads=2)
  dcfg, tcfg = DataConfig(task="copy", seq_len=16, batch_size=2), TrainConfig(steps=20)
  sweep = Sweep(decode_new_tokens=5, decode_repeats=3)
  prompts = [[1, 2]] * 8
  calls, model = [], object()

  def load_checkpoint(workdir_, step):
    calls.append(("load", workdir_, step))
    return model, mcfg

  def decode_tokens_per_s(model_, prompts_, batch, new_tokens, repeats):
    assert model_ is model and prompts_ is prompts
    calls.append(("decode", batch, new_tokens, repeats))
    return 1000.0 + batch

  def evaluate_workdir(workdir_, step):
    calls.append(("evaluate", workdir_, step))
    return {"loss": 2.25, "exact_match": 0.5, "bleu": 12}

  monkeypatch.setattr(sweep_lib, "load_checkpoint", load_checkpoint)
  monkeypatch.setattr(sweep_lib, "decode_tokens_per_s", decode_tokens_per_s)
  monkeypatch.setattr(sweep_lib.trainer, "evaluate_workdir", evaluate_workdir)
  flag = {"window_holds_compile": True}
  records = [{"step": 5, "split": "train", "tokens_per_s": 1.0, **flag},
             {"step": 10, "split": "train", "tokens_per_s": 100.0},
             {"step": 10, "split": "eval", "loss": 3.0},
             {"step": 15, "split": "train", "tokens_per_s": 300.0},
             {"step": 10, "split": "eval", "loss": 1.75},  # resumed: the last record counts
             {"step": 20, "split": "train", "tokens_per_s": 200.0},
             {"step": 20, "split": "eval", "loss": 2, "exact_match": 1}]
  # ... and a line a kill cut short, warned of once (twice until 2026-12-06: read twice)
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records)
                                          + '{"step": 25, "spl\n')
  D, N, K, H, F, V = 32, 8, 2, 4, 64, 40
  attn = D * N * H * 2 + D * K * H * 2
  sizes = {"params": attn + V * D + 3 * D * F + 3 * D, "attention_params": attn, "d_ff": F,
           "num_kv_heads": K, "kv_bytes_per_token": 2 * 1 * K * H * 4, "steps": 20,
           "tokens_per_step": 2 * 16}
  with caplog.at_level(logging.WARNING):
    got = sweep_lib.measure(workdir, mcfg, dcfg, tcfg, sweep, prompts)
  assert len([m for m in caplog.messages if "skipped 1 line(s)" in m]) == 1, caplog.messages
  assert got == {**sizes, "val_loss": 2.0, "val_ppl": math.exp(2.0), "best_val_loss": 1.75,
                 "best_val_ppl": math.exp(1.75), "train_tokens_per_s": 200.0,
                 "curve": [[10, 1.75], [20, 2.0]], "exact_match": 1.0,
                 "decode_tokens_per_s_b1": 1001.0, "decode_tokens_per_s_b8": 1008.0}
  assert all(type(got[k]) is float for k in ("val_loss", "best_val_loss", "exact_match"))
  assert [type(loss) for _, loss in got["curve"]] == [float, float]
  assert calls == [("load", workdir, 20), ("decode", 1, 5, 3), ("decode", 8, 5, 3)]
  calls.clear()
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 10, "split": "eval",
                                                      "loss": float("nan")}) + "\n")
  got = sweep_lib.measure(workdir, mcfg, dcfg, tcfg, sweep, prompts)
  curve = got.pop("curve")
  assert got == {**sizes, "val_loss": 2.25, "val_ppl": math.exp(2.25), "best_val_loss": 2.25,
                 "best_val_ppl": math.exp(2.25), "train_tokens_per_s": None,
                 "exact_match": 0.5, "bleu": 12.0, "decode_tokens_per_s_b1": 1001.0,
                 "decode_tokens_per_s_b8": 1008.0}
  assert curve[1] == [20, 2.25] and curve[0][0] == 10 and math.isnan(curve[0][1])
  assert type(got["bleu"]) is float
  assert calls == [("evaluate", workdir, 20), ("load", workdir, 20), ("decode", 1, 5, 3),
                   ("decode", 8, 5, 3)]


def test_the_best_eval_step_skips_a_nan_loss():
  """A validation loss over no counted token is nan (2026-12-04): never the best step, and
  not in the way of the best when it comes first (min picked it: nan compares False). Equal
  losses: the earlier step."""
  nan = float("nan")
  assert sweep_lib.best_eval_step({2: {"loss": nan}, 4: {"loss": 3.0}, 6: {"loss": 2.5}}) == 6
  assert sweep_lib.best_eval_step({2: {"loss": 3.0}, 4: {"loss": nan}, 6: {"loss": 3.0}}) == 2
  assert sweep_lib.best_eval_step({6: {"loss": 3.0}, 4: {"loss": 3.0}, 2: {"loss": 4.0}}) == 4
  assert sweep_lib.best_eval_step({4: {"loss": 2.5}, 2: {"loss": 3.0}}) == 4
  assert sweep_lib.best_eval_step({2: {"loss": nan}}) == 2
  assert sweep_lib.best_eval_step({8: {"loss": "1.5"}, 2: {"loss": 2}}) == 8  # as float()


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_decode_tokens_per_s_is_the_best_timed_call_after_a_compile_call(monkeypatch, arch):
  """generate and the clock stood in for: the first ``batch`` prompts, padded on the right
  with pad_id to the longest, not to a bucket (a decoder-only call gets their lengths),
  greedy without an eos, once to
  compile and ``repeats`` times timed; tokens / s of the fastest."""
  import types

  cfg = base(arch=arch, pad_id=3, **({"num_encoder_layers": 1}
                                     if arch == "encoder_decoder" else {}))
  model = types.SimpleNamespace(cfg=cfg)
  clock, calls = [0.0], []
  durations = iter([100.0, 0.5, 0.25, 0.4])  # the compile call, then three timed ones

  def generate(model_, prompt_BT, **kw):
    assert model_ is model
    calls.append((prompt_BT.tolist(), prompt_BT.dtype,
                  {k: (v.tolist(), v.dtype) if isinstance(v, np.ndarray) else v
                   for k, v in kw.items()}))
    clock[0] += next(durations)
    return np.zeros((2, 1), np.int32)

  monkeypatch.setattr(sweep_lib, "generate", generate)
  monkeypatch.setattr(sweep_lib, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  prompts = [[5, 6, 7], [8], [9, 10, 11, 12]]
  got = sweep_lib.decode_tokens_per_s(model, prompts, 2, 6, 3)
  assert got == 2 * 6 / 0.25
  # One width every call: no bucket padding, which would only be timed.
  kw = {"max_new_tokens": 6, "eos_id": None, "bucket": False}
  if arch == "decoder_only":
    kw["prompt_lengths_B"] = ([3, 1], np.int32)
  assert calls == [([[5, 6, 7], [8, 3, 3]], np.int32, kw)] * 4
  calls.clear()
  durations = iter([1.0, 2.0])
  assert sweep_lib.decode_tokens_per_s(model, prompts, 1, 4, 1) == 1 * 4 / 2.0
  assert [c[0] for c in calls] == [[[5, 6, 7]]] * 2


def test_the_operative_sweep_config_reruns_the_sweep_on_its_own(tmp_path):
  """The sweep file ``attnlab ablate`` writes: its own header, then every field of the sweep
  (``base`` emptied) and of the three configs, as operative_config binds them; parsed back,
  it is the same sweep and configs."""
  from attnlab import config_gin

  sweep = Sweep(base=("lm_stdlib_tiny.gin",), num_kv_heads=(8, 1), seeds=(0, 3),
                uptrain_num_kv_heads=(1,), uptrain_fraction=0.25)
  cfgs = (base(), DataConfig(task="copy", seq_len=16, batch_size=2),
          TrainConfig(steps=20, warmup_steps=2))
  text = sweep_lib.operative_sweep_config(sweep, *cfgs)
  lines = config_gin.operative_config(dataclasses.replace(sweep, base=()), *cfgs).split("\n")
  assert lines[2] == ""
  assert text == "\n".join([
      "# The operative sweep config, written by `attnlab ablate`.",
      "# `attnlab ablate --gin_file THIS_FILE --out ...` reruns it. The seed of each run",
      "# replaces TrainConfig.seed and DataConfig.seed.", *lines[2:]])
  assert "Sweep.base = ()" in text.splitlines()
  path = tmp_path / "sweep.gin"
  path.write_text(text)
  assert config_gin.parse_sweep(str(path), []) == (dataclasses.replace(sweep, base=()), *cfgs)

