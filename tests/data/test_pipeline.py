"""The batch layouts, row by row; the iterator's order over epochs; the validation batches;
and what ``build_sources`` builds or refuses for every task."""

import dataclasses
import re

import numpy as np
import pytest

from attnlab.config import DataConfig, ModelConfig
from attnlab.data import packing, pipeline, text
from attnlab.data.tokenizer import ByteTokenizer
from tests.data.hf_tokenizer import word_level_tokenizer_json

TOK = ByteTokenizer()
PAD, BOS, EOS = 0, 1, 2
INT_KEYS = ("tokens_BT", "targets_BT", "segment_ids_BT", "positions_BT")


def ids(text):
  return [ord(c) + 3 for c in text]


def check(batch, want):
  """The batch has exactly ``want``'s keys, values and dtypes (int32; the mask float32)."""
  assert sorted(batch) == sorted(want)
  for k, v in want.items():
    assert batch[k].dtype == (np.float32 if k == "loss_mask_BT" else np.int32), k
    np.testing.assert_array_equal(batch[k], v, err_msg=k)


@pytest.mark.parametrize("loss_on_prompt", [False, True])
def test_decoder_only_pairs_row_by_row(loss_on_prompt):
  """[bos] source [eos] target [eos], cut to T + 1 tokens and shifted by one; segment ids
  mark the tokens, positions count from 0; the loss covers the target and its eos (or,
  with loss_on_prompt, everything)."""
  src = pipeline.PairBatches([("ab", "xyz"), ("abcdef", "uvwxyz")], TOK, seq_len=10,
                             arch="decoder_only", loss_on_prompt=loss_on_prompt)
  a, b, c, d, e, f = ids("abcdef")
  u, v, w, x, y, z = ids("uvwxyz")
  short = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
  check(src.batch([0, 1]), dict(
      tokens_BT=[[BOS, a, b, EOS, x, y, z, EOS, PAD, PAD], [BOS, a, b, c, d, e, f, EOS, u, v]],
      targets_BT=[[a, b, EOS, x, y, z, EOS, PAD, PAD, PAD], [a, b, c, d, e, f, EOS, u, v, w]],
      segment_ids_BT=[short, [1] * 10],
      positions_BT=[list(range(10))] * 2,
      loss_mask_BT=[[1, 1, 1, 1, 1, 1, 1, 0, 0, 0], [1] * 10] if loss_on_prompt else
      [[0, 0, 0, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]]))
  assert src.size == 2


