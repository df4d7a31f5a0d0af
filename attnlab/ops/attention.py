"""The attention operator: ``softmax(Q K^T / sqrt(H)) V`` and its implementations.

``attention(...)`` validates a request and dispatches it to one of:

  * ``reference``: one grouped einsum, the whole [T, S] score matrix, float32
    softmax. The definition every other path is tested against.
  * ``blocked``: the reference math over query blocks, each against only the
    key range its mask can see (``masks.key_range``): causal and sliding-window
    requests skip the masked part of [T, S]. What "auto" uses on XLA:CPU.
  * ``chunked``: pure-JAX online softmax over key blocks (``lax.scan``) with a
    FlashAttention-2 style custom VJP: memory O(T x block) instead of O(T x S),
    forward and backward, on every backend.
  * ``xla`` / ``cudnn``: thin passthroughs to ``jax.nn.dot_product_attention``.
  * ``pallas``: the blocked Pallas kernel in ``attnlab/ops/flash.py``.

Grouped-query attention never repeats K/V: queries are reshaped to
``[B, T, K, G, H]`` (G = N / K query heads per KV head) and contracted against
``[B, S, K, H]``. Softmax statistics and accumulators are float32 whatever the
input dtype, and a query that sees no key returns zeros (with zero, finite
gradients), never NaN.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attnlab.ops import masks

IMPLEMENTATIONS = ("reference", "blocked", "chunked", "xla", "cudnn", "pallas")


def attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    causal: bool = False,
    window: int | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_offset=0,
    scale: float | None = None,
    implementation: str = "reference",
    q_positions=None,
    kv_positions=None,
):
  """Multi-head (MHA / GQA / MQA) scaled dot-product attention.

  Args:
    q_BTNH: queries [B, T, N, H].
    k_BSKH: keys [B, S, K, H]; N must be a multiple of K.
    v_BSKH: values [B, S, K, H].
    causal: a query at position t sees keys at positions <= t.
    window: sliding window of that many keys, the query's own included.
    q_segment_ids: int [B, T]; with ``kv_segment_ids`` [B, S] a query sees
      only keys of its own segment (packing; 0 marks padding).
    q_offset: int or int [B]: position of the first query, for queries that
      are the tail of a longer sequence (decoding against a cache).
    scale: multiplier of the scores; default 1/sqrt(H).
    implementation: "reference" | "chunked" | "xla" | "cudnn" | "pallas" |
      "auto" (see ``auto_implementation``).
    q_positions, kv_positions: explicit int [B, T] / [B, S] positions, for
      caches whose slots are not in order (a ring buffer); a negative key
      position marks an empty slot. Supported by "reference" and "chunked".

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``.
  """
  _validate(q_BTNH, k_BSKH, v_BSKH, window, q_segment_ids, kv_segment_ids)
  if scale is None:
    scale = 1.0 / math.sqrt(q_BTNH.shape[-1])
  if implementation == "auto":
    implementation = auto_implementation(q_BTNH.shape[1], k_BSKH.shape[1])
    if implementation == "blocked" and not _blockable(causal, window, q_offset, q_positions,
                                                      kv_positions):
      implementation = "reference"
  kwargs = dict(
      causal=causal,
      window=window,
      q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      q_offset=q_offset,
      scale=scale,
  )
  if implementation in ("reference", "chunked"):
    fn = reference_attention if implementation == "reference" else chunked_attention
    return fn(q_BTNH, k_BSKH, v_BSKH, q_positions=q_positions, kv_positions=kv_positions,
              **kwargs)
  if q_positions is not None or kv_positions is not None:
    raise ValueError(
        f"q_positions/kv_positions are supported by implementation='reference' or "
        f"'chunked', not {implementation!r}"
    )
  if implementation == "blocked":
    if q_positions is not None or kv_positions is not None:
      raise ValueError("implementation='blocked' does not take q_positions/kv_positions")
    return blocked_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs)
  if implementation in ("xla", "cudnn"):
    return jax_nn_attention(q_BTNH, k_BSKH, v_BSKH, implementation=implementation, **kwargs)
  if implementation == "pallas":
    from attnlab.ops import flash

    return flash.flash_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs)
  raise ValueError(
      f"implementation={implementation!r} is not one of {', '.join(map(repr, IMPLEMENTATIONS))}"
      " or 'auto'"
  )


def auto_implementation(q_len: int, kv_len: int, backend: str | None = None) -> str:
  """The implementation "auto" resolves to for a backend and a length."""
  backend = backend or jax.default_backend()
  if backend == "gpu":
    # Not "pallas" yet: the Triton path of ops/flash.py has never been
    # compiled or run on a GPU (only interpret mode on CPU is tested). Switch
    # to "pallas" for long sequences once tools/gpu_check.sh passes on a card.
    return "xla"
  if backend == "tpu":
    # ops/flash.py has no Mosaic lowering.
    return "xla"
  # XLA:CPU: query blocks against only their visible keys (causal / window)
  # while [T, S] scores fit in memory comfortably; past that, the online
  # softmax bounds memory. tools/bench_attention.py measures the choice.
  return "blocked" if q_len * kv_len <= 2048 * 2048 else "chunked"


def cache_implementation(implementation: str, *, num_queries: int, paged: bool) -> str:
  """The path a request against a KV cache takes, for a layer's ``implementation``.

  Cache slots are not in position order (ring) or not all filled, so the
  request needs explicit positions: only "reference" and "chunked" take them.
  "chunked" even when the scores would fit: 240 decode steps at B=8 over a
  255-slot cache took 0.25-0.29 s with it, 0.40-0.48 s with "reference"
  (XLA:CPU, the tools/bench_decode.py model), and the same time at B=1.
  One new query against a paged cache with "pallas" reads the pages in place
  ("paged_decode": ``attnlab.ops.decode.paged_decode_attention``), with no
  gather of the whole sequence.
  """
  if paged and implementation == "pallas" and num_queries == 1:
    return "paged_decode"
  return "reference" if implementation == "reference" else "chunked"


def _blockable(causal, window, q_offset, q_positions, kv_positions) -> bool:
  """Whether "blocked" can help: a band to skip, and static key ranges."""
  return ((causal or window is not None) and isinstance(q_offset, int)
          and q_positions is None and kv_positions is None)


def _validate(q, k, v, window, q_segment_ids, kv_segment_ids):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"q, k, v must be rank 4 ([B, T, N, H], [B, S, K, H], [B, S, K, H]); got shapes "
        f"{q.shape}, {k.shape}, {v.shape}"
    )
  if k.shape != v.shape:
    raise ValueError(f"k shape {k.shape} and v shape {v.shape} must be equal")
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"batch of q ({q.shape[0]}) and k ({k.shape[0]}) must be equal")
  if q.shape[3] != k.shape[3]:
    raise ValueError(f"head_dim of q ({q.shape[3]}) and k ({k.shape[3]}) must be equal")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"num_heads of q ({q.shape[2]}) must be a multiple of num_kv_heads of k ({k.shape[2]})"
    )
  if window is not None and (not isinstance(window, int) or window < 1):
    raise ValueError(f"window={window!r} must be a positive integer or None")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None:
    if q_segment_ids.shape != q.shape[:2]:
      raise ValueError(f"q_segment_ids shape {q_segment_ids.shape} must be [B, T] = {q.shape[:2]}")
    if kv_segment_ids.shape != k.shape[:2]:
      raise ValueError(
          f"kv_segment_ids shape {kv_segment_ids.shape} must be [B, S] = {k.shape[:2]}"
      )


def _group_queries(q_BTNH, num_kv_heads):
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
  scale = 1.0 / math.sqrt(H) if scale is None else scale
  if q_BTNH.dtype == jnp.float32:
    # Scaling the [T, H] queries instead of the [T, S] scores saves a pass
    # over the largest array (exact up to float32 rounding).
    q_BTKGH = _group_queries(q_BTNH * jnp.float32(scale), K)
    logits_BKGTS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  else:
    logits_BKGTS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", _group_queries(q_BTNH, K), k_BSKH,
        preferred_element_type=jnp.float32) * scale
  mask_BTS = masks.make_attention_mask(
      B, T, S, causal=causal, window=window, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, q_offset=q_offset, q_positions=q_positions,
      kv_positions=kv_positions,
  )
  mask_B11TS = mask_BTS[:, None, None]
  logits_BKGTS = jnp.where(mask_B11TS, logits_BKGTS, -jnp.inf)
  # The max is only for range; the result does not depend on it.
  m_BKGT = jax.lax.stop_gradient(jnp.max(logits_BKGTS, axis=-1))
  m_BKGT = jnp.where(jnp.isfinite(m_BKGT), m_BKGT, 0.0)
  p_BKGTS = jnp.exp(logits_BKGTS - m_BKGT[..., None])
  l_BKGT = jnp.sum(p_BKGTS, axis=-1)
  if dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p_BKGTS.shape)
    p_BKGTS = jnp.where(keep, p_BKGTS / (1.0 - dropout_rate), 0.0)
  # Normalizing the [T, H] output instead of the [T, S] probabilities: one
  # pass less over the scores, forward and backward.
  out_BTKGH = jnp.einsum(
      "BKGTS,BSKH->BTKGH", p_BKGTS.astype(v_BSKH.dtype), v_BSKH,
      preferred_element_type=jnp.float32,
  )
  l_BTKG = jnp.transpose(l_BKGT, (0, 3, 1, 2))
  out_BTKGH = out_BTKGH / jnp.where(l_BTKG > 0, l_BTKG, 1.0)[..., None]
  return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


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
  The loop over blocks is unrolled at trace time, so ``q_offset`` must be a
  Python int.

  Args:
    block_q: queries per block; default max(64, T / 16) (bounds the unrolled
      program's size and its compile time).
  """
  if not isinstance(q_offset, int):
    raise ValueError(f"implementation='blocked' needs an int q_offset, got {type(q_offset)}")
  B, T, N, H = q_BTNH.shape
  S = k_BSKH.shape[1]
  if block_q is None:
    block_q = max(64, -(-T // 16))
  outs = []
  for q_lo in range(0, T, block_q):
    q_hi = min(q_lo + block_q, T)
    k_lo, k_hi = masks.key_range(q_offset + q_lo, q_offset + q_hi, causal=causal, window=window,
                                 kv_len=S)
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
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


# ----------------------------------------------------------------------------
# chunked: online softmax over key blocks, FlashAttention-2 style backward.
# ----------------------------------------------------------------------------


def chunked_attention(
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
    block_k: int = 512,
):
  """Online-softmax attention over key blocks of ``block_k``; any S.

  Keys are padded to a multiple of the block with position -1 (masked), so
  the result is exact for every length.
  """
  B, T, N, H = q_BTNH.shape
  S = k_BSKH.shape[1]
  scale = 1.0 / math.sqrt(H) if scale is None else scale
  if block_k < 1:
    raise ValueError(f"block_k={block_k} must be positive")
  block_k = min(block_k, S)
  if q_positions is None:
    offset_B = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))
    q_positions = offset_B[:, None] + jnp.arange(T, dtype=jnp.int32)
  if kv_positions is None:
    kv_positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  if q_segment_ids is None:
    q_segment_ids = jnp.zeros((B, T), jnp.int32)
    kv_segment_ids = jnp.zeros((B, S), jnp.int32)
  pad = -S % block_k
  if pad:
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    k_BSKH = jnp.pad(k_BSKH, widths)
    v_BSKH = jnp.pad(v_BSKH, widths)
    kv_positions = jnp.pad(kv_positions, ((0, 0), (0, pad)), constant_values=-1)
    kv_segment_ids = jnp.pad(kv_segment_ids, ((0, 0), (0, pad)))
  return _chunked(
      q_BTNH, k_BSKH, v_BSKH, q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32),
      q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32),
      causal, window, float(scale), block_k,
  )


