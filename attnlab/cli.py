"""The ``attnlab`` command line: ``attnlab COMMAND [flags]``.

Each command lives next to the code it drives (training/commands.py,
decoding/commands.py); this module only dispatches, so ``attnlab kv-size``
does not import orbax and ``attnlab --help`` imports nothing heavy.

A command signals bad input by raising ``CommandError``: one line on stderr
naming what is wrong, exit code 2.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("attnlab.training.commands", "train_main", "train a model from gin files"),
    "eval": ("attnlab.training.commands", "eval_main", "evaluate a checkpoint"),
    "decode": ("attnlab.decoding.commands", "decode_main", "generate from a checkpoint"),
    "kv-size": ("attnlab.decoding.commands", "kv_size_main", "KV-cache bytes for a shape"),
    "convert": ("attnlab.commands.convert", "convert_main", "transformers checkpoints in / out"),
}


class CommandError(Exception):
  """Bad input to a command: printed as one line, exit code 2."""


def usage() -> str:
  lines = ["usage: attnlab COMMAND [flags]   (attnlab COMMAND --help for its flags)", ""]
  lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(usage())
    return 0 if argv else 2
  name, rest = argv[0], argv[1:]
  if name not in COMMANDS:
    print(f"attnlab: unknown command {name!r}\n{usage()}", file=sys.stderr)
    return 2
  module_name, fn_name, _ = COMMANDS[name]
  fn = getattr(importlib.import_module(module_name), fn_name)
  # Under `python -m attnlab.cli` this module is `__main__`; commands raise
  # the class of the importable `attnlab.cli`, so catch that one.
  command_error = importlib.import_module("attnlab.cli").CommandError
  try:
    return int(fn(rest) or 0)
  except command_error as e:
    print(f"attnlab {name}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
