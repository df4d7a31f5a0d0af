"""gin at the edge: the config dataclasses as gin configurables.

Only this module (and attnlab/commands/) imports gin. A config file binds
``ModelConfig.*``, ``DataConfig.*`` and ``TrainConfig.*``; the command line
adds ``--gin.NAME=VALUE`` bindings, which are applied after the files and so
win. The operative config written to ``workdir/config.gin`` lists every field
of the three configs explicitly, so a later change of a default cannot change
what a workdir means.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util  # noqa: F401 - gin 0.5 needs it loaded to report a missing include
import logging
import os
import re
import shutil
import sys
import threading
import tokenize

import gin

from attnlab.config import (
    DataConfig,
    ModelConfig,
    Sweep,
    TrainConfig,
    absolute_path,
    saved_data_config,
)

log = logging.getLogger(__name__)

CONFIG_CLASSES = (ModelConfig, DataConfig, TrainConfig)
# The built-in configs ship inside the package (package data), so an include
# such as 'models/llama_tiny.gin' resolves in an installed copy as well as in a
# checkout (where the top-level configs/ is a link to this folder).
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# Where an include is looked for after the including files' folders: the built-in configs
# and the working directory; then ``configs/NAME``, as a checkout spells a built-in config,
# is the built-in NAME (``_builtin_include``).
_INCLUDE_FOLDERS = [CONFIGS_DIR, ""]
# transformers' generation settings (sampling defaults, eos ids), which an HF import keeps
# in a workdir beside its config.gin: the export gives it back, decode reads its eos ids,
# convert-heads copies it.
GENERATION_CONFIG = "generation_config.json"

_configurables = {}
# One parse at a time in a process: a parse fills gin's process-wide registry and config and
# puts the caller's back after. Until 2026-12-07 two threads' parses (two load_checkpoint
# calls) interleaved: one built its configs from the other's bindings (a model of another
# window over these parameters, without a word) or failed, and the root logger's level was
# left at CRITICAL for good.
_PARSE_LOCK = threading.RLock()


def _builtin_include(path: str, configs_dir: str | None = None) -> str | None:
  """The built-in config that a relative ``configs/NAME`` names (as a checkout spells it: an
  installed attnlab has no configs/ folder beside the working directory), where there is
  one; None for any other path. The one reading of that spelling: gin includes (through a
  file reader of their own), ``--gin_file`` (``find_gin_file``) and ``Sweep.base``
  (``resolve_base``, whose ``configs_dir`` it takes). Nothing else of attnlab's package
  folder is reached: until 2026-12-07 that folder was searched for includes, so that
  ``include 'nn/layers.py'`` went to gin as a config to parse ("Unexpected token.
  (layers.py, line 1)")."""
  if os.path.isabs(path):
    return None
  parts = os.path.normpath(path).split(os.sep)
  if len(parts) < 2 or parts[0] != "configs":
    return None
  builtin = os.path.join(CONFIGS_DIR if configs_dir is None else configs_dir, *parts[1:])
  return builtin if os.path.isfile(builtin) else None


def _read_builtin_include(path: str):
  return open(_builtin_include(path), encoding="utf-8")


def _missing_on_error(exists):
  """gin's check of whether a file reader finds an include, with an error taken as "not
  found". gin's package-resource reader reads 'configs/x.gin' as the file x.gin of a package
  ``configs``, and raised a TypeError on a namespace package of that name (a folder on
  sys.path, such as a checkout's configs/ under an editable install), which ended the
  search with "expected str, bytes or os.PathLike object, not NoneType" (until 2026-12-06)."""
  if getattr(exists, "_attnlab_checked", False):
    return exists

  def checked(path):
    try:
      return exists(path)
    except (TypeError, ValueError, ImportError, OSError):
      return False

  checked._attnlab_checked = True
  return checked


def _own_gin_state(classes):
  """gin's process-wide state for one parse of attnlab's configs; the caller's put back.

  Inside: an empty config, and the registry with attnlab's classes (the three configs and
  ``classes``, such as a sweep's ``Sweep``, each as ``attnlab.<name>``, bound by its bare
  name; until 2026-12-07 every class any parse of the process had registered, so that after
  an ``ablate`` a ``train`` took a ``--gin.Sweep.seeds`` binding and ignored it, which it
  refuses in a fresh process) and the caller's configurables but those of
  the same names (a config file may still refer to one of theirs: ``@their_fn()``); yields
  {class: its gin wrapper}. After, also after an error: the caller's bindings, imports,
  operative config, lock and registry as they were, plus what the parse registered (a gin
  ``import`` of a module of configurables, which Python does not import twice). Until
  2026-12-07 a parse (every ``load_checkpoint``, eval and train) cleared the caller's own
  bindings and unlocked a config they had finalized (``gin.clear_config``), and left these
  classes registered, so that a configurable of the caller's named ``TrainConfig`` and ours
  made that bare name ambiguous for both ("Ambiguous selector").
  """
  c = gin.config
  ours = tuple(dict.fromkeys(CONFIG_CLASSES + tuple(classes)))
  names = {cls.__name__ for cls in ours}
  saved = (dict(c._CONFIG), dict(c._SINGLETONS), set(c._IMPORTS), dict(c._OPERATIVE_CONFIG),
           c._CONFIG_IS_LOCKED, c._REGISTRY.copy(), dict(c._INVERSE_REGISTRY))
  kept = {selector: info for selector, info in saved[5].items() if info.name not in names}
  own = set()
  try:
    # A config the caller finalized is locked, and gin registers nothing then (a first parse
    # of the process was a RuntimeError until 2026-12-07); the lock is put back after.
    c._set_config_is_locked(False)
    c._REGISTRY.clear()
    c._INVERSE_REGISTRY.clear()
    for info in kept.values():
      c._REGISTRY[info.selector] = info
      c._INVERSE_REGISTRY[info.wrapped] = info
    wrappers = {}
    for cls in ours:
      if cls not in _configurables:  # registered once; its (wrapper, info) kept here
        wrapper = gin.external_configurable(cls, name=cls.__name__, module="attnlab")
        _configurables[cls] = wrapper, c._INVERSE_REGISTRY[cls]
      wrappers[cls], info = _configurables[cls]
      c._REGISTRY[info.selector] = info
      c._INVERSE_REGISTRY[cls] = info
      own.add(info.selector)
    gin.clear_config()
    yield wrappers
  finally:
    gin.clear_config()
    config, singletons, imports, operative, locked, registry, inverse = saved
    added = [info for selector, info in c._REGISTRY.items()
             if selector not in kept and selector not in own]
    c._CONFIG.update(config)
    c._SINGLETONS.update(singletons)
    c._IMPORTS.update(imports)
    with c._OPERATIVE_CONFIG_LOCK:
      c._OPERATIVE_CONFIG.update(operative)
    c._REGISTRY.clear()
    c._INVERSE_REGISTRY.clear()
    c._INVERSE_REGISTRY.update(inverse)
    for selector, info in registry.items():
      c._REGISTRY[selector] = info
    for info in added:
      c._REGISTRY[info.selector] = info
      c._INVERSE_REGISTRY[info.wrapped] = info
    c._set_config_is_locked(locked)


# A context manager; assigned rather than decorated so that tools/mutation.sh reaches it.
_own_gin = contextlib.contextmanager(_own_gin_state)


class GinConfigError(ValueError):
  """A config file or binding that cannot be used (one line, names it)."""


# Where gin says it was when a value failed: "In call to configurable 'ModelConfig' (<class
# ...>)", "In bindings string line 1", "In file ...". The message itself names the field.
_GIN_CONTEXT = ("In call to configurable", "In bindings string", "In file ")


def _first_line(e: Exception) -> str:
  lines = [x.strip() for x in (str(e).strip() or type(e).__name__).splitlines()]
  lines = [x for x in lines if x and not x.startswith(_GIN_CONTEXT)] or lines
  return _with_hint(" ".join(lines[:2]))


_NO_PARAMETER = re.compile(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'")
_NO_CONFIGURABLE = re.compile(r"No configurable matching '([\w.]+)'")


def _with_hint(message: str) -> str:
  """gin's message for a misspelt field or configurable, with the nearest name attnlab
  has, or where the names are (until 2026-12-04 gin's message alone)."""
  known = {cls.__name__: cls for cls in (*CONFIG_CLASSES, Sweep)}
  m = _NO_PARAMETER.search(message)
  if m and m.group(1) in known:
    cls, field = m.groups()
    close = difflib.get_close_matches(field, [f.name for f in dataclasses.fields(known[cls])],
                                      n=1)
    return message + (f" (did you mean {cls}.{close[0]}?)" if close else
                      f" ({cls}'s fields are documented in attnlab/config.py)")
  m = _NO_CONFIGURABLE.search(message)
  if m:
    name = m.group(1).rsplit(".", 1)[-1]
    if name == "Sweep":
      return message + " (Sweep.* belongs to a sweep file: run it with attnlab ablate)"
    close = difflib.get_close_matches(name, list(known), n=1)
    return message + (f" (did you mean {close[0]}?)" if close else
                      f" (attnlab's configurables: {', '.join(known)})")
  return message


def builtin_configs() -> list[str]:
  """The built-in gin files, as paths relative to ``CONFIGS_DIR`` ("models/llama_tiny.gin")."""
  return sorted(os.path.relpath(os.path.join(folder, name), CONFIGS_DIR)
                for folder, _, names in os.walk(CONFIGS_DIR)
                for name in names if name.endswith(".gin"))


def find_gin_file(path: str) -> str:
  """``path`` if it exists as given; else the built-in config of that relative name
  (``lm_stdlib_tiny.gin``, ``models/llama_tiny.gin``, or ``configs/...`` as a checkout spells
  it), so an installed attnlab runs its own configs from any directory.

  Raises:
    GinConfigError: neither exists; the message lists the built-in configs.
  """
  if os.path.exists(path) or os.path.isabs(path):
    if not os.path.exists(path):
      raise GinConfigError(f"gin file {path!r} does not exist")
    return path
  if os.path.isfile(builtin := os.path.join(CONFIGS_DIR, os.path.normpath(path))):
    return builtin
  if (builtin := _builtin_include(path)) is not None:
    return builtin
  raise GinConfigError(f"gin file {path!r} does not exist, as given or among the built-in "
                       f"configs ({', '.join(builtin_configs())})")


def parse(gin_files: list[str], bindings: list[str], classes=CONFIG_CLASSES, *,
          check_macros: bool = True) -> tuple[
    ModelConfig, DataConfig, TrainConfig]:
  """The three configs that gin files plus bindings describe.

  Includes are searched next to each file, in the built-in configs
  (``CONFIGS_DIR``, attnlab/configs/) and in the working directory. A
  relative ``DataConfig.tokenizer_model`` is found next to the gin files (the
  last first) or else as given (the working directory): a workdir's
  config.gin names the tokenizer.json beside it as "tokenizer.json", so the
  workdir can move.

  ``classes`` are built, in order. One parse at a time in a process (``_PARSE_LOCK``).

  Raises:
    GinConfigError: a missing file or include, an unknown configurable or
      parameter, a value of the wrong type or out of range.
  """
  with _PARSE_LOCK, _own_gin(classes) as wrapped:
    # the caller's gin state is theirs: put back after
    return _parse(gin_files, bindings, classes, check_macros, wrapped)


def _parse(gin_files, bindings, classes, check_macros, wrapped):
  gin_files = [find_gin_file(p) for p in gin_files]
  for path in gin_files:
    if os.path.isdir(path):
      raise GinConfigError(f"gin file {path!r} is a directory, not a file")
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except UnicodeDecodeError as e:
      raise GinConfigError(f"gin file {path!r} is not UTF-8 text ({e.reason} at byte "
                           f"{e.start})") from None
    if text.startswith("\ufeff"):  # gin's "Unexpected token. (x.gin, line 1)" until 12-05
      raise GinConfigError(f"gin file {path!r} starts with a UTF-8 byte order mark, which gin "
                           "cannot read: save it without one")
  # Where gin looks for an include, in order: this call's files' folders, the built-in
  # configs, the working directory, and last attnlab's own folder (an include of
  # ``configs/NAME``, as a checkout spells it, is the built-in NAME where the working
  # directory has no configs/: an installed attnlab; until 2026-12-07 not found there).
  # gin keeps one global list (cwd first) that clear_config does not reset, so it is set
  # for this call and put back after: a folder of an earlier call, or a same-named file in
  # the working directory, must not win.
  folders = [os.path.dirname(os.path.abspath(p)) for p in gin_files] + _INCLUDE_FOLDERS
  # gin logs an ERROR for every search-path miss before it finds an include, through
  # logging's module functions, which configure a root logger without handlers
  # (basicConfig): a handler of their own stays, and the caller's basicConfig then did
  # nothing ("WARNING:attnlab.training.trainer: ..." lines until 2026-12-06). gin's modules
  # log nothing while it parses (``_quiet_gin``); until 2026-12-07 the root logger's level
  # was CRITICAL for the parse, which silenced every other thread's warnings meanwhile, and
  # then the root logger had a filter and a handler of attnlab's for it, which other threads
  # saw.
  with _include_folders(folders), _quiet_gin():
    try:
      with gin.unlock_config():
        gin.parse_config_files_and_bindings([os.path.abspath(p) for p in gin_files], bindings,
                                            finalize_config=False)
      names = {cls.__name__ for cls in classes}  # a macro is a scope of gin's own: not these
      scoped = sorted(f"{scope}/{selector.rsplit('.', 1)[-1]}.{name}"
                      for (scope, selector), values in gin.config._CONFIG.items()
                      if scope and selector.rsplit(".", 1)[-1] in names for name in values)
      if scoped:  # the configs are built once, unscoped: gin would drop these without a word
        raise GinConfigError(
            f"scoped binding{'s' if len(scoped) > 1 else ''} {', '.join(scoped)}: attnlab builds "
            "each config once, without a scope: bind it as Name.field")
      unused = _unused_macro_binding(bindings, gin_files, folders, classes) if check_macros \
          else None
      if unused is not None:
        raise GinConfigError(unused)
      configs = tuple(wrapped[cls]() for cls in classes)
    except RecursionError as e:  # a traceback of thousands of lines until 2026-12-05
      raise GinConfigError(
          "gin config recursion: a gin file includes itself (directly or through the files it "
          "includes), or a binding's value refers to its own configurable") from e
    except tokenize.TokenError as e:  # a traceback until 2026-12-05
      what, where = (e.args + (None, None))[:2]
      line = f", line {where[0]}" if isinstance(where, tuple) and where else ""
      raise GinConfigError(f"a gin file or binding ends inside an open bracket or string ({what}"
                           f"{line})") from e
    except (ValueError, OSError, SyntaxError, TypeError, KeyError, ImportError) as e:
      unbound = _unbound_macros(gin_files, bindings, folders) if "macro()" in str(e) else []
      if unbound:
        names, many = ", ".join("%" + m for m in unbound), len(unbound) > 1
        raise GinConfigError(
            f"gin macro{'s' if many else ''} {names} {'are' if many else 'is'} used but never "
            f"bound: bind {'each' if many else 'it'} in a gin file ({unbound[0]} = ...) or with "
            f"--gin.{unbound[0]}=...") from e
      found = (_non_utf8_include(gin_files, folders) if isinstance(e, UnicodeDecodeError)
               else None)
      if found is not None:  # gin's message names the file that includes it
        path, includer, err = found
        raise GinConfigError(f"gin file {path!r}, included by {includer!r}, is not UTF-8 text "
                             f"({err.reason} at byte {err.start})") from e
      # gin reads the files first: a SyntaxError with a file name is the file's (until
      # 2026-12-06 a binding that did not parse either, or included that file, was named).
      bad = (_unparsable_binding(bindings) if isinstance(e, SyntaxError) and not e.filename
             else None)
      if bad is not None:  # gin's message names neither the binding nor its flag
        name = bad.split("=", 1)[0].strip()
        if "=" not in bad:  # until 2026-12-06 "its value does not parse", as for the next
          raise GinConfigError(f"binding {bad!r} has no '=' (a binding is NAME = VALUE: "
                               "TrainConfig.steps = 100)") from e
        if not _GIN_NAME.fullmatch(name):
          raise GinConfigError(
              f"binding {bad!r}: {name!r} is not a gin name (a binding is NAME = VALUE, NAME a "
              "field or a macro, after scopes without dots if any: TrainConfig.steps = 100, "
              "train/LR = 0.5)") from e
        raise GinConfigError(
            f"binding {bad!r}: its value does not parse (a string needs quotes, a tuple "
            "parentheses: TrainConfig.schedule = 'cosine', TrainConfig.mesh_shape = (2, 1, 1))"
        ) from e
      if (isinstance(e, SyntaxError) and "Failed to parse token" in str(e) and e.filename
          and e.text):  # in a file: gin's message held a Python object's address until 2026-12-05
        raise GinConfigError(
            f"gin file {e.filename!r}, line {e.lineno}: {e.text.strip()!r}: its value does not "
            "parse (a string needs quotes, a tuple parentheses: TrainConfig.schedule = "
            "'cosine', TrainConfig.mesh_shape = (2, 1, 1))") from e
      raise GinConfigError(_first_line(e)) from e
  return tuple(_find_tokenizer(c, gin_files) if isinstance(c, DataConfig) else c
               for c in configs)


class _SilentLogging:
  """What gin's modules see as ``logging`` while attnlab parses: ``logging`` itself, less its
  module functions that log (``info``, ``warning``, ...), which do nothing. gin logs through
  those functions (an ERROR for every search-path miss before it finds an include), and they
  configure a root logger without handlers (``basicConfig``) for good. Until 2026-12-07 the
  root logger got a filter and, where it had none, a handler of attnlab's for the parse: a
  command or a caller's ``basicConfig`` in another thread meanwhile saw that handler, added
  none of its own, and was left without one."""

  def __getattr__(self, name):
    return getattr(logging, name)

  @staticmethod
  def _nothing(*args, **kwargs):
    pass

  debug = info = warning = warn = error = exception = critical = fatal = log = _nothing


_GIN_LOGGING_MODULES = ("gin.config", "gin.resource_reader")


@contextlib.contextmanager
def _include_folders(folders: list[str]):
  """gin looks for an include in ``folders``, in order, then among the built-in configs as
  ``configs/NAME`` (``_builtin_include``), until the block ends; its readers take an error
  as "not found" (``_missing_on_error``). gin's global lists of folders and readers, which
  ``clear_config`` does not reset, are put back after (the readers stayed wrapped for good
  until 2026-12-07)."""
  saved = list(gin.config._LOCATION_PREFIXES), list(gin.config._FILE_READERS)
  gin.config._LOCATION_PREFIXES[:] = list(dict.fromkeys(folders))
  gin.config._FILE_READERS[:] = [(read, _missing_on_error(exists)) for read, exists in saved[1]]
  gin.config._FILE_READERS.append((_read_builtin_include, _builtin_include))
  try:
    yield
  finally:
    gin.config._LOCATION_PREFIXES[:], gin.config._FILE_READERS[:] = saved


@contextlib.contextmanager
def _quiet_gin():
  """While gin parses (under ``_PARSE_LOCK``): gin's modules log nothing (``_SilentLogging``),
  and nothing else changes: the root logger, which every thread shares, is left as it is."""
  modules = [m for m in map(sys.modules.get, _GIN_LOGGING_MODULES)
             if m is not None and getattr(m, "logging", None) is logging]
  for module in modules:
    module.logging = _SilentLogging()
  try:
    yield
  finally:
    for module in modules:
      module.logging = logging


_INCLUDE = re.compile(r"""^\s*include\s+['"]([^'"]+)['"]""", re.MULTILINE)


def _included(text: str, folders: list[str]) -> list[str]:
  """The files that ``text`` includes and that exist, each looked up in ``folders`` as gin
  looks it up (the first folder that holds it)."""
  found = (next((os.path.join(d, name) for d in folders if os.path.isfile(os.path.join(d, name))),
                _builtin_include(name)) for name in _INCLUDE.findall(text))
  return [path for path in found if path is not None]


def _walk(gin_files: list[str], folders: list[str]):
  """(path, the file that includes it or None, its bytes) of each file and of each file it
  includes, at any depth, each once."""
  todo, seen = [(p, None) for p in gin_files], set()
  while todo:
    path, includer = todo.pop(0)
    if os.path.abspath(path) in seen:
      continue
    seen.add(os.path.abspath(path))
    with open(path, "rb") as f:
      data = f.read()
    yield path, includer, data
    todo.extend((p, path) for p in _included(data.decode("utf-8", "replace"), folders))


def _texts(gin_files: list[str], folders: list[str]) -> list[str]:
  """The text of each file and of each file it includes, at any depth."""
  return [data.decode("utf-8", "replace") for _, _, data in _walk(gin_files, folders)]


def copy_generation_config(src: str, dst: str) -> bool:
  """``src``'s GENERATION_CONFIG into ``dst``, where there is one (an import, an export,
  convert-heads). True if there was one."""
  path = os.path.join(src, GENERATION_CONFIG)
  if not os.path.isfile(path):
    return False
  shutil.copyfile(path, os.path.join(dst, GENERATION_CONFIG))
  return True


def _macro_name(line: str) -> str | None:
  """The name a binding line binds if gin reads it as a macro (no dot after its last
  scope: ``steps = 1``, ``TrainConfig/steps = 1``), else None (``Name.field = ...``, a
  comment, an include, no binding)."""
  binding = line.strip()
  if not binding or binding.startswith("#") or "=" not in binding:
    return None  # a blank or comment line (a config.gin read line by line), an include
  name = binding.split("=", 1)[0].strip()
  if not re.fullmatch(r"[\w./]+", name) or "." in name.rsplit("/", 1)[-1]:
    return None  # Name.field (a scoped one: parse refuses those on its own)
  return name


def _unused_macro_binding(bindings, gin_files, folders, classes) -> str | None:
  """The message for the first binding that gin read as a macro nothing uses, if any: a
  name without a dot (``steps = 1``, a scoped ``TrainConfig/steps = 1``) binds a gin macro,
  not a field, and gin drops a macro that no ``%NAME`` reads without a word (until
  2026-12-05 ``--gin.steps=1`` trained the file's 2000 steps). The bindings first, then
  the lines of the gin files and of what they include (a file's own ``steps = 5`` was
  dropped without a word until 2026-12-06; a line of a value over several lines, a quoted
  ``'a=b.txt',``, names no macro)."""
  lines = [line for binding in bindings for line in binding.splitlines()]
  # The files, what they include and what the bindings include.
  files = [(path, data.decode("utf-8", "replace")) for path, _, data in
           _walk(list(gin_files) + _included("\n".join(lines), folders), folders)]
  everything = "\n".join([text for _, text in files] + lines)

  def unread(name):  # a scoped macro too: %train/LR reads train/LR = ... (2026-12-06)
    return re.search(rf"%{re.escape(name)}(?![\w.])", everything) is None

  def message(binding, name):
    field = name.rsplit("/", 1)[-1]
    owners = [cls.__name__ for cls in classes
              if field in {f.name for f in dataclasses.fields(cls)}]
    hint = (f" (did you mean {owners[0]}.{field}?)" if owners else
            " (a field is bound as Name.field, e.g. TrainConfig.steps)")
    # the macro the binding makes is %name, its scope included (%LR for train/LR named
    # another macro until 2026-12-07)
    return (f"binding {binding!r} sets nothing: {name!r} is no config field, and no %{name} "
            f"macro reads it{hint}")

  for line in lines:
    name = _macro_name(line)
    if name is not None and unread(name):
      return message(line.strip(), name)
  for path, text in files:
    for number, line in enumerate(text.splitlines(), 1):
      name = _macro_name(line)
      if name is not None and unread(name):
        return f"gin file {path!r}, line {number}: {message(line.strip(), name)}"
  return None


# What gin parses left of a binding's "=": scopes (names without dots) joined by "/", then a
# macro or a dotted configurable.field.
_GIN_NAME = re.compile(r"(?:[A-Za-z_]\w*/)*[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _unparsable_binding(bindings: list[str]) -> str | None:
  """The first binding whose text gin cannot parse on its own, if any (configurables it does
  not know are skipped: only the syntax is asked about)."""
  for binding in bindings:
    try:
      with gin.unlock_config():
        gin.parse_config(binding, skip_unknown=True)
    except SyntaxError:
      return binding
    except Exception:  # noqa: BLE001 - another fault of a binding that parses: not this one
      continue
  return None


def _non_utf8_include(gin_files: list[str], folders: list[str]):
  """(path, the file that includes it, its UnicodeDecodeError) of the first file included,
  at any depth, that is not UTF-8, each include looked up in ``folders`` as gin looks it
  up; None if there is none."""
  for path, includer, data in _walk(gin_files, folders):
    try:
      data.decode("utf-8")
    except UnicodeDecodeError as err:
      if includer is not None:  # a top-level file is checked before gin reads it
        return path, includer, err
  return None


def _unbound_macros(gin_files: list[str], bindings: list[str], folders: list[str]) -> list[str]:
  """The ``%NAME`` macros referenced by the files, their includes (since 2026-12-05) and
  the bindings that the gin config being parsed leaves unbound (gin's own error names
  neither)."""
  texts = list(bindings) + _texts(gin_files, folders)
  names = dict.fromkeys(re.findall(r"%([A-Za-z_][\w.]*)", "\n".join(texts)))
  unbound = []
  for name in names:
    try:
      gin.query_parameter(f"%{name}")
    except ValueError:
      unbound.append(name)
  return unbound


def _find_tokenizer(dcfg: DataConfig, gin_files: list[str]) -> DataConfig:
  """``dcfg`` with a relative tokenizer_model that lies next to a gin file (the last
  first) pointing there; else as given (the working directory). Beside the gin file
  first: a workdir's config.gin names its own tokenizer.json, which a tokenizer.json in
  the working directory must not replace."""
  path = dcfg.tokenizer_model
  if not path or os.path.isabs(path):
    return dcfg
  for gin_file in reversed(gin_files):
    beside = os.path.join(os.path.dirname(os.path.abspath(gin_file)), path)
    if os.path.isfile(beside):
      return dataclasses.replace(dcfg, tokenizer_model=beside)
  return dcfg


def relative_inside(path: str, folder: str) -> str | None:
  """``path`` relative to ``folder`` if it lies inside it (links resolved), else None."""
  root, path = os.path.realpath(folder), os.path.realpath(path)
  return os.path.relpath(path, root) if os.path.commonpath([root, path]) == root else None


def gin_value(value) -> str:
  """``value`` as gin reads it back (a one-element tuple keeps its comma)."""
  if isinstance(value, tuple):
    inner = ", ".join(gin_value(v) for v in value)
    return f"({inner},)" if len(value) == 1 else f"({inner})"
  return repr(value)


def operative_config(*configs, workdir: str | None = None) -> str:
  """gin text binding every field of ``configs`` (the run, reproducibly).

  With ``workdir`` (where the text goes, as config.gin): a tokenizer_model
  inside it is written relative to it (``parse`` finds it next to the file). A relative
  one outside it (or without ``workdir``) is written as an absolute path, so that the file
  means the same from any working directory (``read_workdir_config`` looks for a relative
  one beside the file; until 2026-12-04 it was written as given, relative to where the
  run trained).
  Relative ``DataConfig.paths`` are written absolute for the same reason, with or without
  ``workdir`` (until 2026-12-04 an ``attnlab eval`` run from another folder read that
  folder's files of the same names as the validation text, without a word; until
  2026-12-06 a sweep's runs, written without ``workdir``, still named them relative).
  """
  lines = ["# The operative config of this run, written by `attnlab train`.",
           "# `attnlab train --gin_file THIS_FILE --workdir ...` reproduces it.", ""]
  for cfg in configs:
    if isinstance(cfg, DataConfig) and cfg.tokenizer_model:
      rel = None if workdir is None else relative_inside(cfg.tokenizer_model, workdir)
      if rel is not None:
        cfg = dataclasses.replace(cfg, tokenizer_model=rel)
      elif not os.path.isabs(cfg.tokenizer_model):
        cfg = dataclasses.replace(cfg, tokenizer_model=os.path.abspath(cfg.tokenizer_model))
    if isinstance(cfg, DataConfig) and cfg.paths:
      cfg = dataclasses.replace(cfg, paths=tuple(
          p if os.path.isabs(p) else absolute_path(p) for p in cfg.paths))
    name = type(cfg).__name__
    lines += [f"{name}.{f.name} = {gin_value(getattr(cfg, f.name))}"
              for f in dataclasses.fields(cfg)]
    lines.append("")
  return "\n".join(lines)


class _Warned(threading.local):
  """What was warned about a saved config.gin in this thread (or its command:
  ``forget_warnings``): ``unread``, the (config.gin, class, field, value) of ``parse_saved``;
  ``outside_tokenizer``, the (config.gin, tokenizer file) of ``read_workdir_config``. A
  command reads a workdir's config.gin more than once (decode: the checkpoint's model, then
  its tokenizer; convert-heads: three to five times), and printed each warning once per read
  until 2026-12-06. Per thread: a command starting in another thread (``attnlab.cli.main``)
  forgets its own warnings, not those of a command running here (a process-wide set until
  2026-12-07's review: the running command warned twice)."""

  def __init__(self):
    self.unread: set[tuple] = set()
    self.outside_tokenizer: set[tuple[str, str]] = set()


_WARNED = _Warned()


def parse_saved(path: str, bindings=()) -> tuple[ModelConfig, DataConfig, TrainConfig]:
  """``parse([path], bindings)`` of a saved run's config.gin: the fields its run did not read
  (``config.saved_data_config``: a task's, the byte tokenizer's ``tokenizer_model``, adam's
  ``weight_decay``) are reset to their defaults, with a warning naming each once per thread
  or command (``_read_saved``), rather than refused as a new config's would be. ``bindings``
  are the user's own: a field they set that their run does not read is refused, as
  ``parse`` refuses it."""
  return _read_saved(path, list(bindings), lambda bindings: parse([path], bindings))


def parse_saved_sweep(path: str, bindings=()):
  """``parse_sweep(path, bindings)`` of an output folder's saved sweep.gin (``attnlab ablate
  --report``), read as ``parse_saved`` reads a run's config.gin."""
  return _read_saved(path, list(bindings), lambda bindings: parse_sweep(path, bindings))


def _bound_name(binding: str) -> str:
  """``Class.field`` of a binding ``[scope/][module.]Class.field = value`` (gin takes the
  module-qualified and scoped forms: ``attnlab.TrainConfig.b2`` slipped past the checks
  below, which compared the names as written, until 2026-12-07)."""
  name = binding.split("=", 1)[0].strip().rsplit("/", 1)[-1]
  return ".".join(name.split(".")[-2:])


# The fields that say which other fields a run reads.
_READERS = frozenset({"TrainConfig.optimizer", "DataConfig.task", "DataConfig.tokenizer"})


def _bound_fields(bindings: list[str], beside: str) -> set[str]:
  """The ``Class.field`` names the user's ``bindings`` set, as gin reads them: each line of
  a binding of several lines, and what a file they include binds, looked up as ``parse``
  looks it up beside the saved file ``beside`` (until 2026-12-07 only the name before a
  binding's first "=", so that a value bound on a binding's second line was reset as the
  file's). The names as written, line by line, are counted too (all of them where gin
  cannot read the bindings alone)."""
  names = {_bound_name(line) for b in bindings for line in b.splitlines() if "=" in line}
  if not bindings:
    return names
  folders = [os.path.dirname(os.path.abspath(beside))] + _INCLUDE_FOLDERS
  with _PARSE_LOCK, _own_gin((Sweep,)), _include_folders(folders), _quiet_gin():
    try:
      with gin.unlock_config():
        gin.parse_config_files_and_bindings([], bindings, finalize_config=False)
    except Exception:  # noqa: BLE001 - gin raises many kinds; the names as written stand
      return names
    names |= {f"{selector.rsplit('.', 1)[-1]}.{field}"
              for (_, selector), fields in gin.config._CONFIG.items() for field in fields}
  return names


def _field_values(configs) -> dict:
  """{(class name, field): value} of the configs (dataclasses) among ``configs``."""
  return {(type(c).__name__, f.name): getattr(c, f.name)
          for c in configs if dataclasses.is_dataclass(c) for f in dataclasses.fields(c)}


def _read_saved(path: str, bindings: list[str], parse_fn):
  """``parse_fn(bindings)`` under ``config.saved_data_config``: the fields the saved file
  itself sets and its run did not read are warned about (once per thread, or command) and
  read as their defaults, also where a binding of another optimizer, task or tokenizer would
  read them; one that a binding set (``_bound_fields``, or a macro of the user's), or that a
  binding left unread, is the user's: refused with the strict check's message where it does
  not apply."""
  with saved_data_config() as dropped:
    configs = parse_fn(bindings)
  bound = _bound_fields(bindings, path)
  dropped_by_file, file_configs = dropped, configs
  if bindings:  # which fields the file's own run leaves unread: the file alone, or where it
    # needs bindings to parse (a value refused since), with those that change no reader
    try:
      with saved_data_config() as dropped_by_file:
        file_configs = parse_fn([])
    except GinConfigError:
      own = [b for b in bindings if not _bound_fields([b], path) & _READERS]
      try:
        with saved_data_config() as dropped_by_file:
          file_configs = parse_fn(own)
      except GinConfigError:
        dropped_by_file, file_configs = dropped, configs
  files_own = {(owner, name) for owner, name, _ in dropped_by_file}
  # A field the file sets and its run never read, which a binding of another optimizer,
  # task or tokenizer reads (adam's weight_decay under --gin.TrainConfig.optimizer='adamw'):
  # read as the default, as without the binding; until 2026-12-07 a resume trained with it,
  # without a word, while convert-heads (which replaces after a plain read) dropped it.
  read_now = {(owner, name) for owner, name, _ in dropped}
  revived = [(owner, name, value) for owner, name, value in dropped_by_file
             if (owner, name) not in read_now and f"{owner}.{name}" not in bound]
  if revived and any(_macro_name(line) for b in bindings for line in b.splitlines()):
    # a field whose value a macro of the user's gives (a file written by hand reads %WD) is
    # theirs too: one that the bindings without their macros leave otherwise
    plain = [b for b in bindings if not any(_macro_name(line) for line in b.splitlines())]
    try:
      with saved_data_config():
        without = parse_fn(plain)
    except GinConfigError:  # a binding of theirs reads the macro (LR = 0.1 beside
      without = configs  # TrainConfig.learning_rate = %LR): no field told apart
    now, before = _field_values(configs), _field_values(without)
    revived = [r for r in revived if now[r[0], r[1]] == before[r[0], r[1]]]
  if revived:
    configs = list(configs)
    for i, cfg in enumerate(configs):  # a class's fields reset at once (min_len, max_len)
      owner = type(cfg).__name__
      mine = [(name, value) for o, name, value in revived if o == owner]
      if not mine:
        continue
      defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
      try:
        configs[i] = dataclasses.replace(cfg, **{name: defaults[name] for name, _ in mine})
      except ValueError as e:  # the binding's reader needs one: the user's to give
        needed = [(name, value) for name, value in mine
                  if re.search(rf"\b{name}\b", str(e))]
        if not needed:  # another refusal (betas at 1 under a new optimizer): its own
          raise GinConfigError(str(e)) from None
        sets = ", ".join(f"{owner}.{name} = {value!r}" for name, value in needed)
        raise GinConfigError(
            f"{e} ({path} sets {sets}, which its run did not read: read as the default; "
            f"bind it to use it, --gin.{owner}.{needed[0][0]}=...)") from None
    configs = tuple(configs)
  # the user's own (or an optimizer of theirs that reads them anew): checked as new
  if bound & {"TrainConfig.b1", "TrainConfig.b2", "TrainConfig.optimizer"}:
    tcfg = next(c for c in configs if isinstance(c, TrainConfig))
    try:
      tcfg._check_betas_below_1_in_float32()
    except ValueError as e:
      raise GinConfigError(str(e)) from None
  from_file = []
  for owner, name, value in dropped:
    # A field the user bound, or one a binding of theirs left unread (another optimizer,
    # task or tokenizer): the strict check's own message, not a reset the run never had.
    if f"{owner}.{name}" in bound or (owner, name) not in files_own:
      try:
        dataclasses.replace(next(c for c in configs if type(c).__name__ == owner),
                            **{name: value})
      except ValueError as e:
        raise GinConfigError(str(e)) from None
    elif (owner, name, value) not in from_file:
      from_file.append((owner, name, value))
  from_file += [r for r in revived if r not in from_file]
  # each of them is one the file's own run left unread: named by that run's reader, in the
  # fields' order (a read with bindings and one without warned twice about one set of
  # fields, in two orders, until 2026-12-07)
  order = {field: n for n, field in enumerate(_field_values(configs))}
  from_file.sort(key=lambda r: order[r[0], r[1]])
  dcfg = next(c for c in file_configs if isinstance(c, DataConfig))
  tcfg = next(c for c in file_configs if isinstance(c, TrainConfig))
  # each field warned about once (per file, process or command): a command that reads the
  # file twice, with bindings and without (convert-heads), named a field twice until
  # 2026-12-07
  where = os.path.abspath(path)
  from_file = [r for r in from_file if (where, *r) not in _WARNED.unread]
  _WARNED.unread.update((where, *r) for r in from_file)
  since = {(o, n): _refused_since(o, n, dcfg.task) for o, n, _ in from_file}
  for owner, reader in (("DataConfig", f"task={dcfg.task!r} with tokenizer={dcfg.tokenizer!r}"),
                        ("TrainConfig", f"optimizer={tcfg.optimizer!r}")):
    for until in sorted({since[o, n] for o, n, _ in from_file if o == owner}):
      text = ", ".join(f"{owner}.{name} = {value!r}" for o, name, value in from_file
                       if o == owner and since[o, name] == until)
      log.warning("%s sets %s, which %s does not read (attnlab before %s took and ignored "
                  "it): read as the default", path, text, reader, until)
  return configs


def _refused_since(owner: str, name: str, task: str) -> str:
  """Since when a new config refuses ``owner.name`` where its run does not read it (the
  date its warning names; every one said 2026-12-06, the task fields' date, until
  2026-12-07): ``config.TASK_FIELDS`` and ``_TASK_READS`` say which."""
  if (owner, name) == ("TrainConfig", "weight_decay"):
    return "2026-12-03"
  if (owner, name) == ("DataConfig", "loss_on_prompt"):
    return "2026-12-04"
  if owner == "DataConfig" and task == "add" and name in ("min_len", "vocab_chars"):
    return "2026-12-03"  # 20eca3d
  return "2026-12-06"


def forget_warnings() -> None:
  """Warn again about what a saved config.gin holds: each ``attnlab`` command starts so
  (``cli._dispatch``), as a fresh process does (until 2026-12-07 a second command of one process,
  a notebook's, printed none of them). Library calls warn once per thread."""
  _WARNED.unread.clear()
  _WARNED.outside_tokenizer.clear()


def read_workdir_config(path: str) -> tuple[ModelConfig, DataConfig, TrainConfig]:
  """The configs a workdir's config.gin describes. A relative tokenizer_model is the file
  beside it, wherever the command runs: one missing there is named by that path, not
  looked up in the working directory (until 2026-12-04 a workdir whose tokenizer.json was
  gone decoded with the working directory's tokenizer.json, another vocabulary).

  A DataConfig field the run's task does not read, which attnlab before 2026-12-06 took and
  wrote here, is read as its default with a warning (``parse_saved``)."""
  mcfg, dcfg, tcfg = parse_saved(path)
  name = dcfg.tokenizer_model
  if name and not os.path.isabs(name):  # parse found it neither beside nor in the cwd
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), name)
    if os.path.isfile(name) and not os.path.exists(beside):
      # Written by attnlab before 2026-12-04, relative to where the run trained.
      warned = (os.path.abspath(path), os.path.abspath(name))
      if warned not in _WARNED.outside_tokenizer:
        _WARNED.outside_tokenizer.add(warned)
        log.warning("%s names tokenizer_model=%r, which is not beside it (%s); reading %s "
                    "from the working directory, where a workdir written before 2026-12-04 "
                    "named an outside tokenizer from (write its absolute path into the file "
                    "if it is the run's)", path, name, beside, os.path.abspath(name))
      dcfg = dataclasses.replace(dcfg, tokenizer_model=os.path.abspath(name))
    else:
      dcfg = dataclasses.replace(dcfg, tokenizer_model=beside)
  return mcfg, dcfg, tcfg


def resolve_base(base, sweep_file: str, configs_dir: str) -> list[str]:
  """The paths of ``Sweep.base`` files: as given, next to the sweep file, or in configs/
  (``configs/NAME``, as a checkout spells it, is the built-in NAME too: an installed
  attnlab has no configs/ folder beside the working directory; until 2026-12-07 such a
  sweep file ran in a checkout only)."""
  out = []
  for name in base:
    places = (name, os.path.join(os.path.dirname(os.path.abspath(sweep_file)), name),
              os.path.join(configs_dir, name), _builtin_include(name, configs_dir))
    path = next((p for p in places if p is not None and os.path.isfile(p)), None)
    if path is not None:
      out.append(path)
    else:
      raise FileNotFoundError(f"Sweep.base file {name!r} was not found (as given, next to "
                              f"{sweep_file}, or in {configs_dir})")
  return out


def parse_sweep(sweep_file: str, bindings: list[str]):
  """(Sweep, ModelConfig, DataConfig, TrainConfig) of an ``attnlab ablate`` sweep.

  The sweep file binds ``Sweep.*`` (and may bind the three configs); its
  ``Sweep.base`` files (found as given, next to the sweep file, or in
  configs/) are read first, then the sweep file, then the bindings.

  Raises:
    GinConfigError: as ``parse``, also for an unknown ``Sweep.*`` binding.
  """
  sweep_file = find_gin_file(sweep_file)
  # Without the macro check: a macro a binding sets may be read by a base file, which the
  # second call reads (and checks).
  (sweep,) = parse([sweep_file], bindings, classes=(Sweep,), check_macros=False)
  try:
    base = resolve_base(sweep.base, sweep_file, CONFIGS_DIR)
  except FileNotFoundError as e:
    raise GinConfigError(str(e)) from None
  # Sweep built again beside the base files: a Sweep.* binding in one of them, which the
  # sweep file's reading does not see, is refused (ignored until 2026-12-07).
  again, *configs = parse([*base, sweep_file], bindings, classes=(Sweep, *CONFIG_CLASSES))
  if again != sweep:
    changed = [f"Sweep.{f.name}" for f in dataclasses.fields(Sweep)
               if getattr(again, f.name) != getattr(sweep, f.name)]
    raise GinConfigError(f"{', '.join(changed)} bound in a base file ({', '.join(base)}): "
                         f"Sweep.* belongs to the sweep file {sweep_file}")
  return (sweep, *configs)
