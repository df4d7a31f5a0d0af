"""The ablation report from hand-written run results: results.csv row by row (finished,
failed, interrupted and pending runs), summary.csv's means, standard deviations and paired
noise test against numpy, and the numbers report.md prints."""

import csv
import dataclasses
import json
import os

import numpy as np
import pytest

from attnlab import ModelConfig
from attnlab.config import DataConfig, Sweep, TrainConfig
from attnlab.training import report as report_lib
from attnlab.training import sweep as sweep_lib
from tests.fifos import released_after

MCFG = ModelConfig(d_model=32, num_heads=4, num_layers=1, d_ff=64)
BASE = (MCFG, DataConfig(task="copy", batch_size=2, seq_len=16),
        TrainConfig(steps=20, warmup_steps=2))
SWEEP = Sweep(num_kv_heads=(4, 2, 1), seeds=(0, 1, 2), uptrain_num_kv_heads=(1,),
              uptrain_methods=("mean",), uptrain_fraction=0.25)
# val_loss per arm and seed; None: the run did not finish.
LOSSES = {"mha": [2.0, 2.1, 1.9], "gqa2": [2.05, 2.2, None], "mqa": [2.5, None, None],
          "uptrain-mean-mqa": [2.3, 2.35, 2.4]}


def result(arm, seed, loss):
  r = dict(status="ok", val_loss=loss, val_ppl=float(np.exp(loss)), best_val_loss=loss - 0.01,
           train_tokens_per_s=1000.0 * (seed + 1), decode_tokens_per_s_b1=500.0 + seed,
           decode_tokens_per_s_b8=3000.0 - seed, wall_time_s=10.0 + seed,
           curve=[[0, 5.0], [20, loss]], arm=arm.name, kind=arm.kind, method=arm.method,
           seed=seed, num_kv_heads=arm.num_kv_heads)
  if arm.kind == "uptrain":
    r["val_loss_converted"] = 3.0 + seed
  return r


def write_result(out, arm, seed, r):
  """The run's result.json, as the sweep writes it."""
  workdir = sweep_lib.run_dir(out, arm, seed)
  os.makedirs(workdir)
  with open(os.path.join(workdir, sweep_lib.RESULT_FILE), "w") as f:
    json.dump(r, f)


def write_prompts(out, lengths):
  """OUT/prompts.json as the sweep writes it: prompts of these lengths."""
  with open(os.path.join(out, sweep_lib.PROMPTS_FILE), "w") as f:
    json.dump([list(range(3, 3 + n)) for n in lengths], f)


def read_report(out):
  with open(os.path.join(out, "report.md")) as f:
    return f.read()


@pytest.fixture
def report(tmp_path):  # per test: mutation testing attributes the calls to each test
  out = str(tmp_path)
  arms = sweep_lib.plan(SWEEP, MCFG)
  for arm in arms:
    for seed, loss in enumerate(LOSSES[arm.name]):
      if loss is not None:
        write_result(out, arm, seed, result(arm, seed, loss))
  write_result(out, "gqa2", 2, dict(status="failed", error="RuntimeError: boom",
                                     wall_time_s=1.0))
  os.makedirs(os.path.join(sweep_lib.run_dir(out, "mqa", 1), "checkpoints", "5"))
  write_prompts(out, [16] * 8)  # decode_prompt_len 32, cut to seq_len 16
  counts = report_lib.write_report(out, SWEEP, arms, BASE, plots=False)
  return out, arms, counts


def read_csv(out, name):
  with open(os.path.join(out, name)) as f:
    return list(csv.DictReader(f))


def test_results_csv_has_every_planned_run_with_its_status(report):
  out, arms, counts = report
  assert counts == {"ok": 9, "failed": 1, "interrupted": 1, "pending": 1, "outside_plan": 0}
  rows = read_csv(out, "results.csv")
  assert list(rows[0]) == report_lib.RESULT_COLUMNS
  assert [(r["arm"], r["seed"], r["status"]) for r in rows] == [
      ("mha", "0", "ok"), ("mha", "1", "ok"), ("mha", "2", "ok"),
      ("gqa2", "0", "ok"), ("gqa2", "1", "ok"), ("gqa2", "2", "failed"),
      ("mqa", "0", "ok"), ("mqa", "1", "interrupted"), ("mqa", "2", "pending"),
      ("uptrain-mean-mqa", "0", "ok"), ("uptrain-mean-mqa", "1", "ok"),
      ("uptrain-mean-mqa", "2", "ok")]
  by = {(r["arm"], int(r["seed"])): r for r in rows}
  assert by[("gqa2", 2)]["error"] == "RuntimeError: boom"
  assert by[("gqa2", 2)]["val_loss"] == ""
  assert by[("mqa", 1)]["error"] == "checkpoint at step 5 of 20; rerun to resume"
  assert by[("mqa", 2)]["error"] == "" and by[("mqa", 2)]["val_loss"] == ""
  # A run that never started still shows its plan.
  assert (by[("mqa", 2)]["kind"], by[("mqa", 2)]["num_kv_heads"]) == ("scratch", "1")
  assert by[("uptrain-mean-mqa", 2)]["method"] == "mean"
  r = by[("gqa2", 1)]
  assert float(r["val_loss"]) == 2.2 and float(r["train_tokens_per_s"]) == 2000.0
  assert (r["kind"], r["num_kv_heads"], r["steps"]) == ("scratch", "2", "20")
  assert int(r["train_tokens"]) == 20 * 2 * 16
  # Planned columns come from the arm's model: K KV heads of 8 dims, float32, 1 layer.
  assert int(r["kv_bytes_per_token"]) == 2 * 1 * 2 * 8 * 4
  params, attn = sweep_lib.param_counts(MCFG.replace(num_kv_heads=2))
  assert (int(r["params"]), int(r["attention_params"])) == (params, attn)
  up = by[("uptrain-mean-mqa", 2)]
  assert (up["kind"], up["method"], up["steps"]) == ("uptrain", "mean", "5")
  assert float(up["val_loss_converted"]) == 5.0


