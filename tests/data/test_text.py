"""Corpus files and their splits, TSV pairs, the synthetic tasks' ranges and the byte
tokenizer's edges."""

import os
import re
import sys

import numpy as np
import pytest

from attnlab.data import synthetic, text
from attnlab.data.tokenizer import (
    ByteTokenizer,
    HFJsonTokenizer,
    SentencePieceTokenizer,
    make_tokenizer,
)
from attnlab.extras import MissingDependencyError
from tests.data.hf_tokenizer import word_level_tokenizer_json
from tests.fifos import released_after


def test_stdlib_files_are_whole_paths_of_many_files():
  files = text.stdlib_files()
  assert len(files) > 100 and all(os.path.isabs(f) and os.path.isfile(f) for f in files[:50])
  split = text.lm_files((), validation_percent=5)  # no max_files: every file
  assert len(split["train"]) + len(split["validation"]) == len(files)


def test_expand_paths_globs_recursively_and_sorts(tmp_path):
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "deep").mkdir()
  for p in ("z.txt", "b/y.txt", "b/deep/x.txt"):
    (tmp_path / p).write_text(p)
  got = text.expand_paths([str(tmp_path / "**" / "*.txt"), str(tmp_path / "z.txt")])
  assert got == sorted(str(tmp_path / p) for p in ("z.txt", "b/y.txt", "b/deep/x.txt"))
  # A file's own name first: the patterns after it are read too.
  got = text.expand_paths([str(tmp_path / "z.txt"), str(tmp_path / "b" / "*.txt")])
  assert got == sorted(str(tmp_path / p) for p in ("z.txt", "b/y.txt"))


def test_every_spelling_of_a_corpus_is_one_list_of_files(tmp_path, monkeypatch):
  """Relative, ./-prefixed and absolute patterns (one training stream to the data state)
  give the same absolute files in the same order, each once; until 2026-12-04 they were
  sorted as spelled ("./zz/..." before "aa/...", "zz/..." after) and a file named twice was
  read twice. A TSV path takes "~" as an LM path does."""
  for p in ("aa/f1.txt", "zz/f1.txt", "zz/f2.txt"):
    (tmp_path / p).parent.mkdir(exist_ok=True)
    (tmp_path / p).write_text(p)
  monkeypatch.chdir(tmp_path)
  want = [str(tmp_path / p) for p in ("aa/f1.txt", "zz/f1.txt", "zz/f2.txt")]
  for patterns in (["zz/*.txt", "aa/*.txt"], ["./zz/*.txt", "aa/*.txt"],
                   [str(tmp_path / "zz" / "*.txt"), "aa/*.txt"],
                   ["aa/*.txt", "zz/*.txt", "./zz/f1.txt", "zz/../zz/f2.txt"]):
    assert text.expand_paths(patterns) == want, patterns
  monkeypatch.setenv("HOME", str(tmp_path))
  (tmp_path / "pairs.tsv").write_text("a\tb\nc\td\n")
  assert text.tsv_splits(["~/pairs.tsv"], 0)["train"] == [("a", "b"), ("c", "d")]


def test_in_validation_holds_out_none_at_0_and_all_at_100_percent():
  keys = [f"file{i}.py" for i in range(500)]
  assert not any(text.in_validation(k, 0) for k in keys)
  assert all(text.in_validation(k, 100) for k in keys)
  assert 0.2 < np.mean([text.in_validation(k, 30) for k in keys]) < 0.4


def names(want_in_validation: bool, percent: int, n: int):
  """n file names that the hash puts (or not) in the validation split at ``percent``."""
  out = [f"m{i}.py" for i in range(1000) if text.in_validation(f"m{i}.py", percent)
         == want_in_validation]
  return out[:n]


