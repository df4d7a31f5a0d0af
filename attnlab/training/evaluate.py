"""Evaluation: validation loss / perplexity and seq2seq exact match.

Exact match decodes greedily with ``greedy_continue``, a deliberately simple
uncached loop (one full forward pass per new token, fixed shapes so it
compiles once). It is the one function to swap for ``attnlab.generate``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.training.metrics import perplexity


def greedy_continue(model, batch: dict, prompt_lens, max_new_tokens: int, eos_id: int):
  """Greedy continuation of each row of a fixed-length token buffer.

  Args:
    model: a DecoderOnly or EncoderDecoder (in eval mode).
    batch: a batch dict (decoder-only: ``tokens_BT`` holds the prompts;
      encoder-decoder: ``src_BS`` and ``tgt_in_BT``, whose first token is bos).
    prompt_lens: int [B], tokens of each row's prompt (1 = just bos).
    max_new_tokens: tokens to generate per row.
    eos_id: generation of a row stops at eos (later tokens are ignored).

  Returns:
    int [B, max_new_tokens] numpy: the generated tokens (eos included).
  """
  enc = model.cfg.arch == "encoder_decoder"
  buf_BT = np.array(batch["tgt_in_BT"] if enc else batch["tokens_BT"])
  B, T = buf_BT.shape
  lens = np.asarray(prompt_lens).copy()
  buf_BT[np.arange(T)[None, :] >= lens[:, None]] = 0
  buf_BT = np.pad(buf_BT, ((0, 0), (0, max_new_tokens)))  # room past T

  if enc:
    src_BS = jnp.asarray(batch["src_BS"])
    seg_BS = model.source_segment_ids(src_BS)
    encoded = jax.jit(lambda s, g: model.encode(s, src_segment_ids_BS=g))(src_BS, seg_BS)
    forward = jax.jit(lambda t: model.decode(t, encoded, src_segment_ids_BS=seg_BS))
  else:
    forward = jax.jit(lambda t: model(t))
  out = np.zeros((B, max_new_tokens), np.int32)
  rows = np.arange(B)
  for i in range(max_new_tokens):
    logits_BTV = forward(jnp.asarray(buf_BT))
    # Causal: the tokens after each row's end do not change its next token.
    nxt = np.asarray(jnp.argmax(logits_BTV[rows, lens - 1], axis=-1))
    out[:, i] = nxt
    buf_BT[rows, lens] = nxt
    lens = lens + 1
  del eos_id  # rows are cut at eos by the caller
  return out


def _until_eos(ids, eos_id: int) -> list[int]:
  ids = list(np.asarray(ids))
  return ids[:ids.index(eos_id)] if eos_id in ids else ids


def exact_match(model, batches: list[dict], eos_id: int) -> float:
  """Fraction of examples whose greedy output equals the reference target."""
  hits = total = 0
  enc = model.cfg.arch == "encoder_decoder"
  for batch in batches:
    targets = np.asarray(batch["targets_BT"])
    B, T = targets.shape
    if enc:
      starts = np.zeros(B, np.int64)
      prompt_lens = np.ones(B, np.int64)
    else:
      # Rows are [bos] source [eos] target [eos]: the prompt ends at the first eos.
      tokens = np.asarray(batch["tokens_BT"])
      starts = np.argmax(tokens == eos_id, axis=1)
      prompt_lens = starts + 1
    refs = [_until_eos(targets[b, starts[b]:], eos_id) for b in range(B)]
    max_new = max(len(r) for r in refs) + 1
    out = greedy_continue(model, batch, prompt_lens, max_new, eos_id)
    for b in range(B):
      hits += _until_eos(out[b], eos_id) == refs[b]
      total += 1
  return hits / max(total, 1)


def validation_loss(eval_step, params, batches, put_batch) -> dict:
  """Token-weighted validation loss and perplexity over ``batches``."""
  nll = weight = 0.0
  for batch in batches:
    n, w = jax.device_get(eval_step(params, put_batch(batch)))
    nll, weight = nll + float(n), weight + float(w)
  loss = nll / max(weight, 1.0)
  return {"loss": loss, "perplexity": perplexity(loss), "tokens": weight}
