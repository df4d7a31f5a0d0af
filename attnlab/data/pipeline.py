"""Batches for training and evaluation, from a ``DataConfig``.

Every batch is a pure function of (config, position): the iterator's state is
the position of the next example in the training stream (and the batch count),
saved in checkpoints with the fields of the config that decide which example
is the i-th, so a resumed run reads exactly the examples an uninterrupted one
would have, and a resume under another stream is refused (``DataStateError``).
Finite sources are reshuffled every epoch by a permutation seeded with (seed,
epoch).

Batch layouts (numpy, int32 unless noted):
  decoder-only: tokens_BT, targets_BT, segment_ids_BT, positions_BT,
    loss_mask_BT (float32).
  encoder-decoder: src_BS, src_segment_ids_BS, tgt_in_BT, targets_BT,
    tgt_segment_ids_BT, loss_mask_BT (float32).
  validation batches (``validation_batches``) add example_mask_B (bool): False
    on the rows that only fill up the last batch.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from attnlab.config import DataConfig, ModelConfig, absolute_path
from attnlab.data import packing, text
from attnlab.data.synthetic import SyntheticPairs
from attnlab.data.tokenizer import make_tokenizer

log = logging.getLogger(__name__)


class PackedText:
  """A text corpus packed into rows of T tokens (see data/packing.py)."""

  def __init__(self, docs: list[str], tokenizer, seq_len: int, seed: int,
               what: str = "the corpus", files: list[str] | None = None):
    self.files = files  # the corpus files the documents were read from (the data state's)
    order = np.random.default_rng([seed, 7]).permutation(len(docs))
    ids = [tokenizer.encode(docs[i], add_special_tokens=False) for i in order]
    self.tokens_Y, self.doc_ids_Y = packing.concat_documents(ids, tokenizer.bos_id,
                                                              tokenizer.eos_id)
    self.seq_len = seq_len
    self.size = packing.num_rows(len(self.tokens_Y), seq_len)
    if self.size == 0:
      raise ValueError(f"{what} has {len(self.tokens_Y)} tokens, fewer than one row of "
                       f"seq_len={seq_len} needs ({seq_len + 1})")

  def batch(self, indices) -> dict[str, np.ndarray]:
    return packing.packed_rows(self.tokens_Y, self.doc_ids_Y, np.asarray(indices), self.seq_len)


def prompt_ids(tokenizer, text: str, arch: str, task: str) -> np.ndarray:
  """``text`` as the model read such input in training (``PackedText``, ``PairBatches``):
  a decoder-only LM ("lm") reads ``[bos] text``, a decoder-only pair task ("tsv", "copy",
  ...) ``[bos] source [eos]`` and then writes the target, an encoder-decoder's source is
  ``source [eos]``. The text is encoded without a tokenizer.json's post-processor (the bos
  added here is the model's; a tokenizer without a bos starts with the text)."""
  ids = list(tokenizer.encode(text, add_special_tokens=False))
  if arch == "encoder_decoder":
    return np.asarray(ids + [tokenizer.eos_id], np.int32)
  head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  tail = [] if task == "lm" else [tokenizer.eos_id]
  return np.asarray(head + ids + tail, np.int32)


def layout_fits(arch: str, source_len, target_len, seq_len: int) -> np.ndarray:
  """Whether examples of these source / target lengths fit rows of ``seq_len`` with their
  eos: an encoder-decoder's source and target rows hold each with its eos (the target's
  input also its bos); a decoder-only row holds [bos] source [eos] target [eos], whose
  first T + 1 tokens are the inputs and the targets."""
  source_len, target_len = np.asarray(source_len), np.asarray(target_len)
  if arch == "encoder_decoder":
    return np.maximum(source_len, target_len) <= seq_len - 1
  return source_len + target_len + 3 <= seq_len + 1


