"""``attnlab convert-heads``: an MHA (or any K0-head) run to a K-head run.

    attnlab convert-heads --from RUN --to RUN2 --num_kv_heads K
                          --method mean|first|random [--step N] [--seed S]
                          [--gin.TrainConfig.steps=500 --gin.DataConfig.* ...]

RUN2 gets a checkpoint at step 0 (the converted parameters, a fresh optimizer
state, the source's data position) and a config.gin (the source's, with K
KV heads and the bindings), so ``attnlab train --workdir RUN2`` uptrains it
and ``attnlab decode --workdir RUN2`` decodes from it. Bad input (K not
dividing the source's KV heads or larger, an unknown method, a missing run
or step, an existing RUN2, a tokenizer file inside RUN that the new run's copy of it
could not serve: empty, cut off, a folder or a FIFO) is one line on stderr, exit 2,
nothing written. A write that
fails (a full disk) is one line naming it, exit 1, and what the command wrote is taken
away (RUN2 itself where the command made it), so the same command runs again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time

from attnlab import config_gin
from attnlab.commands import CommandError
from attnlab.commands._common import (
  CommandParser,
  check_can_make,
  check_workdir_given,
  gin_flags_help,
  log_attnlab_info,
  split_gin_flags,
)
from attnlab.commands.train import trainer_run_check
from attnlab.training.checkpoint import CheckpointMismatchError, UnreadableCheckpointError
from attnlab.training.sweep import write_converted_run
from attnlab.training.trainer import SaveError


def _passes_run_check(mcfg, dcfg, tcfg) -> bool:
  try:
    trainer_run_check(mcfg, tcfg, dcfg)
  except (FileNotFoundError, ValueError, ImportError):
    return False
  return True


def _folders_to_make(path: str) -> list[str]:
  """The folders that making ``path`` creates, ``path`` first, its missing parents after
  (deepest first); none when ``path`` exists (an empty folder: ``check_can_make``)."""
  made, at = [], os.path.abspath(path)
  while not os.path.lexists(at):
    made.append(at)
    at = os.path.dirname(at)
  return made


def _remove_written(dst: str, made: list[str], settle_s: float = 0.2,
                    timeout_s: float = 10.0) -> None:
  """Take away what a failed conversion wrote, so that the same command runs again once the
  cause is mended: ``dst`` and its parents where this command made them (``made``), else
  (an empty folder given as --to, which is kept) what it wrote into it. Until 2026-12-07 a
  failed save left ``dst`` with its half-made checkpoint, and the rerun was refused ("--to
  ... already exists and is not empty").

  Removed again until nothing comes back for ``settle_s`` (at most ``timeout_s``):
  tensorstore's own threads, which Python cannot join, may still finish a write of the
  failed save (and make its folders again) after it raised."""
  deadline = time.monotonic() + timeout_s
  while True:
    if made:
      shutil.rmtree(made[0], ignore_errors=True)
      for folder in made[1:]:  # parents made for it, deepest first, if nothing else came in
        with contextlib.suppress(OSError):
          os.rmdir(folder)
    else:
      for name in os.listdir(dst):  # it was empty: all of this is the conversion's
        path = os.path.join(dst, name)
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path, ignore_errors=True)
        else:
          with contextlib.suppress(OSError):
            os.remove(path)
    time.sleep(settle_s)
    left = os.path.lexists(made[0]) if made else bool(os.listdir(dst))
    if not left or time.monotonic() > deadline:
      return


def main(argv: list[str]) -> int:
  bindings, rest = split_gin_flags(argv)
  p = CommandParser(prog="attnlab convert-heads",
              description="Convert a run's checkpoint to fewer KV heads (GQA / MQA).",
              epilog=gin_flags_help("the new run's TrainConfig and DataConfig",
                                     after="the source run's config.gin"))
  p.add_argument("--from", dest="src", required=True, help="the source training workdir")
  p.add_argument("--to", dest="dst", required=True,
                 help="the new workdir (must not exist, or be an empty folder)")
  p.add_argument("--num_kv_heads", type=int, required=True, help="K, dividing the source's")
  p.add_argument("--method", required=True, help="mean | first | random")
  p.add_argument("--step", type=int, default=None, help="source checkpoint; default the latest")
  p.add_argument("--seed", type=int, default=0, help="init of the 'random' method")
  args = p.parse_args(rest)
  log_attnlab_info()
  check_workdir_given(args.src, "--from")  # "" converted the working directory's run
  for b in bindings:
    if not b.startswith(("TrainConfig.", "DataConfig.")):
      raise CommandError(f"--gin.{b.split(' = ')[0]}: only TrainConfig.* and DataConfig.* "
                         "bindings apply (the model is the converted source)")

  # The new run is for `attnlab train` by hand: it shows its progress unless bound, whatever
  # the source's (a sweep's runs have progress=False: the sweep prints its own; until
  # 2026-12-06 a run converted from one trained without a progress line).
  overrides = {"TrainConfig": {"progress": True}, "DataConfig": {}}
  config_path = os.path.join(args.src, "config.gin")
  if bindings and os.path.isfile(config_path):
    try:
      _, dcfg, tcfg = config_gin.parse_saved(config_path, bindings)
    except config_gin.GinConfigError as e:
      raise CommandError(str(e)) from None
    for b in bindings:
      cls, field = b.split(" = ")[0].strip().split(".", 1)
      overrides[cls][field] = getattr(tcfg if cls == "TrainConfig" else dcfg, field)
  kwargs = dict(step=args.step, seed=args.seed, bindings=overrides)
  try:
    # Everything is checked before anything is written.
    checked = write_converted_run(args.src, args.dst, args.num_kv_heads, args.method,
                                  check_only=True, **kwargs)
    # and the new run's data against its model, as `attnlab train` checks them, where the
    # bindings made a source that passes them fail (a seq_len past max_len was written, then
    # refused by train, until 2026-12-06); a source that fails them alone (an HF import,
    # whose data config is the default's) is converted as before, its data to be bound later
    new_mcfg, new_dcfg, new_tcfg = checked["configs"]
    if bindings and _passes_run_check(*config_gin.read_workdir_config(config_path)):
      trainer_run_check(new_mcfg, new_tcfg, new_dcfg)
  except (FileNotFoundError, ValueError, ImportError) as e:
    raise CommandError(str(e)) from None
  check_can_make("--to", args.dst)
  made = _folders_to_make(args.dst)
  try:
    info = write_converted_run(args.src, args.dst, args.num_kv_heads, args.method, **kwargs)
  # read before anything is written: a config.gin that does not fit, a damaged --step, or
  # no checkpoint that reads (until 2026-12-04 the last two were tracebacks)
  except (CheckpointMismatchError, UnreadableCheckpointError, FileNotFoundError) as e:
    raise CommandError(str(e)) from None
  except SaveError as e:
    _remove_written(args.dst, made)
    print(f"attnlab convert-heads: error: {e}; nothing was kept in --to {args.dst}: free the "
          "space (or mend the cause) and rerun the same command", file=sys.stderr)
    return 1
  print(json.dumps({"workdir": os.path.abspath(args.dst), **info}))
  sys.stdout.flush()
  return 0
