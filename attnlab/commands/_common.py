"""What every command shares: ``CommandError``, the parser, gin flags, the XLA cache flag.

A command signals bad input by raising ``CommandError``: attnlab/cli.py
prints it as one line on stderr and exits 2, before anything is written.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from attnlab import config_gin
from attnlab.commands import CommandError
from attnlab.config import DataConfig, ModelConfig, TrainConfig, check_mesh_shape


class CommandParser(argparse.ArgumentParser):
  """argparse that raises ``CommandError`` (one line, exit 2) instead of exiting."""

  def error(self, message):
    raise CommandError(message)


def gin_flags_help(which: str, after: str = "the --gin_file files") -> str:
  """The ``--help`` epilog of a command that takes gin bindings (``which``: the
  configurables it takes; ``after``: what they override)."""
  return (f"gin bindings: --gin.NAME=VALUE or --gin.NAME VALUE (repeatable), NAME one of "
          f"{which}'s fields, VALUE as gin writes it: --gin.TrainConfig.steps=100, "
          f"--gin.DataConfig.paths=\"('data/*.txt',)\". They come after {after}.")


def split_gin_flags(argv: list[str]) -> tuple[list[str], list[str]]:
  """(``--gin.NAME=VALUE`` bindings as "NAME = VALUE", the other args)."""
  bindings, rest = [], []
  it = iter(argv)
  for arg in it:
    if arg.startswith("--gin."):
      body = arg[len("--gin."):]
      if "=" not in body:
        value = next(it, None)
        # A flag is not a value: "--gin.X --workdir w" bound X to "--workdir" before.
        if value is None or value.startswith("--"):
          raise CommandError(f"{arg} needs a value: --gin.NAME=VALUE")
        body = f"{body}={value}"
      name, value = body.split("=", 1)
      bindings.append(f"{name} = {value}")
    else:
      rest.append(arg)
  return bindings, rest


def parse_gin(gin_files: list[str], bindings: list[str]) -> tuple[ModelConfig, DataConfig,
                                                                   TrainConfig]:
  """The three configs of ``--gin_file`` files and ``--gin.`` bindings; bad ones: CommandError."""
  if not gin_files:
    raise CommandError("at least one --gin_file is needed")
  try:
    return config_gin.parse(gin_files, bindings)
  except config_gin.GinConfigError as e:
    raise CommandError(str(e)) from None


class _StderrHandler(logging.StreamHandler):
  """A StreamHandler writing to ``sys.stderr`` as it is when each record is emitted (a
  ``contextlib.redirect_stderr``, pytest's capsys, a notebook cell's), not as it was when
  the handler was made."""

  def __init__(self):
    super().__init__(sys.stderr)

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, value):  # StreamHandler.__init__ and setStream set it: nothing to keep
    pass


class _SharedSetting:
  """A setting of the whole process that commands running at once share (threads:
  ``attnlab.cli.main`` in a notebook): its value before the first of them set it
  (``before``) is put back when the last of them ends (until 2026-12-07 the first command
  to end put it back under the others). A thread's command counts once, however often it
  sets it. ``take`` and ``release`` are called under ``lock``."""

  def __init__(self):
    self.lock = threading.Lock()
    self.users = 0
    self.before = None
    self._here = threading.local()

  def held_here(self) -> bool:
    """Whether this thread's command has set it."""
    return getattr(self._here, "held", False)

  def take(self, current) -> None:
    """This thread's command sets it; ``current``, its value now, is kept where no other
    command holds it."""
    if not self.held_here():
      if self.users == 0:
        self.before = current
      self.users += 1
      self._here.held = True

  def release(self) -> bool:
    """This thread's command ends: whether it held the setting last (put ``before`` back)."""
    if not self.held_here():
      return False
    self._here.held = False
    self.users -= 1
    return self.users == 0


# attnlab's log level (``log_attnlab_info`` / ``restore_logging``) and JAX's compilation
# cache folder (``use_compilation_cache`` / ``restore_compilation_cache``), which
# ``attnlab.cli.main`` puts back at a command's end.
_LOG_LEVEL = _SharedSetting()
_CACHE_DIR = _SharedSetting()