class PairBatches:
  """(source, target) text pairs laid out for one of the two architectures.

  Encoder-decoder: src = source [eos]; tgt_in = [bos] target; targets =
  target [eos]. Decoder-only: [bos] source [eos] target [eos] shifted by
  one, the loss on the target part only unless ``loss_on_prompt``.
  """

  def __init__(self, pairs, tokenizer, *, seq_len: int, arch: str, loss_on_prompt: bool,
               warn_cut: str | None = None):
    self.pairs, self.tok, self.seq_len, self.arch = pairs, tokenizer, seq_len, arch
    self.loss_on_prompt = loss_on_prompt
    self.size = len(pairs) if isinstance(pairs, list) else pairs.size
    # The split named in a warning at the first example the layout cuts (once; the
    # training split's: a validation example cut is counted by the evaluation). Cut
    # without a word until 2026-12-04.
    self.warn_cut = warn_cut

  def _warn_if_cut(self, i, s, t) -> None:
    if self.warn_cut is None or layout_fits(self.arch, len(s), len(t), self.seq_len):
      return
    left = ""
    if self.arch == "decoder_only":
      kept = max(0, self.seq_len - len(s) - 1)  # a cut row: fewer than len(t) + 1
      left = (f"; its row keeps {kept} of its {len(t) + 1} target tokens (with eos)"
              + (": it trains on nothing" if kept == 0 and not self.loss_on_prompt else ""))
    source = self.pairs[int(i)][0]
    log.warning("%s: a pair (source %r, %d tokens; target %d) is longer than seq_len=%d and "
                "is cut%s; raise DataConfig.seq_len to keep such pairs whole (this warning is "
                "shown once)", self.warn_cut, source[:30] + ("..." if len(source) > 30 else ""),
                len(s), len(t), self.seq_len, left)
    self.warn_cut = None

  def _ids(self, i):
    src, tgt = self.pairs[int(i)]
    # Without the tokenizer's own bos / eos: the layout below adds them.
    return (self.tok.encode(src, add_special_tokens=False),
            self.tok.encode(tgt, add_special_tokens=False))

  def lengths(self, indices) -> np.ndarray:
    """int32 [B, 2]: each example's source and target length in tokens (without bos /
    eos), before the layout cuts them."""
    return np.asarray([[len(x) for x in self._ids(i)] for i in indices],
                      np.int32).reshape(-1, 2)

  def fits(self, indices=None, *, lengths=None) -> np.ndarray:
    """bool [B]: whether each example's layout holds all of its source and target (the
    layout below cuts longer ones, keeping an encoder-decoder's eos, so the batch alone
    cannot tell); of ``indices``, or of their ``lengths()``."""
    if (indices is None) == (lengths is None):
      raise ValueError("PairBatches.fits takes the examples' indices or their lengths (one)")
    src, tgt = (self.lengths(indices) if lengths is None else np.asarray(lengths)).T
    return layout_fits(self.arch, src, tgt, self.seq_len)

  def batch(self, indices) -> dict[str, np.ndarray]:
    B, T = len(indices), self.seq_len
    pad, bos, eos = self.tok.pad_id, self.tok.bos_id, self.tok.eos_id
    # Masks and segment ids come from the lengths, not from comparing tokens with pad: a
    # tokenizer.json may give a real token the pad id (0 is "!" in GPT-2's).
    if self.arch == "encoder_decoder":
      out = {k: np.full((B, T), pad, np.int32) for k in ("src_BS", "tgt_in_BT", "targets_BT")}
      out["src_segment_ids_BS"] = np.zeros((B, T), np.int32)
      out["tgt_segment_ids_BT"] = np.zeros((B, T), np.int32)
      cut_rows = []  # rows whose target was cut: their eos sits at T - 1
      for b, i in enumerate(indices):
        # Too-long examples are cut: the test below checks synthetic ones fit.
        s, t = self._ids(i)
        self._warn_if_cut(i, s, t)
        if len(t) > T - 1:
          cut_rows.append(b)
        s, t = np.append(s[:T - 1], eos), t[:T - 1]
        out["src_BS"][b, :len(s)] = s
        out["src_segment_ids_BS"][b, :len(s)] = 1
        out["tgt_in_BT"][b, :len(t) + 1] = np.insert(t, 0, bos)
        out["targets_BT"][b, :len(t) + 1] = np.append(t, eos)
        out["tgt_segment_ids_BT"][b, :len(t) + 1] = 1
      out["loss_mask_BT"] = out["tgt_segment_ids_BT"].astype(np.float32)
      # A cut target's eos is where the row ends, not where the target does: not a label
      # (it taught the model to stop there; the decoder-only layout drops it with the cut).
      out["loss_mask_BT"][cut_rows, T - 1] = 0.0
      return out
    tokens = np.full((B, T + 1), pad, np.int32)
    mask = np.zeros((B, T), np.float32)
    seg = np.zeros((B, T), np.int32)
    for b, i in enumerate(indices):
      s, t = self._ids(i)
      self._warn_if_cut(i, s, t)
      seq = np.concatenate([[bos], s, [eos], t, [eos]])[:T + 1]
      tokens[b, :len(seq)] = seq
      seg[b, :min(len(seq), T)] = 1  # inputs seq[:-1], and the last eos when it fits
      first = 0 if self.loss_on_prompt else len(s) + 1  # targets[j] = seq[j + 1]
      mask[b, first:len(seq) - 1] = 1.0
    return dict(tokens_BT=tokens[:, :-1], targets_BT=tokens[:, 1:], segment_ids_BT=seg,
                positions_BT=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                loss_mask_BT=mask)


