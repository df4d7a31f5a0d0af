"""The tables, report and plots of a head-sharing sweep (``attnlab ablate``).

Built only from the ``result.json`` files of ``OUT/arms/*/seed_*`` and the
sweep plan, so it can be rebuilt at any time from whatever has finished:

- ``results.csv``: one row per planned run (``RESULT_COLUMNS``); a run not
  started has status "pending", one stopped before its last step
  "interrupted", one that raised "failed" (and its error; while a rerun retries
  it, "interrupted" or "pending" again, naming the failure before);
- ``summary.csv``: one row per arm (``SUMMARY_COLUMNS``): mean and standard
  deviation over its finished seeds, and the noise test below;
- ``report.md``: the same as tables, the uptraining comparison, the runs that
  failed or are pending, and the plots; the decode benchmark's prompt lengths are
  measured on ``OUT/prompts.json``, the prompts every run was decoded from;
- ``val_loss_vs_tokens.png``, ``val_loss_vs_kv_bytes.png``,
  ``decode_tokens_per_s.png``.

Seed noise: arms of one seed share the init seed, the training data order and
the validation rows, so an arm is compared with MHA seed by seed (a paired
test): with d_s = loss_a(s) - loss_mha(s) over the n seeds both finished, the
arm differs beyond seed noise when |mean(d)| > 2 * stdev(d) / sqrt(n) (n >= 2),
i.e. the mean difference exceeds twice its standard error.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import socket
import statistics

from attnlab.config import kv_cache_bytes
from attnlab.data.tokenizer import not_a_regular_file
from attnlab.training import sweep as sweep_lib
from attnlab.training.trainer import failure_cause, write_text_atomically

RESULT_COLUMNS = [
    "arm", "kind", "method", "num_kv_heads", "seed", "status", "params", "attention_params",
    "d_ff", "kv_bytes_per_token", "steps", "train_tokens", "val_loss", "val_ppl",
    "best_val_loss", "best_val_ppl", "val_loss_converted", "train_tokens_per_s",
    "decode_tokens_per_s_b1", "decode_tokens_per_s_b8", "wall_time_s", "exact_match", "bleu",
    "error",
    # Appended 2026-12-04 (the columns before keep their places): the run's peak learning
    # rate and warmup (an uptraining run's are Sweep.uptrain_learning_rate's and the scaled
    # warmup), and an encoder-decoder's cross-attention K/V bytes per source token (empty
    # for a decoder-only model). kv_bytes_per_token is the decoder's self-attention alone.
    "learning_rate", "warmup_steps", "cross_kv_bytes_per_source_token",
]
PLANNED_SETTINGS = ["learning_rate", "warmup_steps", "cross_kv_bytes_per_source_token"]
MEASURES = ["val_loss", "val_ppl", "best_val_loss", "val_loss_converted", "train_tokens_per_s",
            "decode_tokens_per_s_b1", "decode_tokens_per_s_b8", "wall_time_s", "exact_match",
            "bleu"]
SUMMARY_COLUMNS = (
    ["arm", "kind", "method", "num_kv_heads", "runs_ok", "runs_planned", "params",
     "attention_params", "d_ff", "kv_bytes_per_token", "steps"]
    + [f"{m}_{s}" for m in MEASURES for s in ("mean", "std")]
    + ["val_loss_diff_vs_mha", "val_loss_diff_se", "exceeds_seed_noise"]
    + PLANNED_SETTINGS)  # appended 2026-12-04, as in RESULT_COLUMNS
PLOTS = ("val_loss_vs_tokens.png", "val_loss_vs_kv_bytes.png", "decode_tokens_per_s.png")
NOISE_FACTOR = 2.0


class ReportWriteError(RuntimeError):
  """A file of the report could not be written (a full disk, a read-only folder): the
  message names it and the reason. The files written before it are whole and new, the
  others as they were."""


def cross_kv_bytes_per_source_token(mcfg) -> int | None:
  """Bytes of cross-attention K and V an encoder-decoder caches per source token over its
  decoder layers (``CrossKVCache``: 2 x L x K x head_dim, in the model's dtype; the
  source's int32 segment ids aside); None for a decoder-only model. It shrinks with K
  as the self-attention cache (``ModelConfig.kv_cache_bytes_per_token``) does."""
  if mcfg.arch == "decoder_only":
    return None
  return kv_cache_bytes(layers=mcfg.num_layers, seq=1, kv_heads=mcfg.num_kv_heads,
                        head_dim=mcfg.head_dim, dtype=mcfg.dtype)


def _read_json(path: str):
  """The JSON in the file ``path``; an OSError for anything there that is no regular file
  (a FIFO would make the report wait for a writer for good), as for a missing one."""
  kind = not_a_regular_file(path)
  if kind is not None:
    raise OSError(f"{path} is {kind}, not a regular file")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def prompt_lengths(out: str) -> list[int] | None:
  """The token counts of the decode benchmark's prompts (``OUT/prompts.json``, written
  before the first run is measured); None when that file is missing or not a list of
  token lists."""
  try:
    prompts = _read_json(os.path.join(out, sweep_lib.PROMPTS_FILE))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  if not (isinstance(prompts, list) and prompts
          and all(isinstance(p, list) and p for p in prompts)):
    return None
  return [len(p) for p in prompts]


def collect(out: str, sweep, arms, base) -> tuple[list[dict], dict]:
  """(rows of results.csv, {(arm, seed): its curve [[step, val_loss], ...]})."""
  mcfg, dcfg, tcfg = base
  rows, curves = [], {}
  for arm in arms:
    amcfg, adcfg, atcfg = sweep_lib.run_configs(sweep, arm, sweep.seeds[0], mcfg, dcfg, tcfg)
    params, attn = sweep_lib.param_counts(amcfg)
    planned = {"arm": arm.name, "kind": arm.kind, "method": arm.method,
               "num_kv_heads": arm.num_kv_heads, "params": params, "attention_params": attn,
               "d_ff": arm.d_ff, "kv_bytes_per_token": amcfg.kv_cache_bytes_per_token(),
               "steps": atcfg.steps,
               "train_tokens": atcfg.steps * adcfg.batch_size * adcfg.seq_len,
               "learning_rate": atcfg.learning_rate, "warmup_steps": atcfg.warmup_steps,
               "cross_kv_bytes_per_source_token": cross_kv_bytes_per_source_token(amcfg)}
    for seed in sweep.seeds:
      r = sweep_lib.read_result(out, arm, seed) or _unfinished(out, arm, seed, atcfg.steps)
      row = {**planned, "seed": seed, "status": r["status"]}
      if r["status"] == "ok":
        # The plan names the run (arm, seed): a file's own fields cannot move it.
        row.update({k: r[k] for k in RESULT_COLUMNS if k in r and k not in row})
        curves[(arm.name, seed)] = r["curve"]
      else:
        row["error"] = r.get("error", "")
      rows.append(row)
  return rows, curves


def outside_plan(out: str, arms, seeds) -> list[tuple[str, int, str]]:
  """(arm, seed, status) of the runs under ``OUT/arms`` that have a result.json but are
  not in this plan (another ``Sweep.seeds`` or ``num_kv_heads`` than the sweep that ran
  them): left out of the tables, and listed so that a report does not pass for all of
  what OUT holds."""
  planned = {(a.name, s) for a in arms for s in seeds}
  root = os.path.join(out, sweep_lib.ARMS_DIR)
  found = []
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    if not os.path.isdir(os.path.join(root, name)):  # a note beside the arms
      continue
    for d in sorted(os.listdir(os.path.join(root, name))):
      seed = d[len("seed_"):]
      if not (d.startswith("seed_") and seed.isdigit()) or (name, int(seed)) in planned:
        continue
      try:
        r = sweep_lib.read_result(out, name, int(seed))
      except ValueError:  # not this report's to refuse: it reads none of it
        r = {"status": "unreadable result.json"}
      if r is not None:
        found.append((name, int(seed), r["status"]))
  return sorted(found, key=lambda x: (x[0], x[1]))


def _unfinished(out: str, arm, seed: int, steps: int) -> dict:
  """"pending" (not started), or "interrupted" (a checkpoint short of the end); a run
  whose retry after a failure has not finished yet says that attempt's error too."""
  workdir = sweep_lib.run_dir(out, arm, seed)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  saved = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit()] if os.path.isdir(
      ckpt_dir) else []
  notes = [f"checkpoint at step {max(saved)} of {steps}; rerun to resume"] if saved else []
  try:
    before = _read_json(os.path.join(workdir, sweep_lib.PREVIOUS_FAILURE_FILE))
    notes.append(f"the attempt before failed: {before['error']}")
  except (OSError, ValueError, TypeError, KeyError):  # none, or not one attnlab wrote
    pass
  return {"status": "interrupted" if saved else "pending", "error": "; ".join(notes)}