def test_split_files_puts_a_file_on_each_side(tmp_path):
  assert text.split_files([], 10) == {"train": [], "validation": []}
  for in_val in (False, True):  # one file is read by both sides, wherever the hash puts it
    one = [str(tmp_path / names(in_val, 10, 1)[0])]
    assert text.split_files(one, 10) == {"train": one, "validation": one}
  # Two files, both drawn: the first is held out.
  two = [str(tmp_path / n) for n in sorted(names(True, 60, 2))]
  assert text.split_files(two, 60) == {"train": two[1:], "validation": two[:1]}
  # No file drawn for validation: the last one is.
  train_only = [str(tmp_path / n) for n in sorted(names(False, 10, 3))]
  assert text.split_files(train_only, 10) == {"train": train_only[:2],
                                              "validation": train_only[2:]}
  # Every file drawn: the first one only.
  val_only = [str(tmp_path / n) for n in sorted(names(True, 60, 3))]
  assert text.split_files(val_only, 60) == {"train": val_only[1:], "validation": val_only[:1]}
  # percent 0: nothing is held out, and validation reads the training files.
  assert text.split_files(train_only, 0) == {"train": train_only, "validation": train_only}


def test_a_file_named_with_glob_characters_and_mixed_spellings(tmp_path, monkeypatch):
  """A path naming an existing file is that file, "[" and "]" in its name too (as a glob
  it matched nothing); relative and absolute paths together split as all absolute ones
  (commonpath raised "Can't mix absolute and relative paths")."""
  (tmp_path / "notes[v2].txt").write_text("x")
  (tmp_path / "notes2.txt").write_text("y")  # what "notes[v2].txt" matches as a glob
  assert text.expand_paths([str(tmp_path / "notes[v2].txt")]) == [
      str(tmp_path / "notes[v2].txt")]
  monkeypatch.chdir(tmp_path)
  files = [f"m{i}.py" for i in range(20)]
  mixed = [f if i % 2 else str(tmp_path / f) for i, f in enumerate(files)]
  split = text.split_files(mixed, 30)
  absolute = text.split_files([str(tmp_path / f) for f in files], 30)
  for side in ("train", "validation"):
    assert [os.path.basename(f) for f in split[side]] == [
        os.path.basename(f) for f in absolute[side]]
  assert split["validation"] and split["train"]


def test_split_files_depends_on_paths_relative_to_the_corpus(tmp_path):
  files = sorted(names(True, 30, 3) + names(False, 30, 3))
  a, b = tmp_path / "a", tmp_path / "elsewhere" / "b"
  split_a = text.split_files([str(a / f) for f in files], 30)
  split_b = text.split_files([str(b / f) for f in files], 30)
  for side in ("train", "validation"):
    assert [os.path.basename(f) for f in split_a[side]] == [
        os.path.basename(f) for f in split_b[side]]
  assert [os.path.basename(f) for f in split_a["validation"]] == sorted(names(True, 30, 3))
  # Two files in two folders are keyed from their common folder ("d0/m1.py"), not from the
  # first one's ("m1.py"): a pair where only "d0/..." is drawn, and "m1.py" alone is not.
  held = next(n for n in (f"m{i}.py" for i in range(1000))
              if text.in_validation(f"d0/{n}", 30) and not text.in_validation(n, 30))
  kept = next(n for n in (f"m{i}.py" for i in range(1000)) if not text.in_validation(f"d1/{n}", 30))
  files = [str(tmp_path / "d0" / held), str(tmp_path / "d1" / kept)]
  assert text.split_files(files, 30) == {"train": files[1:], "validation": files[:1]}


def test_an_empty_default_corpus_is_refused(monkeypatch):
  monkeypatch.setattr(text, "stdlib_files", lambda: [])
  with pytest.raises(FileNotFoundError, match="^the LM corpus is empty$"):
    text.lm_files((), validation_percent=5)


def test_lm_files_keeps_every_kth_file_of_each_side_up_to_max_files(tmp_path):
  """k = n // max_files: a spread when n is many times max_files, a prefix when n is
  under twice max_files (the validation side here: 3 files, max_files=2)."""
  files = sorted(names(False, 20, 9) + names(True, 20, 3))
  for f in files:
    (tmp_path / f).write_text("x")
  paths = [str(tmp_path / f) for f in files]
  split = text.lm_files([str(tmp_path / "*.py")], validation_percent=20, max_files=3)
  train = [p for p in paths if not text.in_validation(os.path.basename(p), 20)]
  val = [p for p in paths if text.in_validation(os.path.basename(p), 20)]
  assert split == {"train": train[::3], "validation": val}
  split = text.lm_files([str(tmp_path / "*.py")], validation_percent=20, max_files=2)
  assert split == {"train": train[::4][:2], "validation": val[::1][:2]}
  with pytest.raises(FileNotFoundError, match=re.escape("no files match")):
    text.lm_files([str(tmp_path / "*.none")], validation_percent=20)
  # A folder is named as one (it "matched no files" until 2026-12-04).
  with pytest.raises(FileNotFoundError, match="^" + re.escape(
      f"{str(tmp_path)!r} is a directory: give its files as a glob, e.g. "
      f"{str(tmp_path / '*.txt')!r} or {str(tmp_path / '**' / '*.py')!r}") + "$"):
    text.lm_files([str(tmp_path)], validation_percent=20)