class DataStateError(ValueError):
  """A saved iterator state belongs to another training stream than this config's.

  ``fields``: the stream's keys that differ (``"files"``: an LM corpus matched other files
  under the same config)."""

  def __init__(self, message: str, fields: tuple[str, ...] = ()):
    super().__init__(message)
    self.fields = fields


# The DataConfig fields that decide which example is the i-th of the training
# stream, per task. The others (batch_size, loss_on_prompt; for pairs seq_len and
# the tokenizer) change how examples are cut into batches or laid out, not which
# ones come next, so a resume may change them. The tokenizer model's path is left
# out: a moved workdir names its own tokenizer.json by another path.
_STREAM_FIELDS = {
  "lm": ("paths", "validation_percent", "max_files", "seq_len", "tokenizer", "bos_id",
         "eos_id"),
  "tsv": ("paths", "validation_percent"),
}
_SYNTHETIC_STREAM_FIELDS = ("min_len", "max_len", "vocab_chars")


def stream_fields(dcfg: DataConfig, files: list[str] | None = None) -> dict:
  """The fields of ``dcfg`` that decide which example is the i-th of its training
  stream, JSON-ready (saved with the iterator's state).

  ``files``: an LM corpus's training files as read (``training_files``), saved as
  ``"files"`` (the default corpus's relative to the standard library's folder): a resume
  compares them rather than the ``paths`` patterns when both states have them."""
  names = ("task", "seed") + _STREAM_FIELDS.get(dcfg.task, _SYNTHETIC_STREAM_FIELDS)
  out = {n: getattr(dcfg, n) for n in names}
  if files is not None and dcfg.task == "lm":
    out["files"] = _file_names(files, stdlib=not dcfg.paths)
  if "paths" in out:
    # Saved as the files they name from this working directory: a resume from another
    # directory compares them as they were meant (until 2026-12-06 a relative pattern was
    # saved as spelt and resolved from the resuming process's directory: the same pattern
    # there, another corpus, was taken for the same stream).
    out["paths"] = [absolute_path(p) for p in out["paths"]]
  if dcfg.task == "tsv" and len(dcfg.paths) > 1:
    # A second file is the validation set: the first is the whole training data, and
    # neither the validation file nor validation_percent decides the stream.
    out["paths"] = out["paths"][:1]
    out["validation_file"] = True
    del out["validation_percent"]
  return out


