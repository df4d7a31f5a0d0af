"""``attnlab eval --workdir runs/x [--step N] [--beam_size 4 --length_penalty 0.6]``:
validation metrics of a checkpoint (a seq2seq task's outputs greedy, or by beam search)."""

from __future__ import annotations

import json

from attnlab.commands._common import (
  CommandError,
  CommandParser,
  add_cache_flag,
  use_compilation_cache,
)
from attnlab.config import DecodeConfig
from attnlab.extras import MissingDependencyError
from attnlab.training import trainer


def main(argv: list[str]) -> int:
  p = CommandParser(prog="attnlab eval", description="Validation metrics of a checkpoint.")
  p.add_argument("--workdir", required=True)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--beam_size", type=int, default=None,
                 help="decode a seq2seq task's examples by beam search of this width (the "
                      "paper: 4); default greedy")
  p.add_argument("--length_penalty", type=float, default=None,
                 help="GNMT alpha of the beam search (default "
                      f"{DecodeConfig.length_penalty}, the paper's)")
  add_cache_flag(p)
  args = p.parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  if args.length_penalty is None:
    args.length_penalty = DecodeConfig.length_penalty
  elif args.beam_size is None:
    raise CommandError("--length_penalty is the beam search's: give --beam_size too")
  try:
    out = trainer.evaluate_workdir(args.workdir, args.step, beam_size=args.beam_size,
                                   length_penalty=args.length_penalty)
  except (FileNotFoundError, ValueError, MissingDependencyError) as e:
    raise CommandError(str(e)) from None
  print(json.dumps(out))
  return 0
