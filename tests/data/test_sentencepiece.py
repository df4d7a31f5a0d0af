"""The optional sentencepiece tokenizer (``pip install sentencepiece``): trained
on a local corpus, it keeps pad/bos/eos at 0/1/2, round-trips source code
exactly (indentation, blank lines, non-ASCII via byte fallback), and feeds
the LM pipeline. Skipped when sentencepiece is not installed (the test extra
installs it, so CI runs these)."""

import dataclasses
import re

import numpy as np
import pytest

from attnlab.config import DataConfig, ModelConfig
from attnlab.data import pipeline

spm = pytest.importorskip("sentencepiece")

VOCAB = 320


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("spm")
  files = []
  for k in range(2):
    path = root / f"mod{k}.py"
    path.write_text("".join(f"def function_{i}(x, y):\n    if x:\n        return x * {i} + y\n\n"
                            for i in range(150 * k, 150 * (k + 1))))
    files.append(str(path))
  from attnlab.data.tokenizer import SentencePieceTokenizer

  model = SentencePieceTokenizer.train(files, str(root / "spm"), vocab_size=VOCAB)
  return files, model


def test_special_ids_and_exact_round_trip(corpus):
  from attnlab.data.tokenizer import SentencePieceTokenizer

  _, model = corpus
  tok = pipeline.make_tokenizer("sentencepiece", model)
  assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == VOCAB
  proc = spm.SentencePieceProcessor(model_file=model)
  assert [proc.id_to_piece(i) for i in (tok.pad_id, tok.bos_id, tok.eos_id)] == [
      "<pad>", "<s>", "</s>"]
  assert (proc.unk_id(), proc.id_to_piece(3)) == (3, "<unk>")  # right after the specials
  text = "def f(a):\n\n    if a:\n        return  a  # déjà ✓\n"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.min() > tok.eos_id and ids.max() < VOCAB
  assert tok.decode(ids) == text
  # Specials and padding around the ids are dropped.
  assert tok.decode(np.concatenate([[1], ids, [2, 0, 0]])) == text
  # Ids past the vocabulary (a model's extra rows can sample them) are dropped, not an error.
  assert tok.decode(np.concatenate([ids, [tok.vocab_size, 10**6]])) == text
  assert tok.decode(ids[None]) == text  # a row with its batch axis
  # Subword pieces: fewer tokens than bytes on text like the corpus.
  assert len(tok.encode("def function_7(x, y):\n")) < len(b"def function_7(x, y):\n")


def test_lm_pipeline_with_sentencepiece(corpus):
  files, model = corpus
  dcfg = DataConfig(task="lm", paths=tuple(files), seq_len=32, batch_size=2,
                    tokenizer="sentencepiece", tokenizer_model=model)
  with pytest.raises(ValueError, match=f"smaller than the tokenizer's {VOCAB}"):
    pipeline.build_sources(dcfg, ModelConfig())  # the byte vocabulary, 259
  sources, tok = pipeline.build_sources(dcfg, ModelConfig(vocab_size=VOCAB))
  batch = next(pipeline.train_iterator(sources, dcfg))
  assert batch["tokens_BT"].shape == (2, 32)
  assert batch["tokens_BT"].max() < VOCAB
  np.testing.assert_array_equal(batch["tokens_BT"][:, 1:], batch["targets_BT"][:, :-1])
  assert "def function_" in tok.decode(batch["tokens_BT"][0])


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_a_synthetic_task_through_sentencepiece_is_never_cut(corpus, arch):
  """Its "▁" prefix makes a text one token longer than its characters: the seq_len check
  counts one more per text, so at the smallest seq_len it accepts every example fits
  (until 2026-12-04 it counted characters, and the longest examples were cut)."""
  _, model = corpus
  mcfg = ModelConfig(arch=arch, vocab_size=VOCAB)
  need = 2 * 13 + 2 if arch == "decoder_only" else 13 + 1  # (12 + 1) tokens a text
  dcfg = DataConfig(task="copy", max_len=12, seq_len=need, tokenizer="sentencepiece",
                    tokenizer_model=model)
  sources, tok = pipeline.build_sources(dcfg, mcfg)
  lengths = sources["train"].lengths(range(400))
  assert lengths.max() == 13  # the prefix: the bound is reached
  assert sources["train"].fits(range(400)).all()
  with pytest.raises(ValueError, match=re.escape(
      f"DataConfig.seq_len={need - 1} is too short for task='copy' with DataConfig.max_len=12: "
      f"needs {need} (with tokenizer='sentencepiece': a token per character, and one more per "
      "text)")):
    pipeline.build_sources(dataclasses.replace(dcfg, seq_len=need - 1), mcfg)