def test_read_text_replaces_bad_utf8_and_drops_a_byte_order_mark(tmp_path, warned):
  path = tmp_path / "t.txt"
  path.write_bytes("é\n".encode() + b"\xff!")
  assert text.read_text(str(path)) == "é\n\ufffd!"
  # ... with a warning naming the file, the first bad byte and the count (silent until
  # 2026-12-04); a U+FFFD written in the file is text, not counted.
  path.write_bytes("\ufffd\r\n".encode() + b"a\xff\xfeb\rc\xe9")
  assert text.read_text(str(path)) == "\ufffd\na\ufffd\ufffdb\nc\ufffd"
  assert warned()[-1] == (f"{path} is not UTF-8 text (invalid start byte at byte 6): 3 byte "
                          "sequence(s) read as U+FFFD"), warned()
  assert len(warned()) == 2
  # A leading UTF-8 byte order mark is not text (it was 3 byte tokens in front of the
  # document); one elsewhere is a character like any other.
  path.write_bytes("\ufeffdef f():\n  x = '\ufeff'\n".encode())
  assert text.read_text(str(path)) == "def f():\n  x = '\ufeff'\n"
  # ... also in a file with bytes that are not UTF-8, whose first bad byte is counted in the
  # file's bytes, the mark's three too (until 2026-12-06 from after the mark: "byte 2").
  path.write_bytes("\ufeffab".encode() + b"\xffc")
  assert text.read_text(str(path)) == "ab\ufffdc"
  assert warned()[-1] == (f"{path} is not UTF-8 text (invalid start byte at byte 5): 1 byte "
                          "sequence(s) read as U+FFFD")


def test_read_tsv_keeps_fields_as_written_and_names_bad_lines(tmp_path, warned):
  good = tmp_path / "a.tsv"
  good.write_text("hello\tbonjour  \nx\t\n\n  \ny\toui\textra\nX\tboX\n\tz\n\t\n",
                  encoding="utf-8")
  assert text.read_tsv(str(good)) == [("hello", "bonjour  "), ("x", ""), ("y", "oui"),
                                      ("X", "boX"), ("", "z"), ("", "")]
  # The empty source or target is kept, with one warning (silent until 2026-12-04); a line
  # that is only a tab is such a pair, both sides empty (dropped as a blank line, uncounted,
  # until 2026-12-06), where a line of spaces without a tab is blank.
  assert warned() == [f"{good}: 3 pair(s) with an empty source or target (the first at line "
                      "2); they are trained on as they are"]
  # A byte order mark (Windows editors write one) and CRLF line ends are not text.
  bom = tmp_path / "bom.tsv"
  bom.write_bytes("\ufeffhello\tbonjour\r\nx\ty\r\n".encode())
  assert text.read_tsv(str(bom)) == [("hello", "bonjour"), ("x", "y")]
  # A lone CR ends a line too (universal newlines, as the csv module reads a file).
  cr = tmp_path / "cr.tsv"
  cr.write_bytes(b"a\tb\rc\td\r")
  assert text.read_tsv(str(cr)) == [("a", "b"), ("c", "d")]
  bad = tmp_path / "b.tsv"
  bad.write_text("ok\tok\n" + "z" * 70 + "\n")
  with pytest.raises(ValueError, match=re.escape(
      f"{bad}:2: expected 'source<TAB>target', got '{'z' * 60}'") + "$"):
    text.read_tsv(str(bad))
  # Bytes that are not UTF-8: the file and line (was a UnicodeDecodeError naming neither).
  latin = tmp_path / "latin.tsv"
  latin.write_bytes(b"ok\tok\r\nfine\tfine\nbad\tcaf\xe9\n")
  with pytest.raises(ValueError, match=re.escape(
      f"{latin}:3: not UTF-8 (invalid continuation byte: byte 0xe9)")):
    text.read_tsv(str(latin))
  # ... counted as the reader counts lines: lone \r too (it said line 1 here before 2026-12-04).
  latin.write_bytes(b"ok\tok\rfine\tfine\r\nbad\tcaf\xe9\r")
  with pytest.raises(ValueError, match=re.escape(f"{latin}:3: not UTF-8")):
    text.read_tsv(str(latin))
  # ... and after a byte order mark, the line and byte of the bad one (until 2026-12-04 the
  # positions were the text's, read in the file's bytes: line 2, byte 0x09 here).
  latin.write_bytes(b"\xef\xbb\xbfa\tb\nc\td\n\xff\tx\n")
  with pytest.raises(ValueError, match=re.escape(
      f"{latin}:3: not UTF-8 (invalid start byte: byte 0xff)")):
    text.read_tsv(str(latin))
  empty = tmp_path / "c.tsv"
  empty.write_text("\n\n")
  with pytest.raises(ValueError, match=re.escape(f"{empty}: no 'source<TAB>target' lines")):
    text.read_tsv(str(empty))