class BatchIterator:
  """Deterministic, checkpointable batches of a source.

  Batch n of a run that never changed its batch size holds examples
  [n * B, (n + 1) * B) of the stream (each epoch of a finite source is a new
  permutation); the state is the next example's position, so a resume with
  another batch size continues at the same example.

  Args:
    source: has ``size`` (None = endless) and ``batch(indices)``.
    batch_size: B.
    seed: the per-epoch shuffle; None = source order (validation).
    index: start at batch ``index`` (example ``index * batch_size``).
    stream: what ``stream_fields`` gives for the config; saved with the state
      and compared on ``set_state`` (None: not checked).
  """

  def __init__(self, source, batch_size: int, seed: int | None, index: int = 0,
               stream: dict | None = None):
    self.source, self.batch_size, self.seed, self.index = source, batch_size, seed, index
    self.example = index * batch_size
    self.stream = stream
    if source.size is not None and source.size < batch_size:
      raise ValueError(f"batch_size={batch_size} is larger than the data ({source.size} rows)")
    self._perm_epoch, self._perm = None, None

  def _example_ids(self, first: int) -> np.ndarray:
    ids = np.arange(first, first + self.batch_size)
    size = self.source.size
    if size is None:
      return ids
    out = np.empty_like(ids)
    for j, g in enumerate(ids):
      epoch, k = divmod(int(g), size)
      if self.seed is None:
        out[j] = k
        continue
      if self._perm_epoch != epoch:
        self._perm = np.random.default_rng([self.seed, epoch]).permutation(size)
        self._perm_epoch = epoch
      out[j] = self._perm[k]
    return out

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = self.source.batch(self._example_ids(self.example))
    self.index += 1
    self.example += self.batch_size
    return batch

  def get_state(self) -> dict:
    state = {"index": int(self.index), "example": int(self.example),
             "batch_size": int(self.batch_size)}
    if self.stream is not None:
      state["stream"] = self.stream
    return state

  def set_state(self, state: dict) -> None:
    """Continue where ``state`` (a ``get_state``) stopped.

    A state without ``example`` (saved before 2026-12-03; ``complete_state`` fills it
    in from the config it was saved under) is a batch index under this batch size.

    Raises:
      DataStateError: ``state`` was saved under another training stream (its
        ``stream`` differs from this iterator's); names the fields that differ.
    """
    saved = state.get("stream")
    if saved is not None and self.stream is not None and not same_stream(saved, self.stream):
      files = _both_have_files(saved, self.stream)
      a, b = _comparable(saved, files), _comparable(self.stream, files)
      keys = tuple(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
      changed = [_change(k, saved.get(k), self.stream.get(k)) for k in keys]
      raise DataStateError(
          f"the saved data position belongs to another training stream ({', '.join(changed)})",
          keys)
    self.index = int(state["index"])
    self.example = int(state["example"]) if "example" in state else self.index * self.batch_size


def _file_names(files: list[str], *, stdlib: bool) -> list[str]:
  """Corpus files as a data state names them: absolute (``text.expand_paths`` made them so);
  the standard library's (the default corpus) relative to its folder, so that one library
  installed under another prefix is the same stream."""
  if not stdlib:
    return list(files)
  root = text.stdlib_root()
  return [os.path.join("<stdlib>", os.path.relpath(f, root)) for f in files]


def training_files(dcfg: DataConfig) -> list[str] | None:
  """The files of an LM corpus's training split as ``build_sources`` reads them now (None
  for the other tasks)."""
  if dcfg.task != "lm":
    return None
  return text.lm_files(dcfg.paths, validation_percent=dcfg.validation_percent,
                       max_files=dcfg.max_files)["train"]


def complete_state(state: dict, saved: DataConfig) -> dict:
  """A state saved before the position was kept (``{"index": n}``: checkpoints before
  2026-12-03, weights-only conversions) in today's layout, from ``saved``, the DataConfig
  of the run that wrote it (the workdir's config.gin, written before this resume): its
  index counts batches of that size, and a resume under another stream is refused as
  for a new state. A new state is returned as it is."""
  if "example" in state:
    return state
  return {**state, "example": int(state["index"]) * saved.batch_size,
          "batch_size": saved.batch_size, "stream": stream_fields(saved)}


def _comparable(stream: dict, files: bool) -> dict:
  """``stream`` as compared: with ``files`` (both states have them) the files matched
  rather than the ``paths`` patterns; else without them, its ``paths`` as absolute,
  normalized paths (relative ones taken from the working directory, ``~`` expanded), so
  that two spellings of the same files ("data/a.txt", "./data/a.txt",
  "/home/me/run/data/a.txt") are one stream."""
  if files:
    return {k: v for k, v in stream.items() if k != "paths"}
  stream = {k: v for k, v in stream.items() if k != "files"}
  paths = stream.get("paths")
  if paths is None:
    return stream
  return {**stream, "paths": [absolute_path(p) for p in paths]}


def _both_have_files(a: dict, b: dict) -> bool:
  # A state saved before 2026-12-07 has no "files": compared by its patterns as it was.
  return "files" in a and "files" in b


def same_stream(a: dict, b: dict) -> bool:
  """Whether two ``stream_fields`` name the same training stream."""
  files = _both_have_files(a, b)
  return _comparable(a, files) == _comparable(b, files)


def _show(v):
  return repr(tuple(v)) if isinstance(v, list) else repr(v)


def _files_change(before: list[str], after: list[str]) -> str:
  """The files of an LM corpus that a resume would read differently: those added and gone."""
  def some(names):
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "") or "none"
  new = sorted(set(after) - set(before))
  gone = sorted(set(before) - set(after))
  return (f"DataConfig.paths: {len(before)} training files -> {len(after)} (new: {some(new)}; "
          f"gone: {some(gone)})")