def test_an_unreadable_model_file_is_a_value_error_naming_it(tmp_path):
  """A workdir whose sentencepiece model was moved or overwritten: a ValueError naming the
  file (one line from the commands), not sentencepiece's RuntimeError."""
  missing = str(tmp_path / "gone.model")
  with pytest.raises(ValueError, match="^" + re.escape(
      f"tokenizer_model={missing!r} is not a readable sentencepiece model: NOT_FOUND")):
    pipeline.make_tokenizer("sentencepiece", missing)
  garbage = tmp_path / "bad.model"
  garbage.write_text("not a model")
  with pytest.raises(ValueError, match="^" + re.escape(
      f"tokenizer_model={str(garbage)!r} is not a readable sentencepiece model: ")):
    pipeline.make_tokenizer("sentencepiece", str(garbage))


def test_train_defaults_to_a_vocabulary_of_4096(monkeypatch, tmp_path):
  """``SentencePieceTokenizer.train(files, prefix)`` asks sentencepiece for 4096 pieces
  (the trainer is stubbed: a corpus for 4096 pieces would take seconds to train)."""
  from attnlab.data.tokenizer import SentencePieceTokenizer

  seen = {}
  monkeypatch.setattr(spm.SentencePieceTrainer, "train", lambda **kw: seen.update(kw))
  prefix = str(tmp_path / "spm")
  assert SentencePieceTokenizer.train(["a.txt", "b.txt"], prefix) == prefix + ".model"
  assert (seen["input"], seen["model_prefix"], seen["vocab_size"]) == (
      "a.txt,b.txt", prefix, 4096)


def _train_spm(files, prefix, **ids):
  spm.SentencePieceTrainer.train(input=",".join(files), model_prefix=prefix, vocab_size=VOCAB,
                                 minloglevel=2, **ids)
  return prefix + ".model"


def test_a_model_of_another_layout_is_refused_by_name_the_default_layout_is_read(
    corpus, tmp_path):
  """A model whose bos / eos are not 1 / 2 (T5's layout: pad 0, eos 1, unk 2, no bos) would
  have been read with the wrong eos: refused, naming its ids. sentencepiece's default layout
  (unk 0, bos 1, eos 2, no pad) is read; its <unk> shares id 0 with padding, and a pair's
  source holding one keeps it (segment ids from lengths)."""
  files, _ = corpus
  t5 = _train_spm(files, str(tmp_path / "t5"), pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
  with pytest.raises(ValueError, match="^" + re.escape(
      f"tokenizer_model={t5!r} has pad=0, bos=-1, eos=1, unk=2 (-1: none); attnlab's "
      "sentencepiece tokenizer needs bos=1, eos=2 and pad=0 or none "
      "(SentencePieceTokenizer.train reserves them); for another layout use a tokenizer.json "
      "(tokenizer='hf_json' with DataConfig.bos_id / eos_id)") + "$"):
    pipeline.make_tokenizer("sentencepiece", t5)
  for prefix, ids, named in (("swapped", dict(pad_id=3, unk_id=0), "pad=3, bos=1, eos=2, unk=0"),
                             ("eos3", dict(eos_id=3, unk_id=2), "pad=-1, bos=1, eos=3, unk=2"),
                             ("bos0", dict(bos_id=0, unk_id=3), "pad=-1, bos=0, eos=2, unk=3")):
    with pytest.raises(ValueError, match=re.escape(f"has {named} (-1: none)")):
      pipeline.make_tokenizer("sentencepiece", _train_spm(files, str(tmp_path / prefix), **ids))
  default = _train_spm(files, str(tmp_path / "default"))
  tok = pipeline.make_tokenizer("sentencepiece", default)
  # An export to transformers names no pad for it (id 0 is <unk>; until 2026-12-04 it wrote
  # pad_token_id 0), and attnlab's own layout's pad 0.
  from attnlab.commands.convert import export_special_ids
  from attnlab.config import DataConfig

  assert tok.model_pad_id is None
  for model, pad in ((default, None), (corpus[1], 0)):
    dcfg = DataConfig(tokenizer="sentencepiece", tokenizer_model=model)
    assert export_special_ids(dcfg) == (1, 2, pad)
  ids = tok.encode("def 漢(x):")  # a character the corpus never had: <unk>, id 0
  assert 0 in ids.tolist()
  batch = pipeline.PairBatches([("def 漢(x):", "x")], tok, seq_len=16, arch="encoder_decoder",
                               loss_on_prompt=False).batch([0])
  n = len(ids) + 1  # the source and its eos
  np.testing.assert_array_equal(batch["src_BS"][0, :n], [*ids, tok.eos_id])
  assert batch["src_segment_ids_BS"][0].tolist() == [1] * n + [0] * (16 - n)