def test_tsv_splits_by_a_second_file_or_by_line(tmp_path):
  lines = [(f"s{i}", f"t{i}") for i in range(200)]
  one = tmp_path / "one.tsv"
  one.write_text("".join(f"{s}\t{t}\n" for s, t in lines))
  split = text.tsv_splits([str(one)], 10)
  held = [text.in_validation(str(i), 10) for i in range(200)]
  assert split["validation"] == [p for p, h in zip(lines, held) if h]
  assert split["train"] == [p for p, h in zip(lines, held) if not h]
  assert 5 < len(split["validation"]) < 40
  # Nothing held out at 0%: the first pair is the validation set.
  assert text.tsv_splits([str(one)], 0) == {"train": lines, "validation": lines[:1]}
  # Every pair held out (a small file at 99%): one goes to validation, the rest train (it
  # trained on all of them, the validation set itself, until 2026-12-04).
  few = tmp_path / "few.tsv"
  few.write_text("".join(f"{s}\t{t}\n" for s, t in lines[:4]))
  assert all(text.in_validation(str(i), 99) for i in range(4))
  assert text.tsv_splits([str(few)], 99) == {"train": lines[1:4], "validation": lines[:1]}
  # Two pairs, both held out: the second trains (the smallest file this applies to).
  few.write_text("".join(f"{s}\t{t}\n" for s, t in lines[:2]))
  assert text.tsv_splits([str(few)], 99) == {"train": lines[1:2], "validation": lines[:1]}
  two = tmp_path / "two.tsv"
  two.write_text("v\tw\n")
  assert text.tsv_splits([str(one), str(two)], 10) == {"train": lines,
                                                        "validation": [("v", "w")]}
  with pytest.raises(FileNotFoundError, match=re.escape(
      f"TSV file {str(tmp_path / 'no.tsv')!r} does not exist")):
    text.tsv_splits([str(one), str(tmp_path / "no.tsv")], 10)
  # A folder is named as one (it was "does not exist" until 2026-12-06).
  with pytest.raises(ValueError, match=re.escape(
      f"TSV file {str(tmp_path)!r} is a folder: give the .tsv file itself")):
    text.tsv_splits([str(tmp_path)], 10)


def examples(task, **kw):
  return [synthetic.make_example(task, np.random.default_rng([0, i]), **kw) for i in range(600)]


def test_synthetic_sources_draw_every_length_and_letter_of_their_range():
  pairs = examples("copy", min_len=2, max_len=6, vocab_chars=4)
  assert {len(s) for s, _ in pairs} == {2, 3, 4, 5, 6}
  assert set("".join(s for s, _ in pairs)) == set("abcd")
  src = synthetic.SyntheticPairs("copy", seed=0, split="train", min_len=2, max_len=6,
                                 vocab_chars=4)
  assert src.size is None and src.longest() == (6, 6)
  with pytest.raises(ValueError, match=re.escape(
      "task='mul' is not one of 'copy', 'reverse', 'sort', 'add'")):
    synthetic.make_example("mul", np.random.default_rng(0), min_len=1, max_len=2, vocab_chars=2)