def _change(key, before, after) -> str:
  """One changed field of a stream, named as the DataConfig field it comes from."""
  if key == "files":
    return _files_change(before or [], after or [])
  if key == "validation_file":  # a tsv stream's second path (see stream_fields)
    has = lambda v: "a validation file" if v else "no validation file"
    return f"DataConfig.paths: {has(before)} -> {has(after)}"
  return f"DataConfig.{key}: {_show(before)} -> {_show(after)}"


def continue_state(state: dict, dcfg: DataConfig) -> dict:
  """``state`` (``complete_state``'s layout, saved under some config) as the start of a
  new run under ``dcfg`` (``attnlab convert-heads``): the same position when the
  training stream is the same, its first example otherwise. The batch count starts
  again at 0."""
  try:
    files = training_files(dcfg)
  except FileNotFoundError:  # a conversion needs no corpus (the new run will, to train):
    files = None             # its stream is then compared by its patterns
  stream = stream_fields(dcfg, files)
  example = int(state["example"]) if same_stream(state["stream"], stream) else 0
  return {"index": 0, "example": example, "batch_size": dcfg.batch_size, "stream": stream}


def _split_seed(dcfg: DataConfig, split: str) -> int:
  """The training split follows ``DataConfig.seed``; the validation split is the
  same for every seed (laid out as with seed 0), so runs that differ only in
  their seed are evaluated on the same text."""
  return dcfg.seed if split == "train" else 0


def _split_named(split: str, files: list[str], dcfg: DataConfig) -> str:
  shown = ", ".join(files[:3]) + (f", ... ({len(files)} files)" if len(files) > 3 else "")
  return f"the {split} split ({shown}; validation_percent={dcfg.validation_percent})"


def _warn_overlap(dcfg: DataConfig) -> None:
  log.warning("the validation split of DataConfig.paths=%r (validation_percent=%d) is "
              "training data: nothing could be held out, so the validation loss and scores "
              "measure the training set", dcfg.paths, dcfg.validation_percent)


def check_data_fits_model(dcfg: DataConfig, mcfg: ModelConfig, tok) -> None:
  """ValueError naming what of the data config the model cannot take (its vocabulary, its
  positions, its architecture, the tokenizer's special ids), before any data is read."""
  if tok.vocab_size > mcfg.vocab_size:
    raise ValueError(f"vocab_size={mcfg.vocab_size} is smaller than the tokenizer's "
                     f"{tok.vocab_size}")
  if dcfg.seq_len > mcfg.max_len:
    raise ValueError(f"seq_len={dcfg.seq_len} is longer than ModelConfig.max_len="
                     f"{mcfg.max_len}, the positions the model has")
  if dcfg.loss_on_prompt and mcfg.arch == "encoder_decoder":  # ignored until 2026-12-04
    raise ValueError("DataConfig.loss_on_prompt=True does not apply to an encoder-decoder "
                     "(its source is the encoder's input, never a target); it is for a "
                     "decoder-only model")
  if tok.bos_id is None or tok.eos_id is None:
    raise ValueError(f"training data is laid out with bos and eos: set DataConfig.bos_id "
                     f"(={dcfg.bos_id}) and eos_id (={dcfg.eos_id}) of the hf_json tokenizer")
  for name, i in (("bos_id", tok.bos_id), ("eos_id", tok.eos_id)):
    if i >= mcfg.vocab_size:  # a NaN loss at the first step until 2026-12-04
      raise ValueError(f"DataConfig.{name}={i} is outside the model's vocabulary "
                       f"(ModelConfig.vocab_size={mcfg.vocab_size}): give the tokenizer's id")
  if dcfg.task == "lm" and mcfg.arch != "decoder_only":
    raise ValueError("task='lm' needs arch='decoder_only'")


