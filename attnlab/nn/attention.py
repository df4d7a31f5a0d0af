"""The attention layer: projections, RoPE, the mask request, the output.

The math of attention itself lives in ``attnlab.ops.attention``; this layer
owns the parameters (``q_proj`` [D, N, H], ``k_proj`` / ``v_proj`` [D, K, H],
``o_proj`` [N, H, D]) and decides what to ask the op for. MHA, GQA and MQA are
the same code with K = N, 1 < K < N and K = 1.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attnlab.nn.layers import Einsum
from attnlab.nn.positions import apply_rope
from attnlab.ops.attention import attention, reference_attention


class Attention(nnx.Module):
  """Self- or cross-attention with ``num_kv_heads`` key/value heads.

  Args:
    d_model, num_heads, num_kv_heads, head_dim: D, N, K, H.
    causal: self-attention sees only earlier positions (decoders).
    window: sliding window of that many keys, or None.
    rope_theta: apply RoPE to queries and keys with this base; None = no RoPE
      (sinusoidal / learned / no positions, and always for cross-attention).
    rope_pairing: "half" or "adjacent".
    use_bias: biases on the four projections.
    o_bias: biases on the output projection; None = ``use_bias`` (Qwen2 has
      them on q/k/v only).
    dropout_rate: dropout on the attention probabilities (reference op only).
    implementation: the ``attnlab.attention`` implementation.
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               causal: bool = False, window: int | None = None,
               rope_theta: float | None = None, rope_pairing: str = "half",
               use_bias: bool = False, o_bias: bool | None = None, dropout_rate: float = 0.0,
               implementation: str = "auto", dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.causal, self.window = causal, window
    self.rope_theta, self.rope_pairing = rope_theta, rope_pairing
    self.implementation = implementation
    self.dropout_rate = dropout_rate
    self.deterministic = False
    self.dropout_rngs = rngs["dropout"].fork() if dropout_rate > 0 else nnx.data(None)
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    bias = (1, 2) if use_bias else None
    self.q_proj = Einsum("BTD,DNH->BTNH", (d_model, num_heads, head_dim),
                         ("embed", "heads", "head_dim"), in_axes=(0,), bias_dims=bias, **kw)
    self.k_proj = Einsum("BSD,DKH->BSKH", (d_model, num_kv_heads, head_dim),
                         ("embed", "kv_heads", "head_dim"), in_axes=(0,), bias_dims=bias, **kw)
    self.v_proj = Einsum("BSD,DKH->BSKH", (d_model, num_kv_heads, head_dim),
                         ("embed", "kv_heads", "head_dim"), in_axes=(0,), bias_dims=bias, **kw)
    self.o_proj = Einsum("BTNH,NHD->BTD", (num_heads, head_dim, d_model),
                         ("heads", "head_dim", "embed"), in_axes=(0, 1),
                         bias_dims=(2,) if (use_bias if o_bias is None else o_bias) else None,
                         **kw)

  def __call__(self, x_BTD, *, positions_BT=None, segment_ids_BT=None, context_BSD=None,
               context_segment_ids_BS=None, cache=None):
    """Attend from ``x_BTD`` to itself, or to ``context_BSD`` (cross-attention).

    Args:
      x_BTD: the queries' input [B, T, D].
      positions_BT: int positions [B, T] (RoPE, and the causal / window mask
        when packing restarts positions per segment is not needed: masks use
        the row index, segments separate documents).
      segment_ids_BT: int [B, T]; tokens attend only within their segment;
        0 is padding.
      context_BSD: encoder output [B, S, D] for cross-attention.
      context_segment_ids_BS: segment ids of the context (0 = padding).
      cache: decoding (``attnlab.decoding.cache``): a self-attention cache
        (``KVCache`` / ``RingKVCache`` / ``PagedKVCache``) that the new K/V
        are appended to before the queries attend over it, or a
        ``CrossKVCache`` holding the projected context. With a cache,
        ``positions_BT`` defaults to the cache lengths + 0..T-1 and
        ``segment_ids_BT`` only marks right padding (0) of the new tokens.

    Returns:
      [B, T, D], or ([B, T, D], updated cache) when ``cache`` is given.
    """
    B, T, _ = x_BTD.shape
    if cache is not None:
      return self._call_cached(x_BTD, positions_BT, segment_ids_BT, cache)
    if context_BSD is None:
      if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
      q_BTNH, k_BSKH, v_BSKH = self._project_self(x_BTD, positions_BT)
      kv_segment_ids = segment_ids_BT
      causal, window = self.causal, self.window
    else:
      q_BTNH = self.q_proj(x_BTD)
      k_BSKH = self.k_proj(context_BSD)
      v_BSKH = self.v_proj(context_BSD)
      kv_segment_ids = context_segment_ids_BS
      causal, window = False, None
    q_segment_ids = segment_ids_BT
    if (q_segment_ids is None) != (kv_segment_ids is None):
      # Only one side is segmented (e.g. a padded source, an unpadded target):
      # the other side is all segment 1.
      if q_segment_ids is None:
        q_segment_ids = jnp.ones((B, T), jnp.int32)
      else:
        kv_segment_ids = jnp.ones(k_BSKH.shape[:2], jnp.int32)
    out_BTNH = self._attend(q_BTNH, k_BSKH, v_BSKH, causal=causal, window=window,
                            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    return self.o_proj(out_BTNH)

  def _project_self(self, x_BTD, positions_BT):
    """Q [B, T, N, H], K and V [B, T, K, H] of self-attention, RoPE applied."""
    q_BTNH = self.q_proj(x_BTD)
    k_BTKH = self.k_proj(x_BTD)
    v_BTKH = self.v_proj(x_BTD)
    if self.rope_theta is not None:
      q_BTNH = apply_rope(q_BTNH, positions_BT, theta=self.rope_theta, pairing=self.rope_pairing)
      k_BTKH = apply_rope(k_BTKH, positions_BT, theta=self.rope_theta, pairing=self.rope_pairing)
    return q_BTNH, k_BTKH, v_BTKH

  def cross_kv(self, context_BSD, context_segment_ids_BS):
    """The cross-attention K/V of an encoder output, to compute once per source."""
    from attnlab.decoding.cache import CrossKVCache

    return CrossKVCache(self.k_proj(context_BSD), self.v_proj(context_BSD),
                        context_segment_ids_BS.astype(jnp.int32))

  def _call_cached(self, x_BTD, positions_BT, segment_ids_BT, cache):
    """Decoding: the same projections, RoPE and op, over cached keys/values."""
    from attnlab.decoding.cache import CrossKVCache, PagedKVCache

    B, T, _ = x_BTD.shape
    if isinstance(cache, CrossKVCache):
      q_BTNH = self.q_proj(x_BTD)
      out_BTNH = self._attend(
          q_BTNH, cache.k_BSKH, cache.v_BSKH, causal=False, window=None,
          q_segment_ids=jnp.ones((B, T), jnp.int32), kv_segment_ids=cache.segment_ids_BS,
          implementation=self._cached_implementation())
      return self.o_proj(out_BTNH), cache
    if positions_BT is None:
      positions_BT = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    num_new_B = (jnp.full((B,), T, jnp.int32) if segment_ids_BT is None
                 else jnp.sum(segment_ids_BT != 0, axis=1, dtype=jnp.int32))
    q_BTNH, k_BTKH, v_BTKH = self._project_self(x_BTD, positions_BT)
    cache, k_BSKH, v_BSKH, kv_positions_BS = cache.append(k_BTKH, v_BTKH, num_new_B)
    decode_kernels = _decode_kernels() if self.implementation == "pallas" and T == 1 else None
    if decode_kernels is not None and isinstance(cache, PagedKVCache):
      # The kernel reads the pages in place: no gather of the whole sequence.
      out_BTNH = decode_kernels.paged_decode_attention(
          q_BTNH, cache.k_pages_PCKH, cache.v_pages_PCKH, jnp.maximum(cache.page_table_BM, 0),
          cache.lengths_B, window=self.window)
    else:
      out_BTNH = self._attend(
          q_BTNH, k_BSKH, v_BSKH, causal=self.causal, window=self.window,
          q_positions=positions_BT, kv_positions=kv_positions_BS,
          implementation=self._cached_implementation())
    return self.o_proj(out_BTNH), cache

  def _cached_implementation(self):
    # Cache slots are not in position order (ring) or not all filled, so the
    # request needs explicit positions: only "reference" and "chunked" take them.
    # "chunked" even when the scores would fit: 240 decode steps at B=8 over a
    # 255-slot cache took 0.25-0.29 s with it, 0.40-0.48 s with "reference"
    # (XLA:CPU, the tools/bench_decode.py model), and the same time at B=1.
    return "reference" if self.implementation == "reference" else "chunked"

  def _attend(self, q_BTNH, k_BSKH, v_BSKH, implementation=None, **mask_kwargs):
    if self.dropout_rate > 0 and not self.deterministic:
      return reference_attention(q_BTNH, k_BSKH, v_BSKH, dropout_rate=self.dropout_rate,
                                 dropout_rng=self.dropout_rngs(), **mask_kwargs)
    return attention(q_BTNH, k_BSKH, v_BSKH, implementation=implementation or self.implementation,
                     **mask_kwargs)


def _decode_kernels():
  """attnlab.ops.decode (Pallas decode kernels) when it exists, else None."""
  try:
    from attnlab.ops import decode
  except ImportError:
    return None
  return decode
