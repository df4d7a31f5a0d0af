"""Text corpora: the LM corpus (default: this interpreter's standard library
source) and parallel-text TSV files for translation.

Splits are by a stable hash (crc32) of the file's relative path or the
line's index, so they do not depend on the file system's listing order.
"""

from __future__ import annotations

import codecs
import glob
import io
import logging
import os
import sysconfig
import zlib

log = logging.getLogger(__name__)

# Test suites, IDLE and vendored packages are a different dialect of Python
# from the library itself (and half its bytes): leave them out.
_STDLIB_SKIP = ("test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
                "__pycache__", "turtledemo", "ensurepip")


def stdlib_root() -> str:
  """This interpreter's standard library folder (the default LM corpus's)."""
  return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
  """The ``*.py`` files of this interpreter's standard library, sorted."""
  root = stdlib_root()
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
    out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
  return sorted(out)


def expand_paths(patterns) -> list[str]:
  """The files named by paths or glob patterns, as sorted absolute paths, each once; a
  pattern matching nothing is an error (a typo should not train on an empty corpus).

  Absolute, so that spellings of one corpus (``data/*.txt``, ``./data/*.txt``, its absolute
  path; the same training stream to the data state) give the same files in the same order:
  sorted as spelled, ``./zz/a.txt`` came before ``aa/b.txt`` and ``zz/a.txt`` after it, and
  one file named twice was read twice (until 2026-12-04)."""
  out = []
  for pattern in patterns:
    path = os.path.expanduser(pattern)
    if os.path.isfile(path):  # a file's own name, "[" and "*" too
      out.append(os.path.abspath(path))
      continue
    matches = sorted(glob.glob(path, recursive=True))
    matches = [os.path.abspath(m) for m in matches if os.path.isfile(m)]
    if not matches:
      if os.path.isdir(path):  # "no files match" until 2026-12-04
        raise FileNotFoundError(
            f"{pattern!r} is a directory: give its files as a glob, e.g. "
            f"{os.path.join(pattern, '*.txt')!r} or {os.path.join(pattern, '**', '*.py')!r}")
      raise FileNotFoundError(f"no files match {pattern!r}")
    out += matches
  return sorted(set(out))


def in_validation(key: str, percent: int) -> bool:
  return zlib.crc32(key.encode("utf-8")) % 100 < percent


def split_files(files: list[str], percent: int) -> dict[str, list[str]]:
  """Deterministic file-level train / validation split.

  Keys are paths relative to the files' common folder, so the split is the
  same wherever the corpus lives (files named by relative and absolute paths
  together are taken from the working directory). At least one file goes to
  each side when there are two or more.
  """
  if not files:
    return {"train": [], "validation": []}
  absolute = [os.path.abspath(f) for f in files]
  root = os.path.commonpath(absolute) if len(files) > 1 else os.path.dirname(absolute[0])
  val = [f for f, a in zip(files, absolute) if in_validation(os.path.relpath(a, root), percent)]
  if percent and not val and len(files) > 1:
    val = [files[-1]]
  if len(val) == len(files) and len(files) > 1:
    val = val[:1]
  train = [f for f in files if f not in set(val)] or list(files)
  return {"train": train, "validation": val or list(files)}


def split_lines(doc: str, percent: int) -> tuple[str, str]:
  """(train, validation) of a corpus of one file: its last ``percent`` of lines (at least
  one line) held out, the lines before for training. A text of one line, or a percent of
  0, holds nothing out: (doc, doc). Lines end at "\n" only (``read_text`` has made every
  "\r\n" and lone "\r" one): a form feed or a U+2028 inside a line, which
  ``str.splitlines`` breaks at, is text (until 2026-12-04 they moved the split)."""
  lines = doc.split("\n")
  lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
  if not percent or len(lines) < 2:
    return doc, doc
  n = min(max(1, round(len(lines) * percent / 100)), len(lines) - 1)
  return "".join(lines[:-n]), "".join(lines[-n:])