def _fmt(v) -> str:
  if v is None or v == "":
    return ""
  if isinstance(v, float):
    return "nan" if math.isnan(v) else f"{v:.6g}"
  return str(v)


def _write_csv(path: str, columns: list[str], rows: list[dict]) -> None:
  text = io.StringIO(newline="")
  w = csv.writer(text)
  w.writerow(columns)
  for r in rows:
    w.writerow([_fmt(r.get(c)) for c in columns])
  write_text_atomically(path, text.getvalue())


def _stdev(values) -> float:
  """The sample standard deviation; nan when a value is not finite (``statistics.stdev``
  raises on nan / inf, and one diverged seed must not stop the report)."""
  if not all(math.isfinite(v) for v in values):
    return math.nan
  return statistics.stdev(values)


def _mean_std(values):
  values = [float(v) for v in values if v is not None and v != ""]
  if not values:
    return None, None
  mean = statistics.fmean(values)
  return mean, (_stdev(values) if len(values) > 1 else None)


def noise_test(a: dict[int, float], b: dict[int, float]
               ) -> tuple[float | None, float | None, str]:
  """(mean of a[s] - b[s] over the seeds s in both, its standard error,
  "yes" | "no" | "n/a") by the module docstring's paired criterion ("n/a"
  with fewer than 2 common seeds)."""
  d = [a[s] - b[s] for s in sorted(a.keys() & b.keys())]
  if not d:
    return None, None, "n/a"
  diff = statistics.fmean(d)
  if len(d) < 2:
    return diff, None, "n/a"
  se = _stdev(d) / math.sqrt(len(d))
  if not (math.isfinite(diff) and math.isfinite(se)):  # a diverged seed: no verdict
    return diff, se, "n/a"
  return diff, se, "yes" if abs(diff) > NOISE_FACTOR * se else "no"


