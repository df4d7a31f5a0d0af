"""The definition of attention, and the same math over query blocks.

  * ``reference_attention``: one grouped einsum, the whole [T, S] score
    matrix, float32 softmax. The definition every other path is tested
    against; the only path with attention dropout.
  * ``blocked_attention``: the reference math over query blocks, each against
    only the key range its mask can see (``masks.key_range``): causal and
    sliding-window requests skip the masked part of [T, S]. What "auto" uses
    on XLA:CPU.

Grouped-query attention never repeats K/V: queries are reshaped to
``[B, T, K, G, H]`` (G = N / K query heads per KV head) and contracted against
``[B, S, K, H]``.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.config import is_integer
from attnlab.ops import checks, masks


def group_queries(q_BTNH, num_kv_heads):
  B, T, N, H = q_BTNH.shape
  return q_BTNH.reshape(B, T, num_kv_heads, N // num_kv_heads, H)


def reference_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    causal=False,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_offset=0,
    scale=None,
    q_positions=None,
    kv_positions=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
):
  """The definition: full scores, masked, float32 softmax, weighted values."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  # Also when called directly, not via attention: "false" would be a truthy causal, and
  # the layers call it directly for attention dropout (a window past int32 overflowed).
  causal, q_offset = checks.check_causal(causal), checks.check_q_offset(q_offset, B, T)
  checks.check_offset_or_positions(q_offset, q_positions)
  window = checks.check_window(window)
  checks.check_ids_fit_int32(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                             q_positions=q_positions, kv_positions=kv_positions)
  # A NumPy float32 rate was refused until 2026-12-06 (the README takes NumPy scalars).
  if not (isinstance(dropout_rate, numbers.Real) and 0.0 <= dropout_rate < 1.0):
    raise ValueError(f"dropout_rate={dropout_rate!r} must be a number in [0, 1)")
  dropout_rate = float(dropout_rate)
  if dropout_rate > 0.0 and dropout_rng is None:
    raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng (a jax.random key)")
  scale = 1.0 / math.sqrt(H) if scale is None else scale
  if q_BTNH.dtype == jnp.float32:
    # Scaling the [T, H] queries instead of the [T, S] scores saves a pass
    # over the largest array (exact up to float32 rounding).
    q_BTKGH = group_queries(q_BTNH * jnp.float32(scale), K)
    logits_BKGTS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  else:
    logits_BKGTS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", group_queries(q_BTNH, K), k_BSKH,
        preferred_element_type=jnp.float32) * scale
  mask_BTS = masks.make_attention_mask(
      B, T, S, causal=causal, window=window, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, q_offset=q_offset, q_positions=q_positions,
      kv_positions=kv_positions,
  )
  mask_B11TS = mask_BTS[:, None, None]
  logits_BKGTS = jnp.where(mask_B11TS, logits_BKGTS, -jnp.inf)
  # The max is only for range; the result does not depend on it.
  m_BKGT = jax.lax.stop_gradient(jnp.max(logits_BKGTS, axis=-1, initial=-jnp.inf))
  m_BKGT = jnp.where(jnp.isfinite(m_BKGT), m_BKGT, 0.0)
  p_BKGTS = jnp.exp(logits_BKGTS - m_BKGT[..., None])
  l_BKGT = jnp.sum(p_BKGTS, axis=-1)
  if dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p_BKGTS.shape)
    p_BKGTS = jnp.where(keep, p_BKGTS / (1.0 - dropout_rate), 0.0)
  # Normalizing the [T, H] output instead of the [T, S] probabilities: one
  # pass less over the scores, forward and backward. The product comes out [B, K, G, T, H],
  # batch dimensions first, a plain batched matrix product (the transpose to [B, T, N, H]
  # after it is of the output only): written straight into [B, T, K, G, H], XLA:CPU turned
  # it around into a product over the values' S axis that no kernel of its libraries takes,
  # and for bfloat16 at B > 1 over a contiguous cache's [B, K, S, H] buffer none at all
  # ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32" until 2026-12-06).
  out_BKGTH = jnp.einsum(
      "BKGTS,BSKH->BKGTH", p_BKGTS.astype(v_BSKH.dtype), v_BSKH,
      preferred_element_type=jnp.float32,
  )
  out_BKGTH = out_BKGTH / jnp.where(l_BKGT > 0, l_BKGT, 1.0)[..., None]
  return jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q_BTNH.dtype)


