"""``attnlab eval --workdir runs/x [--step N]``: validation metrics of a checkpoint."""

from __future__ import annotations

import json

from attnlab.commands._common import (
  CommandError,
  CommandParser,
  add_cache_flag,
  use_compilation_cache,
)
from attnlab.extras import MissingDependencyError
from attnlab.training import trainer


def main(argv: list[str]) -> int:
  p = CommandParser(prog="attnlab eval", description="Validation metrics of a checkpoint.")
  p.add_argument("--workdir", required=True)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  add_cache_flag(p)
  args = p.parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  try:
    out = trainer.evaluate_workdir(args.workdir, args.step)
  except (FileNotFoundError, ValueError, MissingDependencyError) as e:
    raise CommandError(str(e)) from None
  print(json.dumps(out))
  return 0