def _losses(rows: list[dict], arm_name) -> dict[int, float]:
  """{seed: val_loss} of the arm's finished runs."""
  return {int(r["seed"]): float(r["val_loss"]) for r in rows
          if r["arm"] == arm_name and r["status"] == "ok"}


def summarize(rows: list[dict], arms, mcfg) -> list[dict]:
  """One row per arm (SUMMARY_COLUMNS)."""
  mha = sweep_lib.mha_arm(arms, mcfg)
  ok = lambda name: [r for r in rows if r["arm"] == name and r["status"] == "ok"]
  mha_losses = _losses(rows, mha.name) if mha else {}
  out = []
  for arm in arms:
    mine = [r for r in rows if r["arm"] == arm.name]
    good = ok(arm.name)
    s = {k: mine[0][k] for k in ["arm", "kind", "method", "num_kv_heads", "params",
                                 "attention_params", "d_ff", "kv_bytes_per_token", "steps",
                                 *PLANNED_SETTINGS]}
    s.update(runs_ok=len(good), runs_planned=len(mine))
    for m in MEASURES:
      values = [r.get(m) for r in good]
      s[f"{m}_mean"], s[f"{m}_std"] = _mean_std(values)
      s[f"{m}_n"] = sum(v is not None and v != "" for v in values)  # report.md, not the CSV
    if mha is not None and arm.name != mha.name:
      diff, se, verdict = noise_test(_losses(rows, arm.name), mha_losses)
      s.update(val_loss_diff_vs_mha=diff, val_loss_diff_se=se, exceeds_seed_noise=verdict)
    out.append(s)
  return out


def _pm(mean, std, digits=4) -> str:
  if mean is None:
    return "-"
  text = f"{mean:.{digits}f}"
  return text + (f" ± {std:.{digits}f}" if std is not None else "")


