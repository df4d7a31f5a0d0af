"""``attnlab eval --workdir runs/x [--step N] [--beam_size 4 --length_penalty 0.6]
[--mesh_shape D,F,T]``:
validation metrics of a checkpoint (a seq2seq task's outputs greedy, or by beam search)."""

from __future__ import annotations

import json

from attnlab.commands._common import (
  CommandError,
  CommandParser,
  add_cache_flag,
  check_workdir_given,
  log_attnlab_info,
  mesh_shape_flag,
  out_of_memory,
  use_compilation_cache,
)
from attnlab.config import DecodeConfig
from attnlab.extras import MissingDependencyError
from attnlab.training import sharding, trainer
from attnlab.training.checkpoint import workdir_config


def main(argv: list[str]) -> int:
  p = CommandParser(prog="attnlab eval", description="Validation metrics of a checkpoint.")
  p.add_argument("--workdir", required=True,
                 help="training workdir (config.gin + checkpoints); the metrics print as JSON, "
                 "a seq2seq task's predictions go to WORKDIR/eval/")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--beam_size", type=int, default=None,
                 help="decode a seq2seq task's examples by beam search of this width (the "
                      "paper: 4); default greedy")
  p.add_argument("--length_penalty", type=float, default=None,
                 help="GNMT alpha of the beam search (default "
                      f"{DecodeConfig.length_penalty}, the paper's)")
  p.add_argument("--mesh_shape", default=None,
                 help="evaluate on this (data, fsdp, tensor) device mesh, e.g. 1,1,1 (one -1 "
                      "takes the remaining devices); default the run's TrainConfig.mesh_shape")
  add_cache_flag(p)
  args = p.parse_args(argv)
  log_attnlab_info()
  mesh_shape = mesh_shape_flag(args.mesh_shape)
  if args.length_penalty is None:
    args.length_penalty = DecodeConfig.length_penalty
  elif args.beam_size is None:
    raise CommandError("--length_penalty is the beam search's: give --beam_size too")
  try:  # before the cache's folder is made (until 2026-12-06 a mistyped --workdir made
    # WORKDIR/xla_cache, and so WORKDIR, then failed)
    check_workdir_given(args.workdir)
    workdir_config(args.workdir)
  except FileNotFoundError as e:
    raise CommandError(str(e)) from None
  use_compilation_cache(args.compilation_cache)
  try:
    out = trainer.evaluate_workdir(args.workdir, args.step, beam_size=args.beam_size,
                                   length_penalty=args.length_penalty, mesh_shape=mesh_shape)
  except Exception as e:
    oom = out_of_memory(e)  # a traceback until 2026-12-06
    if oom is not None:
      raise CommandError(f"out of memory evaluating ({oom}): give a narrower --beam_size, or "
                         "more devices with --mesh_shape") from None
    if not isinstance(e, FileNotFoundError | ValueError | MissingDependencyError):
      raise
    hint = ""
    if mesh_shape is None and isinstance(e, sharding.MeshShapeError):  # the run's mesh
      hint = (" (the run's TrainConfig.mesh_shape; evaluate on another mesh with --mesh_shape "
              "D,F,T, e.g. 1,1,1)")
    raise CommandError(f"{e}{hint}") from None
  print(json.dumps(out))
  return 0
