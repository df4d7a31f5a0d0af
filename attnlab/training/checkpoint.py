"""Checkpoints (orbax ``CheckpointManager``) and the public ``load_checkpoint``.

A checkpoint at step S holds, as separate orbax items: ``params``,
``opt_state`` (with the step counter), ``data`` (the data iterator's state:
the index of the next batch) and ``meta`` (step, seed, the config files it
came from). Trees are stored flat, one named array per leaf, and restored
into the abstract tree of a freshly built state whose shardings come from the
*current* mesh, so a checkpoint written on one mesh shape restores onto
another.

Every checkpoint's ``meta`` keeps a checksum of each array it saved and of
the data state (``CHECKSUMS``); a restore recomputes them and takes a
checkpoint whose bytes changed on disk after the save for a damaged one
(``CorruptCheckpointError``): orbax's array files carry no checksum of their
own, so garbled bytes inside one restored as other weights.

Saves are synchronous (a kill -9 can only lose the checkpoint being written,
which orbax never publishes half-done); a corrupted latest checkpoint makes
``restore_latest`` fall back to the previous one with a warning. Only the
errors of an unreadable checkpoint are caught there (``is_unreadable``):
anything else, e.g. a checkpoint of another model shape or a bug, raises.

Fault injection (tests only, off by default): with the environment variable
``ATTNLAB_TEST_KILL_MID_SAVE=N`` the process kills itself with SIGKILL while
saving step N, after orbax has written every item of the checkpoint into its
temporary directory and before it commits it (the rename that publishes it).
"""

from __future__ import annotations

import asyncio.base_events
import contextlib
import functools
import gc
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import config_gin as gin_config
from attnlab.config import is_integer
from attnlab.data.tokenizer import not_a_regular_file
from attnlab.nn.transformer import build_model
from attnlab.training.sharding import check_mesh, param_shardings

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.gin"
KILL_MID_SAVE_ENV = "ATTNLAB_TEST_KILL_MID_SAVE"
# meta's key for the checksums: {"params": {name: [dtype, checksum]}, "opt_state": {...},
# "data": sha256 of the data state's JSON}.
CHECKSUMS = "checksums"

log = logging.getLogger(__name__)

# tensorstore reports a missing, cut-short or garbled array file as a
# ValueError whose message starts with its status code.
_TENSORSTORE_READ_ERRORS = ("NOT_FOUND:", "OUT_OF_RANGE:", "DATA_LOSS:")


def is_unreadable(e: BaseException) -> bool:
  """Whether ``e`` is what restoring a corrupt or incomplete checkpoint raises.

  Found by damaging saved checkpoints (orbax 0.12): a missing file raises
  ``FileNotFoundError`` (other ``OSError``s, e.g. ``PermissionError`` or EIO, are not
  unreadable: they may pass, and the run stops instead of falling back); a garbled or
  truncated JSON file (an item's metadata, the data state) ``json.JSONDecodeError``, or
  ``UnicodeDecodeError`` for bytes that are not UTF-8; a missing item
  directory ``KeyError("Item ... was not found in the checkpoint")``; a
  missing, truncated or garbled array file a tensorstore ``ValueError``
  (NOT_FOUND / OUT_OF_RANGE / DATA_LOSS, or FAILED_PRECONDITION "Error reading ..."
  for a data file removed from under the index), which orbax may raise as the cause of
  its own plain ``Exception`` (a truncated data file: the chain of causes is
  followed). A shape or tree mismatch (another model) is a plain ValueError and
  is *not* unreadable.
  """
  return unreadable_cause(e) is not None


def unreadable_cause(e: BaseException) -> BaseException | None:
  """The error in ``e``'s chain of explicit causes that ``is_unreadable`` takes for a
  damaged checkpoint, or None (``cause_in_chain``)."""
  return cause_in_chain(e, _unreadable_itself)