def _rate(mean, std) -> str:
  if mean is None:
    return "-"
  return f"{mean:,.0f}" + (f" ± {std:,.0f}" if std is not None else "")


def _cell(s: dict, measure: str, fmt=_pm, *args) -> str:
  """``measure``'s mean ± std of summary row ``s``, with the number of runs behind it
  when some finished runs lack it ("(2 runs)" in a row of 3 finished)."""
  text = fmt(s.get(f"{measure}_mean"), s.get(f"{measure}_std"), *args)
  n = s.get(f"{measure}_n")
  if n is not None and 0 < n < s["runs_ok"]:
    text += f" ({n} run{'s' if n > 1 else ''})"
  return text


def prompts_text(lengths: list[int] | None, sweep, mcfg, dcfg) -> str:
  """The decode benchmark's prompts as report.md names them: their measured lengths (a
  decoder-only prompt is cut to ``Sweep.decode_prompt_len`` and to a row's seq_len; an
  encoder-decoder's source loses its padding, so lengths vary). Until 2026-12-04 the
  report named ``decode_prompt_len`` whatever the prompts were."""
  what = "prompts" if mcfg.arch == "decoder_only" else "source prompts"
  if not lengths:
    cap = min(sweep.decode_prompt_len, dcfg.seq_len)
    return (f"{what} of at most {cap} tokens (their lengths unknown: no readable "
            f"{sweep_lib.PROMPTS_FILE})")
  lo, hi = min(lengths), max(lengths)
  if lo == hi:
    return f"{lo}-token {what}"
  return (f"{what} of {lo}-{hi} tokens (mean {statistics.fmean(lengths):.1f}; batch 1 "
          f"decodes the first, of {lengths[0]})")