@pytest.mark.parametrize("max_len,top", [(6, 3), (7, 3), (1, 1)])
def test_add_operands_have_1_to_max_len_over_2_digits(max_len, top):
  pairs = examples("add", min_len=1, max_len=max_len, vocab_chars=10)
  operands = [int(x) for s, _ in pairs for x in s.split("+")]
  assert {len(str(x)) for x in operands} == set(range(1, top + 1))
  assert min(operands) == 0 and max(operands) >= 10 ** top * 0.9
  assert np.mean(np.array(operands) == 0) < 0.15  # (1/10 + 1/100 + ...) / top: rare
  # The longest example is the bound the pipeline sizes rows by.
  src = synthetic.SyntheticPairs("add", seed=0, split="train", min_len=1, max_len=max_len,
                                 vocab_chars=10)
  assert src.longest() == (2 * top + 1, top + 1)
  assert max(len(s) for s, _ in pairs) == 2 * top + 1
  assert max(len(t) for _, t in pairs) == top + 1


def test_byte_tokenizer_takes_bytes_and_decodes_only_byte_ids():
  tok = ByteTokenizer()
  np.testing.assert_array_equal(tok.encode(b"\x00\xff"), [3, 258])
  assert tok.encode("é").dtype == np.int32 and tok.encode("é").tolist() == [198, 172]
  # pad / bos / eos and ids past the vocabulary are dropped; a 2-D array is read row-major.
  assert tok.decode(np.array([[0, 1, 2, 3 + 104], [259, 260, 3 + 105, 3]])) == "hi\x00"
  assert tok.decode([3 + 0xC3]) == "\ufffd"  # a lone UTF-8 lead byte


def test_make_tokenizer_builds_the_kind_named(tmp_path):
  assert isinstance(make_tokenizer(), ByteTokenizer)
  path = word_level_tokenizer_json(tmp_path / "tokenizer.json", ["<pad>", "a"])
  hf = make_tokenizer("hf_json", path, bos_id=5, eos_id=6)
  assert isinstance(hf, HFJsonTokenizer) and (hf.bos_id, hf.eos_id, hf.vocab_size) == (5, 6, 2)
  # No model file given: the refusal names the empty path.
  with pytest.raises(ValueError, match="^" + re.escape(
      "tokenizer_model='' is not a readable tokenizer.json: ")):
    make_tokenizer("hf_json")
  with pytest.raises(ValueError, match=re.escape(
      "tokenizer='bpe' is not one of 'byte', 'sentencepiece', 'hf_json'")):
    make_tokenizer("bpe", "m.model")


def test_hf_json_tokenizer_ids_vocabulary_and_bad_files(tmp_path):
  # An added token counts in the vocabulary.
  path = word_level_tokenizer_json(tmp_path / "tokenizer.json", ["<pad>", "a", "b"],
                                   specials=["<eos>"])
  hf = HFJsonTokenizer(path)
  assert (hf.vocab_size, hf.pad_id, hf.bos_id, hf.eos_id) == (4, 0, None, None)
  ids = hf.encode("a b a")
  assert ids.dtype == np.int32 and ids.tolist() == [1, 2, 1]
  assert hf.decode(np.array([[1, 3], [2, 0]])) == "a b <pad>"  # <eos> is special: dropped
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match=re.escape(
      f"tokenizer_model={str(bad)!r} is not a readable tokenizer.json: ")):
    HFJsonTokenizer(str(bad))


@pytest.mark.parametrize("kind", ["hf_json", "sentencepiece"])
@pytest.mark.parametrize("make, what", [(os.mkdir, "a folder"), (os.mkfifo, "a FIFO")])
def test_a_tokenizer_file_that_is_no_regular_file_is_refused_by_name(tmp_path, kind, make,
                                                                     what):
  """A folder or a FIFO in the tokenizer file's place: a ValueError naming the path and what
  is there, at once (until 2026-12-07 a FIFO blocked the reader for good, waiting for a
  writer, and a folder was the library's "Is a directory (os error 21)")."""
  pytest.importorskip("tokenizers" if kind == "hf_json" else "sentencepiece")
  path = str(tmp_path / ("tokenizer.json" if kind == "hf_json" else "spm.model"))
  make(path)
  file = "tokenizer.json" if kind == "hf_json" else "sentencepiece .model"
  with released_after(10, path), pytest.raises(ValueError, match="^" + re.escape(
      f"tokenizer_model={path!r} is {what}, not a regular file: give the {file} file "
      "itself") + "$"):
    make_tokenizer(kind, path)


