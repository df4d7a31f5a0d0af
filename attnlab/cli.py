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
traceback: closed before a command starts (``attnlab kv-size ... >&-``),
"attnlab kv-size: error: standard output is closed; nothing was run", and the
command is not run (a checkpoint opened then could take file descriptor 1); a
write or flush of it that fails (``> /dev/full``, an I/O error), "attnlab
kv-size: error: cannot write to standard output: [Errno 28] No space left on
device", where it fails: ``train`` prints at its end, after its checkpoints are
saved, while ``decode --prompts_file`` stops at the first result it cannot
print. A command that ended with its own non-zero status (``train`` stopped by a
signal: 75) keeps it, after the line. Only an error of stdout's own write or
flush is taken so: a full disk under a checkpoint or a file keeps the command's
own handling. stdout's reader gone (``| head -1``, a pipe's or a socket's) is
quiet, exit 141.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import signal
import sys
import threading

from attnlab.commands import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, CommandError
from attnlab.version import __version__

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
  lines = ["usage: attnlab COMMAND [flags]   (attnlab COMMAND --help for its flags; "
           "attnlab --version)", ""]
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
  if not name and argv[:1] not in (["-h"], ["--help"], ["--version"]):
    return _dispatch(argv)  # no command or an unknown one: its lines go to stderr, exit 2
  if _stdout_closed():  # a traceback (decode, eval) or exit 0 with nothing said
    # (kv-size) until 2026-12-07
    print(f"{who}: error: standard output is closed; nothing was run", file=sys.stderr)
    return 1
  stdout = _watch_stdout()
  since = stdout.mark()
  try:
    try:
      code = _dispatch(argv)
    except SystemExit:  # --help: argparse prints the help and hides a write that failed
      _check_written(stdout, since)
      raise
    try:
      _check_written(stdout, since)
    except OSError as e:
      if not code or isinstance(e, BrokenPipeError):
        raise
      # The command ended with its own status (train stopped by a signal: 75, resumable)
      # and its last write failed: the line, and the command's status kept.
      _stdout_failed(who, stdout, e)
      return code
    return code
  except BrokenPipeError as e:
    if not stdout.failed(e, since) and not _stdout_broken():  # another pipe (a
      raise  # subprocess's, a socket's): not ours to hide
    # The reader of stdout went away (`attnlab decode ... | head -1`, a socket's reader
    # too): stop quietly, as a Unix filter does, with SIGPIPE's exit status (a traceback
    # until 2026-12-06). The process's stdout goes to /dev/null so that the interpreter's
    # last flush does not fail again.
    _to_devnull(stdout.stream)
    return EXIT_BROKEN_PIPE
  except OSError as e:
    if not stdout.failed(e, since):  # not stdout's (a checkpoint's, a file's): its own
      raise  # traceback
    # A full disk under a redirected stdout, an I/O error: a traceback, and an "Exception
    # ignored" at the interpreter's last flush, until 2026-12-07. A command's result line
    # (``commands.print_result``) carries its own status: kept.
    _stdout_failed(who, stdout, e)
    return getattr(e, "exit_code", None) or 1
  except KeyboardInterrupt:
    # One line (a traceback from wherever it landed until 2026-12-06); what was printed
    # stays.
    print(f"\n{who}: interrupted", file=sys.stderr)
    raise
  finally:
    _unwatch_stdout(stdout)


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
  if argv[0] == "--version":
    print(f"attnlab {__version__}")
    return 0
  name, rest = argv[0], argv[1:]
  if name not in COMMANDS:
    print(f"attnlab: unknown command {name!r}\n{usage()}", file=sys.stderr)
    return 2
  module = importlib.import_module(f"attnlab.commands.{COMMANDS[name][0]}")
  # each command warns about what a saved config.gin holds, as a fresh process does
  saved_configs = sys.modules.get("attnlab.config_gin")
  if saved_configs is not None:
    saved_configs.forget_warnings()
  common = sys.modules.get("attnlab.commands._common")
  # a command running this one (nested, in its thread): what it set is its own to put back
  held = common.held_here() if common is not None else (False, False)
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
        if not held[1]:
          common.restore_compilation_cache()
      finally:
        if not held[0]:
          common.restore_logging()


class _WatchedStdout:
  """``sys.stdout`` while commands run: the caller's stream (``stream``), keeping every
  OSError of its write or flush (``errors``), so that ``main`` tells a failure of stdout from
  any other OSError (a full disk fails a checkpoint's write with the same errno). One is
  installed for all the ``main`` calls running at once (threads), the caller's stream put
  back when the last returns."""

  def __init__(self, stream):
    self.stream = stream
    self.errors = []
    self.users = 0

  def _watch(self, method, *args):
    try:
      return method(*args)
    except OSError as e:
      self.errors.append(e)
      raise

  def write(self, text):
    return self._watch(self.stream.write, text)

  def writelines(self, lines):
    return self._watch(self.stream.writelines, lines)

  def flush(self):
    return self._watch(self.stream.flush)

  def mark(self) -> int:
    """Where a call's errors begin in ``errors``."""
    return len(self.errors)

  def failed(self, error: BaseException, since: int) -> bool:
    """Whether ``error`` is one of stdout's own, met since ``since``."""
    return any(error is e for e in self.errors[since:])

  def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's
    if name == "stream":  # not set yet (copy.copy makes an instance without __init__)
      raise AttributeError(name)
    return getattr(self.stream, name)


_WATCH_LOCK = threading.Lock()


def _watch_stdout() -> _WatchedStdout:
  """``sys.stdout`` as a ``_WatchedStdout``: the one installed by a ``main`` running in
  another thread, or a new one over the caller's stream."""
  with _WATCH_LOCK:
    stdout = sys.stdout
    if not isinstance(stdout, _WatchedStdout):
      stdout = sys.stdout = _WatchedStdout(stdout)
    stdout.users += 1
    return stdout


def _unwatch_stdout(stdout: _WatchedStdout) -> None:
  """The caller's stream back once no ``main`` uses ``stdout`` (unless a command set a
  ``sys.stdout`` of its own meanwhile: that one stays)."""
  with _WATCH_LOCK:
    stdout.users -= 1
    if stdout.users == 0 and sys.stdout is stdout:
      sys.stdout = stdout.stream


def _check_written(stdout: _WatchedStdout, since: int) -> None:
  """Flush ``stdout`` (a failed buffered write fails here, not at the interpreter's exit)
  and raise the error of a write that failed since ``since`` and was caught on its way
  (argparse's help)."""
  stdout.flush()
  if len(stdout.errors) > since:
    raise stdout.errors[-1]


def _stdout_failed(who: str, stdout: _WatchedStdout, error: OSError) -> None:
  print(f"{who}: error: cannot write to standard output: {error}", file=sys.stderr)
  _to_devnull(stdout.stream)


def _to_devnull(stream) -> None:
  """The process's own stdout (``sys.__stdout__``, which the interpreter flushes at exit) to
  /dev/null, so that that flush cannot fail again; a notebook's or a test's stream is left
  as it is."""
  if stream is not sys.__stdout__:
    return
  with contextlib.suppress(OSError, ValueError):  # ValueError: no file descriptor
    null = os.open(os.devnull, os.O_WRONLY)
    try:
      os.dup2(null, stream.fileno())
    finally:
      os.close(null)


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