def report_markdown(summary, rows, arms, sweep, base, outside=(), lengths=None) -> str:
  """report.md; ``lengths``: the token counts of the decode benchmark's prompts
  (``prompt_lengths``)."""
  mcfg, dcfg, tcfg = base
  by = {s["arm"]: s for s in summary}
  n_ok = sum(r["status"] == "ok" for r in rows)
  enc_dec = mcfg.arch != "decoder_only"
  # An encoder-decoder also caches cross-attention K/V per source token: its own column.
  kv_head = "self-attn KV bytes/token | cross-attn KV bytes/source token" if enc_dec else (
      "KV bytes/token")
  lines = [
      "# Head-sharing ablation", "",
      f"Base model: {mcfg.arch}, d_model {mcfg.d_model}, {mcfg.num_layers} layers, "
      f"{mcfg.num_heads} query heads (head dim {mcfg.head_dim}), d_ff "
      f"{mcfg.d_ff}, {mcfg.dtype}. Data: task {dcfg.task!r}, batch {dcfg.batch_size} x "
      f"{dcfg.seq_len} tokens. Training: {tcfg.steps} steps ({tcfg.optimizer}, "
      f"{tcfg.schedule}, peak lr {tcfg.learning_rate:g}). Seeds: "
      f"{', '.join(map(str, sweep.seeds))}. match_params: {sweep.match_params}.",
      f"Finished runs: {n_ok} of {len(rows)}.", "",
      "## Arms (mean ± std over seeds)", "",
      f"| arm | K | params | attention params | {kv_head} | val loss | val ppl | "
      "best val loss | Δ loss vs MHA | beyond seed noise | train tok/s | decode tok/s b=1 | "
      "decode tok/s b=8 | wall s | runs |",
      "|---|---:|---:|---:|---:|" + "---:|" * enc_dec + "---:|---:|---:|---:|:---:|---:|---:|"
      "---:|---:|---:|",
  ]
  for s in summary:
    diff = s.get("val_loss_diff_vs_mha")
    d = "-" if diff is None else f"{diff:+.4f}"
    kv = f"{s['kv_bytes_per_token']:,}"
    if enc_dec:
      kv += f" | {s['cross_kv_bytes_per_source_token']:,}"
    lines.append(
        f"| {s['arm']} | {s['num_kv_heads']} | {s['params']:,} | {s['attention_params']:,} | "
        f"{kv} | {_cell(s, 'val_loss')} | "
        f"{_cell(s, 'val_ppl', _pm, 3)} | {_cell(s, 'best_val_loss')} | {d} | "
        f"{s.get('exceeds_seed_noise', '-')} | {_cell(s, 'train_tokens_per_s', _rate)} | "
        f"{_cell(s, 'decode_tokens_per_s_b1', _rate)} | "
        f"{_cell(s, 'decode_tokens_per_s_b8', _rate)} | {_cell(s, 'wall_time_s', _pm, 0)} | "
        f"{s['runs_ok']}/{s['runs_planned']} |")
  if any(s.get("exact_match_mean") is not None for s in summary):
    lines += ["", "| arm | exact match | BLEU |", "|---|---:|---:|"]
    lines += [f"| {s['arm']} | {_cell(s, 'exact_match')} | {_cell(s, 'bleu', _pm, 2)} |"
              for s in summary]
  lines += [
      "", "Δ: the mean over seeds of the per-seed difference arm - MHA (arms of a seed share "
      "the init seed, the data order and the validation rows). Beyond seed noise: |Δ| > 2 x "
      "stdev(per-seed differences) / sqrt(n), n the seeds both finished (n/a with fewer than "
      "2): the mean difference exceeds twice its standard error (a paired test). "
      "Δ > 0 means the arm's loss is higher (worse) than MHA's. Throughputs are tokens/s "
      "(training: the median over logged windows, leaving out the first window of every "
      "process, i.e. of the run's start and of each resume, which holds a compilation; "
      f"decode: cached greedy, {sweep.decode_new_tokens} new tokens after "
      f"{prompts_text(lengths, sweep, mcfg, dcfg)}, best of {sweep.decode_repeats}; a run "
      "left with no training window has none). "
      "Wall s: a run's seconds over all its attempts (a resume after an interruption or a "
      "failure adds to it).",
  ]
  if enc_dec:
    lines[-1] += (
        " KV bytes: K and V cached per token over the decoder's self-attention layers "
        "(self-attn, per decoder token) and its cross-attention layers "
        "(cross-attn, per source token, computed once per source), 2 x layers x K x head "
        f"dim x {mcfg.dtype} bytes each.")
  uptrain = [a for a in arms if a.kind == "uptrain"]
  if uptrain:
    scratch = {a.num_kv_heads: a.name for a in arms if a.kind == "scratch"}
    mha = sweep_lib.mha_arm(arms, mcfg)
    up_steps = sweep_lib.uptrain_steps(sweep, tcfg)
    _, _, up_tcfg = sweep_lib.run_configs(sweep, uptrain[0], sweep.seeds[0], *base)
    lr_from = ("Sweep.uptrain_learning_rate" if sweep.uptrain_learning_rate is not None
               else "the base's: Sweep.uptrain_learning_rate is unset")
    lines += [
        "", f"## Uptraining (MHA checkpoint converted, then {up_steps} steps = "
        f"{sweep.uptrain_fraction:g} of {tcfg.steps})", "",
        f"Each uptraining run: a fresh {up_tcfg.optimizer} state, {up_tcfg.schedule} schedule, "
        f"{up_tcfg.warmup_steps} warmup steps (the base's {tcfg.warmup_steps} scaled by "
        f"{sweep.uptrain_fraction:g}) to peak lr {up_tcfg.learning_rate:g} ({lr_from}; the "
        f"from-scratch arms' is {tcfg.learning_rate:g}).", "",
        "| K | method | val loss after conversion | after uptraining | same K from scratch | "
        "Δ uptrained - scratch | beyond seed noise | MHA |",
        "|---:|---|---:|---:|---:|---:|:---:|---:|",
    ]
    for a in uptrain:
      s = by[a.name]
      ref = by.get(scratch.get(a.num_kv_heads, ""), {})
      diff, _, verdict = noise_test(_losses(rows, a.name), _losses(rows, ref.get("arm")))
      m = by[mha.name]
      lines.append(
          f"| {a.num_kv_heads} | {a.method} | "
          f"{_cell(s, 'val_loss_converted')} | {_cell(s, 'val_loss')} | "
          f"{_pm(ref.get('val_loss_mean'), ref.get('val_loss_std'))} | "
          f"{'-' if diff is None else f'{diff:+.4f}'} | {verdict} | "
          f"{_pm(m['val_loss_mean'], m['val_loss_std'])} |")
  bad = [r for r in rows if r["status"] != "ok"]
  if bad:
    lines += ["", "## Runs not finished", ""]
    lines += [f"- {r['arm']} seed {r['seed']}: {r['status']}"
              + (f" ({r['error']})" if r.get("error") else "") for r in bad]
  if outside:
    lines += ["", "## Runs under arms/ outside this plan", "",
              f"{len(outside)} run(s) with a result.json that this sweep's arms and seeds "
              f"({', '.join(map(str, sweep.seeds))}) do not include; they are in none of the "
              "tables and plots above (rerun with the Sweep.seeds / Sweep.num_kv_heads that "
              "ran them to include them):", ""]
    lines += [f"- {name} seed {seed}: {status}" for name, seed, status in outside]
  lines += ["", "## Plots", ""]
  lines += [f"![{p[:-4]}]({p})" for p in PLOTS]
  return "\n".join(lines) + "\n"