def cause_in_chain(e: BaseException, matches) -> BaseException | None:
  """The first error in ``e``'s chain of explicit causes (``raise ... from``; ``e`` first)
  that ``matches``, or None: orbax raises the errors of tensorstore and XLA as the causes of
  its own. An error merely raised while another was handled (``__context__``) is not
  followed: a mismatch raised in an ``except`` block stays a mismatch."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if matches(e):
      return e
    e = e.__cause__
  return None


@contextlib.contextmanager
def _held_library_errors():
  """Hold back what orbax logs (through absl's logger) while a save runs: when the save
  raises, the error says it once (orbax's threads logged each write failure with its
  traceback, ~350 lines for one full disk); when it succeeds, the held lines are logged
  after it, so nothing is lost. Only records logged from orbax's and tensorstore's files are
  held: another thread's own absl lines go through as they are logged (until 2026-12-07
  they were held too, and dropped with orbax's when the save failed). The save's other
  reports of its failure are ``_quiet_library_failure``'s."""
  held = []
  absl_logger = logging.getLogger("absl")
  folders = _library_folders()

  def hold(record):
    try:
      orbaxs = os.path.abspath(record.pathname).startswith(folders)
    except Exception:  # noqa: BLE001 - a record this cannot read is not orbax's: shown
      orbaxs = False
    if orbaxs:
      held.append(record)
    return not orbaxs

  absl_logger.addFilter(hold)
  try:
    with _quiet_library_failure():
      yield
  finally:
    absl_logger.removeFilter(hold)
  for record in held:  # the save returned: nothing said it, so they are shown
    absl_logger.handle(record)


@contextlib.contextmanager
def _quiet_library_failure():
  """Around an orbax save or restore: when it raises, what orbax's and tensorstore's work
  of its other writes or reads reports afterwards is not shown, for the rest of the
  process (it comes as that work ends, or at exit when its objects are collected): the
  error says it once. Until 2026-12-07, 170-690 lines around attnlab's one line on a full
  disk, up to ~3700 for one checkpoint of damaged array data: tensorstore's "Event loop is
  closed" tracebacks (``_teardown_noise``), asyncio's "exception was never retrieved"
  reports of orbax's tasks and futures (``_drop_orbax_task_reports``), exceptions ignored
  in its coroutines as they are collected (``_teardown_noise`` too), orbax's own error
  tracebacks through absl's logger (``_drop_orbax_error_tracebacks``) and "coroutine ...
  was never awaited" warnings of its coroutines that never ran
  (``_ignore_unawaited_library_coroutines``). Nothing changes when every such call returns
  (the filters are taken away when the last one running ends, unless one failed: nested
  reads, ``read_as_step``, or another thread's); an interrupt (Ctrl-C) leaves them too."""
  with _TEARDOWN_LOCK:
    _TEARDOWN["removes"].append(_install_teardown_filters())
    _TEARDOWN["running"] += 1
  failed = True
  try:
    yield
    failed = False
  except Exception:
    _ignore_unawaited_library_coroutines()
    raise
  finally:
    with _TEARDOWN_LOCK:
      _TEARDOWN["running"] -= 1
      _TEARDOWN["failed"] |= failed
      if not _TEARDOWN["running"]:
        removes, _TEARDOWN["removes"] = _TEARDOWN["removes"], []
        if not _TEARDOWN["failed"]:  # (until 2026-12-07 the outer call of a failed
          for remove in reversed(removes):  # nested one took them away)
            remove()


def _join_library_threads(before: set, timeout: float = 60.0, settle: float = 0.1) -> None:
  """Wait (up to ``timeout`` seconds in all) for orbax's threads of a save that raised, those
  not in ``before`` (the threads alive when it began: another orbax save of the process is
  not waited for): the first failed write raises, the others go on writing into the step's
  folder and log their own failures, and start more threads of their own (the metadata
  written after the commits). Joined until none is left for ``settle`` seconds while the
  save's log lines are held, they say nothing, and a caller that removes the folder
  (``attnlab convert-heads``) removes it for good: until 2026-12-07 they wrote into it again
  after it was removed. A thread's own failure, which orbax's ``join`` raises, is not this
  wait's (the save's error is the one raised)."""
  deadline = time.monotonic() + timeout
  quiet = False
  while time.monotonic() < deadline:
    alive = [t for t in threading.enumerate()
             if t not in before and t is not threading.current_thread() and t.is_alive()
             and type(t).__module__.startswith("orbax.")]
    if not alive:
      if quiet:
        return
      quiet = True
      time.sleep(settle)
      continue
    quiet = False
    for thread in alive:
      with contextlib.suppress(Exception):  # its own write's error: said by the save's
        thread.join(max(0.0, deadline - time.monotonic()))


# The calls of ``_quiet_library_failure`` running, what they installed, and whether one of
# this process failed (then the filters stay).
_TEARDOWN_LOCK = threading.Lock()
_TEARDOWN = {"running": 0, "removes": [], "failed": False}


def _library_folders() -> tuple[str, ...]:
  """The folders of orbax's and tensorstore's files (of those imported)."""
  files = (getattr(sys.modules.get(name), "__file__", None)
           for name in ("orbax.checkpoint", "tensorstore"))
  return tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in files if f)


def _ignore_unawaited_library_coroutines() -> None:
  """A warnings filter, for the rest of the process, of the "coroutine 'NAME' was never
  awaited" RuntimeWarning of every coroutine function of orbax's or tensorstore's (those of
  their functions loaded, nested ones included: a coroutine made by the failed work and
  never started warns when it is collected, at exit at the latest, and work still under
  way after the failure makes more of them)."""
  folders = _library_folders()
  names, seen = set(), set()
  # type(f), not isinstance: an object's __class__ may be a property that warns (torch's
  # deprecated reduce_op printed a FutureWarning per failed save)
  todo = [f.__code__ for f in gc.get_objects() if type(f) is types.FunctionType
          and os.path.abspath(f.__code__.co_filename).startswith(folders)]
  while todo:
    code = todo.pop()
    if id(code) in seen:
      continue
    seen.add(id(code))
    if code.co_flags & inspect.CO_COROUTINE:
      names.add(getattr(code, "co_qualname", code.co_name))
    todo.extend(c for c in code.co_consts if inspect.iscode(c))
  new = names - _UNAWAITED_IGNORED
  if new:
    _UNAWAITED_IGNORED.update(new)
    warnings.filterwarnings(
        "ignore", "coroutine '(" + "|".join(map(re.escape, sorted(new))) + ")' was never awaited",
        RuntimeWarning)


# The coroutine functions whose "never awaited" warnings are filtered in this process.
_UNAWAITED_IGNORED: set[str] = set()


# tensorstore's errors are absl status texts: "OUT_OF_RANGE: Error writing ...".
_STATUS = re.compile(r"(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|"
                     r"ALREADY_EXISTS|PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|"
                     r"ABORTED|OUT_OF_RANGE|UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|"
                     r"UNAUTHENTICATED): ")


