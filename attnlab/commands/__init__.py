"""One module per ``attnlab`` command, each with a ``main(argv) -> int``.

``CommandError`` lives here, not in ``_common``, so attnlab/cli.py can catch it
without importing jax or gin (``attnlab --help`` stays instant).
"""


class CommandError(Exception):
  """Bad input to a command: printed as one line on stderr, exit code 2."""