def build_sources(dcfg: DataConfig, mcfg: ModelConfig, tokenizer=None):
  """Train and validation sources and the tokenizer for a data config.

  ``tokenizer``: the data config's tokenizer when the caller has made it
  already (a tokenizer model file is then read once); made here otherwise.
  """
  tok = tokenizer
  if tok is None:
    tok = make_tokenizer(dcfg.tokenizer, dcfg.tokenizer_model, bos_id=dcfg.bos_id,
                         eos_id=dcfg.eos_id)
  check_data_fits_model(dcfg, mcfg, tok)
  if dcfg.task == "lm":
    files = text.lm_files(dcfg.paths, validation_percent=dcfg.validation_percent,
                          max_files=dcfg.max_files)
    docs = {split: [text.read_text(f) for f in fs] for split, fs in files.items()}
    names = {split: fs for split, fs in files.items()}
    if len(files["train"]) == 1 and files["train"] == files["validation"]:
      # One file: its last lines are the validation text (it was all of it, the training
      # text too).
      docs["train"][0], docs["validation"][0] = text.split_lines(docs["train"][0],
                                                                 dcfg.validation_percent)
      if docs["train"] != docs["validation"]:
        names = {"train": [f"the first lines of {files['train'][0]}"],
                 "validation": [f"the last lines of {files['train'][0]}"]}
    if docs["train"] == docs["validation"]:  # nothing held out
      _warn_overlap(dcfg)
    return {split: PackedText(docs[split], tok, dcfg.seq_len, _split_seed(dcfg, split),
                              what=_split_named(split, names[split], dcfg),
                              files=files[split])
            for split in files}, tok
  if dcfg.task == "tsv":
    pairs = text.tsv_splits(dcfg.paths, dcfg.validation_percent)
    if pairs["validation"][0] is pairs["train"][0]:  # nothing held out: a training pair
      _warn_overlap(dcfg)
  else:
    pairs = {split: SyntheticPairs(dcfg.task, seed=_split_seed(dcfg, split), split=split,
                                   min_len=dcfg.min_len,
                                   max_len=dcfg.max_len, vocab_chars=dcfg.vocab_chars)
             for split in ("train", "validation")}
    src_len, tgt_len = pairs["train"].longest()  # characters: the byte tokenizer's tokens
    extra = ""
    if dcfg.tokenizer != "byte":
      # A subword tokenizer takes a synthetic text's ASCII characters one token or fewer
      # each, and may add one in front (sentencepiece's "▁"): until 2026-12-04 its examples
      # were counted as characters and the longest were cut from their training rows.
      src_len, tgt_len = src_len + 1, tgt_len + 1
      extra = (f" (with tokenizer={dcfg.tokenizer!r}: a token per character, and one "
               "more per text)")
    need = src_len + tgt_len + 2 if mcfg.arch == "decoder_only" else max(src_len, tgt_len) + 1
    if need > dcfg.seq_len:
      # DataConfig's max_len, not the model's (named plainly since 2026-12-04)
      raise ValueError(f"DataConfig.seq_len={dcfg.seq_len} is too short for task="
                       f"{dcfg.task!r} with DataConfig.max_len={dcfg.max_len}: needs "
                       f"{need}{extra}")
  kw = dict(seq_len=dcfg.seq_len, arch=mcfg.arch, loss_on_prompt=dcfg.loss_on_prompt)
  return {split: PairBatches(p, tok, **kw, warn_cut=(
      f"the training split of DataConfig.paths={dcfg.paths!r}" if split == "train" else None))
          for split, p in pairs.items()}, tok


def train_iterator(sources, dcfg: DataConfig) -> BatchIterator:
  size = sources["train"].size
  if size is not None and size < dcfg.batch_size:
    raise ValueError(f"DataConfig.batch_size={dcfg.batch_size} is larger than the training "
                     f"split of task={dcfg.task!r}, paths={dcfg.paths!r} ({size} rows of "
                     f"seq_len={dcfg.seq_len}): lower batch_size or give more data")
  # A source's ``files`` (PackedText's): the corpus files it read, which the state saves;
  # a source of one's own without them is compared by its config's paths.
  return BatchIterator(sources["train"], dcfg.batch_size, dcfg.seed,
                       stream=stream_fields(dcfg, getattr(sources["train"], "files", None)))