def _blocks(x_BS, block_k):
  """[B, S, ...] -> [S / block_k, B, block_k, ...] for scanning over key blocks."""
  B, S = x_BS.shape[:2]
  return jnp.swapaxes(x_BS.reshape(B, S // block_k, block_k, *x_BS.shape[2:]), 0, 1)


def _block_scores(q_BTKGH, k_BbKH, q_pos_BT, k_pos_Bb, q_seg_BT, k_seg_Bb, causal, window, scale):
  """Masked float32 scores [B, K, G, T, b] of all queries against one key block."""
  s_BKGTb = jnp.einsum(
      "BTKGH,BbKH->BKGTb", q_BTKGH, k_BbKH, preferred_element_type=jnp.float32
  ) * scale
  mask_BTb = masks.position_mask(
      q_pos_BT[:, :, None], k_pos_Bb[:, None, :], causal=causal, window=window
  )
  mask_BTb &= (k_pos_Bb >= 0)[:, None, :] & masks.segment_mask(q_seg_BT, k_seg_Bb)
  return jnp.where(mask_BTb[:, None, None], s_BKGTb, -jnp.inf)


def _chunked_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, window, scale, block_k):
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  q_BTKGH = _group_queries(q, K)
  xs = (_blocks(k, block_k), _blocks(v, block_k), _blocks(k_pos, block_k),
        _blocks(k_seg, block_k))

  def step(carry, x):
    m_BKGT, l_BKGT, acc_BKGTH = carry
    k_BbKH, v_BbKH, k_pos_Bb, k_seg_Bb = x
    s_BKGTb = _block_scores(q_BTKGH, k_BbKH, q_pos, k_pos_Bb, q_seg, k_seg_Bb, causal, window,
                            scale)
    m_new = jnp.maximum(m_BKGT, jnp.max(s_BKGTb, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m_BKGT - m_safe)
    p_BKGTb = jnp.exp(s_BKGTb - m_safe[..., None])
    l_BKGT = alpha * l_BKGT + jnp.sum(p_BKGTb, axis=-1)
    acc_BKGTH = alpha[..., None] * acc_BKGTH + jnp.einsum(
        "BKGTb,BbKH->BKGTH", p_BKGTb.astype(v.dtype), v_BbKH,
        preferred_element_type=jnp.float32,
    )
    return (m_new, l_BKGT, acc_BKGTH), None

  init = (
      jnp.full((B, K, G, T), -jnp.inf, jnp.float32),
      jnp.zeros((B, K, G, T), jnp.float32),
      jnp.zeros((B, K, G, T, H), jnp.float32),
  )
  (m, l, acc), _ = jax.lax.scan(step, init, xs)
  out_BKGTH = acc / jnp.where(l > 0, l, 1.0)[..., None]
  # A row that saw no key gets lse = +inf, so its backward probabilities are 0.
  lse_BKGT = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
  out_BTNH = jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q.dtype)
  return out_BTNH, lse_BKGT


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _chunked(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, window, scale, block_k):
  return _chunked_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, window, scale, block_k)[0]