def _from_orbax(exc: BaseException) -> bool:
  """Whether ``exc`` is orbax's or tensorstore's: its traceback runs through their files,
  or it has none (set on a future by tensorstore's own threads) and is tensorstore's kind
  of error, a ValueError whose text starts with a status code."""
  frames = traceback.extract_tb(exc.__traceback__)
  if not frames:
    return type(exc) is ValueError and _STATUS.match(str(exc)) is not None
  folders = _library_folders()
  return any(os.path.abspath(f.filename).startswith(folders) for f in frames)


def _teardown_noise(unraisable) -> bool:
  """Whether ``unraisable`` (``sys.unraisablehook``'s argument) is what orbax's and
  tensorstore's work left after a failed save or restore reports: asyncio's
  ``RuntimeError: Event loop is closed`` from ``call_soon_threadsafe`` on orbax's event
  loop, closed when the operation failed, one for each write or read still under way (a
  traceback of 5 lines each, 122 of them on a full disk until 2026-12-07); an exception
  ignored in one of orbax's coroutines as it is collected (its error of a damaged array's
  read, "Encountered error while reading array index", ~50 lines each, 41 of them for one
  damaged checkpoint until 2026-12-07)."""
  obj = unraisable.object
  if inspect.iscoroutine(obj):
    return os.path.abspath(obj.cr_code.co_filename).startswith(_library_folders())
  exc = unraisable.exc_value
  if obj is not None or type(exc) is not RuntimeError or str(exc) != "Event loop is closed":
    return False
  frames = traceback.extract_tb(unraisable.exc_traceback)
  asyncio_file = os.path.abspath(asyncio.base_events.__file__)
  return ([f.name for f in frames] == ["call_soon_threadsafe", "_check_closed"]
          and all(os.path.abspath(f.filename) == asyncio_file for f in frames))


def _drop_orbax_task_reports(record: logging.LogRecord) -> bool:
  """An ``asyncio`` logger filter: False for asyncio's report of an orbax task or future
  that failed with a save or restore ("Task exception was never retrieved" and its
  traceback, when it is collected: at exit, after a full disk)."""
  exc_info = record.exc_info
  exc = exc_info[1] if isinstance(exc_info, tuple) and len(exc_info) == 3 else None
  try:
    return not (isinstance(exc, BaseException)
                and "exception was never retrieved" in str(record.msg) and _from_orbax(exc))
  except Exception:  # noqa: BLE001 - a record this cannot read is not one of these: kept
    return True


def _drop_orbax_error_tracebacks(record: logging.LogRecord) -> bool:
  """An ``absl`` logger filter (orbax logs through absl's logger): False for an error that
  orbax's own files log with its traceback (its threads of the failed work that go on
  after it: "_SignalingThread.run() raised an exception", "cannot schedule new futures
  after shutdown", each write's own failure)."""
  try:
    return not (record.exc_info and record.levelno >= logging.ERROR
                and os.path.abspath(record.pathname).startswith(_library_folders()))
  except Exception:  # noqa: BLE001 - a record this cannot read is not one of these: kept
    return True


class _UnraisableFilter:
  """``sys.unraisablehook`` while it is installed: ``_teardown_noise`` dropped, the rest
  handed to the hook it replaced."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable):
    try:
      noise = _teardown_noise(unraisable)
    except Exception:  # noqa: BLE001 - one this cannot read is not noise: handed on
      noise = False
    if not noise:
      self.previous(unraisable)


def _install_teardown_filters():
  """Install the filters of a failed save's or restore's teardown reports where they are
  not in place (a failed one leaves them for the process) and return the function that
  takes away those it installed (the hook only where it was not replaced since)."""
  removes = []
  if not isinstance(sys.unraisablehook, _UnraisableFilter):
    hook = sys.unraisablehook = _UnraisableFilter(sys.unraisablehook)

    def put_back_hook():
      if sys.unraisablehook is hook:
        sys.unraisablehook = hook.previous

    removes.append(put_back_hook)
  for name, drop in (("asyncio", _drop_orbax_task_reports),
                     ("absl", _drop_orbax_error_tracebacks)):
    logger = logging.getLogger(name)
    if drop not in logger.filters:
      logger.addFilter(drop)
      removes.append(functools.partial(logger.removeFilter, drop))

  def remove():
    for undo in removes:
      undo()

  return remove


class CorruptCheckpointError(ValueError):
  """A checkpoint's arrays or data state read back other values than were saved (their
  checksums in its meta item differ): its bytes changed on disk after the save."""


class UnreadableCheckpointError(ValueError):
  """A checkpoint could not be restored because it is damaged or cut short
  (``is_unreadable``); the message names the checkpoint and the error, which is also the
  exception's ``__cause__``. Raised by every ``Checkpointer`` restore of a given step
  (until 2026-12-04 the bare cause came through: ``attnlab decode`` on a garbled
  checkpoint printed "Expecting value: line 1 column 1 (char 0)")."""


class CheckpointGoneError(UnreadableCheckpointError):
  """A checkpoint that was no longer there when it was read: a run still training in the
  workdir deletes its older checkpoints (``keep_checkpoints``) while a reader reads."""


# How often a reader opens the checkpoints again or tries the newest again when a run
# still training deletes what it was reading.
_READ_TRIES = 20


def _fmix32(h):
  """MurmurHash3's 32-bit finalizer: a bijection of uint32 that mixes every bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


