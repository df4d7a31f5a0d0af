"""``attnlab ablate``: a head-sharing ablation sweep (MHA / GQA / MQA x seeds).

    attnlab ablate --gin_file experiments/head_sharing/sweep.gin --out runs/heads
                   [--gin.Sweep.seeds=[0,1] --gin.TrainConfig.steps=300 ...]
    attnlab ablate ... --arm NAME    # only that arm (one job of a job array)
    attnlab ablate ... --report      # (re)build the report from the finished runs

``--gin.`` bindings (``Sweep.*``, ``ModelConfig.*``, ``DataConfig.*``,
``TrainConfig.*``) apply to every arm. The operative sweep goes to
OUT/sweep.gin (self-contained: ``--gin_file OUT/sweep.gin`` reruns it);
``--report`` without ``--gin_file`` reads it. A rerun skips finished runs,
resumes interrupted ones and retries failed ones; an OUT holding a sweep
with a different base config or decode benchmark is refused. Exit 0 when every run of this
invocation finished, 1 when a run failed (recorded in results.csv / report.md) or a file of
the report could not be written (one line naming it; each file is written through a
temporary file and a rename, so the others are whole),
2 on bad input (one line on stderr, nothing written), 75 when a signal stopped
the sweep (``EXIT_STOPPED``: checkpoints saved; rerun to resume).
"""

from __future__ import annotations

import json
import os
import sys

from attnlab import config_gin
from attnlab.commands import EXIT_STOPPED, CommandError
from attnlab.commands._common import (
    CommandParser,
    add_cache_flag,
    check_can_make,
    gin_flags_help,
    log_attnlab_info,
    split_gin_flags,
    use_compilation_cache,
)
from attnlab.commands.train import trainer_run_check
from attnlab.extras import MissingDependencyError, require
from attnlab.training import report as report_lib
from attnlab.training import sweep as sweep_lib
from attnlab.training import trainer

PREFIXES = ("Sweep.", "ModelConfig.", "DataConfig.", "TrainConfig.")


def _base_difference(sweep_path: str, sweep, base) -> tuple[str, str] | None:
  """None if the sweep file at ``sweep_path`` has the base configs ``base`` and the
  decode benchmark's settings of ``sweep``, else their first difference (its binding,
  this sweep's). The configs are compared, not their text: a file an older attnlab wrote
  lacks the fields added since, which take their defaults."""
  try:
    saved_sweep, *saved = config_gin.parse_saved_sweep(sweep_path)
  except config_gin.GinConfigError as e:  # e.g. a field this attnlab does not have
    return str(e), "a sweep file this attnlab reads"
  diff = sweep_lib.configs_difference(saved, base)
  for name in sweep_lib.MEASURE_FIELDS:  # every run of an OUT is measured alike
    a, b = getattr(saved_sweep, name), getattr(sweep, name)
    if diff is None and a != b:
      diff = tuple(f"Sweep.{name} = {config_gin.gin_value(x)}" for x in (a, b))
  return diff


def _report_failed(e: Exception) -> int:
  """One line for a report file that could not be written (a full disk), exit 1: the runs
  are kept, and the files of the report not yet written are as they were (until 2026-12-07
  a traceback, and a plot cut short)."""
  print(f"attnlab ablate: error: {e}; the report's other files are whole: free the space (or "
        "mend the cause) and rerun with --report", file=sys.stderr)
  return 1