def curve_band(curves: list[list]) -> tuple[list, list, list]:
  """(steps, mean, std) of the seeds' curves ([[step, val_loss], ...] each): at every
  step logged by any seed, over the seeds that logged it (a run whose eval failed once
  and that resumed lacks that step; the others' points stay); std 0 where one did."""
  by_step = [dict((p[0], p[1]) for p in c) for c in curves]
  steps = sorted(set().union(*by_step))
  vals = [[c[s] for c in by_step if s in c] for s in steps]
  return (steps, [statistics.fmean(v) for v in vals],
          [_stdev(v) if len(v) > 1 else 0.0 for v in vals])


def _legend(ax, **kw):
  """A legend, where something is drawn (an empty one makes matplotlib warn)."""
  if ax.get_legend_handles_labels()[0]:
    ax.legend(**kw)


def save_figure_atomically(fig, path: str) -> None:
  """``fig`` as a PNG into ``path`` through a temporary file beside it and a rename, as
  ``write_text_atomically`` writes text: a failed write (a full disk) removes its temporary
  and leaves ``path`` as it was. Until 2026-12-07 ``savefig`` wrote ``path`` itself, and a
  full disk left the previous plot cut short (85107 bytes to 16384)."""
  tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
  try:
    fig.savefig(tmp, dpi=120, format="png")
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def plot(out: str, summary, curves, arms, base) -> list[str]:
  """Write the three PNGs into ``out``; their paths. Through matplotlib's ``Figure`` alone,
  never pyplot: the caller's backend stays theirs (``matplotlib.use("Agg")`` here switched a
  notebook's until 2026-12-07, and its later ``plt.show()`` showed nothing)."""
  from matplotlib.figure import Figure

  _, dcfg, tcfg = base
  tokens_per_step = dcfg.batch_size * dcfg.seq_len
  scratch = [a for a in arms if a.kind == "scratch"]
  uptrain = [a for a in arms if a.kind == "uptrain"]
  by = {s["arm"]: s for s in summary}
  paths = [os.path.join(out, p) for p in PLOTS]

  def band(ax, arm, offset, **kw):
    seeds = [c for (name, _), c in curves.items() if name == arm.name]
    steps, mean, std = curve_band(seeds)
    if not steps:
      return
    x = [offset + s * tokens_per_step for s in steps]
    line, = ax.plot(x, mean, label=f"{arm.name} ({len(seeds)} seed{'s' * (len(seeds) != 1)})", **kw)
    ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                    color=line.get_color(), alpha=0.2)

  fig = Figure(figsize=(12 if uptrain else 6.5, 4.5))
  axes = fig.subplots(1, 2 if uptrain else 1, squeeze=False)
  ax = axes[0][0]
  for a in scratch:
    band(ax, a, 0, marker=".")
  ax.set(xlabel="training tokens", ylabel="validation loss",
         title="from scratch (mean ± std over seeds)")
  _legend(ax, fontsize=8)
  ax.grid(alpha=0.3)
  if uptrain:
    ax = axes[0][1]
    for a in uptrain:
      band(ax, a, 0, marker=".", linestyle="--" if a.method != "mean" else "-")
    for a in scratch:
      s = by[a.name]
      if s["val_loss_mean"] is not None and a.num_kv_heads in {u.num_kv_heads for u in uptrain}:
        ax.axhline(s["val_loss_mean"], color="gray", linestyle=":", linewidth=1)
        ax.annotate(f"{a.name} from scratch", (0, s["val_loss_mean"]), fontsize=7,
                    color="gray", va="bottom")
    ax.set(xlabel="uptraining tokens (after the MHA run)", ylabel="validation loss",
           title="uptrained from the MHA checkpoint")
    _legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  _written(paths[0], lambda path: save_figure_atomically(fig, path))

  fig = Figure(figsize=(6.5, 4.5))
  ax = fig.subplots()
  for group, marker in ((scratch, "o"), (uptrain, "^")):
    for a in group:
      s = by[a.name]
      if s["val_loss_mean"] is None:
        continue
      ax.errorbar(s["kv_bytes_per_token"], s["val_loss_mean"], yerr=s["val_loss_std"] or 0,
                  marker=marker, capsize=3, label=a.name, linestyle="none")
  ax.set_xscale("log", base=2)
  xlabel = "KV-cache bytes per token" if base[0].arch == "decoder_only" else (
      "self-attention KV-cache bytes per token")
  ax.set(xlabel=xlabel, ylabel="final validation loss",
         title="quality vs cache memory (mean ± std)")
  _legend(ax, fontsize=7)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  _written(paths[1], lambda path: save_figure_atomically(fig, path))

  fig = Figure(figsize=(6.5, 4.5))
  ax = fig.subplots()
  done = [by[a.name] for a in scratch if by[a.name]["runs_ok"]]
  ks = [s["num_kv_heads"] for s in done]
  for b in sweep_lib.DECODE_BATCHES:
    have = [s for s in done if s[f"decode_tokens_per_s_b{b}_mean"] is not None]
    if have:
      ax.errorbar([s["num_kv_heads"] for s in have],
                  [s[f"decode_tokens_per_s_b{b}_mean"] for s in have],
                  yerr=[s[f"decode_tokens_per_s_b{b}_std"] or 0 for s in have], marker="o",
                  capsize=3, label=f"batch {b}")
  ax.set_xscale("log", base=2)
  ax.set_xticks(ks or [1], [str(k) for k in ks] or ["1"])
  ax.set(xlabel="num_kv_heads (K)", ylabel="decode tokens/s",
         title="cached greedy decode throughput (mean ± std)")
  _legend(ax)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  _written(paths[2], lambda path: save_figure_atomically(fig, path))
  return paths