def read_text(path: str) -> str:
  """A corpus file's text: bytes that are not UTF-8 are replaced (U+FFFD) with a warning
  naming the file, where the first one is (its byte offset in the file, a byte order mark
  counted) and how many were replaced (silent until 2026-12-04: a glob that caught a binary
  file trained on it as text), a UTF-8 byte order
  mark at the start is not text, and line ends are "\n" (Python's universal newlines:
  "\r\n" and a lone "\r" read as "\n", so one corpus packs alike whichever system wrote
  it)."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    return utf8_text(data)
  except UnicodeDecodeError as e:
    out = utf8_text(data, errors="replace")
    replaced = out.count("\ufffd") - data.count("\ufffd".encode())
    log.warning("%s is not UTF-8 text (%s at byte %d): %d byte sequence(s) read as U+FFFD",
                path, e.reason, e.start, replaced)
    return out


def utf8_text(data: bytes, errors: str = "strict") -> str:
  """``data`` (a file's bytes) as text: a UTF-8 byte order mark at the start is not text,
  and line ends are "\n" (Python's universal newlines: "\r\n" and a lone "\r" too). A
  UnicodeDecodeError places the bad byte in ``data`` itself, the mark counted
  (``decode("utf-8-sig")`` counts from after it)."""
  mark = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
  try:
    text = data[mark:].decode("utf-8", errors)
  except UnicodeDecodeError as e:
    raise UnicodeDecodeError(e.encoding, data, mark + e.start, mark + e.end, e.reason) from None
  return text.replace("\r\n", "\n").replace("\r", "\n")


def lm_files(patterns, *, validation_percent: int, max_files: int = 0) -> dict[str, list[str]]:
  """The train / validation files of an LM corpus (default: the stdlib)."""
  files = expand_paths(patterns) if patterns else stdlib_files()
  if not files:
    raise FileNotFoundError("the LM corpus is empty")
  split = split_files(files, validation_percent)
  if max_files:
    # Every (n // max_files)-th file, the first max_files of those: spread over the sorted
    # files when there are many, a prefix when there are fewer than 2 * max_files (the
    # demo's files; an even spread would change them, and the README's numbers of its
    # checkpoint).
    for name in ("train", "validation"):
      fs = split[name]
      step = max(1, len(fs) // max_files)
      split[name] = fs[::step][:max_files]
  return split


def read_tsv(path: str) -> list[tuple[str, str]]:
  """Pairs of a "source<TAB>target" file; lines end at "\\n", "\\r\\n" or a lone "\\r"
  (universal newlines, as Python's csv module reads them); blank lines (whitespace without
  a tab) are skipped, a
  UTF-8 byte order mark is not part of the first source, columns after the second are
  ignored (the attribution column of the Tatoeba / manythings.org files); bytes that are
  not UTF-8 are an error naming the line. A pair whose source or target is empty (a line
  "a<TAB>" or "<TAB>b": a data fault more often than not) is kept, with one warning
  counting them and naming the first (silent until 2026-12-04)."""
  with open(path, "rb") as f:
    data = f.read()
  data = data.removeprefix(codecs.BOM_UTF8)  # positions below count from the text
  try:
    content = data.decode("utf-8")
  except UnicodeDecodeError as e:
    # Lines as the reader below counts them: ending at \n, \r\n or a lone \r.
    lineno = data[:e.start].replace(b"\r\n", b"\n").replace(b"\r", b"\n").count(b"\n") + 1
    raise ValueError(f"{path}:{lineno}: not UTF-8 ({e.reason}: byte {data[e.start]:#04x})") \
        from None
  pairs, empty = [], []
  with io.StringIO(content, newline=None) as f:
    for lineno, line in enumerate(f, 1):
      line = line.rstrip("\n")
      # Blank: whitespace without a tab. A line that is only a tab (or whitespace around
      # one) is a pair with an empty side, kept and counted below (dropped without a word
      # until 2026-12-06).
      if "\t" not in line and not line.strip():
        continue
      parts = line.split("\t")
      if len(parts) < 2:
        raise ValueError(f"{path}:{lineno}: expected 'source<TAB>target', got {line[:60]!r}")
      pairs.append((parts[0], parts[1]))
      if not parts[0] or not parts[1]:
        empty.append(lineno)
  if not pairs:
    raise ValueError(f"{path}: no 'source<TAB>target' lines")
  if empty:
    log.warning("%s: %d pair(s) with an empty source or target (the first at line %d); "
                "they are trained on as they are", path, len(empty), empty[0])
  return pairs


def tsv_splits(paths, validation_percent: int) -> dict[str, list[tuple[str, str]]]:
  """Train / validation pairs: a second file is the validation set, else a
  hash of the line index holds ``validation_percent`` out (the last pair when the
  hash picks none of two or more, the first pair it picks when it picks all of them, so
  training keeps the rest; a file of one pair, or a percent of 0, holds nothing out: its
  first pair is the validation set, a training pair)."""
  if len(paths) > 2:
    raise ValueError(f"DataConfig.paths has {len(paths)} TSV files; give one (split by "
                     "validation_percent) or two (training, validation)")
  for p in paths:
    if os.path.isdir(os.path.expanduser(p)):
      raise ValueError(f"TSV file {p!r} is a folder: give the .tsv file itself")
    if not os.path.isfile(os.path.expanduser(p)):
      raise FileNotFoundError(f"TSV file {p!r} does not exist")
  paths = [os.path.expanduser(p) for p in paths]  # "~/pairs.tsv" as an LM path reads it
  pairs = read_tsv(paths[0])
  if len(paths) > 1:
    return {"train": pairs, "validation": read_tsv(paths[1])}
  held = [in_validation(str(i), validation_percent) for i in range(len(pairs))]
  if validation_percent and not any(held) and len(pairs) > 1:
    held[-1] = True
  if all(held) and len(pairs) > 1:  # as split_files keeps a file for training
    held = [i == held.index(True) for i in range(len(pairs))]
  val = [p for p, h in zip(pairs, held) if h]
  train = [p for p, h in zip(pairs, held) if not h]
  return {"train": train or pairs, "validation": val or pairs[:1]}