def main(argv: list[str]) -> int:
  bindings, rest = split_gin_flags(argv)
  p = CommandParser(prog="attnlab ablate", description="Head-sharing ablation sweep.",
                    epilog=gin_flags_help("Sweep, ModelConfig, DataConfig and TrainConfig"))
  p.add_argument("--gin_file", default=None, action="append",
                 help="the sweep gin file (binds Sweep.*; one: it names its base files in "
                      "Sweep.base)")
  p.add_argument("--out", required=True, help="the sweep directory")
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--arm", default=None, help="run only this arm (all its seeds)")
  mode.add_argument("--report", action="store_true",
                    help="only (re)build results.csv, summary.csv, report.md and the plots")
  add_cache_flag(p)
  args = p.parse_args(rest)
  if args.gin_file is not None and len(args.gin_file) > 1:
    # until 2026-12-06 the last one replaced the others without a word (another sweep ran)
    raise CommandError(f"--gin_file is given {len(args.gin_file)} times "
                       f"({', '.join(args.gin_file)}); a sweep is one file: name the others in "
                       "its Sweep.base (read first), or bind with --gin.X=V")
  for b in bindings:
    if not b.startswith(PREFIXES):
      raise CommandError(f"--gin.{b.split(' = ')[0]}: only {', '.join(PREFIXES)} bindings "
                         "apply to a sweep")
  log_attnlab_info()  # before check_not_stale's Checkpointer imports orbax (and absl)
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    raise CommandError(f"--out {args.out} is a file; give a directory (new, or a sweep's)")
  check_can_make("--out", args.out)
  sweep_path = os.path.join(args.out, sweep_lib.SWEEP_FILE)
  if os.path.isfile(os.path.join(args.out, "config.gin")) and not os.path.isfile(sweep_path):
    # a training workdir: the sweep and its report were written in among the run's files
    # until 2026-12-06
    raise CommandError(f"--out {args.out} holds a training run (config.gin), not a sweep: give "
                       "a new directory")
  gin_file = args.gin_file and args.gin_file[0]
  if gin_file is None:
    if not (args.report and os.path.isfile(sweep_path)):
      # --report of a folder that is no sweep says so (until 2026-12-04 only the first half)
      why = ")" if not args.report else (
          f"; {args.out} has none: not a sweep directory)" if os.path.isdir(args.out) else
          f"; {args.out} does not exist)")
      raise CommandError("--gin_file is needed (only --report of an existing --out reads "
                         "OUT/sweep.gin" + why)
    gin_file = sweep_path

  try:
    # OUT/sweep.gin (--report without --gin_file) is a saved one: a DataConfig field its task
    # does not read, which attnlab took (and ignored) before 2026-12-06, reads as the default
    read = config_gin.parse_saved_sweep if gin_file == sweep_path else config_gin.parse_sweep
    sweep, mcfg, dcfg, tcfg = read(gin_file, bindings)
  except config_gin.GinConfigError as e:
    raise CommandError(str(e)) from None
  base = (mcfg, dcfg, tcfg)
  try:
    arms = sweep_lib.plan(sweep, mcfg)
    if not args.report:  # an OUT made before the check was added can still be reported
      sweep_lib.check_benchmark(sweep, mcfg, dcfg)
    for arm in arms:
      sweep_lib.run_configs(sweep, arm, sweep.seeds[0], *base)
  except ValueError as e:
    raise CommandError(str(e)) from None
  names = [a.name for a in arms]
  if args.arm is not None and args.arm not in names:
    raise CommandError(f"--arm {args.arm!r} is not an arm of this sweep: {', '.join(names)}")
  try:  # the report's plots: checked before anything trains or is written
    require("matplotlib", "attnlab ablate (its plots)")
  except MissingDependencyError as e:
    raise CommandError(str(e)) from None
  text = sweep_lib.operative_sweep_config(sweep, *base)
  if os.path.isfile(sweep_path):
    diff = _base_difference(sweep_path, sweep, base)
    if diff is not None:
      raise CommandError(f"{args.out} holds a sweep of other settings "
                         f"({sweep_path} has {diff[0]!r} where this sweep gives {diff[1]!r}); "
                         "use a new --out")
  try:  # before anything is written: a run trained under other settings is neither
    # reused nor reported under these
    sweep_lib.check_not_stale(args.out, sweep, arms, base, only=args.arm)
  except ValueError as e:
    raise CommandError(str(e)) from None
  if args.report:
    if not os.path.isdir(os.path.join(args.out, sweep_lib.ARMS_DIR)):
      raise CommandError(f"{args.out} holds no runs yet (no {sweep_lib.ARMS_DIR}/ folder)")
    try:
      counts = report_lib.write_report(args.out, sweep, arms, base)
    except ValueError as e:  # a run's result.json that attnlab did not write
      raise CommandError(str(e)) from None
    except report_lib.ReportWriteError as e:
      return _report_failed(e)
    print(json.dumps({"out": os.path.abspath(args.out), **counts}))
    return 0
  try:
    # with the runs' TrainConfig: every run evaluates (its validation batches are bounded
    # here, before anything is written; with the base's eval_every=0 each run failed on them)
    trainer_run_check(mcfg, sweep_lib.run_configs(sweep, arms[0], sweep.seeds[0], *base)[2],
                      dcfg)
    sweep_lib.check_run_dirs(args.out, sweep, arms, only=args.arm)
  except (ValueError, FileNotFoundError, ImportError) as e:
    raise CommandError(str(e)) from None

  use_compilation_cache(args.compilation_cache)
  os.makedirs(args.out, exist_ok=True)
  trainer.write_text_atomically(sweep_path, text)
  try:
    counts = sweep_lib.run_sweep(args.out, sweep, arms, base, only=args.arm)
    out = {"out": os.path.abspath(args.out), "this_invocation": counts}
    if args.arm is None:
      out["report"] = report_lib.write_report(args.out, sweep, arms, base)
  except sweep_lib.SweepInterrupted as e:
    print(f"attnlab ablate: {e}; rerun the same command to resume", file=sys.stderr)
    return EXIT_STOPPED
  except ValueError as e:  # a run's result.json that attnlab did not write (a failing run
    raise CommandError(str(e)) from None  # is recorded in its result, not raised)
  except report_lib.ReportWriteError as e:
    return _report_failed(e)
  print(json.dumps(out))
  return 1 if counts["failed"] else 0