def _written(path: str, write) -> None:
  """``write(path)``; its OSError (a full disk) as a ``ReportWriteError`` naming ``path``."""
  try:
    write(path)
  except OSError as e:
    raise ReportWriteError(f"writing {path} failed ({failure_cause(e)})") from e


def write_report(out: str, sweep, arms, base, *, plots: bool = True) -> dict:
  """results.csv, summary.csv, report.md and the PNGs of ``out``, each through a temporary
  file and a rename; counts. A write that fails is a ``ReportWriteError`` naming the file:
  it and the files not yet written are as they were (until 2026-12-07 a plot was written in
  place, and a full disk cut it short, with a traceback)."""
  rows, curves = collect(out, sweep, arms, base)
  outside = outside_plan(out, arms, sweep.seeds)
  summary = summarize(rows, arms, base[0])
  _written(os.path.join(out, "results.csv"),
           lambda path: _write_csv(path, RESULT_COLUMNS, rows))
  _written(os.path.join(out, "summary.csv"),
           lambda path: _write_csv(path, SUMMARY_COLUMNS, summary))
  markdown = report_markdown(summary, rows, arms, sweep, base, outside, prompt_lengths(out))
  _written(os.path.join(out, "report.md"), lambda path: write_text_atomically(path, markdown))
  if plots:
    plot(out, summary, curves, arms, base)
  counts = {s: sum(r["status"] == s for r in rows)
            for s in ("ok", "failed", "interrupted", "pending")}
  return {**counts, "outside_plan": len(outside)}