def _chunked_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, window, scale, block_k):
  out, lse = _chunked_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, window, scale,
                              block_k)
  return out, (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


def _chunked_bwd(causal, window, scale, block_k, res, dout_BTNH):
  q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse_BKGT = res
  B, T, N, H = q.shape
  K = k.shape[2]
  q_BTKGH = _group_queries(q, K)
  do_BTKGH = _group_queries(dout_BTNH, K)
  # D_t = sum_h dO_th O_th: the softmax Jacobian's diagonal correction.
  delta_BTKG = jnp.sum(
      do_BTKGH.astype(jnp.float32) * _group_queries(out, K).astype(jnp.float32), axis=-1
  )
  delta_BKGT = jnp.transpose(delta_BTKG, (0, 2, 3, 1))
  xs = (_blocks(k, block_k), _blocks(v, block_k), _blocks(k_pos, block_k),
        _blocks(k_seg, block_k))

  def step(dq_BTKGH, x):
    k_BbKH, v_BbKH, k_pos_Bb, k_seg_Bb = x
    s_BKGTb = _block_scores(q_BTKGH, k_BbKH, q_pos, k_pos_Bb, q_seg, k_seg_Bb, causal, window,
                            scale)
    p_BKGTb = jnp.exp(s_BKGTb - lse_BKGT[..., None])
    dv_BbKH = jnp.einsum("BKGTb,BTKGH->BbKH", p_BKGTb.astype(do_BTKGH.dtype), do_BTKGH,
                         preferred_element_type=jnp.float32)
    dp_BKGTb = jnp.einsum("BTKGH,BbKH->BKGTb", do_BTKGH, v_BbKH,
                          preferred_element_type=jnp.float32)
    ds_BKGTb = p_BKGTb * (dp_BKGTb - delta_BKGT[..., None]) * scale
    dq_BTKGH = dq_BTKGH + jnp.einsum("BKGTb,BbKH->BTKGH", ds_BKGTb.astype(k.dtype), k_BbKH,
                                     preferred_element_type=jnp.float32)
    dk_BbKH = jnp.einsum("BKGTb,BTKGH->BbKH", ds_BKGTb.astype(q.dtype), q_BTKGH,
                         preferred_element_type=jnp.float32)
    return dq_BTKGH, (dk_BbKH, dv_BbKH)

  dq, (dk_blocks, dv_blocks) = jax.lax.scan(
      step, jnp.zeros(q_BTKGH.shape, jnp.float32), xs
  )

  def unblock(x_nBbKH):
    return jnp.swapaxes(x_nBbKH, 0, 1).reshape(k.shape)

  return (
      dq.reshape(q.shape).astype(q.dtype),
      unblock(dk_blocks).astype(k.dtype),
      unblock(dv_blocks).astype(v.dtype),
      None, None, None, None,
  )


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ----------------------------------------------------------------------------
# xla / cudnn: jax.nn.dot_product_attention
# ----------------------------------------------------------------------------


def jax_nn_attention(
    q_BTNH, k_BSKH, v_BSKH, *, implementation, causal, window, q_segment_ids, kv_segment_ids,
    q_offset, scale,
):
  """``jax.nn.dot_product_attention`` with attnlab's mask semantics.

  "xla" receives the explicit boolean mask built from the same predicate as
  the reference op; "cudnn" receives only what cuDNN's fused kernel supports
  (aligned causal, a causal sliding window, no segments, no offset) and
  raises ``ValueError`` for anything else.
  """
  B, T, _, _ = q_BTNH.shape
  S = k_BSKH.shape[1]
  if implementation == "cudnn":
    if jax.default_backend() != "gpu":
      raise ValueError(
          f"implementation='cudnn' needs a CUDA GPU; the default backend is "
          f"{jax.default_backend()!r}. Use 'xla', 'chunked' or 'reference'."
      )
    unsupported = []
    if q_segment_ids is not None:
      unsupported.append("segment ids")
    if not (isinstance(q_offset, int) and q_offset == 0):
      unsupported.append("q_offset")
    if window is not None and not causal:
      unsupported.append("a non-causal window")
    if causal and T != S:
      unsupported.append(f"causal with T={T} != S={S}")
    if unsupported:
      raise ValueError(
          f"implementation='cudnn' does not support {', '.join(unsupported)}; "
          "use 'pallas', 'xla' or 'chunked'"
      )
    return jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, scale=scale, is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )
  needs_mask = causal or window is not None or q_segment_ids is not None
  if not needs_mask:
    return jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, scale=scale, implementation="xla"
    )
  mask_BTS = masks.make_attention_mask(
      B, T, S, causal=causal, window=window, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, q_offset=q_offset,
  )
  out_BTNH = jax.nn.dot_product_attention(
      q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None], scale=scale, implementation="xla"
  )
  # jax.nn averages the values of a row that sees no key; attnlab returns zeros.
  seen_BT = jnp.any(mask_BTS, axis=-1)
  return jnp.where(seen_BT[:, :, None, None], out_BTNH, 0).astype(q_BTNH.dtype)