def test_summary_means_stds_and_the_paired_noise_test(report):
  out, _, _ = report
  summary = {s["arm"]: s for s in read_csv(out, "summary.csv")}
  assert list(next(iter(summary.values()))) == report_lib.SUMMARY_COLUMNS
  for name, losses in LOSSES.items():
    ok = [x for x in losses if x is not None]
    s = summary[name]
    assert (int(s["runs_ok"]), int(s["runs_planned"])) == (len(ok), 3), name
    assert float(s["val_loss_mean"]) == pytest.approx(np.mean(ok), rel=1e-5), name
    if len(ok) > 1:
      assert float(s["val_loss_std"]) == pytest.approx(np.std(ok, ddof=1), rel=1e-5), name
    else:
      assert s["val_loss_std"] == "", name  # one seed: no spread
  # Throughputs over the finished seeds only (gqa2: seeds 0 and 1).
  assert float(summary["gqa2"]["train_tokens_per_s_mean"]) == 1500.0
  assert float(summary["gqa2"]["decode_tokens_per_s_b8_std"]) == pytest.approx(
      np.std([3000.0, 2999.0], ddof=1), rel=1e-5)
  assert summary["mha"]["exceeds_seed_noise"] == ""  # the reference itself
  # gqa2 - mha over the seeds both finished (0, 1): +0.05, +0.10.
  d = np.array([2.05 - 2.0, 2.2 - 2.1])
  g = summary["gqa2"]
  assert float(g["val_loss_diff_vs_mha"]) == pytest.approx(d.mean(), rel=1e-5)
  assert float(g["val_loss_diff_se"]) == pytest.approx(d.std(ddof=1) / np.sqrt(2), rel=1e-5)
  assert g["exceeds_seed_noise"] == ("yes" if abs(d.mean()) > 2 * d.std(ddof=1) / np.sqrt(2)
                                     else "no")
  assert summary["mqa"]["exceeds_seed_noise"] == "n/a"  # one common seed
  u = np.array([0.3, 0.25, 0.5])  # uptrained mqa - mha, seeds 0..2
  assert float(summary["uptrain-mean-mqa"]["val_loss_diff_vs_mha"]) == pytest.approx(
      u.mean(), rel=1e-5)
  assert summary["uptrain-mean-mqa"]["exceeds_seed_noise"] == "yes"
  assert float(summary["uptrain-mean-mqa"]["val_loss_converted_mean"]) == 4.0


def test_report_markdown_prints_the_summary(report):
  out, arms, _ = report
  text = read_report(out)
  assert text.startswith(
      "# Head-sharing ablation\n\n"
      "Base model: decoder_only, d_model 32, 1 layers, 4 query heads (head dim 8), d_ff 64, "
      "float32. Data: task 'copy', batch 2 x 16 tokens. Training: 20 steps (adamw, cosine, "
      "peak lr 0.001). Seeds: 0, 1, 2. match_params: False.\n"
      "Finished runs: 9 of 12.\n\n"
      "## Arms (mean ± std over seeds)\n\n"
      "| arm | K | params | attention params | KV bytes/token | val loss | val ppl | "
      "best val loss | Δ loss vs MHA | beyond seed noise | train tok/s | decode tok/s b=1 | "
      "decode tok/s b=8 | wall s | runs |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|\n"
      "| mha | 4 | ")
  assert "| - | - | 2,000 ± 1,000 | 501 ± 1 | 2,999 ± 1 | 11 ± 1 | 3/3 |\n| gqa2" in text
  assert ("\n\nΔ: the mean over seeds of the per-seed difference arm - MHA (arms of a seed "
          "share the init seed, the data order and the validation rows). Beyond seed noise: "
          "|Δ| > 2 x stdev(per-seed differences) / sqrt(n), n the seeds both finished (n/a "
          "with fewer than 2): the mean difference exceeds twice its standard error (a paired "
          "test). Δ > 0 means the arm's loss is higher (worse) than MHA's. Throughputs are "
          "tokens/s (training: the median over logged windows, leaving out the first window "
          "of every process, i.e. of the run's start and of each resume, which holds a "
          "compilation; decode: cached greedy, 64 new tokens after 16-token prompts, best of "
          "3; a run left with no training window has none). Wall s: a run's seconds over all "
          "its attempts (a resume after an interruption or a failure adds to it).\n\n"
          "## Uptraining (MHA checkpoint converted, then 5 steps = 0.25 of 20)\n\n"
          "Each uptraining run: a fresh adamw state, cosine schedule, 0 warmup steps (the "
          "base's 2 scaled by 0.25) to peak lr 0.001 (the base's: Sweep.uptrain_learning_rate "
          "is unset; the from-scratch arms' is 0.001).\n\n"
          "| K | method | val loss after conversion | after uptraining | same K from scratch | "
          "Δ uptrained - scratch | beyond seed noise | MHA |\n"
          "|---:|---|---:|---:|---:|---:|:---:|---:|\n| 1 | mean | ") in text
  assert text.endswith(
      "\n\n## Runs not finished\n\n"
      "- gqa2 seed 2: failed (RuntimeError: boom)\n"
      "- mqa seed 1: interrupted (checkpoint at step 5 of 20; rerun to resume)\n"
      "- mqa seed 2: pending\n\n"
      "## Plots\n\n"
      "![val_loss_vs_tokens](val_loss_vs_tokens.png)\n"
      "![val_loss_vs_kv_bytes](val_loss_vs_kv_bytes.png)\n"
      "![decode_tokens_per_s](decode_tokens_per_s.png)\n")
  assert "exact match" not in text  # no translation scores, no table for them
  params, attn = sweep_lib.param_counts(MCFG.replace(num_kv_heads=2))
  mean, std = np.mean([2.05, 2.2]), np.std([2.05, 2.2], ddof=1)
  ppl = [np.exp(2.05), np.exp(2.2)]
  best = [2.04, 2.19]
  d = np.mean([0.05, 0.1])
  se = np.std([0.05, 0.1], ddof=1) / np.sqrt(2)
  row = (f"| gqa2 | 2 | {params:,} | {attn:,} | 128 | {mean:.4f} ± {std:.4f} | "
         f"{np.mean(ppl):.3f} ± {np.std(ppl, ddof=1):.3f} | "
         f"{np.mean(best):.4f} ± {np.std(best, ddof=1):.4f} | {d:+.4f} | "
         f"{'yes' if abs(d) > 2 * se else 'no'} | 1,500 ± 707 | 500 ± 1 | 3,000 ± 1 | "
         f"10 ± 1 | 2/3 |")
  assert row in text, row
  params, attn = sweep_lib.param_counts(MCFG.replace(num_kv_heads=1))
  assert (f"| mqa | 1 | {params:,} | {attn:,} | 64 | 2.5000 | {np.exp(2.5):.3f} | 2.4900 | "
          f"{0.5:+.4f} | n/a | 1,000 | 500 | 3,000 | 10 | 1/3 |") in text
  # The uptraining table: K, method, after conversion, after uptraining, the same K from
  # scratch (mqa: one seed), the paired difference (one common seed: n/a), MHA.
  up = (f"| 1 | mean | 4.0000 ± 1.0000 | 2.3500 ± 0.0500 | 2.5000 | {2.3 - 2.5:+.4f} | n/a | "
        f"2.0000 ± 0.1000 |")
  assert up in text, up