def test_what_is_there_is_named_by_its_kind(tmp_path, monkeypatch):
  """Every kind of file the stat of Linux reports: a socket, a character device (/dev/null),
  and, through a stat that reports them (no block device need be there), a block device and
  a kind Linux has none of; a regular file, a link to one and nothing there are None."""
  import socket
  import stat
  import tempfile
  import types

  from attnlab.data import tokenizer

  # a socket's path: 107 bytes at most, so not under pytest's long tmp_path
  with tempfile.TemporaryDirectory(dir="/tmp") as short, socket.socket(socket.AF_UNIX) as sock:
    sock.bind(os.path.join(short, "s"))
    assert tokenizer.not_a_regular_file(os.path.join(short, "s")) == "a socket"
  assert tokenizer.not_a_regular_file(os.devnull) == "a character device"
  (tmp_path / "f").write_text("{}")
  (tmp_path / "link").symlink_to(tmp_path / "f")
  assert [tokenizer.not_a_regular_file(str(tmp_path / name)) for name in ("f", "link", "no")] \
      == [None, None, None]
  for mode, kind in ((stat.S_IFBLK, "a block device"), (0o160000, "another kind of file")):
    with monkeypatch.context() as patch:
      patch.setattr(tokenizer.os, "stat",
                    lambda path, mode=mode: types.SimpleNamespace(st_mode=mode | 0o600))
      assert tokenizer.not_a_regular_file("x") == kind


def test_a_symbolic_link_to_a_tokenizer_json_reads_and_a_fifo_beside_it_is_skipped(tmp_path):
  """A link to a regular tokenizer.json is that file; a FIFO for tokenizer_config.json is
  passed over by ``named_pad_id`` (opening it waited for a writer) as an absent file is."""
  real = word_level_tokenizer_json(tmp_path / "real.json", ["<pad>", "a", "w1"])
  link = tmp_path / "tokenizer.json"
  link.symlink_to(real)
  hf = HFJsonTokenizer(str(link))
  assert hf.vocab_size == 3
  (tmp_path / "special_tokens_map.json").write_text('{"pad_token": "w1"}')
  os.mkfifo(tmp_path / "tokenizer_config.json")
  with released_after(10, str(tmp_path / "tokenizer_config.json")):
    assert hf.named_pad_id(str(link)) == 2


def test_the_named_pad_is_tokenizer_configs_else_special_tokens_maps(tmp_path):
  """``named_pad_id`` reads special_tokens_map.json when tokenizer_config.json is absent or
  unreadable, or names no pad (the files transformers writes beside tokenizer.json)."""
  path = word_level_tokenizer_json(tmp_path / "tokenizer.json", ["<pad>", "a", "w1"])
  hf = HFJsonTokenizer(path)
  assert hf.named_pad_id(path) is None
  (tmp_path / "special_tokens_map.json").write_text('{"pad_token": "w1"}')
  assert hf.named_pad_id(path) == 2
  for config in ("{not json", "[1]", '{"pad_token": null}'):
    (tmp_path / "tokenizer_config.json").write_text(config)
    assert hf.named_pad_id(path) == 2, config
  (tmp_path / "tokenizer_config.json").write_text('{"pad_token": {"content": "a"}}')
  assert hf.named_pad_id(path) == 1


@pytest.mark.parametrize("module,build,message", [
    ("sentencepiece", lambda: SentencePieceTokenizer("x.model"),
     "tokenizer='sentencepiece' needs the sentencepiece package: "
     "pip install 'attnlab[sentencepiece]'"),
    ("tokenizers", lambda: HFJsonTokenizer("tokenizer.json"),
     "tokenizer='hf_json' needs the tokenizers package: pip install 'attnlab[tokenizers]'"),
])
def test_a_missing_tokenizer_package_is_named_with_its_extra(monkeypatch, module, build, message):
  monkeypatch.setitem(sys.modules, module, None)  # `import <module>` raises ImportError
  with pytest.raises(MissingDependencyError, match="^" + re.escape(message) + "$"):
    build()