def test_encoder_decoder_pairs_row_by_row():
  """src = source [eos]; tgt_in = [bos] target; targets = target [eos]; each cut to T (a cut
  target's eos is no label)."""
  src = pipeline.PairBatches([("ab", "xyz"), ("abcdefg", "uvwxyzq")], TOK, seq_len=5,
                             arch="encoder_decoder", loss_on_prompt=False)
  a, b, c, d = ids("abcd")
  u, v, w, x, y, z = ids("uvwxyz")
  batch = src.batch([0, 1])
  for k in ("src_BS", "src_segment_ids_BS", "tgt_in_BT", "targets_BT", "tgt_segment_ids_BT"):
    assert batch[k].dtype == np.int32, k
  assert batch["loss_mask_BT"].dtype == np.float32 and len(batch) == 6
  want = dict(src_BS=[[a, b, EOS, PAD, PAD], [a, b, c, d, EOS]],
              src_segment_ids_BS=[[1, 1, 1, 0, 0], [1] * 5],
              tgt_in_BT=[[BOS, x, y, z, PAD], [BOS, u, v, w, x]],
              targets_BT=[[x, y, z, EOS, PAD], [u, v, w, x, EOS]],
              tgt_segment_ids_BT=[[1, 1, 1, 1, 0], [1] * 5],
              loss_mask_BT=[[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
  for k, v_ in want.items():
    np.testing.assert_array_equal(batch[k], v_, err_msg=k)


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_fits_tells_the_examples_the_layout_cuts(arch):
  """``PairBatches.fits``: an encoder-decoder row holds T - 1 source and target tokens (then
  eos), a decoder-only row [bos] s [eos] t [eos] in T + 1; one token more is cut. For a
  decoder-only row this is what the batch shows too (its last eos is there or not); the
  validation batches of pairs carry it as EXAMPLE_FITS (an LM's have none)."""
  T = 6
  pairs = [("abcde", "xyzuv"), ("abcdef", "x"), ("a", "xyzuvw"), ("ab", "xy")]
  if arch == "decoder_only":
    pairs = [("ab", "xy"), ("abc", "xy"), ("abcd", ""), ("", "xyzuv")]
  src = pipeline.PairBatches(pairs, TOK, seq_len=T, arch=arch, loss_on_prompt=False)
  want = [True, False, False, True] if arch == "encoder_decoder" else [True, False, True, False]
  assert src.fits([0, 1, 2, 3]).tolist() == want and src.fits([3, 0]).tolist() == want[::-3]
  assert src.fits(lengths=src.lengths([0, 1, 2, 3])).tolist() == want
  lengths = src.lengths([0, 1, 2, 3])
  assert lengths.dtype == np.int32 and lengths.tolist() == [[len(s), len(t)] for s, t in pairs]
  for bad in (dict(), dict(indices=[0], lengths=src.lengths([0]))):  # one of the two
    with pytest.raises(ValueError, match="^" + re.escape(
        "PairBatches.fits takes the examples' indices or their lengths (one)") + "$"):
      src.fits(**bad)
  if arch == "decoder_only":
    batch = src.batch([0, 1, 2, 3])
    ends = [EOS in row[row != PAD][-1:] for row in batch["targets_BT"]]
    assert ends == want
  dcfg = DataConfig(task="reverse", seq_len=T, max_len=3, batch_size=3)
  (first, second) = pipeline.validation_batches({"validation": src}, dcfg, 2)
  assert first[pipeline.EXAMPLE_FITS].tolist() == want[:3]
  assert second[pipeline.EXAMPLE_FITS].tolist() == [want[3]] + want[:2]


def test_a_cut_encoder_decoder_target_is_not_trained_to_end_at_the_cut():
  """A target longer than its row keeps an eos at the cut (the layout's shape), but that eos
  is no label: the target does not end there (until 2026-12-04 it trained the model to stop
  early on long pairs). A target that fits keeps its eos a label; one a token or two longer
  (T or T + 1 tokens) is cut like a longer one."""
  src = pipeline.PairBatches([("ab", "xyzuvw"), ("ab", "xyz"), ("ab", "xyzu"), ("ab", "xyzuv")],
                             TOK, seq_len=4, arch="encoder_decoder", loss_on_prompt=False)
  batch = src.batch([0, 1, 2, 3])
  x, y, z = TOK.encode("xyz").tolist()
  assert batch["targets_BT"].tolist() == [[x, y, z, EOS]] * 4
  assert batch["loss_mask_BT"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0],
                                            [1, 1, 1, 0]]
  assert src.fits([0, 1, 2, 3]).tolist() == [False, True, False, False]


def test_packed_rows_dtypes_and_the_rows_a_stream_holds():
  tokens, doc_ids = packing.concat_documents([np.array([5, 6]), np.array([7])], 1, 2)
  assert tokens.dtype == doc_ids.dtype == np.int32
  np.testing.assert_array_equal(doc_ids, [1, 1, 1, 1, 2, 2, 2])
  batch = packing.packed_rows(tokens, doc_ids, np.array([0, 1]), seq_len=3)
  check(batch, dict(tokens_BT=[[1, 5, 6], [2, 1, 7]], targets_BT=[[5, 6, 2], [1, 7, 2]],
                    segment_ids_BT=[[1, 1, 1], [1, 2, 2]], positions_BT=[[0, 1, 2], [0, 0, 1]],
                    loss_mask_BT=[[1, 1, 1], [0, 1, 1]]))
  # A row reads T + 1 tokens: a stream of n tokens holds (n - 1) // T rows.
  assert [packing.num_rows(n, 3) for n in (0, 1, 3, 4, 6, 7, 10)] == [0, 0, 0, 1, 1, 2, 3]


def test_packed_text_of_exactly_one_row_and_of_less():
  one = pipeline.PackedText(["abcdefg"], TOK, seq_len=8, seed=0)  # bos + 7 + eos = 9 = T + 1
  assert one.size == 1
  with pytest.raises(ValueError, match=re.escape(
      "the corpus has 9 tokens, fewer than one row of seq_len=9 needs (10)")):
    pipeline.PackedText(["abcdefg"], TOK, seq_len=9, seed=0)


class Rows:
  """A source whose row i is the number i."""

  def __init__(self, size):
    self.size = size

  def batch(self, indices):
    return np.asarray(indices)


def test_iterator_without_a_seed_reads_rows_in_order_across_epochs():
  it = pipeline.BatchIterator(Rows(5), 2, seed=None)
  assert [next(it).tolist() for _ in range(4)] == [[0, 1], [2, 3], [4, 0], [1, 2]]
  endless = pipeline.BatchIterator(Rows(None), 3, seed=None, index=2)
  assert next(endless).tolist() == [6, 7, 8]


def test_iterator_with_a_seed_reads_each_epoch_as_its_own_permutation():
  it = pipeline.BatchIterator(Rows(6), 3, seed=4)
  epochs = [np.concatenate([next(it), next(it)]) for _ in range(3)]
  for e, rows in enumerate(epochs):
    np.testing.assert_array_equal(rows, np.random.default_rng([4, e]).permutation(6))
  assert len({tuple(r) for r in epochs}) == 3  # reshuffled every epoch
  assert pipeline.BatchIterator(Rows(6), 6, seed=0).source.size == 6  # one batch: fine
  with pytest.raises(ValueError, match=re.escape(
      "batch_size=7 is larger than the data (6 rows)")):
    pipeline.BatchIterator(Rows(6), 7, seed=0)


def test_train_iterator_shuffles_with_the_data_seed():
  sources = {"train": Rows(8), "validation": Rows(10)}
  dcfg = DataConfig(task="copy", batch_size=4, seed=3)
  it = pipeline.train_iterator(sources, dcfg)
  np.testing.assert_array_equal(next(it), np.random.default_rng([3, 0]).permutation(8)[:4])


class MaskedRows(Rows):
  """Row i is the number i, with a loss mask of ones."""

  def batch(self, indices):
    return {"row": np.asarray(indices), "loss_mask_BT": np.ones((len(indices), 3), np.float32)}


def _rows(batches):
  """(rows, example mask, loss-mask row sums) of each validation batch."""
  return [(b["row"].tolist(), b[pipeline.EXAMPLE_MASK].tolist(),
           b["loss_mask_BT"].sum(axis=1).tolist()) for b in batches]


def test_validation_reads_every_row_in_order_and_fills_up_the_last_batch():
  """Batches of the validation rows in order, at most as many as asked for, all of one
  shape: the last one, if the rows end inside it, is filled up with the first rows, which
  are not examples (mask False) and carry no loss (before, those last rows were dropped)."""
  dcfg = DataConfig(task="copy", batch_size=4, seed=3)
  val = {"validation": MaskedRows(10)}
  assert _rows(pipeline.validation_batches(val, dcfg, num_batches=5)) == [
      ([0, 1, 2, 3], [True] * 4, [3.0] * 4), ([4, 5, 6, 7], [True] * 4, [3.0] * 4),
      ([8, 9, 0, 1], [True, True, False, False], [3.0, 3.0, 0.0, 0.0])]
  assert _rows(pipeline.validation_batches(val, dcfg, num_batches=2)) == [
      ([0, 1, 2, 3], [True] * 4, [3.0] * 4), ([4, 5, 6, 7], [True] * 4, [3.0] * 4)]
  whole = {"validation": MaskedRows(8)}
  assert [r for r, _, _ in _rows(pipeline.validation_batches(whole, dcfg, num_batches=5))] == [
      [0, 1, 2, 3], [4, 5, 6, 7]]
  # Fewer rows than a batch: one batch of all of them, rounded up to a multiple of the
  # data shards a batch is split over (filled up as above).
  small = {"validation": MaskedRows(3)}
  assert _rows(pipeline.validation_batches(small, dcfg, num_batches=5)) == [
      ([0, 1, 2], [True] * 3, [3.0] * 3)]
  assert _rows(pipeline.validation_batches(small, dcfg, num_batches=5, multiple_of=2)) == [
      ([0, 1, 2, 0], [True, True, True, False], [3.0, 3.0, 3.0, 0.0])]
  assert _rows(pipeline.validation_batches({"validation": MaskedRows(1)}, dcfg, 5,
                                           multiple_of=4)) == [
      ([0, 0, 0, 0], [True, False, False, False], [3.0, 0.0, 0.0, 0.0])]
  assert [r for r, _, _ in _rows(pipeline.validation_batches(val, dcfg, num_batches=5,
                                                             multiple_of=4))] == [
      [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
  # As many rows as a batch is not fewer: batch_size rows, whatever multiple_of says.
  assert [r for r, _, _ in _rows(pipeline.validation_batches({"validation": MaskedRows(4)},
                                                             dcfg, 5, multiple_of=3))] == [
      [0, 1, 2, 3]]
  endless = pipeline.validation_batches({"validation": MaskedRows(None)}, dcfg, num_batches=2)
  assert _rows(endless) == [([0, 1, 2, 3], [True] * 4, [3.0] * 4),
                            ([4, 5, 6, 7], [True] * 4, [3.0] * 4)]
  # One pytree of dtypes for every batch (a filled-up one too): eval compiles once.
  for batches in (endless, pipeline.validation_batches(val, dcfg, num_batches=5)):
    assert {(b[pipeline.EXAMPLE_MASK].dtype, b["loss_mask_BT"].dtype) for b in batches} == {
        (np.dtype(bool), np.dtype(np.float32))}
  with pytest.raises(ValueError, match="^the validation data has no rows$"):
    pipeline.validation_batches({"validation": MaskedRows(0)}, dcfg, num_batches=5)


def test_synthetic_sources_are_endless():
  sources, _ = pipeline.build_sources(DataConfig(task="copy", seq_len=32),
                                      ModelConfig(arch="decoder_only"))
  assert sources["train"].size is None and sources["validation"].size is None


@pytest.mark.parametrize("arch,task,max_len,need", [
    ("decoder_only", "reverse", 5, 12),  # [bos] 5 [eos] 5 [eos]
    ("encoder_decoder", "reverse", 5, 6),  # 5 + eos on either side
    ("decoder_only", "add", 6, 13),  # "999+999" [eos] "1998": 1 + 7 + 1 + 4 + 1 - 1 (shift)
    ("encoder_decoder", "add", 6, 8),  # "999+999" + eos
])
def test_synthetic_tasks_need_seq_len_for_their_longest_example(arch, task, max_len, need):
  mcfg = ModelConfig(arch=arch)
  lengths = dict(max_len=max_len) | ({} if task == "add" else dict(min_len=1))
  sources, _ = pipeline.build_sources(DataConfig(task=task, seq_len=need, **lengths), mcfg)
  assert sources["train"].arch == arch
  with pytest.raises(ValueError, match="^" + re.escape(
      f"DataConfig.seq_len={need - 1} is too short for task={task!r} with DataConfig.max_len="
      f"{max_len}: needs {need}") + "$"):
    pipeline.build_sources(DataConfig(task=task, seq_len=need - 1, **lengths), mcfg)


def test_rows_longer_than_the_model_positions_are_refused():
  with pytest.raises(ValueError, match=re.escape(
      "seq_len=32 is longer than ModelConfig.max_len=31, the positions the model has")):
    pipeline.build_sources(DataConfig(task="copy", seq_len=32), ModelConfig(max_len=31))
  assert pipeline.build_sources(DataConfig(task="copy", seq_len=32), ModelConfig(max_len=32))


def test_build_sources_passes_loss_on_prompt():
  sources, _ = pipeline.build_sources(DataConfig(task="copy", seq_len=32, loss_on_prompt=True),
                                      ModelConfig(arch="decoder_only"))
  assert sources["train"].batch([0])["loss_mask_BT"][0, 0] == 1.0


def test_build_sources_lays_out_with_the_tokenizer_it_is_given(tmp_path):
  """A caller's tokenizer is the one used and handed back (the run's check made it, and
  a tokenizer model file is read once), not one made again from the config."""

  class Reversed(ByteTokenizer):
    def encode(self, text, **kw):
      return super().encode(text[::-1], **kw)

  tok = Reversed()
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("abc\tx\n")
  sources, got = pipeline.build_sources(DataConfig(task="tsv", paths=(str(pairs),), seq_len=8),
                                        ModelConfig(arch="encoder_decoder"), tok)
  assert got is tok
  assert sources["train"].batch([0])["src_BS"][0, :4].tolist() == [*TOK.encode("cba"), EOS]


def test_lm_task_needs_a_decoder_only_model():
  with pytest.raises(ValueError, match=r"^task='lm' needs arch='decoder_only'$"):
    pipeline.build_sources(DataConfig(task="lm"), ModelConfig(arch="encoder_decoder"))
  # Nor does loss_on_prompt apply to an encoder-decoder (ignored until 2026-12-04).
  with pytest.raises(ValueError, match="^" + re.escape(
      "DataConfig.loss_on_prompt=True does not apply to an encoder-decoder (its source is the "
      "encoder's input, never a target); it is for a decoder-only model") + "$"):
    pipeline.build_sources(DataConfig(task="copy", loss_on_prompt=True),
                           ModelConfig(arch="encoder_decoder"))


def test_lm_sources_read_at_most_max_files(tmp_path):
  for i in range(6):
    (tmp_path / f"f{i}.txt").write_text("x" * (10 + i))
  dcfg = DataConfig(task="lm", paths=(str(tmp_path / "*.txt"),), seq_len=4, batch_size=1,
                    validation_percent=20, max_files=1)
  sources, _ = pipeline.build_sources(dcfg, ModelConfig())
  for split in ("train", "validation"):  # one document: its bytes + bos + eos
    assert set(sources[split].doc_ids_Y.tolist()) == {1}, split


def test_tsv_task_reads_its_files(tmp_path):
  train, valid = tmp_path / "train.tsv", tmp_path / "valid.tsv"
  train.write_text("ab\tba\ncd\tdc\n")
  valid.write_text("ef\tfe\n")
  dcfg = DataConfig(task="tsv", paths=(str(train), str(valid)), seq_len=8, batch_size=1)
  sources, _ = pipeline.build_sources(dcfg, ModelConfig(arch="encoder_decoder"))
  assert sources["train"].pairs == [("ab", "ba"), ("cd", "dc")]
  assert sources["validation"].pairs == [("ef", "fe")]
  assert sources["train"].arch == "encoder_decoder"
  # One file: validation_percent of its lines are held out.
  train.write_text("".join(f"s{i}\tt{i}\n" for i in range(100)))
  dcfg = DataConfig(task="tsv", paths=(str(train),), seq_len=8, batch_size=1,
                    validation_percent=30)
  sources, _ = pipeline.build_sources(dcfg, ModelConfig(arch="encoder_decoder"))
  assert sources["validation"].pairs == text.tsv_splits([str(train)], 30)["validation"]
  assert 15 < sources["validation"].size < 45
  # A third file is refused (it was ignored).
  with pytest.raises(ValueError, match=r"^DataConfig.paths has 3 TSV files; give one \(split by "
                     r"validation_percent\) or two \(training, validation\)$"):
    text.tsv_splits([str(train), str(valid), str(valid)], 5)


def test_a_split_that_holds_nothing_out_holds_out_the_last_line_or_says_so(tmp_path, caplog):
  """One TSV file whose hash holds out no line: its last pair is the validation set (it
  was the first pair, a training pair too). One LM file: its last lines (the percent, at
  least one) are the validation text and the lines before the training text (it was the
  whole file, both). Where nothing can be held out (one pair, one line,
  validation_percent=0) the validation set is training data, and a warning says so."""
  tsv = tmp_path / "few.tsv"
  tsv.write_text("a\tA\nb\tB\nc\tC\n")
  assert not any(text.in_validation(str(i), 5) for i in range(3))
  assert text.tsv_splits([str(tsv)], 5) == {"train": [("a", "A"), ("b", "B")],
                                            "validation": [("c", "C")]}
  lm = tmp_path / "corpus.txt"
  lines = [f"line {i} of the corpus\n" for i in range(40)]
  lm.write_text("".join(lines))
  assert text.split_lines("".join(lines), 5) == ("".join(lines[:38]), "".join(lines[38:]))
  assert text.split_lines("".join(lines), 1) == ("".join(lines[:39]), lines[39])
  assert text.split_lines("one line", 5) == ("one line", "one line")
  assert text.split_lines("a\nb", 5) == ("a\n", "b")  # two lines: one each side
  ten = [f"{i}\n" for i in range(10)]
  assert text.split_lines("".join(ten), 15) == ("".join(ten[:8]), "".join(ten[8:]))  # 1.5 -> 2
  assert text.split_lines("".join(ten), 14) == ("".join(ten[:9]), ten[9])  # 1.4 -> 1
  assert text.split_lines("a\nb\nc\n", 99) == ("a\n", "b\nc\n")  # training keeps a line
  assert text.tsv_splits([str(tsv)], 5) == {"train": [("a", "A"), ("b", "B")],
                                            "validation": [("c", "C")]}
  tsv2 = tmp_path / "two.tsv"
  tsv2.write_text("a\tA\nb\tB\n")
  assert text.tsv_splits([str(tsv2)], 5) == {"train": [("a", "A")], "validation": [("b", "B")]}
  assert text.split_lines("a\nb\n", 0) == ("a\nb\n", "a\nb\n")
  # Lines end at \n only: a form feed (the stdlib has them), \x1c-\x1e, \x85, U+2028 or a
  # \v is text (until 2026-12-04 each was a line of its own and moved the split).
  assert text.split_lines("a\x0cb\x1cc\x85d\u2028e\vf\ng\n", 50) == (
      "a\x0cb\x1cc\x85d\u2028e\vf\n", "g\n")
  assert text.split_lines("a\x0cb", 50) == ("a\x0cb", "a\x0cb")  # one line
  crlf = tmp_path / "crlf.txt"
  crlf.write_bytes(b"a\r\nb\rc\n")
  assert text.read_text(str(crlf)) == "a\nb\nc\n"  # universal newlines
  decoder = ModelConfig(arch="decoder_only")
  logger = pipeline.__name__
  for task, path, percent, overlap in (("tsv", tsv, 5, False), ("lm", lm, 5, False),
                                       ("tsv", tsv, 0, True), ("lm", lm, 0, True)):
    caplog.clear()
    dcfg = DataConfig(task=task, paths=(str(path),), seq_len=8, batch_size=1,
                      validation_percent=percent)
    with caplog.at_level("WARNING", logger=logger):
      sources, tok = pipeline.build_sources(dcfg, decoder)
    warned = [r.getMessage() for r in caplog.records if r.name == logger]
    assert warned == ([
        f"the validation split of DataConfig.paths=('{path}',) (validation_percent={percent}) "
        "is training data: nothing could be held out, so the validation loss and scores "
        "measure the training set"] if overlap else []), (task, percent)
    if task == "lm":  # the validation rows hold the last two lines' tokens, or all of them
      held = "".join(lines[38:]) if percent else "".join(lines)
      n = len(tok.encode(held, add_special_tokens=False)) + 2
      assert len(sources["validation"].tokens_Y) == n
      assert len(sources["train"].tokens_Y) == (
          len(tok.encode("".join(lines[:38]), add_special_tokens=False)) + 2 if percent else n)
  # Two files: one each side, whole (only a corpus of one file is split inside).
  other = tmp_path / "other.txt"
  other.write_text("".join(f"another {i}\n" for i in range(30)))
  files = text.lm_files((str(lm), str(other)), validation_percent=5)
  assert len(files["train"]) == len(files["validation"]) == 1
  sources, tok = pipeline.build_sources(DataConfig(task="lm", paths=(str(lm), str(other)),
                                                   seq_len=8, batch_size=1), decoder)
  for split in ("train", "validation"):
    (path,) = files[split]
    n = len(tok.encode(text.read_text(path), add_special_tokens=False)) + 2
    assert len(sources[split].tokens_Y) == n, split
  # A held-out tail too short for one row is named as what it is.
  with pytest.raises(ValueError, match=re.escape(
      f"the validation split (the last lines of {lm}; validation_percent=5) has 46 tokens, "
      "fewer than one row of seq_len=64 needs (65)")):
    pipeline.build_sources(DataConfig(task="lm", paths=(str(lm),), seq_len=64, batch_size=1),
                           decoder)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_split_of_many_files_too_short_for_a_row_names_three_of_them(tmp_path, n):
  """A split shorter than one row is refused naming its first three files, and how many it
  has when there are more (validation_percent=0: every file is a training file)."""
  files = [tmp_path / f"f{i}.txt" for i in range(n)]
  for f in files:
    f.write_text("x\n")
  files = [str(f) for f in files]
  dcfg = DataConfig(task="lm", paths=(str(tmp_path / "*.txt"),), seq_len=64, batch_size=1,
                    validation_percent=0)
  shown = ", ".join(files[:3]) + (f", ... ({n} files)" if n > 3 else "")
  with pytest.raises(ValueError, match="^" + re.escape(
      f"the train split ({shown}; validation_percent=0) has {4 * n} tokens, fewer than "
      "one row of seq_len=64 needs (65)") + "$"):
    pipeline.build_sources(dcfg, ModelConfig(arch="decoder_only"))


def _llama_like_tokenizer(tmp_path):
  """Word-level, with a real token at id 0 ("!", as GPT-2's tokenizer.json has) and a
  post-processor that adds bos (as Llama's does): <s> = 3, </s> = 4."""
  tokenizers = pytest.importorskip("tokenizers")
  path = word_level_tokenizer_json(tmp_path / "tokenizer.json", ["!", "a", "b", "<s>", "</s>"],
                                   specials=["<s>", "</s>"])
  tok = tokenizers.Tokenizer.from_file(path)
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", 3)])
  tok.save(path)
  return path


def test_an_hf_json_vocabulary_with_gaps_is_as_large_as_its_largest_id(tmp_path):
  """ids {0, 1, 2, 300}: vocab_size 301, not the 4 tokens it holds (until 2026-12-06 a model
  of 8 rows passed the data check while the data held id 300, and decode dropped it)."""
  from attnlab.data.tokenizer import make_tokenizer

  path = word_level_tokenizer_json(tmp_path / "tokenizer.json", ["<unk>", "<s>", "</s>",
                                                                 "hello", "world"],
                                   ids=[0, 1, 2, 3, 300])
  tok = make_tokenizer("hf_json", path, bos_id=1, eos_id=2)
  assert tok.vocab_size == 301
  np.testing.assert_array_equal(tok.encode("hello world", add_special_tokens=False), [3, 300])
  assert tok.decode([3, 300]) == "hello world"
  (tmp_path / "doc.txt").write_text("hello world " * 20)
  dcfg = DataConfig(task="lm", paths=(str(tmp_path / "doc.txt"),), seq_len=8, batch_size=1,
                    tokenizer="hf_json", tokenizer_model=path, bos_id=1, eos_id=2)
  with pytest.raises(ValueError, match="vocab"):
    pipeline.build_sources(dcfg, ModelConfig(vocab_size=8))
  pipeline.build_sources(dcfg, ModelConfig(vocab_size=301))


def test_hf_json_data_gets_bos_once_and_keeps_a_real_token_with_the_pad_id(tmp_path):
  """The training data is encoded without the tokenizer's own bos (the layout adds one:
  it was [bos][bos] before 2026-12-03), while a prompt keeps it as transformers encodes
  one; segment ids and loss masks come from the lengths, so a real token whose id is the
  pad id (0) is attended to and trained on (it was masked as padding)."""
  path = _llama_like_tokenizer(tmp_path)
  (tmp_path / "doc.txt").write_text("a ! b")
  kw = dict(task="lm", paths=(str(tmp_path / "doc.txt"),), seq_len=4, batch_size=1,
            tokenizer="hf_json", tokenizer_model=path, bos_id=3, eos_id=4)
  sources, tok = pipeline.build_sources(DataConfig(**kw), ModelConfig())
  np.testing.assert_array_equal(sources["train"].tokens_Y, [3, 1, 0, 2, 4])
  np.testing.assert_array_equal(tok.encode("a ! b"), [3, 1, 0, 2])  # a prompt: with bos
  # Decoding drops the specials and ids outside the vocabulary (was an OverflowError).
  assert tok.decode([3, 1, 0, 2, 4, 5, 10**6, -1]) == "a ! b"
  check(sources["train"].batch([0]), dict(
      tokens_BT=[[3, 1, 0, 2]], targets_BT=[[1, 0, 2, 4]], segment_ids_BT=[[1, 1, 1, 1]],
      positions_BT=[[0, 1, 2, 3]], loss_mask_BT=[[1, 1, 1, 1]]))
  dec = pipeline.PairBatches([("a !", "b")], tok, seq_len=8, arch="decoder_only",
                             loss_on_prompt=False)
  check(dec.batch([0]), dict(
      tokens_BT=[[3, 1, 0, 4, 2, 4, 0, 0]], targets_BT=[[1, 0, 4, 2, 4, 0, 0, 0]],
      segment_ids_BT=[[1, 1, 1, 1, 1, 1, 0, 0]], positions_BT=[list(range(8))],
      loss_mask_BT=[[0, 0, 0, 1, 1, 0, 0, 0]]))
  encdec = pipeline.PairBatches([("! a", "! b")], tok, seq_len=4, arch="encoder_decoder",
                                loss_on_prompt=False)
  check(encdec.batch([0]), dict(
      src_BS=[[0, 1, 4, 0]], src_segment_ids_BS=[[1, 1, 1, 0]], tgt_in_BT=[[3, 0, 2, 0]],
      tgt_segment_ids_BT=[[1, 1, 1, 0]], targets_BT=[[0, 2, 4, 0]],
      loss_mask_BT=[[1, 1, 1, 0]]))
  # The train step hands the source's segment ids to the model: its "!" is not padding.
  from flax import nnx

  from attnlab import build_model
  from attnlab.training import steps

  model = build_model(ModelConfig(arch="encoder_decoder", vocab_size=5, d_model=16,
                                  num_heads=2, num_layers=1, d_ff=32), rngs=nnx.Rngs(0))
  batch = encdec.batch([0])
  got = steps.model_logits(model, batch)
  np.testing.assert_array_equal(got, model(
      batch["src_BS"], batch["tgt_in_BT"], src_segment_ids_BS=batch["src_segment_ids_BS"],
      tgt_segment_ids_BT=batch["tgt_segment_ids_BT"]))
  assert not np.allclose(got, model(batch["src_BS"], batch["tgt_in_BT"],
                                    tgt_segment_ids_BT=batch["tgt_segment_ids_BT"]))


def test_hf_json_sources_take_the_configs_bos_and_eos(tmp_path):
  path = word_level_tokenizer_json(tmp_path / "tokenizer.json",
                                   ["<pad>", "<s>", "</s>", "a", "b"])
  (tmp_path / "doc.txt").write_text("a b a b a b a b")
  kw = dict(task="lm", paths=(str(tmp_path / "doc.txt"),), seq_len=4, batch_size=1,
            tokenizer="hf_json", tokenizer_model=path)
  sources, tok = pipeline.build_sources(DataConfig(bos_id=1, eos_id=2, **kw), ModelConfig())
  assert (tok.bos_id, tok.eos_id) == (1, 2)
  np.testing.assert_array_equal(sources["train"].tokens_Y, [1, 3, 4, 3, 4, 3, 4, 3, 4, 2])
  for bos, eos in [(None, 2), (1, None)]:
    with pytest.raises(ValueError, match=re.escape(
        f"training data is laid out with bos and eos: set DataConfig.bos_id (={bos}) and "
        f"eos_id (={eos}) of the hf_json tokenizer")):
      pipeline.build_sources(DataConfig(bos_id=bos, eos_id=eos, **kw), ModelConfig())
  with pytest.raises(ValueError, match=re.escape(
      "vocab_size=4 is smaller than the tokenizer's 5")):
    pipeline.build_sources(DataConfig(bos_id=1, eos_id=2, **kw), ModelConfig(vocab_size=4))
  # An id past the model's vocabulary (a NaN loss at the first step until 2026-12-04).
  for bos, eos, name, bad in ((1, 300, "eos_id", 300), (259, 2, "bos_id", 259)):
    with pytest.raises(ValueError, match="^" + re.escape(
        f"DataConfig.{name}={bad} is outside the model's vocabulary (ModelConfig.vocab_size="
        f"259): give the tokenizer's id") + "$"):
      pipeline.build_sources(DataConfig(bos_id=bos, eos_id=eos, **kw), ModelConfig())


def test_the_bos_a_post_processor_puts_in_front(tmp_path):
  """``HFJsonTokenizer.post_processor_bos`` (the bos of an imported model whose config.json
  has none): the id a template puts before the text; None for a template that only
  appends, or adds nothing; a probe text that encodes to no token is not taken for one
  whose post-processor added a bos (it took an appended eos for the bos before)."""
  tokenizers = pytest.importorskip("tokenizers")
  from attnlab.data.tokenizer import HFJsonTokenizer

  template = tokenizers.processors.TemplateProcessing

  def bos_of(name, model, post):
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    if post is not None:
      tok.post_processor = post
    tok.save(str(tmp_path / f"{name}.json"))
    return HFJsonTokenizer(str(tmp_path / f"{name}.json")).post_processor_bos()

  words = lambda: tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "a"])}, unk_token="<unk>")
  assert bos_of("bos", words(), template(single="<s> $A", special_tokens=[("<s>", 1)])) == 1
  assert bos_of("both", words(), template(single="<s> $A </s>",
                                          special_tokens=[("<s>", 1), ("</s>", 2)])) == 1
  assert bos_of("eos", words(), template(single="$A </s>", special_tokens=[("</s>", 2)])) is None
  assert bos_of("none", words(), None) is None
  # No unknown token and none of the probe texts in the vocabulary: they encode to nothing.
  eos_only = template(single="$A </s>", special_tokens=[("</s>", 1)])
  bpe = lambda vocab: tokenizers.models.BPE(vocab=vocab, merges=[])
  assert bos_of("bpe", bpe({"<s>": 0, "</s>": 1, "b": 2}), eos_only) is None
  # ... but a later probe that encodes finds the bos.
  assert bos_of("bpe0", bpe({"<s>": 0, "</s>": 1, "0": 2}),
                template(single="<s> $A", special_tokens=[("<s>", 0)])) == 0
  # Lower-case letters alone (a text in upper case encodes to nothing): "a", then "hello".
  bos_first = template(single="<s> $A", special_tokens=[("<s>", 0)])
  assert bos_of("bpe_a", bpe({"<s>": 0, "a": 1}), bos_first) == 0
  assert bos_of("bpe_hello", bpe({"<s>": 0, "h": 1, "e": 2, "l": 3, "o": 4}), bos_first) == 0


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_a_training_pair_longer_than_seq_len_is_cut_with_one_warning(tmp_path, caplog, arch):
  """The first cut training pair is named with its lengths, once (cut without a word until
  2026-12-04); a validation split's cuts are the evaluation's to count."""
  train, valid = tmp_path / "train.tsv", tmp_path / "valid.tsv"
  train.write_text("ab\tba\n" + "x" * 30 + "\t" + "y" * 20 + "\ncd\tdc\n" + "z" * 40 + "\tw\n")
  valid.write_text("e" * 30 + "\tfe\n")
  dcfg = DataConfig(task="tsv", paths=(str(train), str(valid)), seq_len=16, batch_size=2)
  sources, _ = pipeline.build_sources(dcfg, ModelConfig(arch=arch))
  logger = pipeline.__name__
  with caplog.at_level("WARNING", logger=logger):
    for ids in ([0, 2], [1, 3], [0, 1]):
      sources["train"].batch(np.array(ids))
    sources["validation"].batch(np.array([0, 0]))
  warned = [r.getMessage() for r in caplog.records if r.name == logger]
  left = ("; its row keeps 0 of its 21 target tokens (with eos): it trains on nothing"
          if arch == "decoder_only" else "")
  assert warned == [
      f"the training split of DataConfig.paths=('{train}', '{valid}'): a pair (source "
      f"'{'x' * 30}', 30 tokens; target 20) is longer than seq_len=16 and is cut{left}; raise "
      "DataConfig.seq_len to keep such pairs whole (this warning is shown once)"]
  if arch == "decoder_only":  # with the loss on the prompt too, the row still trains
    sources, _ = pipeline.build_sources(dataclasses.replace(dcfg, loss_on_prompt=True),
                                        ModelConfig(arch=arch))
    caplog.clear()
    with caplog.at_level("WARNING", logger=logger):
      sources["train"].batch(np.array([1, 3]))
    (message,) = [r.getMessage() for r in caplog.records if r.name == logger]
    assert "(with eos); raise" in message and "trains on nothing" not in message
  # A pair only the decoder-only layout cuts (10 + 10 tokens in rows of 16), whose row keeps
  # part of its target; a long source is quoted by its first 30 characters.
  train.write_text("c" * 10 + "\t" + "d" * 10 + "\n" + "e" * 31 + "\tf\n")
  sources, _ = pipeline.build_sources(dataclasses.replace(dcfg, paths=(str(train), str(valid))),
                                      ModelConfig(arch=arch))
  caplog.clear()
  with caplog.at_level("WARNING", logger=logger):
    sources["train"].batch(np.array([0, 0]))
  warned = [r.getMessage() for r in caplog.records if r.name == logger]
  if arch == "encoder_decoder":
    assert warned == []
    with caplog.at_level("WARNING", logger=logger):
      sources["train"].batch(np.array([1, 1]))
    (message,) = [r.getMessage() for r in caplog.records if r.name == logger]
    assert f"a pair (source '{'e' * 30}...', 31 tokens; target 1)" in message
  else:
    (message,) = warned
    assert "'cccccccccc', 10 tokens; target 10) is longer than seq_len=16 and is cut; its " \
           "row keeps 5 of its 11 target tokens (with eos); raise" in message
