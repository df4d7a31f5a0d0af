"""Tokenizers: byte-level (default, no files needed), sentencepiece and a
transformers ``tokenizer.json`` (both optional extras).

The byte tokenizer maps pad=0, bos=1, eos=2 and byte b -> b + 3, so its
vocabulary (259) and pad id (0) are ``ModelConfig``'s defaults.
"""

from __future__ import annotations

import json
import os
import stat

import numpy as np

from attnlab import extras
from attnlab.config import TOKENIZERS

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3


def not_a_regular_file(path: str) -> str | None:
  """What is at ``path`` when it is there but is no regular file ("a folder", "a FIFO",
  ...); None for a regular file (a symbolic link to one included) or for nothing there,
  which the reader names itself. Checked before a tokenizer file is opened: opening a FIFO
  waits for a writer (`attnlab decode` of a workdir with a FIFO for its tokenizer.json
  hung until 2026-12-07)."""
  try:
    mode = os.stat(path).st_mode
  except (OSError, ValueError):  # missing, a dangling link, a NUL in the path: the reader's
    return None
  if stat.S_ISREG(mode):
    return None
  kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
           (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
  return next((kind for test, kind in kinds if test(mode)), "another kind of file")


def check_regular_file(path: str, what: str) -> None:
  """ValueError naming ``path`` (``what`` it should be: "tokenizer.json") when something
  other than a regular file is there (``not_a_regular_file``)."""
  kind = not_a_regular_file(path)
  if kind is not None:
    raise ValueError(f"tokenizer_model={path!r} is {kind}, not a regular file: give the "
                     f"{what} file itself")


class ByteTokenizer:
  """UTF-8 bytes shifted past the three special ids."""

  vocab_size = 256 + BYTE_OFFSET
  pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

  def encode(self, text: str | bytes, *, add_special_tokens: bool = True) -> np.ndarray:
    """int32 ids of the UTF-8 bytes of ``text`` (no bos / eos either way)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32) + BYTE_OFFSET

  def decode(self, ids) -> str:
    """Text of ``ids``; specials are dropped, bad UTF-8 is replaced."""
    ids = np.asarray(ids).reshape(-1)
    ids = ids[(ids >= BYTE_OFFSET) & (ids < self.vocab_size)]
    return (ids - BYTE_OFFSET).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A trained sentencepiece model (``pip install sentencepiece``).

  Train one on a local corpus with ``train(...)``, which reserves pad=0, bos=1,
  eos=2. Another model must have bos=1 and eos=2, and pad=0 or no pad (e.g.
  sentencepiece's default layout, unk=0 bos=1 eos=2: its <unk> then shares
  id 0 with the padding, which the batches' lengths keep apart); any other
  layout (T5's: pad=0 eos=1 unk=2, no bos) is refused by name.
  """

  def __init__(self, model_path: str):
    spm = _import_sentencepiece()
    check_regular_file(model_path, "sentencepiece .model")
    try:
      self._sp = spm.SentencePieceProcessor(model_file=model_path)
    except (OSError, RuntimeError) as e:  # a missing or unreadable file: RuntimeError NOT_FOUND
      raise ValueError(f"tokenizer_model={model_path!r} is not a readable sentencepiece model: "
                       f"{e}") from e
    self.vocab_size = self._sp.get_piece_size()
    self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID
    sp = self._sp
    # The pad the model itself names (None for the default layout, whose id 0 is <unk>):
    # what an export to transformers calls pad_token_id.
    self.model_pad_id = None if sp.pad_id() == -1 else sp.pad_id()
    if sp.bos_id() != BOS_ID or sp.eos_id() != EOS_ID or sp.pad_id() not in (PAD_ID, -1):
      raise ValueError(
          f"tokenizer_model={model_path!r} has pad={sp.pad_id()}, bos={sp.bos_id()}, "
          f"eos={sp.eos_id()}, unk={sp.unk_id()} (-1: none); attnlab's sentencepiece tokenizer "
          f"needs bos={BOS_ID}, eos={EOS_ID} and pad={PAD_ID} or none "
          "(SentencePieceTokenizer.train reserves them); for another layout use a "
          "tokenizer.json (tokenizer='hf_json' with DataConfig.bos_id / eos_id)")

  @staticmethod
  def train(text_files: list[str], model_prefix: str, vocab_size: int = 4096) -> str:
    """Train a model on local text files; returns the .model path."""
    spm = _import_sentencepiece()
    spm.SentencePieceTrainer.train(
        input=",".join(text_files), model_prefix=model_prefix, vocab_size=vocab_size,
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=3, byte_fallback=True,
        # The default NFKC normalizer collapses runs of spaces and newlines,
        # which would erase the indentation of source code: keep text as is.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
    )
    return model_prefix + ".model"

  def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
    """int32 ids of ``text`` (sentencepiece adds no bos / eos either way)."""
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids) -> str:
    """Text of ``ids``; specials and ids outside the vocabulary (a model may have more rows
    than the tokenizer has pieces) are dropped."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1) if EOS_ID < i < self.vocab_size]
    return self._sp.decode(ids)


def _import_sentencepiece():
  return extras.require("sentencepiece", "tokenizer='sentencepiece'")


# A transformers tokenizer's files: tokenizer.json (what ``HFJsonTokenizer`` reads) and the
# two that transformers writes beside it; copied along with a workdir that holds them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_companion_files(folder: str, why: str) -> None:
  """ValueError naming a tokenizer_config.json / special_tokens_map.json in ``folder`` (beside
  a tokenizer.json) that is there but is no regular file (a folder, a FIFO): ``why`` says
  what reads or copies it. A missing one is no error (they are optional)."""
  for name in TOKENIZER_FILES[1:]:
    path = os.path.join(folder, name)
    kind = not_a_regular_file(path)
    if kind is not None:
      raise ValueError(f"{path} is {kind}, not a regular file: put the file back or move it "
                       f"away ({why})")


class HFJsonTokenizer:
  """A transformers ``tokenizer.json`` (``pip install tokenizers``).

  ``encode`` applies the file's own normalizer, pre-tokenizer, model and
  post-processor (which may add bos); the special ids come from the model's
  config.json, since tokenizer.json does not say which token is bos or eos.

  Args:
    path: the tokenizer.json file.
    bos_id, eos_id: special ids, or None when the model has none.
    pad_id: the id padding is filled with (the ModelConfig's pad_id).
  """

  def __init__(self, path: str, *, bos_id: int | None = None, eos_id: int | None = None,
               pad_id: int = 0):
    tokenizers = extras.require("tokenizers", "tokenizer='hf_json'")
    check_regular_file(path, "tokenizer.json")
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad files
      raise ValueError(f"tokenizer_model={path!r} is not a readable tokenizer.json: {e}") from e
    # The largest id + 1, not the token count: a vocabulary with gaps in its ids ({..., 4,
    # 300}) was counted 6 until 2026-12-06, so a model of 8 rows passed the data check while
    # the data held id 300, and decode dropped it.
    ids = self._tok.get_vocab(with_added_tokens=True).values()
    self.vocab_size = max(ids, default=-1) + 1
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

  def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
    """int32 ids of ``text``; with ``add_special_tokens`` the post-processor's bos / eos
    too (as transformers encodes a prompt). The training data is encoded without them:
    the pipeline lays out bos and eos itself."""
    return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids,
                      np.int32)

  def post_processor_bos(self) -> int | None:
    """The id the file's post-processor puts in front of every text (a Llama
    tokenizer.json's ``<s>``), or None when it adds nothing in front."""
    for probe in ("a", "hello", "0", " "):  # a text that encodes to at least one token
      plain = [int(i) for i in self.encode(probe, add_special_tokens=False)]
      if plain:
        full = [int(i) for i in self.encode(probe, add_special_tokens=True)]
        return full[0] if len(full) > len(plain) and full[1:1 + len(plain)] == plain else None
    return None

  def named_pad_id(self, path: str) -> int | None:
    """The id of the pad token that transformers' files beside ``path`` (this tokenizer.json)
    name: ``pad_token`` of tokenizer_config.json, else of special_tokens_map.json (a string or
    an added-token dict); None when neither names one or the token is not in the vocabulary.
    """
    folder = os.path.dirname(os.path.abspath(path))
    for name in TOKENIZER_FILES[1:]:
      if not_a_regular_file(os.path.join(folder, name)) is not None:  # a FIFO would block
        continue
      try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
          pad = json.load(f).get("pad_token")
      except (OSError, ValueError, AttributeError):  # absent, unreadable, not an object
        continue
      if isinstance(pad, dict):
        pad = pad.get("content")
      if isinstance(pad, str):
        return self._tok.token_to_id(pad)
    return None

  def decode(self, ids) -> str:
    """Text of ``ids``, special tokens (as tokenizer.json marks them) and ids outside the
    vocabulary (a model may have more rows than the tokenizer has tokens) dropped."""
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)
                             if 0 <= i < self.vocab_size], skip_special_tokens=True)


def make_tokenizer(kind: str = "byte", model_path: str = "", *, bos_id: int | None = None,
                   eos_id: int | None = None):
  """The tokenizer ``DataConfig.tokenizer`` names ("byte" | "sentencepiece" | "hf_json");
  ``model_path`` is its model file, ``bos_id`` / ``eos_id`` an hf_json tokenizer's ids."""
  if kind == "byte":
    return ByteTokenizer()
  if kind == "hf_json":
    return HFJsonTokenizer(model_path, bos_id=bos_id, eos_id=eos_id)
  if kind == "sentencepiece":
    return SentencePieceTokenizer(model_path)
  raise ValueError(f"tokenizer={kind!r} is not one of {', '.join(map(repr, TOKENIZERS))}")
