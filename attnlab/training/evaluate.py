"""Evaluation: validation loss / perplexity, and for seq2seq tasks the decoded
outputs scored by exact match (and corpus BLEU for translation).

Outputs come from ``attnlab.generate`` (KV cache, greedy): an
encoder-decoder decodes from its source (its lengths as in training), a
decoder-only model continues the prompt ``[bos] source [eos]``. Every batch
is decoded with the same shapes (the full row width and a fixed number of new
tokens), so generation compiles once per evaluation setup, not once per batch.
"""

from __future__ import annotations

import json
import logging
import math
import os

import jax
import numpy as np

from attnlab import extras
from attnlab.config import DecodeConfig
from attnlab.data.pipeline import (
    EXAMPLE_FITS,
    EXAMPLE_MASK,
    SOURCE_LENGTH,
    TARGET_LENGTH,
    layout_fits,
)
from attnlab.decoding.generate import generate
from attnlab.training.metrics import perplexity, write_text_atomically

log = logging.getLogger(__name__)


def _until_eos(ids, eos_id: int) -> list[int]:
  ids = [int(i) for i in np.asarray(ids)]
  return ids[:ids.index(eos_id)] if eos_id in ids else ids


def host_params(params):
  """A host (numpy) copy of a possibly multi-process sharded parameter tree.

  Arrays spread over other processes' devices cannot be read locally: they
  are gathered (every process must call this, as it does in the loop).
  """
  from jax.experimental import multihost_utils

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

  return jax.tree.map(one, params)


def _split_rows(batch: dict, arch: str, eos_id: int, pad_id: int):
  """(prompt_BT, prompt_lengths_B or None, [source ids], [reference ids], fits_B) of a
  batch.

  Encoder-decoder: the prompt is the source, its lengths those of the batch's
  ``src_segment_ids_BS`` (None without them: pad-masked). Decoder-only rows are
  ``[bos] source [eos] target [eos]``: the prompt is the row up to and
  including the source's eos, found by the batch's ``SOURCE_LENGTH`` (the
  pipeline's validation batches) or else as the first eos after the bos (the bos
  may be the eos id: GPT-2's), right-padded with ``pad_id`` to the longest prompt.
  The references are ``TARGET_LENGTH`` tokens long where the batch says so.
  ``fits_B``: the row holds its source's eos and its target's (an example cut by
  ``seq_len`` is neither a prompt nor a reference); always True for an
  encoder-decoder, whose layout keeps the eos when it cuts (the batch's
  ``EXAMPLE_FITS`` tells those apart).
  """
  targets_BT = np.asarray(batch["targets_BT"])
  B, T = targets_BT.shape
  # The examples' own lengths (the pipeline's validation batches carry them): a text may
  # hold the eos id (a tokenizer.json's "</s>" in it), so the first eos need not end it.
  src_len_B, tgt_len_B = batch.get(SOURCE_LENGTH), batch.get(TARGET_LENGTH)
  if arch == "encoder_decoder":  # the layout keeps both eos when it cuts
    src_BS = np.asarray(batch["src_BS"])
    if src_len_B is None:
      sources = [_until_eos(src_BS[b], eos_id) for b in range(B)]
      refs = [_until_eos(targets_BT[b], eos_id) for b in range(B)]
    else:
      sources = [[int(t) for t in src_BS[b, :min(int(src_len_B[b]), T - 1)]] for b in range(B)]
      refs = [[int(t) for t in targets_BT[b, :min(int(tgt_len_B[b]), T - 1)]]
              for b in range(B)]
    # The source lengths the batch's segment ids give (a real token may have the pad id).
    seg_BS = batch.get("src_segment_ids_BS")
    lengths_B = None if seg_BS is None else (np.asarray(seg_BS) != 0).sum(axis=1).astype(np.int32)
    return src_BS, lengths_B, sources, refs, np.ones((B,), bool)
  tokens_BT = np.asarray(batch["tokens_BT"])
  if src_len_B is None:
    is_eos_BT = tokens_BT[:, 1:] == eos_id
    starts_B = np.argmax(is_eos_BT, axis=1) + 1  # the eos that ends the source
    fits_B = is_eos_BT.any(axis=1) & np.array(
        [eos_id in targets_BT[b, starts_B[b]:] for b in range(B)])
  else:  # [bos] source [eos] target [eos]: the source's eos at 1 + its length
    starts_B = np.asarray(src_len_B, np.int64) + 1
    fits_B = layout_fits(arch, src_len_B, tgt_len_B, T)
  lengths_B = np.where(fits_B, starts_B + 1, 1)
  width = int(lengths_B.max())
  prompt_BT = np.where(np.arange(width)[None, :] < lengths_B[:, None], tokens_BT[:, :width],
                       pad_id)
  sources = [[int(t) for t in tokens_BT[b, 1:starts_B[b]]] for b in range(B)]
  # targets[j] = row[j + 1]: the target starts at the source's eos.
  refs = [_until_eos(targets_BT[b, starts_B[b]:], eos_id) if tgt_len_B is None else
          [int(t) for t in targets_BT[b, starts_B[b]:starts_B[b] + int(tgt_len_B[b])]]
          for b in range(B)]
  return prompt_BT.astype(np.int32), lengths_B.astype(np.int32), sources, refs, fits_B


