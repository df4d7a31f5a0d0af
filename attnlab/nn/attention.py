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
    dropout_rate: dropout on the attention probabilities (reference op only).
    implementation: the ``attnlab.attention`` implementation.
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               causal: bool = False, window: int | None = None,
               rope_theta: float | None = None, rope_pairing: str = "half",
               use_bias: bool = False, dropout_rate: float = 0.0,
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
                         bias_dims=(2,) if use_bias else None, **kw)

  def __call__(self, x_BTD, *, positions_BT=None, segment_ids_BT=None, context_BSD=None,
               context_segment_ids_BS=None):
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

    Returns:
      [B, T, D].
    """
    B, T, _ = x_BTD.shape
    q_BTNH = self.q_proj(x_BTD)
    if context_BSD is None:
      k_BSKH = self.k_proj(x_BTD)
      v_BSKH = self.v_proj(x_BTD)
      kv_segment_ids = segment_ids_BT
      causal, window = self.causal, self.window
      if self.rope_theta is not None:
        if positions_BT is None:
          positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        q_BTNH = apply_rope(q_BTNH, positions_BT, theta=self.rope_theta,
                            pairing=self.rope_pairing)
        k_BSKH = apply_rope(k_BSKH, positions_BT, theta=self.rope_theta,
                            pairing=self.rope_pairing)
    else:
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

  def _attend(self, q_BTNH, k_BSKH, v_BSKH, **mask_kwargs):
    if self.dropout_rate > 0 and not self.deterministic:
      return reference_attention(q_BTNH, k_BSKH, v_BSKH, dropout_rate=self.dropout_rate,
                                 dropout_rng=self.dropout_rngs(), **mask_kwargs)
    return attention(q_BTNH, k_BSKH, v_BSKH, implementation=self.implementation, **mask_kwargs)
