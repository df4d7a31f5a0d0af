"""One module per ``attnlab`` command, each with a ``main(argv) -> int``.

``CommandError`` lives here, not in ``_common``, so attnlab/cli.py can catch it
without importing jax or gin (``attnlab --help`` stays instant).
"""


# A signal (SIGTERM / SIGINT: a preempted job) stopped the work before it finished; what it
# did is saved and the same command resumes it. 75 is EX_TEMPFAIL of sysexits.h ("try
# again later"), so a job that depends on this one (SLURM --dependency=afterok, `a && b`)
# does not start on a half-trained run.
EXIT_STOPPED = 75
# Ctrl-C outside the commands that stop at a step (128 + SIGINT, as a shell reports it:
# cli.console_main's, where SIGINT cannot kill), and stdout's reader gone (128 + SIGPIPE, as a
# Unix filter killed by it: cli.main's).
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


class CommandError(Exception):
  """Bad input to a command: printed as one line on stderr, exit code 2."""


def print_result(text: str, code: int) -> int:
  """Print a command's result line and return its exit ``code``. Where stdout cannot take
  the line (a full disk under it, unbuffered), the OSError carries ``code`` as its
  ``exit_code``, so that ``attnlab.cli.main`` keeps the command's own status after its
  one line (``train`` stopped by a signal: 75, resumable; 1 until 2026-12-07's review)."""
  try:
    print(text)
  except OSError as e:
    e.exit_code = code
    raise
  return code