def test_a_sweep_without_mha_with_an_unfinished_arm_and_translation_scores(tmp_path):
  """No MHA arm: no differences to it; an arm with no finished run prints dashes; the
  exact-match / BLEU table appears when runs report them; the plots are written."""
  pytest.importorskip("matplotlib")
  mcfg = MCFG.replace(head_dim=16)
  sweep = Sweep(num_kv_heads=(2, 1), seeds=(0,))
  arms = sweep_lib.plan(sweep, mcfg)
  write_result(str(tmp_path), arms[0], 0,
               result(arms[0], 0, 2.0) | dict(exact_match=0.5, bleu=12.345))
  base = (mcfg, BASE[1], BASE[2])
  counts = report_lib.write_report(str(tmp_path), sweep, arms, base)
  assert counts == {"ok": 1, "failed": 0, "interrupted": 0, "pending": 1, "outside_plan": 0}
  summary = {s["arm"]: s for s in read_csv(str(tmp_path), "summary.csv")}
  for name in ("gqa2", "mqa"):
    assert summary[name]["val_loss_diff_vs_mha"] == summary[name]["exceeds_seed_noise"] == ""
  assert summary["mqa"]["val_loss_mean"] == "" and summary["mqa"]["runs_ok"] == "0"
  text = read_report(str(tmp_path))
  assert "4 query heads (head dim 16)" in text and "Seeds: 0." in text
  params, attn = sweep_lib.param_counts(mcfg.replace(num_kv_heads=2))
  assert (f"| gqa2 | 2 | {params:,} | {attn:,} | 256 | 2.0000 | {np.exp(2.0):.3f} | 1.9900 | - "
          f"| - | 1,000 | 500 | 3,000 | 10 | 1/1 |") in text
  assert "| mqa | 1 | " in text and "| - | - | - | - | - | - | - | - | - | 0/1 |" in text
  assert "|\n\n| arm | exact match | BLEU |\n|---|---:|---:|\n| gqa2 | 0.5000 | 12.35 |\n" \
      "| mqa | - | - |\n" in text
  assert "## Uptraining" not in text
  for png in report_lib.PLOTS:
    with open(os.path.join(str(tmp_path), png), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", png


def test_a_seed_with_a_non_finite_loss_gives_nan_cells_not_a_crash(tmp_path):
  """A finished run whose loss diverged (nan, inf) is reported as nan: the arm's spread and
  its noise verdict ("n/a") say nothing, the other arms are as usual, and the plots draw."""
  pytest.importorskip("matplotlib")
  sweep = Sweep(num_kv_heads=(4, 2), seeds=(0, 1, 2))
  arms = sweep_lib.plan(sweep, MCFG)
  losses = {"mha": [2.0, 2.1, 1.9], "gqa2": [2.05, float("nan"), float("inf")]}
  for arm in arms:
    for seed, loss in enumerate(losses[arm.name]):
      write_result(str(tmp_path), arm, seed, result(arm, seed, loss))
  assert report_lib.write_report(str(tmp_path), sweep, arms, BASE)["ok"] == 6
  summary = {s["arm"]: s for s in read_csv(str(tmp_path), "summary.csv")}
  assert summary["gqa2"]["val_loss_mean"] == summary["gqa2"]["val_loss_std"] == "nan"
  assert summary["gqa2"]["exceeds_seed_noise"] == "n/a"
  assert summary["mha"]["val_loss_std"] == report_lib._fmt(0.1)
  assert "| gqa2 | 2 | " in read_report(str(tmp_path))
  assert report_lib.noise_test({0: 1.0, 1: float("inf")}, {0: 1.0, 1: 1.0})[2] == "n/a"


@pytest.mark.parametrize("text, problem", [
    ("{not json", "is not a JSON run result (Expecting property name"),
    (b"\xff\xfe", "is not a JSON run result ('utf-8' codec can't decode"),
    ("[1, 2]", "is not a run result attnlab wrote (no status)"),
    ('{"val_loss": 2.0}', "(no status)"),
    ('{"status": "ok", "curve": [[0, 2.0]]}', "(val_loss=None, not a number)"),
    ('{"status": "ok", "val_loss": "2.0", "curve": []}', "(val_loss='2.0', not a number)"),
    ('{"status": "ok", "val_loss": 2.0}', "(no curve of [step, val_loss] pairs)"),
    ('{"status": "ok", "val_loss": 2.0, "curve": [[0, 2.0], [5]]}', "(no curve of"),
])
def test_a_result_file_attnlab_did_not_write_is_named_with_what_it_lacks(tmp_path, text,
                                                                         problem):
  """A hand-edited or damaged result.json: a ValueError naming the file and its fault
  (`attnlab ablate --report` prints it as one line), not a KeyError from inside the report."""
  sweep = Sweep(num_kv_heads=(4, 2), seeds=(0,))
  arms = sweep_lib.plan(sweep, MCFG)
  write_result(str(tmp_path), arms[0], 0, result(arms[0], 0, 2.0))
  path = os.path.join(sweep_lib.run_dir(str(tmp_path), arms[1], 0), sweep_lib.RESULT_FILE)
  os.makedirs(os.path.dirname(path))
  with open(path, "wb") as f:
    f.write(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(ValueError) as e:
    report_lib.write_report(str(tmp_path), sweep, arms, BASE, plots=False)
  assert str(e.value).startswith(path + " ") and problem in str(e.value), str(e.value)
  assert str(e.value).endswith("; delete it to run that arm and seed again")
  # A failed run's result needs no loss; a finished run's loss may be nan (it diverged).
  with open(path, "w") as f:
    json.dump({"status": "failed", "error": "RuntimeError: boom"}, f)
  assert report_lib.write_report(str(tmp_path), sweep, arms, BASE, plots=False) == {
      "ok": 1, "failed": 1, "interrupted": 0, "pending": 0, "outside_plan": 0}


@pytest.mark.parametrize("make, what", [(os.mkdir, "a folder"), (os.mkfifo, "a FIFO")])
def test_a_folder_or_a_fifo_for_a_result_json_is_named_as_a_damaged_one_is(tmp_path, make,
                                                                           what):
  """A folder (or a FIFO) in a planned run's result.json place: the ValueError of a damaged
  file, naming the path and what is there (until 2026-12-07 a folder read as no result: the
  run was counted interrupted or pending). Outside the plan it is listed as an unreadable
  result.json, as a damaged file is."""
  out = str(tmp_path)
  sweep = Sweep(num_kv_heads=(4, 2), seeds=(0,))
  arms = sweep_lib.plan(sweep, MCFG)
  write_result(out, arms[0], 0, result(arms[0], 0, 2.0))
  path = os.path.join(sweep_lib.run_dir(out, arms[1], 0), sweep_lib.RESULT_FILE)
  os.makedirs(os.path.dirname(path))
  make(path)
  with released_after(10, path), pytest.raises(ValueError) as e:
    report_lib.write_report(out, sweep, arms, BASE, plots=False)
  assert str(e.value) == (f"{path} is {what}, not a run result (attnlab writes a file there); "
                          "delete it to run that arm and seed again")
  assert sorted(os.listdir(out)) == [sweep_lib.ARMS_DIR]  # no report written
  narrower = Sweep(num_kv_heads=(4,), seeds=(0,))
  with released_after(10, path):
    counts = report_lib.write_report(out, narrower, sweep_lib.plan(narrower, MCFG), BASE,
                                     plots=False)
  assert counts["outside_plan"] == 1
  assert "\n- gqa2 seed 0: unreadable result.json\n" in read_report(out)


def test_a_fifo_for_the_prompts_or_a_previous_failure_is_read_as_missing(tmp_path):
  """The report's optional files (OUT/prompts.json, a run's result.previous_failure.json):
  a FIFO there is no file to read (until 2026-12-07 the report waited for a writer for
  good), as a missing one is."""
  out = str(tmp_path)
  arm = sweep_lib.plan(Sweep(num_kv_heads=(4,), seeds=(0,)), MCFG)[0]
  prompts = os.path.join(out, sweep_lib.PROMPTS_FILE)
  os.mkfifo(prompts)
  workdir = sweep_lib.run_dir(out, arm, 0)
  os.makedirs(workdir)
  failure = os.path.join(workdir, sweep_lib.PREVIOUS_FAILURE_FILE)
  os.mkfifo(failure)
  with released_after(10, prompts), released_after(10, failure):
    assert report_lib.prompt_lengths(out) is None
    assert report_lib._unfinished(out, arm, 0, 4) == {"status": "pending", "error": ""}


def test_csv_cells_keep_six_significant_digits_and_name_nan():
  assert [report_lib._fmt(v) for v in (None, "", float("nan"), 0.123456789, 1234567.0, 3, "a")
          ] == ["", "", "nan", "0.123457", "1.23457e+06", "3", "a"]


def test_uptraining_to_a_k_without_its_own_from_scratch_arm(tmp_path):
  """The uptraining table compares with the same K from scratch; with no such arm it says
  so with dashes."""
  sweep = Sweep(num_kv_heads=(4,), seeds=(0, 1), uptrain_num_kv_heads=(2,),
                uptrain_methods=("first",))
  arms = sweep_lib.plan(sweep, MCFG)
  for arm in arms:
    for seed in (0, 1):
      write_result(str(tmp_path), arm, seed,
                   result(arm, seed, 2.0 + 0.1 * seed + (arm.kind == "uptrain")))
  report_lib.write_report(str(tmp_path), sweep, arms, BASE, plots=False)
  text = read_report(str(tmp_path))
  assert ("| 2 | first | 3.5000 ± 0.7071 | 3.0500 ± 0.0707 | - | - | n/a | "
          "2.0500 ± 0.0707 |") in text


def test_scores_and_the_from_scratch_reference_show_their_spread_over_seeds(tmp_path):
  sweep = Sweep(num_kv_heads=(4, 2), seeds=(0, 1), uptrain_num_kv_heads=(2,),
                uptrain_methods=("mean",))
  arms = sweep_lib.plan(sweep, MCFG)
  for arm in arms:
    for seed in (0, 1):
      loss = {"mha": 2.0, "gqa2": 2.2, "uptrain-mean-gqa2": 2.1}[arm.name] + 0.2 * seed
      write_result(str(tmp_path), arm, seed, result(arm, seed, loss)
                   | dict(exact_match=0.5 + 0.1 * seed, bleu=10.0 + 2 * seed))
  report_lib.write_report(str(tmp_path), sweep, arms, BASE, plots=False)
  text = read_report(str(tmp_path))
  assert "| gqa2 | 0.5500 ± 0.0707 | 11.00 ± 1.41 |" in text
  # K=2 uptrained (2.1, 2.3) against K=2 from scratch (2.2, 2.4): -0.1 on both seeds.
  assert ("| 2 | mean | 3.5000 ± 0.7071 | 2.2000 ± 0.1414 | 2.3000 ± 0.1414 | -0.1000 | "
          in text)


def draw(out, monkeypatch, sweep, losses):
  """Write the report of ``sweep`` (``losses[arm][seed]``, None: not run) with its plots;
  (the three figures, kept as ``plot`` saves them, with the data they show; summary rows).
  The caller's matplotlib backend stays theirs (``plot`` switched it to Agg until
  2026-12-07)."""
  pytest.importorskip("matplotlib")
  import matplotlib
  from matplotlib.figure import Figure

  matplotlib.use("svg")  # the caller's (a notebook's inline one, say)
  closed = []
  savefig = Figure.savefig
  monkeypatch.setattr(Figure, "savefig",
                      lambda fig, *a, **kw: closed.append(fig) or savefig(fig, *a, **kw))
  arms = sweep_lib.plan(sweep, MCFG)
  for arm in arms:
    for seed, loss in enumerate(losses.get(arm.name, ())):
      if loss is not None:
        write_result(out, arm, seed, result(arm, seed, loss))
  report_lib.write_report(out, sweep, arms, BASE)
  assert matplotlib.get_backend() == "svg"
  assert len(closed) == 3
  for png, fig in zip(report_lib.PLOTS, closed, strict=True):
    with open(os.path.join(out, png), "rb") as f:
      head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", png
    # 120 dpi: the image is the figure's size in inches x 120 (width, height from IHDR).
    size = [int.from_bytes(head[i:i + 4], "big") for i in (16, 20)]
    assert size == [round(v * 120) for v in fig.get_size_inches()], png
  return closed, {s["arm"]: s for s in read_csv(out, "summary.csv")}


PLOT_SWEEP = dataclasses.replace(SWEEP, uptrain_methods=("mean", "first"))
PLOT_LOSSES = {**LOSSES, "uptrain-first-mqa": [2.6, 2.7, None]}


@pytest.fixture
def figures(tmp_path, monkeypatch):
  return draw(str(tmp_path), monkeypatch, PLOT_SWEEP, PLOT_LOSSES)


def band(ax, label):
  """(x, mean, std, line) of the band labelled ``label``: the line and its filled area."""
  (line,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
  x, mean = list(line.get_xdata()), list(line.get_ydata())
  (fill,) = [c for c in ax.collections
             if np.allclose(c.get_facecolor()[0][:3], matplotlib_rgb(line.get_color()))]
  assert fill.get_alpha() == 0.2
  vertices = fill.get_paths()[0].vertices
  lo = [min(y for vx, y in vertices if vx == xi) for xi in x]
  hi = [max(y for vx, y in vertices if vx == xi) for xi in x]
  std = [(h - l) / 2 for l, h in zip(lo, hi)]
  np.testing.assert_allclose([(l + h) / 2 for l, h in zip(lo, hi)], mean, atol=1e-12)
  return x, mean, std, line


def matplotlib_rgb(color):
  from matplotlib.colors import to_rgb

  return to_rgb(color)


def test_the_loss_curves_are_seed_means_with_std_bands_over_training_tokens(figures):
  (fig, _, _), summary = figures
  scratch, uptrain = fig.axes
  tokens_per_step = BASE[1].batch_size * BASE[1].seq_len  # 32
  assert (scratch.get_xlabel(), scratch.get_ylabel(), scratch.get_title()) == (
      "training tokens", "validation loss", "from scratch (mean ± std over seeds)")
  assert [t.get_text() for t in scratch.get_legend().get_texts()] == [
      "mha (3 seeds)", "gqa2 (2 seeds)", "mqa (1 seed)"]
  for label, losses in (("mha (3 seeds)", [2.0, 2.1, 1.9]), ("gqa2 (2 seeds)", [2.05, 2.2]),
                        ("mqa (1 seed)", [2.5])):
    x, mean, std, line = band(scratch, label)
    assert x == [0, 20 * tokens_per_step] and line.get_marker() == "."
    np.testing.assert_allclose(mean, [5.0, np.mean(losses)], rtol=1e-12)
    np.testing.assert_allclose(std, [0.0, np.std(losses, ddof=1) if len(losses) > 1 else 0.0],
                               atol=1e-12)
  assert (uptrain.get_xlabel(), uptrain.get_ylabel(), uptrain.get_title()) == (
      "uptraining tokens (after the MHA run)", "validation loss",
      "uptrained from the MHA checkpoint")
  assert [t.get_text() for t in uptrain.get_legend().get_texts()] == [
      "uptrain-mean-mqa (3 seeds)", "uptrain-first-mqa (2 seeds)"]
  # Mean-pooled conversion solid, the others dashed.
  for label, style, losses in (("uptrain-mean-mqa (3 seeds)", "-", [2.3, 2.35, 2.4]),
                               ("uptrain-first-mqa (2 seeds)", "--", [2.6, 2.7])):
    x, mean, std, line = band(uptrain, label)
    assert x == [0, 640] and line.get_linestyle() == style and line.get_marker() == "."
    np.testing.assert_allclose(mean, [5.0, np.mean(losses)], rtol=1e-12)
    np.testing.assert_allclose(std, [0.0, np.std(losses, ddof=1)], rtol=1e-9, atol=1e-12)
  # The from-scratch arm of the same K, as a dotted gray line at its mean, named.
  (ref,) = [ln for ln in uptrain.get_lines() if ln.get_linestyle() == ":"]
  assert list(ref.get_ydata()) == [2.5, 2.5] and ref.get_color() == "gray"
  assert [(t.get_text(), t.xy, t.get_color()) for t in uptrain.texts] == [
      ("mqa from scratch", (0, 2.5), "gray")]
  assert float(summary["mqa"]["val_loss_mean"]) == 2.5
  assert list(fig.get_size_inches()) == [12, 4.5]


def single_log2_axes(fig, xlabel, ylabel, title):
  """The figure's one axes, checked: x on a log2 scale, its labels and title."""
  (ax,) = fig.axes
  assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
  assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (xlabel, ylabel, title)
  return ax


def test_final_loss_against_kv_bytes_one_point_per_arm(figures):
  (_, fig, _), summary = figures
  ax = single_log2_axes(fig, "KV-cache bytes per token", "final validation loss",
                        "quality vs cache memory (mean ± std)")
  points = {c.get_label(): c for c in ax.containers}
  assert list(points) == ["mha", "gqa2", "mqa", "uptrain-mean-mqa", "uptrain-first-mqa"]
  for name, losses in PLOT_LOSSES.items():
    data_line, _, (bars,) = points[name]
    done = [v for v in losses if v is not None]
    assert list(data_line.get_xdata()) == [int(summary[name]["kv_bytes_per_token"])]
    np.testing.assert_allclose(np.asarray(data_line.get_ydata(), float), [np.mean(done)],
                               rtol=1e-12)
    assert data_line.get_marker() == ("^" if name.startswith("uptrain") else "o")
    assert data_line.get_linestyle() == "None"
    ((_, lo), (_, hi)) = bars.get_segments()[0]
    np.testing.assert_allclose((hi - lo) / 2, np.std(done, ddof=1) if len(done) > 1 else 0.0,
                               atol=1e-12)
  assert [t.get_text() for t in ax.get_legend().get_texts()] == list(points)


def test_decode_throughput_per_k_one_line_per_batch(figures):
  (_, _, fig), _ = figures
  ax = single_log2_axes(fig, "num_kv_heads (K)", "decode tokens/s",
                        "cached greedy decode throughput (mean ± std)")
  assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "2", "1"]
  assert list(ax.get_xticks()) == [4, 2, 1]
  lines = {c.get_label(): c for c in ax.containers}
  assert list(lines) == ["batch 1", "batch 8"]
  # result(): b1 = 500 + seed, b8 = 3000 - seed; mha seeds 0-2, gqa2 0-1, mqa 0.
  for label, per_seed in (("batch 1", lambda s: 500.0 + s), ("batch 8", lambda s: 3000.0 - s)):
    data_line, _, (bars,) = lines[label]
    assert list(data_line.get_xdata()) == [4, 2, 1] and data_line.get_marker() == "o"
    seeds = [(0, 1, 2), (0, 1), (0,)]
    np.testing.assert_allclose(np.asarray(data_line.get_ydata(), float),
                               [np.mean([per_seed(s) for s in ss]) for ss in seeds])
    half = [(seg[1][1] - seg[0][1]) / 2 for seg in bars.get_segments()]
    np.testing.assert_allclose(half, [1.0, 0.5 ** 0.5, 0.0], atol=1e-12)
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["batch 1", "batch 8"]


def test_plots_of_a_sweep_without_uptraining_and_with_unfinished_arms(tmp_path, monkeypatch,
                                                                     recwarn):
  """One panel of curves; an arm with no finished run is left out of every figure (and the
  arms after it are still drawn); with nothing finished the throughput axis still has a tick,
  and nothing warns (no empty legends)."""
  sweep = Sweep(num_kv_heads=(4, 2, 1), seeds=(0, 1))
  (curves, points, throughput), _ = draw(str(tmp_path / "a"), monkeypatch, sweep,
                                          {"mha": [2.0, 2.2], "mqa": [2.4]})
  (ax,) = curves.axes
  assert list(curves.get_size_inches()) == [6.5, 4.5]
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["mha (2 seeds)",
                                                                  "mqa (1 seed)"]
  assert [c.get_label() for c in points.axes[0].containers] == ["mha", "mqa"]
  assert [t.get_text() for t in throughput.axes[0].get_xticklabels()] == ["4", "1"]
  os.makedirs(tmp_path / "b")
  (curves, points, throughput), _ = draw(str(tmp_path / "b"), monkeypatch, sweep, {})
  assert list(throughput.axes[0].get_xticks()) == [1]
  assert [t.get_text() for t in throughput.axes[0].get_xticklabels()] == ["1"]
  assert curves.axes[0].get_legend() is None and points.axes[0].get_legend() is None
  assert not [str(w.message) for w in recwarn], [str(w.message) for w in recwarn]


def test_runs_outside_the_plan_are_listed_not_averaged_and_the_folder_names_the_seed(tmp_path):
  """A report under fewer seeds or arms than OUT holds leaves the other runs out of its
  tables and says so (report.md, the ``outside_plan`` count; a damaged result.json there
  does not stop it); a result.json whose own seed disagrees with its folder is that
  folder's seed (it cannot be counted twice)."""
  out = str(tmp_path)
  sweep = Sweep(num_kv_heads=(4, 2), seeds=(0, 1))
  arms = sweep_lib.plan(sweep, MCFG)
  for arm in arms:
    for seed in (0, 1):
      write_result(out, arm, seed, result(arm, seed, 2.0 + 0.1 * seed) | {"seed": 0})
  write_result(out, arms[1], 10, result(arms[1], 10, 3.5))  # seeds 2, 10: not in this plan
  write_result(out, arms[1], 2, result(arms[1], 2, 3.5))
  os.makedirs(os.path.join(out, sweep_lib.ARMS_DIR, "gqa2", "seed_x"))  # not a run's folder
  write_result(out, "mqa", 0, result(sweep_lib.plan(Sweep(num_kv_heads=(1,)), MCFG)[0], 0,
                                     9.0))
  os.makedirs(sweep_lib.run_dir(out, "mqa", 1))
  with open(os.path.join(sweep_lib.run_dir(out, "mqa", 1), sweep_lib.RESULT_FILE), "w") as f:
    f.write("{")
  os.makedirs(sweep_lib.run_dir(out, "gqa2", 7))  # no result.json: not a run's result
  with open(os.path.join(out, sweep_lib.ARMS_DIR, "a_note.txt"), "w") as f:
    f.write("rerun on the big box\n")  # a note beside the arms, listed before them: skipped
  counts = report_lib.write_report(out, sweep, arms, BASE, plots=False)
  assert counts == {"ok": 4, "failed": 0, "interrupted": 0, "pending": 0, "outside_plan": 4}
  assert [(r["arm"], r["seed"]) for r in read_csv(out, "results.csv")] == [
      ("mha", "0"), ("mha", "1"), ("gqa2", "0"), ("gqa2", "1")]
  summary = {s["arm"]: s for s in read_csv(out, "summary.csv")}
  assert float(summary["gqa2"]["val_loss_mean"]) == pytest.approx(2.05)  # not 3.5, not 2.0
  assert summary["gqa2"]["val_loss_diff_vs_mha"] == report_lib._fmt(0.0)
  text = read_report(out)
  assert ("\n\n## Runs under arms/ outside this plan\n\n4 run(s) with a result.json that this "
          "sweep's arms and seeds (0, 1) do not include; they are in none of the tables and "
          "plots above (rerun with the Sweep.seeds / Sweep.num_kv_heads that ran them to "
          "include them):\n\n- gqa2 seed 2: ok\n") in text
  assert ("\n- gqa2 seed 2: ok\n- gqa2 seed 10: ok\n- mqa seed 0: ok\n- mqa seed 1: "
          "unreadable result.json\n") in text  # seeds in numeric order
  assert "| 2/2 |" in text and "Finished runs: 4 of 4." in text


def test_a_measure_some_finished_runs_lack_names_how_many_runs_it_averages(tmp_path):
  """A throughput a run could not measure (one logged window: None) is averaged over the
  runs that have it, and report.md says over how many; the decode plot skips an arm
  without a decode throughput instead of failing."""
  out = str(tmp_path)
  sweep = Sweep(num_kv_heads=(4, 2), seeds=(0, 1, 2))
  arms = sweep_lib.plan(sweep, MCFG)
  for arm in arms:
    for seed in (0, 1, 2):
      r = result(arm, seed, 2.0)
      if arm.name == "gqa2":
        r["train_tokens_per_s"] = None if seed == 2 else r["train_tokens_per_s"]
        del r["decode_tokens_per_s_b1"]
        if seed:
          del r["decode_tokens_per_s_b8"]  # one run of three has it
      write_result(out, arm, seed, r)
  report_lib.write_report(out, sweep, arms, BASE, plots=False)
  text = read_report(out)
  assert "| 1,500 ± 707 (2 runs) | - | 3,000 (1 run) | 11 ± 1 | 3/3 |" in text  # gqa2
  assert "| 2,000 ± 1,000 | 501 ± 1 | 2,999 ± 1 | 11 ± 1 | 3/3 |" in text  # mha: every run
  pytest.importorskip("matplotlib")
  report_lib.write_report(out, sweep, arms, BASE)
  with open(os.path.join(out, "decode_tokens_per_s.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_curve_bands_average_each_step_over_the_seeds_that_logged_it():
  """A seed missing a step (an eval lost to a failure and resume) or with no curve at all
  leaves the other seeds' points in place."""
  steps, mean, std = report_lib.curve_band([[[0, 5.0], [10, 3.0], [20, 2.0]],
                                            [[0, 7.0], [20, 4.0]], []])
  assert steps == [0, 10, 20]
  assert mean == [6.0, 3.0, 3.0]
  assert std == [pytest.approx(np.std([5.0, 7.0], ddof=1)), 0.0,
                 pytest.approx(np.std([2.0, 4.0], ddof=1))]
  assert report_lib.curve_band([]) == ([], [], [])


def test_the_report_is_utf8_whatever_the_locale(report):
  """report.md holds "±" and "Δ": written as UTF-8 also under a C / ASCII locale (it was
  the locale's encoding: a UnicodeEncodeError and a truncated report.md)."""
  import subprocess
  import sys

  out, _, _ = report
  os.remove(os.path.join(out, "report.md"))
  code = ("import sys; from tests.training.test_report import *; "
          "report_lib.write_report(sys.argv[1], SWEEP, sweep_lib.plan(SWEEP, MCFG), BASE, "
          "plots=False)")
  env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0",
             PYTHONIOENCODING="ascii")
  res = subprocess.run([sys.executable, "-c", code, out], env=env, capture_output=True,
                       text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert res.returncode == 0, res.stderr[-2000:]
  with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
    text = f.read()
  assert "± " in text and "Δ loss vs MHA" in text


def test_the_csvs_and_report_are_utf8_under_an_ascii_locale(tmp_path):
  """A failed run's error as written (a path with an "é"), in results.csv and report.md
  under an ASCII locale too (README: UTF-8 whatever the locale): the in-process twin of the
  test above, whose subprocess mutation testing does not see."""
  import locale
  import sys

  if sys.flags.utf8_mode:  # (PYTHONUTF8=1, or started under the C locale): no locale changes
    pytest.skip("Python's UTF-8 mode opens files as UTF-8 whatever the locale; the "
                "subprocess test above covers the report")
  out = str(tmp_path)
  sweep = Sweep(num_kv_heads=(4,), seeds=(0, 1))
  arms = sweep_lib.plan(sweep, MCFG)
  write_result(out, arms[0], 0, result(arms[0], 0, 2.0))
  error = "OSError: /données/run is full"
  write_result(out, arms[0], 1, dict(status="failed", error=error, wall_time_s=1.0))
  before = locale.setlocale(locale.LC_CTYPE)
  locale.setlocale(locale.LC_CTYPE, "C")
  try:
    assert "utf" not in locale.getpreferredencoding(False).lower()
    report_lib.write_report(out, sweep, arms, BASE, plots=False)
  finally:
    locale.setlocale(locale.LC_CTYPE, before)
  with open(os.path.join(out, "results.csv"), encoding="utf-8", newline="") as f:
    assert [r["error"] for r in csv.DictReader(f)] == ["", error]
  assert f"- mha seed 1: failed ({error})\n" in read_report(out)


def test_train_rate_leaves_out_every_window_that_holds_a_compilation():
  """The first window of each process (a new run, a resume) is flagged by the trainer and
  left out of the median; a resume's records of a step replace the killed run's; records
  written before the flag leave out their first window only; none left: None."""
  flag = {"window_holds_compile": True}
  rec = lambda step, rate, **kw: {"step": step, "split": "train", "tokens_per_s": rate, **kw}
  records = [rec(10, 1.0, **flag), rec(20, 100.0), rec(30, 110.0), rec(40, 5.0),
             {"step": 20, "split": "eval", "loss": 2.0},
             rec(40, 2.0, **flag), rec(50, 120.0)]  # killed after 40, resumed from 30
  assert sweep_lib.train_rate(records) == 110.0  # median of 100, 110, 120
  old = [rec(10, 1.0), rec(20, 100.0), rec(30, 300.0)]
  assert sweep_lib.train_rate(old) == 200.0
  assert sweep_lib.train_rate([rec(10, 1.0, **flag)]) is None
  assert sweep_lib.train_rate([rec(10, 1.0)]) is None


@pytest.mark.parametrize("lengths, text", [
    ([7, 8, 8, 5, 5, 8, 8, 8], "64 new tokens after source prompts of 5-8 tokens (mean 7.1; "
                               "batch 1 decodes the first, of 7), best of 3;"),
    ([6] * 8, "64 new tokens after 6-token source prompts, best of 3;"),
    (None, "64 new tokens after source prompts of at most 16 tokens (their lengths unknown: no "
           "readable prompts.json), best of 3;"),
    (b"\xff\xfe", "of at most 16 tokens (their lengths unknown: no readable prompts.json)"),
    ("[[], [3]]", "of at most 16 tokens (their lengths unknown: no readable prompts.json)"),
])
def test_the_decode_prompts_are_named_by_the_lengths_the_benchmark_used(tmp_path, lengths,
                                                                        text):
  """report.md names the prompts' measured lengths (OUT/prompts.json, the prompts every run
  was decoded from): an encoder-decoder's sources lose their padding, so they vary; a
  decoder-only prompt is cut to seq_len (the fixture's: 16, not decode_prompt_len 32). Until
  2026-12-04 it said "32-token prompts" whatever they were. Without a readable file it gives
  the bound."""
  out = str(tmp_path)
  mcfg = MCFG.replace(arch="encoder_decoder")
  sweep = Sweep(num_kv_heads=(4,), seeds=(0,))
  arms = sweep_lib.plan(sweep, mcfg)
  write_result(out, arms[0], 0, result(arms[0], 0, 2.0))
  if isinstance(lengths, list):
    write_prompts(out, lengths)
  elif lengths is not None:
    with open(os.path.join(out, sweep_lib.PROMPTS_FILE), "wb") as f:
      f.write(lengths if isinstance(lengths, bytes) else lengths.encode())
  report_lib.write_report(out, sweep, arms, (mcfg, BASE[1], BASE[2]), plots=False)
  assert text in read_report(out)


def _encoder_decoder_results(out):
  """An encoder-decoder sweep of MHA and MQA (one seed each), its results written in OUT."""
  mcfg = MCFG.replace(arch="encoder_decoder")
  sweep = Sweep(num_kv_heads=(4, 1), seeds=(0,))
  arms = sweep_lib.plan(sweep, mcfg)
  for arm in arms:
    write_result(out, arm, 0, result(arm, 0, 2.0))
  return mcfg, sweep, arms


def test_an_encoder_decoders_kv_bytes_are_self_attention_and_cross_attention_apart(tmp_path):
  """kv_bytes_per_token is the decoder's self-attention cache per token; an encoder-decoder
  also caches cross-attention K/V per source token, which shrink with K too: report.md
  labels the one column and adds the other, the CSVs append
  cross_kv_bytes_per_source_token (empty for a decoder-only model). Until 2026-12-04 the
  column read "KV bytes/token" and the cross-attention cache was in no figure."""
  out = str(tmp_path)
  mcfg, sweep, arms = _encoder_decoder_results(out)
  report_lib.write_report(out, sweep, arms, (mcfg, BASE[1], BASE[2]), plots=False)
  text = read_report(out)
  assert ("| arm | K | params | attention params | self-attn KV bytes/token | cross-attn KV "
          "bytes/source token | val loss | val ppl | best val loss | Δ loss vs MHA | beyond "
          "seed noise | train tok/s | decode tok/s b=1 | decode tok/s b=8 | wall s | runs |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|\n"
          ) in text
  params, attn = sweep_lib.param_counts(mcfg.replace(num_kv_heads=1))
  # 2 (K and V) x 1 decoder layer x 1 KV head x head dim 8 x 4 bytes, per token either way.
  assert f"| mqa | 1 | {params:,} | {attn:,} | 64 | 64 | 2.0000 | " in text
  assert "| mha | 4 | " in text and " | 256 | 256 | 2.0000 | " in text
  assert ("failure adds to it). KV bytes: K and V cached per token over the decoder's "
          "self-attention layers "  # the notes' paragraph, after its last sentence
          "(self-attn, per decoder token) and its cross-attention layers "
          "(cross-attn, per source token, computed once per source), 2 x layers x K x head "
          "dim x float32 bytes each.") in text
  for name in ("results.csv", "summary.csv"):
    got = {r["arm"]: (r["kv_bytes_per_token"], r["cross_kv_bytes_per_source_token"])
           for r in read_csv(out, name)}
    assert got == {"mha": ("256", "256"), "mqa": ("64", "64")}, name
  # Two encoder layers: the cross-attention cache is the decoder's (1 layer), not theirs.
  assert report_lib.cross_kv_bytes_per_source_token(mcfg.replace(num_encoder_layers=2)) == 256
  assert report_lib.cross_kv_bytes_per_source_token(MCFG) is None


def test_an_encoder_decoders_cache_figure_names_the_self_attention_cache(tmp_path,
                                                                         monkeypatch):
  """The cache-memory figure's x axis of an encoder-decoder sweep is its self-attention
  cache per token (the decoder-only label is checked above)."""
  pytest.importorskip("matplotlib")
  from matplotlib.figure import Figure

  closed = []
  savefig = Figure.savefig
  monkeypatch.setattr(Figure, "savefig",
                      lambda fig, *a, **kw: closed.append(fig) or savefig(fig, *a, **kw))
  out = str(tmp_path)
  mcfg, sweep, arms = _encoder_decoder_results(out)
  report_lib.write_report(out, sweep, arms, (mcfg, BASE[1], BASE[2]))
  assert closed[1].axes[0].get_xlabel() == "self-attention KV-cache bytes per token"


def test_decoder_only_csvs_keep_their_columns_and_append_the_new_ones(report):
  """The CSVs' columns of before 2026-12-04 keep their places (experiments/ and scripts read
  them); learning_rate, warmup_steps and cross_kv_bytes_per_source_token come last."""
  out, _, _ = report
  assert report_lib.RESULT_COLUMNS[:24] == [
      "arm", "kind", "method", "num_kv_heads", "seed", "status", "params", "attention_params",
      "d_ff", "kv_bytes_per_token", "steps", "train_tokens", "val_loss", "val_ppl",
      "best_val_loss", "best_val_ppl", "val_loss_converted", "train_tokens_per_s",
      "decode_tokens_per_s_b1", "decode_tokens_per_s_b8", "wall_time_s", "exact_match", "bleu",
      "error"]
  new = ["learning_rate", "warmup_steps", "cross_kv_bytes_per_source_token"]
  assert report_lib.RESULT_COLUMNS[24:] == new
  assert report_lib.SUMMARY_COLUMNS[-4:] == ["exceeds_seed_noise", *new]
  assert len(report_lib.SUMMARY_COLUMNS) == 34 + 3
  assert {r["cross_kv_bytes_per_source_token"] for r in read_csv(out, "results.csv")} == {""}
  assert "KV bytes/token | val loss" in read_report(out) and "KV bytes:" not in read_report(out)


def test_the_uptraining_runs_learning_rate_and_warmup_are_stated(tmp_path):
  """The uptraining runs' peak lr (Sweep.uptrain_learning_rate) and scaled warmup are in
  report.md's Uptraining section and in each row of the CSVs (until 2026-12-04 only the
  base's peak lr was printed, as if the uptraining arms had trained at it)."""
  out = str(tmp_path)
  sweep = Sweep(num_kv_heads=(4,), seeds=(0,), uptrain_num_kv_heads=(1,),
                uptrain_methods=("mean",), uptrain_fraction=0.25, uptrain_learning_rate=1e-4)
  base = (MCFG, BASE[1], TrainConfig(steps=100, warmup_steps=40))
  arms = sweep_lib.plan(sweep, MCFG)
  for arm in arms:
    write_result(out, arm, 0, result(arm, 0, 2.0))
  report_lib.write_report(out, sweep, arms, base, plots=False)
  assert ("## Uptraining (MHA checkpoint converted, then 25 steps = 0.25 of 100)\n\n"
          "Each uptraining run: a fresh adamw state, cosine schedule, 10 warmup steps (the "
          "base's 40 scaled by 0.25) to peak lr 0.0001 (Sweep.uptrain_learning_rate; the "
          "from-scratch arms' is 0.001).\n\n| K | method |") in read_report(out)
  for name in ("results.csv", "summary.csv"):
    got = {r["arm"]: (r["steps"], r["warmup_steps"], r["learning_rate"])
           for r in read_csv(out, name)}
    assert got == {"mha": ("100", "40", "0.001"),
                   "uptrain-mean-mqa": ("25", "10", "0.0001")}, name