def _decode_prompts(decode, prompt_BW, lengths_B, refs, score_B, T: int, max_len: int):
  """Decoder-only outputs of a batch in which every scored row gets the room its reference
  needs.

  A row of prompt length l and reference length t needs t + 1 new tokens (with its eos),
  up to position l + t <= seq_len <= max_len; but one ``generate`` call gives every row the
  budget its longest prompt W leaves, max_len - W + 1, so a short prompt with a long
  reference beside a long prompt with a short one got too few and was scored as a miss
  (until 2026-12-04). The first call is the batch as it is (width W, budget
  min(T, max_len - W + 1): one program for every batch); the scored rows it left short
  that have room alone (l + t <= max_len and t < T) go again, in the batch's shape (the
  other rows replaced by one of them), at the width of their longest prompt W' rounded up
  to a multiple of 16 where some row has its room there (else W' itself, whose row then
  has it): a call per width, each serving a row at least,
  and one program per width.

  Returns:
    (a row of new tokens per example, None for a scored row that has no room even alone
    (a layout longer than max_len), the number of those).
  """
  B, W = prompt_BW.shape
  need_B = np.array([len(r) + 1 for r in refs])
  out = [None] * B
  todo_B, width = np.ones(B, bool), W  # the first call: every row, filling rows too
  while todo_B.any():
    budget = min(T, max_len - width + 1)
    fill_B = np.where(todo_B, np.arange(B), np.flatnonzero(todo_B)[0])
    tokens_BJ = decode(prompt_BW[fill_B, :width], lengths_B[fill_B], budget)
    short_B = score_B & (need_B > budget)
    for b in np.flatnonzero(todo_B & ~short_B):
      out[b] = tokens_BJ[b]
    # Rows with no room even alone (l + t > max_len, or t >= T) are left out: such a row
    # with the longest prompt stopped the loop, and the rows that fit narrower were lost
    # with it (until 2026-12-05).
    todo_B &= short_B & (need_B <= np.minimum(T, max_len - lengths_B + 1))
    if todo_B.any():
      # The next width: the longest prompt left, rounded up to a multiple of 16 (fewer
      # programs) if some row still has its room there, else as it is (where its row has).
      longest, needs = int(lengths_B[todo_B].max()), need_B[todo_B]
      width = next(w for w in (min(-(-longest // 16) * 16, W), longest)
                   if (needs <= min(T, max_len - w + 1)).any())
  return out, sum(1 for b in range(B) if score_B[b] and out[b] is None)


def decode_batches(model, batches: list[dict], *, eos_id: int, bos_id: int,
                   beam_size: int | None = None,
                   length_penalty: float = DecodeConfig.length_penalty) -> list[dict]:
  """Greedy (or beam search) outputs of every validation example, with its source
  and reference.

  Args:
    model: a ``DecoderOnly`` or ``EncoderDecoder`` (dropout is turned off by
      ``generate``).
    batches: batch dicts of the seq2seq layout (data/pipeline.py).
    eos_id, bos_id: the tokenizer's ids.
    beam_size, length_penalty: beam search of that width with that GNMT alpha
      (``generate``'s); None = greedy.

  Returns:
    one ``{"source", "reference", "prediction"}`` dict of token-id lists per
    example (eos and everything after it removed).
  """
  cfg = model.cfg
  out, cut, unreachable = [], 0, 0
  splits = [_split_rows(batch, cfg.arch, eos_id, cfg.pad_id) for batch in batches]
  # Decoder-only prompts are cut to the longest of the whole evaluation, W, and padded
  # to it: one shape for every batch (one compiled program per run: the validation rows
  # are the same at every evaluation).
  W = max((s[0].shape[1] for s in splits), default=0)
  for batch, (prompt_BT, lengths_B, sources, refs, fits_B) in zip(batches, splits):
    # Rows that only fill up the last batch are neither scored nor counted as cut.
    real_B = np.asarray(batch.get(EXAMPLE_MASK, np.ones(len(fits_B), bool)))
    # The pipeline's own record of what seq_len cut: the only one for an encoder-decoder,
    # whose cut source and target still end with eos.
    fits_B = fits_B & np.asarray(batch.get(EXAMPLE_FITS, np.ones(len(fits_B), bool)))
    cut += int((real_B & ~fits_B).sum())
    fits_B = fits_B & real_B
    # A reference holding the eos id (its text holds the tokenizer's eos string) is one no
    # decoding can give back, which stops at eos: it is counted, not scored.
    holds_eos_B = fits_B & np.array([eos_id in r for r in refs], bool)
    unreachable += int(holds_eos_B.sum())
    fits_B = fits_B & ~holds_eos_B
    T = np.shape(batch["targets_BT"])[1]
    decode = lambda prompt_BT, lengths_B, max_new: np.asarray(generate(
        model, prompt_BT, max_new_tokens=max_new, prompt_lengths_B=lengths_B, eos_id=eos_id,
        bos_id=bos_id, beam_size=beam_size, length_penalty=length_penalty, bucket=False))
    # A reference fits in its row (with its eos): an encoder-decoder's target row,
    # which need not be as wide as the source; a decoder-only prompt of width W
    # leaves max_len - W + 1 positions to generate into.
    if cfg.arch == "encoder_decoder":
      tokens_BJ = decode(prompt_BT, lengths_B, T)
    else:
      prompt_BT = np.pad(prompt_BT, ((0, 0), (0, W - prompt_BT.shape[1])),
                         constant_values=cfg.pad_id)
      tokens_BJ, short = _decode_prompts(decode, prompt_BT, lengths_B, refs, fits_B, T,
                                         cfg.max_len)
      cut += short
      fits_B = fits_B & np.array([t is not None for t in tokens_BJ], bool)
    for b in np.flatnonzero(fits_B):
      out.append({"source": sources[b], "reference": refs[b],
                  "prediction": _until_eos(tokens_BJ[b], eos_id)})
  if cut:
    log.warning("%d validation example(s) do not fit seq_len with their eos (cut by the data "
                "layout): not scored", cut)
  if unreachable:
    log.warning("%d validation example(s) hold the eos id inside their reference (the "
                "tokenizer's eos string in the text), which decoding stops at: not scored",
                unreachable)
  return out


def seq2seq_metrics(examples: list[dict], tokenizer, *, bleu: bool,
                    predictions_path: str | None = None) -> dict:
  """Exact match (token ids) and, with ``bleu``, sacrebleu's corpus BLEU of the
  detokenized predictions against the detokenized references.

  Args:
    examples: ``decode_batches`` output.
    tokenizer: decodes ids to text.
    bleu: add ``"bleu"`` (0..100; sacrebleu's default 13a tokenization).
    predictions_path: if given, one JSON line per example is written there:
      source, reference and prediction as text (what BLEU scores), and
      ``reference_ids`` / ``prediction_ids`` (what exact match compares; the
      text can hide a difference: ids the tokenizer drops), so every reported
      number can be recomputed from the file.
  """
  text = [{k: tokenizer.decode(np.asarray(e[k], np.int32)) for k in
           ("source", "reference", "prediction")} for e in examples]
  lines = [{**t, "reference_ids": [int(i) for i in e["reference"]],
            "prediction_ids": [int(i) for i in e["prediction"]]} for t, e in zip(text, examples)]
  if not examples:  # every example cut by seq_len, say: no score, not a score of 0
    log.warning("no validation example could be scored: exact match%s reported as nan",
                " and BLEU" if bleu else "")
    out = {"exact_match": math.nan, **({"bleu": math.nan} if bleu else {})}
  else:
    out = {"exact_match": sum(e["prediction"] == e["reference"] for e in examples)
           / len(examples)}
  if bleu and examples:
    sacrebleu = extras.require("sacrebleu", "task='tsv' (BLEU in eval)")
    out["bleu"] = float(sacrebleu.corpus_bleu([t["prediction"] for t in text],
                                              [[t["reference"] for t in text]]).score)
  if predictions_path:
    try:
      os.makedirs(os.path.dirname(os.path.abspath(predictions_path)), exist_ok=True)
      # Whole or not at all: an eval stopped while it wrote them cut the step's predictions
      # of an earlier eval short in place until 2026-12-07.
      write_text_atomically(predictions_path, "".join(
          json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    except OSError as e:  # a full disk: the metrics stand (a traceback, and the metrics of
      # the whole eval lost, or a training run stopped, until 2026-12-07)
      log.warning("the decoded examples could not be written to %s (%s: %s); the metrics "
                  "stand", predictions_path, type(e).__name__, e)
  return out


def validation_loss(eval_step, params, batches, put_batch) -> dict:
  """Token-weighted validation loss and perplexity over ``batches``."""
  nll = weight = 0.0
  for batch in batches:
    n, w = jax.device_get(eval_step(params, put_batch(batch)))
    nll, weight = nll + float(n), weight + float(w)
  if weight == 0:  # no counted token: no loss, not a perfect one (0.0 until 2026-12-04)
    log.warning("the validation batches count no token (every target cut by seq_len, say): "
                "the validation loss and perplexity are reported as nan")
    return {"loss": math.nan, "perplexity": math.nan, "tokens": weight}
  loss = nll / weight
  return {"loss": loss, "perplexity": perplexity(loss), "tokens": weight}