@jax.jit
def _leaf_checksum(x):
  """sum_i fmix32(word_i ^ fmix32(i)) mod 2**32 over the uint32 words of ``x``'s bits (one
  word per element of up to 4 bytes, two per 8-byte element). fmix32 is a bijection, so
  any change of one word changes its term and the sum; the mix is not linear, so changes
  of several words do not cancel by construction (two flipped sign bits would in a plain
  weighted sum); the sum is exact in any order (integers mod 2**32), so a sharded array
  gives the same number on any mesh."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  words = words.reshape(-1)
  index = jnp.arange(words.size, dtype=jnp.uint32)
  return jnp.sum(_fmix32(words ^ _fmix32(index)), dtype=jnp.uint32)


def checksums(flat: dict) -> dict:
  """``{name: [dtype, checksum]}`` of a flat tree's arrays (jax or NumPy; one array on
  the device at a time). Every process of a multi-host run calls it (a collective)."""
  out = {}
  for name, x in flat.items():
    if isinstance(x, (np.ndarray, np.generic)) and x.dtype.itemsize == 8:
      # The words on the host: without jax_enable_x64, jit would cast a float64 / int64
      # NumPy leaf to 32 bits first (and read one word of it); these are the words the
      # bitcast reads with x64 on, in the same order (low word first).
      value = _leaf_checksum(np.ascontiguousarray(x).reshape(-1).view(np.uint32))
    else:
      value = _leaf_checksum(x)
    out[name] = [str(x.dtype), int(np.asarray(value.addressable_data(0)))]
  return out


def _as_saved(x, saved: str):
  """``x``, restored from an array saved in dtype ``saved``, as the saved array bit for bit,
  or None where its bits cannot be told from it (an array orbax cast another way).

  orbax widens a bfloat16 value to float32 by appending 16 zero bits (NaN payloads
  included), so the upper half of each float32 word is the saved bfloat16: taken by
  bitcasts, which never rewrite a NaN (``astype`` would: XLA on the CPU makes every
  bfloat16 NaN 0x7FC0, and a GPU's 0x7FFF then failed its checksum)."""
  if str(x.dtype) == saved:
    return x
  if saved == "bfloat16" and x.dtype == jnp.float32:
    words = jax.lax.bitcast_convert_type(x, jnp.uint32) >> jnp.uint32(16)
    return jax.lax.bitcast_convert_type(words.astype(jnp.uint16), jnp.bfloat16)
  return None


def _data_digest(data_state: dict) -> str:
  """SHA-256 of the data state as its JSON file holds it (keys as strings, sorted)."""
  text = json.dumps(json.loads(json.dumps(data_state)), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()


def _unreadable_itself(e: BaseException) -> bool:
  # Of the OSErrors only a missing file or folder: a permission error, too many open files
  # or an I/O error of the disk or network say nothing about the checkpoint, and a fallback
  # past a good checkpoint would have the run save over it (until 2026-12-04 every OSError).
  if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError,
                    json.JSONDecodeError, UnicodeDecodeError, CorruptCheckpointError)):
    return True
  if isinstance(e, KeyError):
    return "not found in the checkpoint" in str(e)
  if isinstance(e, ValueError):
    msg = str(e)
    # A data file whose chunk is gone reads as a truncated stream: FAILED_PRECONDITION.
    return (msg.startswith(_TENSORSTORE_READ_ERRORS) or msg.startswith(
        "Found incomplete checkpoint") or (msg.startswith("FAILED_PRECONDITION:")
                                          and "Error reading" in msg))
  return False


def _kill_mid_save_path_class(ocp, kill_step: int):
  """orbax's atomic-rename temporary path, killing the process (SIGKILL)
  just before it commits the checkpoint of ``kill_step``."""
  base = ocp.path.atomicity.AtomicRenameTemporaryPath

  class KillBeforeCommit(base):
    async def finalize(self, *args, **kwargs):
      if self.get_final().name == str(kill_step):
        os.kill(os.getpid(), signal.SIGKILL)
      return await super().finalize(*args, **kwargs)

  return KillBeforeCommit


