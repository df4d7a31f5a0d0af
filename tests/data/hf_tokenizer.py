"""A word-level transformers ``tokenizer.json`` for the hf_json tests (needs ``tokenizers``)."""

import pytest


def word_level_tokenizer_json(path, words, *, specials=(), ids=None) -> str:
  """``words`` get ids 0, 1, ... in order (or ``ids``; the first word is also the unknown
  word), split on whitespace; ``specials`` are added special tokens after them. Saved at
  ``path``."""
  tokenizers = pytest.importorskip("tokenizers")
  vocab = dict(zip(words, range(len(words)) if ids is None else ids, strict=True))
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=words[0]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  if specials:
    tok.add_special_tokens(list(specials))
  tok.save(str(path))
  return str(path)