def blocked_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    causal=False,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_offset: int = 0,
    scale=None,
    block_q: int | None = None,
):
  """The reference math over query blocks, each against the keys it can see.

  The key range of a query block comes from ``masks.key_range`` (the same
  predicate as the mask), so causal attention computes about half of [T, S]
  and a sliding window only a band. On XLA:CPU the smaller per-block einsums
  also avoid the transposes XLA inserts around one large masked [T, S]
  product, and a block's scores stay in cache. Each block is another einsum
  for XLA to compile, so blocks are kept few: for the tools/bench_train.py
  step (T = 256, 4 blocks of 64) a 4-layer train step ran 1.35x faster than
  with "reference" and compiled in 3.2 s; 8 blocks of 32 compiled twice as
  long for no further gain.
  The loop over blocks is unrolled at trace time, so ``q_offset`` must be
  concrete: a Python or NumPy int, or a NumPy int array of shape () or [B] (one
  offset per row: a block's key range is then the union of its rows', from the
  lowest offset's first key to the highest's last), not a JAX array.

  Args:
    block_q: queries per block; default max(64, T / 16) (bounds the unrolled
      program's size and its compile time).
  """
  if not (is_integer(q_offset) or isinstance(q_offset, np.ndarray)):
    raise ValueError(f"implementation='blocked' needs an int q_offset or a NumPy array of them, "
                     f"got {type(q_offset)}: its query blocks are cut when traced; 'reference' "
                     "and 'chunked' take a JAX array (traced too)")
  # The whole request, as attention() checks it: called directly, a lone kv_segment_ids was
  # ignored and a lone q_segment_ids a TypeError until 2026-12-06.
  causal, window, q_offset = checks.check_qkv(
      q_BTNH, k_BSKH, v_BSKH, causal=causal, window=window, q_offset=q_offset,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  B, T, N, H = q_BTNH.shape
  S = k_BSKH.shape[1]
  # The rows' lowest and highest offsets bound every block's key range (the range's ends
  # grow with the queries' positions).
  lowest, highest = ((q_offset, q_offset) if isinstance(q_offset, int) else
                     (int(q_offset.min()), int(q_offset.max())) if q_offset.size else (0, 0))
  block_q = checks.positive_or_none("block_q", block_q)
  if block_q is None:
    block_q = max(64, -(-T // 16))
  outs = []
  for q_lo in range(0, T, block_q):
    q_hi = min(q_lo + block_q, T)
    k_lo = masks.key_range(lowest + q_lo, lowest + q_hi - 1, causal=causal, window=window,
                           kv_len=S)[0]
    k_hi = masks.key_range(highest + q_lo, highest + q_hi - 1, causal=causal, window=window,
                           kv_len=S)[1]
    if k_hi <= k_lo:
      outs.append(jnp.zeros((B, q_hi - q_lo, N, H), q_BTNH.dtype))
      continue
    segments = {}
    if q_segment_ids is not None:
      segments = dict(q_segment_ids=q_segment_ids[:, q_lo:q_hi],
                      kv_segment_ids=kv_segment_ids[:, k_lo:k_hi])
    # Both positions shift by k_lo: the predicate depends only on q - k.
    outs.append(reference_attention(
        q_BTNH[:, q_lo:q_hi], k_BSKH[:, k_lo:k_hi], v_BSKH[:, k_lo:k_hi], causal=causal,
        window=window, q_offset=q_offset + q_lo - k_lo, scale=scale, **segments))
  if not outs:  # no query
    return jnp.zeros(q_BTNH.shape, q_BTNH.dtype)
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
