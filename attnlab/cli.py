"""The ``attnlab`` command line: ``attnlab COMMAND [flags]``.

Each command is a module of attnlab/commands/ with a ``main(argv) -> int``;
this module only dispatches (one line per command below), importing nothing
but the command that runs, so ``attnlab --help`` is instant.

A command signals bad input by raising ``CommandError``
(attnlab/commands/__init__.py): one line on stderr naming what is wrong, exit
code 2. ``main`` is for a caller in the process (Ctrl-C: a KeyboardInterrupt
after its line); the ``attnlab`` console script is ``console_main`` (Ctrl-C:
the process dies by SIGINT).

Standard output that cannot be written is one line on stderr, exit 1, never a
traceback: closed before the command starts (``attnlab kv-size ... >&-``),
"attnlab kv-size: error: standard output is closed; nothing was run", and the
command is not run (a checkpoint opened then could take file descriptor 1); a
write or flush of it that fails (``> /dev/full``, an I/O error), "attnlab
kv-size: error: cannot write to standard output: [Errno 28] No space left on
device", after what the command did (``train``'s checkpoints stay saved). Only
an error of stdout's own write or flush is taken so: a full disk under a
checkpoint or a file keeps the command's own handling. stdout's reader gone
(``| head -1``) is quiet, exit 141.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import signal
import sys

from attnlab.commands import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, CommandError

# name -> (module in attnlab/commands/, one-line help)
COMMANDS = {
    "train": ("train", "train a model from gin files"),
    "eval": ("eval", "evaluate a checkpoint"),
    "decode": ("decode", "generate from a checkpoint"),
    "kv-size": ("kv_size", "KV-cache bytes for a shape"),
    "ablate": ("ablate", "head-sharing ablation sweep (MHA / GQA / MQA)"),
    "convert-heads": ("convert_heads", "MHA -> GQA/MQA checkpoint"),
    "convert": ("convert", "transformers checkpoints in / out (--from-hf / --to-hf)"),
}


def usage() -> str:
  lines = ["usage: attnlab COMMAND [flags]   (attnlab COMMAND --help for its flags)", ""]
  width = max(map(len, COMMANDS))
  lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  """Run ``attnlab COMMAND [flags]`` (``argv``; None: the process's arguments) and return
  its exit code.

  Ctrl-C outside ``train`` and ``ablate``'s steps (which stop there, exit 75) prints one line,
  "attnlab COMMAND: interrupted", and raises the KeyboardInterrupt again, as any Python call
  does: a caller in the same process (a notebook, a script, a test) goes on or stops as it
  chooses (until 2026-12-07 ``main`` killed its own process by SIGINT, a notebook's kernel
  too). The ``attnlab`` console script and ``python -m attnlab.cli`` run ``console_main``,
  whose process then dies by SIGINT.

  A stdout that is closed, or whose write or flush fails (a full disk), is one line on stderr
  and exit 1 (the module's docstring); this ``main`` flushes stdout before it returns."""
  argv = sys.argv[1:] if argv is None else list(argv)
  name = argv[0] if argv and argv[0] in COMMANDS else None
  who = f"attnlab{' ' + name if name else ''}"
  if _stdout_closed():  # a traceback (decode, eval) or exit 0 with nothing said (kv-size)
    # until 2026-12-07
    print(f"{who}: error: standard output is closed; nothing was run", file=sys.stderr)
    return 1
  stdout = sys.stdout = _WatchedStdout(sys.stdout)
  try:
    try:
      code = _dispatch(argv)
    except SystemExit:  # --help: argparse prints the help and hides a write that failed
      _check_written(stdout)
      raise
    _check_written(stdout)
    return code
  except BrokenPipeError:
    if not _stdout_broken():  # another pipe (a subprocess's, a socket's): not ours to hide
      raise
    # The reader of stdout went away (`attnlab decode ... | head -1`): stop quietly, as a
    # Unix filter does, with SIGPIPE's exit status (a traceback until 2026-12-06). stdout
    # goes to /dev/null so that the interpreter's last flush does not fail again.
    with contextlib.suppress(OSError, ValueError):  # ValueError: a stdout without a file
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # descriptor (a test's)
    return EXIT_BROKEN_PIPE
  except OSError as e:
    if e is not stdout.error:  # not stdout's (a checkpoint's, a file's): its own traceback
      raise
    # A full disk under a redirected stdout, an I/O error: a traceback, and an "Exception
    # ignored" at the interpreter's last flush, until 2026-12-07.
    print(f"{who}: error: cannot write to standard output: {e}", file=sys.stderr)
    if stdout.stream is sys.__stdout__:  # the process's own stdout, which the interpreter
      # flushes at exit: to /dev/null, so that that flush cannot fail again (a notebook's
      # or a test's stream is left as it is)
      with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.stream.fileno())
    return 1
  except KeyboardInterrupt:
    # One line (a traceback from wherever it landed until 2026-12-06); what was printed
    # stays.
    print(f"\n{who}: interrupted", file=sys.stderr)
    raise
  finally:
    if sys.stdout is stdout:  # the caller's stdout back (a command may have set its own)
      sys.stdout = stdout.stream


def console_main() -> int:
  """The ``attnlab`` console script (``[project.scripts]`` in pyproject.toml) and ``python -m
  attnlab.cli``: ``main`` of the process's arguments. After Ctrl-C's line the process dies by
  SIGINT, as an uninterrupted Python would, so that a shell script running it stops too (an
  exit status of 130 alone lets the script go on); ``main`` itself raises the
  KeyboardInterrupt (this is what ``main`` was until 2026-12-07)."""
  try:
    return main()
  except KeyboardInterrupt:
    _die_by_sigint()
    return EXIT_INTERRUPTED  # where SIGINT cannot kill (its handler is not the default)


def _dispatch(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help"):
    print(usage(), file=sys.stdout if argv else sys.stderr)  # no command: an error
    return 0 if argv else 2
  name, rest = argv[0], argv[1:]
  if name not in COMMANDS:
    print(f"attnlab: unknown command {name!r}\n{usage()}", file=sys.stderr)
    return 2
  module = importlib.import_module(f"attnlab.commands.{COMMANDS[name][0]}")
  # each command warns about what a saved config.gin holds, as a fresh process does
  saved_configs = sys.modules.get("attnlab.config_gin")
  if saved_configs is not None:
    saved_configs.forget_warnings()
  try:
    return int(module.main(rest) or 0)
  except CommandError as e:
    print(f"attnlab {name}: error: {e}", file=sys.stderr)
    return 2
  finally:  # --compilation_cache and the log lines' handler are the command's, not the
    # calling process's for good
    common = sys.modules.get("attnlab.commands._common")  # not loaded: nothing was set
    if common is not None:
      try:
        common.restore_compilation_cache()
      finally:
        common.restore_logging()


class _WatchedStdout:
  """``sys.stdout`` while a command runs: the caller's stream (``stream``), keeping the last
  OSError of its write or flush (``error``), so that ``main`` tells a failure of stdout from
  any other OSError (a full disk fails a checkpoint's write with the same errno)."""

  def __init__(self, stream):
    self.stream = stream
    self.error = None

  def _watch(self, method, *args):
    try:
      return method(*args)
    except OSError as e:
      self.error = e
      raise

  def write(self, text):
    return self._watch(self.stream.write, text)

  def writelines(self, lines):
    return self._watch(self.stream.writelines, lines)

  def flush(self):
    return self._watch(self.stream.flush)

  def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's
    return getattr(self.stream, name)


def _check_written(stdout: _WatchedStdout) -> None:
  """Flush ``stdout`` (a failed buffered write fails here, not at the interpreter's exit)
  and raise the error of a write that failed and was caught on its way (argparse's help)."""
  stdout.flush()
  if stdout.error is not None:
    raise stdout.error


def _stdout_closed() -> bool:
  """Whether stdout cannot be written at all: None (the process started with file
  descriptor 1 closed), a closed stream, or one over a closed descriptor."""
  if sys.stdout is None or getattr(sys.stdout, "closed", False):
    return True
  try:
    fd = sys.stdout.fileno()
  except (AttributeError, OSError, ValueError):  # none (a StringIO, pytest's capsys): its
    return False                                 # writes will say
  try:
    os.fstat(fd)
  except OSError:
    return True
  return False


def _stdout_broken() -> bool:
  """Whether stdout is a pipe whose reader has gone (poll says POLLERR); True where that
  cannot be asked (no file descriptor, no poll): the error is then taken for stdout's."""
  try:
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))
  except (OSError, ValueError, AttributeError):
    return True


def _die_by_sigint() -> None:
  sys.stderr.flush()
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
  sys.exit(console_main())