def _leaf_name(i: int, path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
  return f"{i:04d}_" + re.sub(r"[^A-Za-z0-9_]", "_", "_".join(parts))


class CheckpointMismatchError(ValueError):
  """A checkpoint holds arrays of other shapes, or other arrays, than the state it is
  restored into (another model or optimizer)."""


def _shown(name: str) -> str:
  """A flat leaf name as a path: '0003_decoder_layers_0_mlp_w_value' -> 'decoder_layers_0_mlp_w'."""
  return re.sub(r"_value$", "", name.split("_", 1)[-1])


def check_fits(stored: dict, wanted: dict, what: str) -> None:
  """Raise ``CheckpointMismatchError`` unless the flat ``{name: shape}`` dicts agree.

  ``stored``: the checkpoint's; ``wanted``: the state's it is restored into (both
  keyed by ``flatten``'s names, whose leading index is ignored here: a layer added
  shifts it for every leaf after). Dtypes are not compared: orbax casts.
  """
  stored, wanted = _by_shown_name(stored), _by_shown_name(wanted)
  missing = [k for k in wanted if k not in stored]
  extra = [k for k in stored if k not in wanted]
  if missing or extra:
    sides = [f"{len(extra)} not in this run (first: {extra[0]})" if extra else "",
             f"{len(missing)} of this run not in it (first: {missing[0]})" if missing else ""]
    raise CheckpointMismatchError(
        f"{what} holds other arrays than this run: {'; '.join(x for x in sides if x)}")
  differ = [k for k in wanted if stored[k] != wanted[k]]
  if differ:
    more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
    raise CheckpointMismatchError(
        f"{what} holds arrays of other shapes: {differ[0]} is {stored[differ[0]]} there, "
        f"{wanted[differ[0]]} in this run{more}")


def _by_shown_name(flat: dict) -> dict:
  """``{_shown(name): shape}`` in leaf order; leaves whose paths read alike (keys "a.b"
  and "a_b" both become "a_b") keep apart as "a_b", "a_b (2)", ... instead of one
  replacing the other."""
  out, seen = {}, {}
  for k, v in sorted(flat.items()):
    name = _shown(k)
    seen[name] = seen.get(name, 0) + 1
    out[name if seen[name] == 1 else f"{name} ({seen[name]})"] = tuple(v)
  return out


def flatten(tree) -> dict:
  """A flat ``{name: leaf}`` dict of a pytree (names keep the order)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_leaf_name(i, path): leaf for i, (path, leaf) in enumerate(leaves)}


def unflatten(like, flat: dict):
  """The inverse of ``flatten`` given a tree of the same structure."""
  leaves = [flat[k] for k in flatten(like)]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


class Checkpointer:
  """Save / restore train states in ``workdir/checkpoints``, keeping ``keep``.

  A writer (the default) deletes what an earlier writer left half-saved
  (orbax's ``<step>.orbax-checkpoint-tmp`` directories of a killed run) before
  it returns; only the process that trains a workdir opens one. Everything
  that only reads (``load_checkpoint``, ``attnlab eval``, a sweep checking
  how far a run got) opens it with ``read_only=True``, which deletes nothing:
  the temporary directory it sees may be a save of a run still training.
  """

  def __init__(self, workdir: str, keep: int = 3, *, read_only: bool = False):
    import orbax.checkpoint as ocp

    self._ocp = ocp
    self.read_only = read_only
    self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
    extra = {}
    if not read_only:
      kill_step = os.environ.get(KILL_MID_SAVE_ENV)
      if kill_step:
        extra["temporary_path_class"] = _kill_mid_save_path_class(ocp, int(kill_step))
      if jax.process_index() == 0 and os.path.isdir(self.directory):
        for name in ocp.path.step.tmp_checkpoints(self.directory):
          log.info("deleting %s, a checkpoint left half-saved",
                   os.path.join(self.directory, name))
          shutil.rmtree(os.path.join(self.directory, name))
    # Not orbax's cleanup_tmp_directories: it deletes in a background thread that
    # close() does not wait for, so a second manager opened on the same directory
    # soon after raced it on the same paths (FileNotFoundError in rmtree, seen in
    # CI on a resume after a kill mid-save). Nor orbax's read_only option for a
    # reader: it logs two warnings on every open (each decode and eval printed
    # them); a reader creates and deletes nothing, and ``save`` refuses.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, enable_async_checkpointing=False,
        cleanup_tmp_directories=False, **extra)
    # Opening lists the steps and reads each one's folder: a run still training may delete
    # one in between (a bare FileNotFoundError from orbax until 2026-12-07).
    self.manager = self._listing(lambda: ocp.CheckpointManager(self.directory,
                                                               options=options))

  def steps(self) -> list[int]:
    """The saved steps, as listed when this was opened or last ``reload``ed."""
    return sorted(self.manager.all_steps())

  def reload(self) -> None:
    """List the saved steps again (a run still training saves and deletes them)."""
    self._listing(self.manager.reload)

  def _listing(self, list_steps):
    """``list_steps()`` (orbax lists the step folders, then looks into each), again while a
    step deleted in between makes it raise FileNotFoundError, ``_READ_TRIES`` times at
    most; a checkpoint folder that is gone itself is raised at once."""
    for tries_left in reversed(range(_READ_TRIES)):
      try:
        return list_steps()
      except FileNotFoundError:
        if not tries_left or not os.path.isdir(self.directory):
          raise

  def resolve_step(self, step: int | None = None) -> int:
    """``step`` if it is saved, else the newest saved step when ``step`` is None.

    Raises:
      FileNotFoundError: nothing is saved.
      ValueError: ``step`` is not an integer (a Python or NumPy one, not a bool), or not one
        of the saved steps (the message lists them).
    """
    if (isinstance(step, np.ndarray | jax.Array) and step.shape == ()
        and np.issubdtype(step.dtype, np.integer)):  # a saved step, state["step"]
      step = int(step)
    if step is not None and not is_integer(step):
      # until 2026-12-06 "3" was "step=3 has no checkpoint ...; saved steps: [3]", and 3.0
      # passed to fail reading a folder named 3.0
      raise ValueError(f"step={step!r} must be an integer (a saved step) or None, got "
                       f"{type(step).__name__}")
    steps = self.steps()
    if not steps:
      raise FileNotFoundError(f"{self.directory} holds no checkpoint")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise ValueError(f"step={step} has no checkpoint in {self.directory}; "
                       f"saved steps: {steps}")
    return int(step)

  def _check_writable(self) -> None:
    if self.read_only:
      raise ValueError(f"this Checkpointer of {self.directory} is read-only: open it with "
                       "read_only=False to save")

  def save(self, step: int, state: dict, data_state: dict, meta: dict | None = None) -> None:
    self._check_writable()
    ocp = self._ocp
    if step in self.manager.all_steps():
      # Only a resume past a corrupted checkpoint saves a step twice.
      self.manager.delete(step)
    params = flatten(state["params"])
    rest = flatten({"opt_state": state["opt_state"], "step": state["step"]})
    sums = {"params": checksums(params), "opt_state": checksums(rest),
            "data": _data_digest(data_state)}
    threads = set(threading.enumerate())
    with _held_library_errors():
      try:
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(rest),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave({"step": int(step), **(meta or {}), CHECKSUMS: sums}),
        ), force=True)
        self.manager.wait_until_finished()
      except Exception:
        _join_library_threads(threads)
        raise

  def save_params(self, step: int, params, meta: dict | None = None) -> None:
    """A weights-only checkpoint (``attnlab convert``): no optimizer or data
    state, so training from it starts a fresh optimizer at batch 0."""
    self._check_writable()
    ocp = self._ocp
    flat = flatten(params)
    sums = {"params": checksums(flat)}
    self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(flat),
        meta=ocp.args.JsonSave({"step": int(step), **(meta or {}), CHECKSUMS: sums}),
    ), force=True)
    self.manager.wait_until_finished()

  def _check_item(self, step: int, item: str, flat: dict) -> None:
    """Compare the shapes saved in ``step``'s ``item`` with ``flat`` (``flatten`` of the
    abstract state) before orbax reads any array (``CheckpointMismatchError``). An item
    whose metadata cannot be read, or names no leaf of ``flat``, is left to the restore,
    which tells unreadable from mismatched (``is_unreadable``)."""
    try:
      from etils import epath

      meta = self._ocp.StandardCheckpointHandler().metadata(
          epath.Path(self.directory) / str(step) / item)
      stored = {path[-1].key: tuple(m.shape)
                for path, m in jax.tree_util.tree_leaves_with_path(meta)}
    except Exception:  # noqa: BLE001 - unreadable: the restore reports it
      return
    if not {_shown(k) for k in stored} & {_shown(k) for k in flat}:
      return  # names in a layout this code does not know (another orbax): orbax compares
    check_fits(stored, {k: tuple(v.shape) for k, v in flat.items()},
               f"checkpoint {os.path.join(self.directory, str(step))}'s {item}")

  def has_train_state(self, step: int) -> bool:
    """False for a weights-only checkpoint (``save_params``)."""
    return os.path.isdir(os.path.join(self.directory, str(step), "opt_state"))

  def _named(self, step: int, read):
    """``read()``, an error of an unreadable checkpoint raised as
    ``UnreadableCheckpointError`` naming checkpoint ``step``; any other error as it is."""
    path = os.path.join(self.directory, str(step))
    try:
      with _quiet_library_failure():
        return read()
    except UnreadableCheckpointError:
      raise
    except Exception as e:
      if not os.path.isdir(path):  # whatever orbax made of the files going away under it
        raise CheckpointGoneError(
            f"checkpoint {path} is gone: deleted while it was read (a run still training in "
            f"{self.directory} keeps only its newest checkpoints)") from e
      cause = unreadable_cause(e)
      if cause is None:
        raise
      text = str(cause).splitlines()[0][:500] if str(cause) else ""
      raise UnreadableCheckpointError(
          f"checkpoint {os.path.join(self.directory, str(step))} could not be restored "
          f"({type(cause).__name__}: {text})") from e

  def read_as_step(self, step: int, read):
    """``read()``, a read of checkpoint ``step`` through other functions (``load_checkpoint``
    of the same workdir, say), its errors named as the restores here name theirs: a gone
    step as ``CheckpointGoneError`` (so that ``restore_newest`` reads the newest again), a
    damaged one as ``UnreadableCheckpointError``."""
    return self._named(step, read)

  def restore_newest(self, read_step):
    """``(step, read_step(step))`` for the newest saved step that reads, or None.

    ``read_step`` is one of the restores below (or calls them). A checkpoint that raises
    ``UnreadableCheckpointError`` is reported in a WARNING log line (once: until
    2026-12-04 also as a ``UserWarning``, which a command printed a second time) and the
    next older one is tried; nothing is deleted. One that a run still training deleted
    while it was read (``CheckpointGoneError``) is no fault: the steps are listed again
    and the newest not yet tried is read (until 2026-12-07 the reader fell back to older
    ones, which that run deletes first: up to 6% of the reads beside a run saving every
    step failed). Any other error is raised.
    """
    tried = set()
    for _ in range(_READ_TRIES + len(self.steps())):
      left = [step for step in self.steps() if step not in tried]
      if not left:
        return None
      step = left[-1]
      tried.add(step)
      try:
        return step, read_step(step)
      except CheckpointGoneError as e:
        log.info("%s; reading the newest again", e)
        self.reload()
      except UnreadableCheckpointError as e:
        log.warning("%s; falling back to the previous one", e)
    return None

  def read_step(self, step: int | None, read_step):
    """``(step, read_step(step))``; for ``step`` None the newest step that reads
    (``restore_newest``), a ``FileNotFoundError`` naming the saved steps when none does
    (what ``load_checkpoint``, ``convert --to-hf`` and ``convert-heads`` read)."""
    if step is not None:
      return step, read_step(step)
    found = self.restore_newest(read_step)
    if found is None:
      self.reload()
      raise FileNotFoundError(f"no checkpoint in {self.directory} could be read (saved "
                              f"steps: {self.steps()})")
    return found

  def restore(self, step: int, abstract_state: dict,
              init_state: dict | Callable[..., dict] | None = None
              ) -> tuple[dict, dict | None]:
    """(state, data_state) of ``step``, placed as ``abstract_state`` says.

    A weights-only checkpoint takes ``opt_state`` and ``step`` from
    ``init_state`` (a freshly initialized state, or a function giving them for the restored
    parameters: ``TrainSetup.fresh_rest``) and has no data state (None).
    ``UnreadableCheckpointError`` if it is damaged.
    """
    return self._named(step, lambda: self._restore(step, abstract_state, init_state))

  def _restore(self, step, abstract_state, init_state):
    ocp = self._ocp
    if not self.has_train_state(step):
      if init_state is None:
        raise ValueError(f"checkpoint {step} in {self.directory} holds weights only; "
                         "restoring it needs a fresh init_state")
      params = self.restore_params(step, abstract_state["params"])
      fresh = init_state(params) if callable(init_state) else init_state
      return {"params": params, "opt_state": fresh["opt_state"], "step": fresh["step"]}, None
    rest = {"opt_state": abstract_state["opt_state"], "step": abstract_state["step"]}
    flat_params, flat_rest = flatten(abstract_state["params"]), flatten(rest)
    self._check_item(step, "params", flat_params)
    self._check_item(step, "opt_state", flat_rest)
    out = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(flat_params),
        opt_state=ocp.args.StandardRestore(flat_rest),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore(),
    ))
    self._verify(step, out["meta"], {"params": out["params"], "opt_state": out["opt_state"]},
                 dict(out["data"]))
    rest = unflatten(rest, out["opt_state"])
    state = {"params": unflatten(abstract_state["params"], out["params"]),
             "opt_state": rest["opt_state"], "step": rest["step"]}
    return state, dict(out["data"])

  def restore_params(self, step: int, abstract_params):
    """The parameters of ``step`` (``UnreadableCheckpointError`` if it is damaged)."""
    return self._named(step, lambda: self._restore_params(step, abstract_params))

  def _restore_params(self, step, abstract_params):
    ocp = self._ocp
    flat = flatten(abstract_params)
    self._check_item(step, "params", flat)
    out = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(flat), meta=ocp.args.JsonRestore()))
    self._verify(step, out["meta"], {"params": out["params"]})
    return unflatten(abstract_params, out["params"])

  def read_meta(self, step: int) -> dict:
    """The ``meta`` item of ``step`` (its step, the run's seed and schedule, the checksums);
    ``UnreadableCheckpointError`` if it is damaged."""
    ocp = self._ocp
    return self._named(step, lambda: dict(self.manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]))

  def restore_data(self, step: int) -> dict | None:
    """The data-pipeline position saved with ``step`` (None for a weights-only checkpoint;
    ``UnreadableCheckpointError`` if it is damaged)."""
    if not self.has_train_state(step):
      return None
    ocp = self._ocp

    def read():
      out = self.manager.restore(step, args=ocp.args.Composite(
          data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
      self._verify(step, out["meta"], {}, dict(out["data"]))
      return dict(out["data"])

    return self._named(step, read)

  def _verify(self, step: int, meta, items: dict, data_state: dict | None = None) -> None:
    """Raise ``CorruptCheckpointError`` unless the restored ``items`` ({item: flat
    arrays}) and ``data_state`` have the checksums ``save`` kept in ``meta``. A
    checkpoint saved without them (before 2026-12-04) is taken as it is. A bfloat16 array
    restored as float32 (a bfloat16 run's optimizer state saved before 2026-12-07) is
    compared by its saved bits (``_as_saved``); an array cast another way is not compared."""
    saved = dict(meta or {}).get(CHECKSUMS)
    if not saved:
      return
    where = os.path.join(self.directory, str(step))
    for item, flat in items.items():
      want = saved.get(item, {})
      now = {}
      for name, v in flat.items():  # one array (and its saved bits) at a time
        v = _as_saved(v, want[name][0]) if name in want else None
        if v is not None:
          now.update(checksums({name: v}))
      for name, (_, value) in now.items():
        if value != want[name][1]:
          raise CorruptCheckpointError(
              f"checkpoint {where}'s {item} array {_shown(name)} reads other values than "
              f"were saved (checksum {value:#010x}, saved {want[name][1]:#010x})")
    if data_state is not None and "data" in saved and _data_digest(data_state) != saved["data"]:
      raise CorruptCheckpointError(f"checkpoint {where}'s data state {data_state} is not the "
                                   "one that was saved (its checksum differs)")

  def restore_latest(self, abstract_state: dict,
                     init_state: dict | Callable[..., dict] | None = None):
    """(step, state, data_state) of the newest readable checkpoint, or None
    (``restore_newest``: a damaged one is logged and skipped)."""
    found = self.restore_newest(lambda step: self.restore(step, abstract_state, init_state))
    return None if found is None else (found[0], *found[1])

  def close(self) -> None:
    self.manager.close()


def has_saved_steps(workdir: str) -> bool:
  """Whether ``workdir``'s checkpoint folder holds a step's folder (orbax names each by its
  step; a half-saved one has a suffix), without opening orbax: a hint (whether each reads
  is ``Checkpointer``'s to say); False where the folder is missing or cannot be listed."""
  try:
    return any(name.isdigit() for name in os.listdir(os.path.join(workdir, CHECKPOINT_DIR)))
  except OSError:
    return False


def workdir_config(workdir: str) -> str:
  """The path of ``workdir``'s config.gin; a FileNotFoundError naming it where there is
  none (the folder is not a training workdir). A TypeError for a workdir that is no path
  (``load_checkpoint(None)``: a TypeError from inside ``posixpath`` until 2026-12-07)."""
  if not isinstance(workdir, str | os.PathLike):
    raise TypeError(f"workdir must be a path (a str or os.PathLike), got "
                    f"{type(workdir).__name__}")
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(_not_there(path, "file", "not a training workdir"))
  return path


def _not_there(path: str, want: str, meaning: str) -> str:
  """"PATH does not exist: MEANING", or what is there in place of the ``want`` ("file" or
  "folder") a workdir holds there, named as the tokenizer readers name it ("a FIFO", "a
  socket", ...: ``not_a_regular_file``). Until 2026-12-07 a folder or a FIFO in config.gin's
  place was said not to exist, and then, that day, any kind but a file or a folder was
  "neither a file nor a folder"."""
  if not os.path.lexists(path):
    return f"{path} does not exist: {meaning}"
  if not os.path.exists(path):
    return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
  kind = not_a_regular_file(path) or "a file"  # "a folder", "a FIFO", ...
  return f"{path} is {kind}, not the {want} a training workdir holds there"


def _builder(mcfg):
  """A function that builds the model of ``mcfg`` with load_checkpoint's RNG seeds."""
  from flax import nnx

  return lambda: build_model(mcfg, rngs=nnx.Rngs(params=0, dropout=1))


def abstract_model(mcfg):
  """The model of ``mcfg`` with shapes only (nothing allocated): what a checkpoint is
  restored into, and what a sweep counts parameters of."""
  from flax import nnx

  return nnx.eval_shape(_builder(mcfg))


@functools.lru_cache(maxsize=16)
def _init_rest(mcfg):
  """The jitted init of everything of ``mcfg``'s model but its parameters (the RNG
  streams), one per config: a new ``jax.jit`` of a new function on every load traced and
  compiled it again (~0.08 s of a ~0.25 s warm load, 2026-12-05)."""
  from flax import nnx

  make = _builder(mcfg)
  return jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2])


def load_checkpoint(workdir: str, step: int | None = None, *, mesh=None):
  """The model of a training run, with the parameters of a checkpoint.

  Args:
    workdir: a training workdir (holds ``config.gin`` and ``checkpoints/``).
    step: the checkpoint step; None = the newest that reads (a damaged newer one is
      skipped with a warning, as a resume and ``attnlab eval`` skip it).
    mesh: a (data, fsdp, tensor) ``Mesh`` (``training.sharding.make_mesh``): the
      parameters are restored straight into the training layout on it (heads,
      KV heads, MLP and vocabulary over ``tensor``, ``embed`` over ``fsdp``), and
      ``generate`` / ``generate_requests`` then decode on that mesh. None = the
      first device.

  Returns:
    (model, cfg): an ``nnx.Module`` rebuilt from ``workdir/config.gin`` and
    its ``ModelConfig``.

  Raises:
    FileNotFoundError: no ``config.gin`` or no (readable) checkpoint in ``workdir``.
    ValueError: ``step`` is not an integer or not one of the saved steps, ``mesh`` is not a
      Mesh with the axes above, has explicit axes or leaves out a process
      (``sharding.check_mesh``); ``UnreadableCheckpointError`` (a ValueError) when the
      given ``step`` is damaged.
  """
  from flax import nnx

  if mesh is not None:
    check_mesh(mesh)
  config_path = workdir_config(workdir)
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(_not_there(ckpt_dir, "folder", "no checkpoint saved yet"))
  mcfg, _, _ = gin_config.read_workdir_config(config_path)
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    resolved = ckpt.resolve_step(step)  # nothing saved, a step that was not: errors above
    step = None if step is None else resolved  # a NumPy int as the int it holds
    # The parameters' shapes only: initializing them eagerly (one small XLA
    # program per op and shape) cost more than the restore (runs/demo, first
    # load in a process: 3.8-4.0 s against 0.9-1.4 s for this path;
    # tools/bench_load_checkpoint.py). The rest of the state (the dropout RNG
    # streams) is built for real, in one jitted call, compiled once per config.
    graphdef, params, _ = nnx.split(abstract_model(mcfg), nnx.Param, ...)
    rest = _init_rest(mcfg)()
    if mesh is None:  # one device: decoding and eval need no mesh
      device = jax.sharding.make_single_device_sharding(jax.devices()[0])
      shardings = jax.tree.map(lambda _: device, params)
    else:
      shardings = param_shardings(params, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            params, shardings)
    step, params = ckpt.read_step(step, lambda s: ckpt.restore_params(s, abstract))
  finally:
    ckpt.close()
  model = nnx.merge(graphdef, params, rest)
  model.eval()
  return model, mcfg