EXAMPLE_MASK = "example_mask_B"
# bool [B], in the validation batches of (source, target) pairs: the example is laid out
# whole (``PairBatches.fits``); one that seq_len cut is not scored by eval.
EXAMPLE_FITS = "example_fits_B"
# int32 [B], beside it: each example's source and target length in tokens (without bos /
# eos), which eval splits a row by: a text may hold the eos id itself (a tokenizer.json
# encodes "</s>" in a text as its special token), so the row's first eos need not end the
# source.
SOURCE_LENGTH, TARGET_LENGTH = "source_len_B", "target_len_B"


def physical_memory_bytes() -> int | None:
  """This machine's physical memory (None where the OS does not say)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def batch_token_bytes(dcfg: DataConfig) -> int:
  """A lower bound of one host batch's bytes: its token ids and targets, int32 [B, T + 1]
  twice (the memory checks of a batch and of the validation batches)."""
  return 2 * 4 * dcfg.batch_size * (dcfg.seq_len + 1)


def check_validation_fits_memory(dcfg: DataConfig, num_batches: int,
                                 memory: int | None = None) -> None:
  """ValueError naming eval_batches when ``num_batches`` validation batches of a set without
  an end (a synthetic task's) pass this machine's memory: a run makes them once and keeps
  them, each at least int32 [B, T + 1] twice (token ids and targets). Until 2026-12-06
  ``TrainConfig.eval_batches=10**9`` built batches until memory ran out."""
  memory = physical_memory_bytes() if memory is None else memory
  need = num_batches * batch_token_bytes(dcfg)
  if memory is not None and need > memory:
    raise ValueError(f"TrainConfig.eval_batches={num_batches} validation batches of "
                     f"batch_size={dcfg.batch_size} x seq_len={dcfg.seq_len} take at least "
                     f"{need / 2**30:.1f} GiB on the host (int32 token ids and targets, kept "
                     f"for every evaluation), more than this machine's memory "
                     f"({memory / 2**30:.1f} GiB): give fewer eval_batches")


def validation_batches(sources, dcfg: DataConfig, num_batches: int,
                       multiple_of: int = 1) -> list[dict]:
  """The first ``num_batches`` validation batches, in a fixed order.

  Every batch has one shape, ``batch_size`` rows (or, for validation data
  smaller than a batch, its rows rounded up to a multiple of ``multiple_of``:
  the data shards a batch is split over), and ``EXAMPLE_MASK`` (bool [B]):
  which rows are examples (and for (source, target) pairs ``EXAMPLE_FITS``).
  The rows of a finite validation set that the
  batches reach are all read: the last batch, if the rows end inside it, is
  filled up with repeats of the first rows, whose ``EXAMPLE_MASK`` is False and
  whose loss mask is 0 (fewer batches than ``num_batches`` if the data ends).
  """
  src = sources["validation"]
  if src.size == 0:
    raise ValueError("the validation data has no rows")
  bs = dcfg.batch_size
  if src.size is not None and src.size < bs:
    bs = -(-src.size // multiple_of) * multiple_of
  n = num_batches
  if src.size is not None:
    n = min(num_batches, -(-src.size // bs))
  else:  # no end: n batches are made
    check_validation_fits_memory(dcfg, n)
  out = []
  for i in range(n):
    ids = np.arange(i * bs, (i + 1) * bs)
    if src.size is None:
      real_B = np.ones(bs, bool)
    else:  # rows past the end: the first rows again
      real_B, ids = ids < src.size, ids % src.size
    batch = dict(src.batch(ids))
    if not real_B.all():
      batch["loss_mask_BT"] = batch["loss_mask_BT"] * real_B[:, None].astype(
          batch["loss_mask_BT"].dtype)
    batch[EXAMPLE_MASK] = real_B
    if isinstance(src, PairBatches):
      lengths = src.lengths(ids)
      batch[EXAMPLE_FITS] = src.fits(lengths=lengths)
      batch[SOURCE_LENGTH], batch[TARGET_LENGTH] = lengths[:, 0], lengths[:, 1]
    out.append(batch)
  return out