def log_attnlab_info() -> None:
  """Log lines on stderr for the command: attnlab's from INFO up (progress, checkpoints,
  warnings), the libraries' (orbax, JAX) from WARNING up (orbax logs ~70 INFO lines a
  checkpoint), as ``%(message)s``, written to the ``sys.stderr`` of the moment each line is
  logged. Where the root logger has no handler, one of attnlab's own (``_StderrHandler``) is
  added to it, as ``logging.basicConfig`` would, and stays (so that absl, which orbax logs
  through, does not add its own at the next library call: a later command's lines went to
  the stream absl found, in its format); ``restore_logging`` puts attnlab's level back when
  the command ends. Until 2026-12-07 ``logging.basicConfig``: its handler kept the stderr of
  the process's first command, where every later command of the process (a notebook's,
  pytest's) wrote its lines, and attnlab's INFO lines stayed on after it.

  Call it before anything imports orbax: absl configures the root logger itself if nothing
  has ("INFO:attnlab.training.trainer:resumed from step 5"), and this call then only sets
  attnlab's level (as it does under a root logger the caller configured: its handlers write
  attnlab's lines)."""
  attnlab, root = logging.getLogger("attnlab"), logging.getLogger()
  with _LOG_LEVEL.lock:  # commands starting at once in threads: one record, one handler
    _LOG_LEVEL.take(attnlab.level)
    if not root.handlers:  # as logging.basicConfig(level=WARNING, format="%(message)s")
      handler = _StderrHandler()
      handler.setFormatter(logging.Formatter("%(message)s"))
      root.addHandler(handler)
      root.setLevel(logging.WARNING)
    attnlab.setLevel(logging.INFO)


def held_here() -> tuple[bool, bool]:
  """(attnlab's log level, the compilation cache folder): whether this thread's command has
  set them already. ``attnlab.cli.main`` run by a command (a user's) leaves them to the
  outer command, which puts them back when it ends (until 2026-12-07's review the inner
  command's end put them back under the outer one)."""
  return _LOG_LEVEL.held_here(), _CACHE_DIR.held_here()


def restore_logging() -> None:
  """Put back the attnlab logger's level ``log_attnlab_info`` set (nothing where this
  thread's command did not run it), once no other command running at once (another thread's
  ``attnlab.cli.main``) still logs through it: until 2026-12-07 the first to end put the
  level back under the other, whose progress and checkpoint lines were lost from then on."""
  with _LOG_LEVEL.lock:
    if _LOG_LEVEL.release():
      logging.getLogger("attnlab").setLevel(_LOG_LEVEL.before)


def out_of_memory(e: BaseException) -> str | None:
  """The first line of XLA's RESOURCE_EXHAUSTED error (an allocation that cannot be made),
  or None for any other exception (a bug keeps its traceback). By the class's name: this
  module does not import JAX."""
  text = str(e)
  if type(e).__name__ == "JaxRuntimeError" and "RESOURCE_EXHAUSTED" in text:
    return text.strip().splitlines()[0][:200]
  return None


def check_workdir_given(path: str, flag: str = "--workdir") -> None:
  """CommandError for an empty or blank ``--workdir`` of a command that reads a run (``eval``,
  ``decode``, ``convert --to-hf``; ``convert-heads --from``: until 2026-12-06 they read the
  working directory's run, naming no flag)."""
  if not path.strip():
    raise CommandError(f"{flag} {path!r} is empty: give a training workdir")


def check_path_given(flag: str, path: str) -> None:
  """CommandError naming the flag for an empty or blank path (``os.path.abspath("")`` is the
  working directory: read or written in its place without a word)."""
  if not path:  # makedirs("") fails
    raise CommandError(f"{flag} is empty: give a directory")
  if not path.strip():  # a folder named " " was made (until 2026-12-06)
    raise CommandError(f"{flag} {path!r} is only whitespace: give a directory")


