"""The attention layer: projections, RoPE, the mask request, the output.

The math of attention itself lives in ``attnlab.ops`` (``dispatch.attention``); this layer
owns the parameters (``q_proj`` [D, N, H], ``k_proj`` / ``v_proj`` [D, K, H],
``o_proj`` [N, H, D]) and decides what to ask the op for. MHA, GQA and MQA are
the same code with K = N, 1 < K < N and K = 1.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attnlab.config import check_positive
from attnlab.nn.kv_cache import CrossKVCache
from attnlab.nn.layers import Einsum
from attnlab.nn.positions import apply_rope
from attnlab.ops.dispatch import attention
from attnlab.ops.reference import reference_attention


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
    for name, value in (("d_model", d_model), ("num_heads", num_heads),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
      check_positive(name, value)  # 0 KV heads was a ZeroDivisionError
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
      cache: decoding (``attnlab.nn.kv_cache``): a self-attention cache
        (``KVCache`` / ``RingKVCache`` / ``PagedKVCache``) that the new K/V
        are appended to before the queries attend over it, or a
        ``CrossKVCache`` holding the projected context. With a cache,
        ``positions_BT`` defaults to the cache lengths + 0..T-1 and
        ``segment_ids_BT`` only marks right padding (0) of the new tokens.

    Returns:
      [B, T, D], or ([B, T, D], updated cache) when ``cache`` is given.
    """
    self._check_call(x_BTD, positions_BT, context_BSD, cache)
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

  def _check_call(self, x_BTD, positions_BT, context_BSD, cache) -> None:
    """A ValueError naming the input of a direct call that does not fit the layer (shapes and
    dtypes: checked as the call is traced, nothing at run time). Until 2026-12-07 a width
    other than d_model, positions of another shape and a context of another batch were
    errors from inside JAX, float positions turned RoPE by fractions, and a context given
    with a cache was dropped without a word. (The models check their own inputs.)"""
    D = self.q_proj.w.shape[0]
    shape = tuple(jnp.shape(x_BTD))
    if len(shape) != 3 or shape[-1] != D:
      raise ValueError(f"x_BTD has shape {shape}; give [B, T, D] with D = d_model = {D}")
    B, T, _ = shape
    if positions_BT is not None:
      dtype = getattr(positions_BT, "dtype", None)
      if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        what = f"dtype {dtype}" if dtype is not None else f"a {type(positions_BT).__name__}"
        raise ValueError(f"positions_BT has {what}; give int positions [B, T] "
                         "(jnp.asarray(positions, jnp.int32))")
      if tuple(jnp.shape(positions_BT)) not in {(B, T), (1, T)}:
        raise ValueError(f"positions_BT has shape {tuple(jnp.shape(positions_BT))}; it must be "
                         f"x_BTD's [B, T] = ({B}, {T}) or [1, T]")
    if context_BSD is not None:
      if cache is not None:
        raise ValueError("context_BSD is not read with a cache: a CrossKVCache holds the "
                         "projected context (Attention.cross_kv(context_BSD, segment_ids_BS))")
      context = tuple(jnp.shape(context_BSD))
      if len(context) != 3 or context[0] != B or context[-1] != D:
        raise ValueError(f"context_BSD has shape {context}; give the encoder output [B, S, D] "
                         f"with B = {B} (x_BTD's) and D = d_model = {D}")

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
    return CrossKVCache(self.k_proj(context_BSD), self.v_proj(context_BSD),
                        context_segment_ids_BS.astype(jnp.int32))

  def _call_cached(self, x_BTD, positions_BT, segment_ids_BT, cache):
    """Decoding: the same projections and RoPE; the cache attends (``cache.attend``)."""
    B, T, _ = x_BTD.shape
    dropout = self._dropout()
    if isinstance(cache, CrossKVCache):
      out_BTNH, cache = cache.attend(self.q_proj(x_BTD), implementation=self.implementation,
                                     **dropout)
      return self.o_proj(out_BTNH), cache
    # The mask works on row indices, as without a cache: the new tokens' slots
    # follow the cache lengths. ``positions_BT`` only rotates (RoPE).
    rows_BT = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    if positions_BT is None:
      positions_BT = rows_BT
    num_new_B = (jnp.full((B,), T, jnp.int32) if segment_ids_BT is None
                 else jnp.sum(segment_ids_BT != 0, axis=1, dtype=jnp.int32))
    q_BTNH, k_BTKH, v_BTKH = self._project_self(x_BTD, positions_BT)
    if cache.empty:  # a prefill (``kv_cache.as_empty``): as the uncached forward pass, then store
      if segment_ids_BT is not None:  # here it only marks right padding
        segment_ids_BT = (segment_ids_BT != 0).astype(jnp.int32)
      out_BTNH = self._attend(q_BTNH, k_BTKH, v_BTKH, causal=self.causal, window=self.window,
                              q_segment_ids=segment_ids_BT, kv_segment_ids=segment_ids_BT)
      return self.o_proj(out_BTNH), cache.store(k_BTKH, v_BTKH, num_new_B)
    out_BTNH, cache = cache.attend(
        q_BTNH, k_BTKH, v_BTKH, num_new_B=num_new_B, q_positions_BT=rows_BT,
        causal=self.causal, window=self.window, implementation=self.implementation, **dropout)
    return self.o_proj(out_BTNH), cache

  def _dropout(self):
    """Attention-dropout arguments of the ops: the rate and a fresh key, when active."""
    if self.dropout_rate > 0 and not self.deterministic:
      return dict(dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rngs())
    return {}

  def _attend(self, q_BTNH, k_BSKH, v_BSKH, **mask_kwargs):
    dropout = self._dropout()
    if dropout:
      return reference_attention(q_BTNH, k_BSKH, v_BSKH, **dropout, **mask_kwargs)
    return attention(q_BTNH, k_BSKH, v_BSKH, implementation=self.implementation, **mask_kwargs)
