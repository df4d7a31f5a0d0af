"""One decode step in XLA: a new query over a heads-major cache and its own new key.

``decode_step_attention`` is how the contiguous and ring caches
(``attnlab.nn.kv_cache``) attend for one new token per sequence (T = 1) when the layer's
implementation is "auto" (the default; an explicit one is honoured: "reference",
"chunked", the "pallas" decode kernels). It reads the cache *before* the new token is
written: the new key and value enter the softmax as one more term next to the cached
keys, so the cache can be updated afterwards, in place.

Why a path of its own, measured on the tools/bench_decode.py model at B=1 (XLA:CPU, the
compiled decode loop of ``attnlab.generate``; counts from tools/profile_decode_step.py,
which compares the two): writing the token first and then handing ``[B, S, K, H]`` keys
to the "chunked" op (what "auto" did before) left 37 copies in every step's loop body:
each [B, K, S, H] buffer copied three times (the ``mode="drop"`` scatter became a select
and two dynamic-update-slices, one per consumer layout), and every layer's output
projection [N, H, D] transposed, because the attention output came out with H before N.
Here the scores and the weighted values are contracted against the buffer in its own
layout, the output is [B, K, G, H] = [B, N, H] in the order the output projection reads,
and the cache writes happen after the reads. (The output projection's weight was still
transposed in every step until ``layers.weight_einsum``: ``jnp.einsum`` contracted
"BTNH,NHD->BTD" as (H, N), not in the weight's order; now the loop body copies no cache
buffer and makes no weight-sized array, which a test checks.)

int8 caches (one float32 scale per token and KV head) are not dequantized:
the scale of key s multiplies its score, the scale of value s its
probability, which is the same sum: ``q . (k_s c_s) = (q . k_s) c_s``.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnlab.ops import checks, masks


def decode_step_attention(q_BNH, k_new_BKH, v_new_BKH, k_BKSH, v_BKSH, *, q_positions_B,
                          new_positions_B, kv_positions_BS, window: int | None = None,
                          k_scale_BKS=None, v_scale_BKS=None, scale: float | None = None):
  """Causal attention of one new query per sequence over its cache and its new key.

  The keys are the cache's (at ``kv_positions_BS``) and the new one (at
  ``new_positions_B``), under the mask of ``attnlab.ops.masks``: the same
  result as ``reference_attention`` over the cache with the new token written
  in, up to float rounding. A query that sees no key returns zeros.

  Args:
    q_BNH: the new queries [B, N, H] (RoPE applied).
    k_new_BKH, v_new_BKH: the new token's key and value [B, K, H] (as they
      will be stored: an int8 cache passes them quantized and dequantized).
    k_BKSH, v_BKSH: the cache before the new token is written [B, K, S, H],
      float, or int8 with ``k_scale_BKS`` / ``v_scale_BKS`` (float32 [B, K, S]).
    q_positions_B: the query's position [B].
    new_positions_B: the new key's position [B] (normally the query's).
    kv_positions_BS: int positions of the cached keys [B, S]; -1 = empty slot.
    window: sliding window (keys less than ``window`` positions back are
      seen, the query's own included), or None.
    scale: score scale; default 1 / sqrt(H).

  Returns:
    [B, N, H] in the dtype of ``q_BNH``; the softmax runs in float32.
  """
  B, N, H = q_BNH.shape
  K = k_BKSH.shape[1]
  if (k_scale_BKS is None) != (v_scale_BKS is None):
    raise ValueError("k_scale_BKS and v_scale_BKS must be given together (int8 cache) or not")
  if N % K:
    raise ValueError(f"num_heads={N} must be a multiple of the cache's num_kv_heads={K}")
  scale = checks.scale_value(scale, H)
  window = checks.check_window(window)  # 0 or -1 returned zeros until 2026-12-05
  q_BKGH = (q_BNH.astype(jnp.float32) * scale).reshape(B, K, N // K, H)
  k_BKSH = k_BKSH.astype(jnp.float32) if k_scale_BKS is not None else k_BKSH
  s_BKGS = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH, k_BKSH, preferred_element_type=jnp.float32)
  if k_scale_BKS is not None:
    s_BKGS = s_BKGS * k_scale_BKS.astype(jnp.float32)[:, :, None, :]
  s_new_BKG = jnp.einsum("BKGH,BKH->BKG", q_BKGH, k_new_BKH.astype(jnp.float32))
  seen_BS = (kv_positions_BS >= 0) & masks.position_mask(
      q_positions_B[:, None], kv_positions_BS, causal=True, window=window)
  seen_new_B = (new_positions_B >= 0) & masks.position_mask(
      q_positions_B, new_positions_B, causal=True, window=window)
  s_BKGS = jnp.where(seen_BS[:, None, None, :], s_BKGS, -jnp.inf)
  s_new_BKG = jnp.where(seen_new_B[:, None, None], s_new_BKG, -jnp.inf)
  m_BKG = jnp.maximum(jnp.max(s_BKGS, axis=-1), s_new_BKG)
  m_BKG = jnp.where(jnp.isfinite(m_BKG), m_BKG, 0.0)
  p_BKGS = jnp.exp(s_BKGS - m_BKG[..., None])
  p_new_BKG = jnp.exp(s_new_BKG - m_BKG)
  l_BKG = jnp.sum(p_BKGS, axis=-1) + p_new_BKG
  if v_scale_BKS is not None:
    p_BKGS = p_BKGS * v_scale_BKS.astype(jnp.float32)[:, :, None, :]
    v_BKSH = v_BKSH.astype(jnp.float32)
  o_BKGH = jnp.einsum("BKGS,BKSH->BKGH", p_BKGS.astype(v_BKSH.dtype), v_BKSH,
                      preferred_element_type=jnp.float32)
  o_BKGH = o_BKGH + p_new_BKG[..., None] * v_new_BKH.astype(jnp.float32)[:, :, None, :]
  o_BKGH = o_BKGH / jnp.where(l_BKG > 0, l_BKG, 1.0)[..., None]
  return o_BKGH.reshape(B, N, H).astype(q_BNH.dtype)