def check_can_make(flag: str, path: str) -> None:
  """CommandError naming the flag if the output folder ``path`` (existing or not) cannot be
  made or written: it is empty or blank (``check_path_given``), its nearest existing folder
  is a file, or not writable. Checked without writing anything (the commands write only once
  every check passed)."""
  check_path_given(flag, path)
  at = os.path.abspath(path)
  while not os.path.lexists(at):
    at = os.path.dirname(at)
  if os.path.islink(at) and not os.path.exists(at):  # a traceback until 2026-12-05
    raise CommandError(f"{flag} {path}: cannot make this directory ({at} is a symbolic link "
                       f"to {os.readlink(at)}, which does not exist)")
  if not os.path.isdir(at):
    raise CommandError(f"{flag} {path}: cannot make this directory ({at} is a file)")
  if not os.access(at, os.W_OK | os.X_OK):
    raise CommandError(f"{flag} {path}: cannot make this directory ({at} is not writable)")
  # Names the file system cannot hold (ENAMETOOLONG: until 2026-12-07 `attnlab train` made the
  # workdir after its checks and ended in an OSError traceback).
  full = os.path.abspath(path)
  limits = {}
  for key, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
    try:
      limits[key] = os.pathconf(at, key)
    except (OSError, ValueError):
      limits[key] = default
  for name in full.split(os.sep):  # those that exist are within the limit
    if len(os.fsencode(name)) > limits["PC_NAME_MAX"]:
      raise CommandError(f"{flag} {path}: cannot make this directory (its name "
                         f"{name[:16]!r}... is {len(os.fsencode(name))} bytes, more than the "
                         f"{limits['PC_NAME_MAX']} a name may have in {at})")
  if len(os.fsencode(full)) >= limits["PC_PATH_MAX"]:
    raise CommandError(f"{flag} {path}: cannot make this directory (its path is "
                       f"{len(os.fsencode(full))} bytes, more than the "
                       f"{limits['PC_PATH_MAX'] - 1} a path may have)")


def mesh_shape_flag(text: str | None) -> tuple[int, int, int] | None:
  """``--mesh_shape D,F,T`` as a (data, fsdp, tensor) tuple; None without the flag."""
  if text is None:
    return None
  try:
    return check_mesh_shape([int(x) for x in text.split(",")])
  except ValueError:
    raise CommandError(f"--mesh_shape={text}: give 3 comma-separated positive ints (data, fsdp, "
                       "tensor), at most one -1") from None


def add_cache_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--compilation_cache", default=None, metavar="DIR",
                 help="persistent XLA compilation cache (e.g. WORKDIR/xla_cache): a rerun or "
                      "resume of the same config skips compiling (or $JAX_COMPILATION_CACHE_DIR)")


def use_compilation_cache(path: str | None) -> None:
  """Point JAX's persistent compilation cache at ``path`` (None: leave as is) for the
  command (``restore_compilation_cache``, which ``attnlab.cli.main`` runs at its end, puts
  the process's setting back: until 2026-12-07 every later command and jit of a process that
  ran one, a notebook's, wrote its programs into that folder).

  Only programs that took at least ``jax_persistent_cache_min_compile_time_secs`` (default
  1 s) to compile are stored: the train / eval steps and generation, not the small eager ops.
  """
  if path is None:
    return
  if not path.strip():  # "" was taken as "no cache" without a word until 2026-12-06
    raise CommandError(f"--compilation_cache {path!r} is empty: give a directory")
  # One line for a path that cannot be a folder (a FileExistsError traceback until
  # 2026-12-04).
  if os.path.exists(path) and not os.path.isdir(path):
    raise CommandError(f"--compilation_cache {path} is a file; give a directory")
  if not os.path.isdir(path):  # an existing folder is JAX's to read, writable or not
    check_can_make("--compilation_cache", path)
    os.makedirs(path, exist_ok=True)
  import jax  # here, not at the top: `attnlab kv-size` and --help do not start JAX

  with _CACHE_DIR.lock:
    before = jax.config.jax_compilation_cache_dir
    _CACHE_DIR.take(before)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
    if jax.config.jax_compilation_cache_dir != before:
      _reset_jax_cache()


def restore_compilation_cache() -> None:
  """Put back the compilation cache folder ``use_compilation_cache`` replaced (nothing where
  this thread's command set none), once no other command running at once (another thread's
  ``attnlab.cli.main`` with ``--compilation_cache``) still uses one: until 2026-12-07 any
  command that ended, one without the flag too, put the folder back under a running one.
  Two commands at once with two folders share the later one's (JAX's setting is the
  process's)."""
  with _CACHE_DIR.lock:
    if not _CACHE_DIR.release():
      return
    import jax

    if jax.config.jax_compilation_cache_dir != _CACHE_DIR.before:
      jax.config.update("jax_compilation_cache_dir", _CACHE_DIR.before)
      _reset_jax_cache()


def _reset_jax_cache() -> None:
  """JAX opens its persistent cache at the first compilation and keeps that folder: reset,
  the next compilation opens the folder now set (a process that had compiled before the
  command read no cache until 2026-12-07). jax's own reset (a private module: where it is
  gone, the folder set is used from the next process on)."""
  try:
    from jax._src import compilation_cache
  except ImportError:
    return
  reset = getattr(compilation_cache, "reset_cache", None)
  if reset is not None:
    reset()
