"""Online-softmax attention over key blocks with a FlashAttention-2 backward.

``chunked_attention`` walks the keys in blocks of ``block_k`` with
``lax.scan``, keeping a float32 running max, sum and accumulator per query:
memory O(T x block) instead of O(T x S), forward and backward, on every
backend. The custom VJP recomputes a block's probabilities from the saved
log-sum-exp. Keys carry explicit positions (-1 = empty), so it also serves
requests over KV caches whose slots are not in position order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attnlab.ops import checks, masks
from attnlab.ops.reference import group_queries


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
  scale = checks.scale_value(scale, H)
  # Also when called directly, not via attention: "false" would be a truthy causal.
  causal, q_offset = checks.check_causal(causal), checks.check_q_offset(q_offset, B, T)
  checks.check_offset_or_positions(q_offset, q_positions)
  window = checks.check_window(window)
  checks.check_ids_fit_int32(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                             q_positions=q_positions, kv_positions=kv_positions)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  checks.check_query_heads(q_BTNH, num_kv_heads=k_BSKH.shape[2], head_dim=k_BSKH.shape[3])
  if not checks.is_integer(block_k) or block_k < 1:  # 2.5 was a TypeError naming no argument
    raise ValueError(f"block_k={block_k!r} must be a positive integer")
  block_k = max(1, min(int(block_k), S))  # S = 0: a scan over no key block (every query sees none)
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
      causal, window, scale, block_k,
  )


def _blocks(x_BS, block_k):
  """[B, S, ...] -> [n, B, c, ...] for scanning over the n = S / c key blocks of c = block_k."""
  B, S = x_BS.shape[:2]
  return jnp.swapaxes(x_BS.reshape(B, S // block_k, block_k, *x_BS.shape[2:]), 0, 1)


def _block_scores(q_BTKGH, k_BcKH, q_pos_BT, k_pos_Bc, q_seg_BT, k_seg_Bc, causal, window, scale):
  """Masked float32 scores [B, K, G, T, c] of all queries against one key block."""
  s_BKGTc = jnp.einsum(
      "BTKGH,BcKH->BKGTc", q_BTKGH, k_BcKH, preferred_element_type=jnp.float32
  ) * scale
  mask_BTc = masks.position_mask(
      q_pos_BT[:, :, None], k_pos_Bc[:, None, :], causal=causal, window=window
  )
  mask_BTc &= (k_pos_Bc >= 0)[:, None, :] & masks.segment_mask(q_seg_BT, k_seg_Bc)
  return jnp.where(mask_BTc[:, None, None], s_BKGTc, -jnp.inf)


def _key_blocks(k_BSKH, v_BSKH, k_pos_BS, k_seg_BS, block_k):
  return (_blocks(k_BSKH, block_k), _blocks(v_BSKH, block_k), _blocks(k_pos_BS, block_k),
          _blocks(k_seg_BS, block_k))


def _chunked_forward(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, causal,
                     window, scale, block_k):
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  G = N // K
  q_BTKGH = group_queries(q_BTNH, K)

  def step(carry, x):
    m_BKGT, l_BKGT, acc_BKGTH = carry
    k_BcKH, v_BcKH, k_pos_Bc, k_seg_Bc = x
    s_BKGTc = _block_scores(q_BTKGH, k_BcKH, q_pos_BT, k_pos_Bc, q_seg_BT, k_seg_Bc, causal,
                            window, scale)
    m_new_BKGT = jnp.maximum(m_BKGT, jnp.max(s_BKGTc, axis=-1))
    m_safe_BKGT = jnp.where(jnp.isfinite(m_new_BKGT), m_new_BKGT, 0.0)
    alpha_BKGT = jnp.exp(m_BKGT - m_safe_BKGT)
    p_BKGTc = jnp.exp(s_BKGTc - m_safe_BKGT[..., None])
    l_BKGT = alpha_BKGT * l_BKGT + jnp.sum(p_BKGTc, axis=-1)
    acc_BKGTH = alpha_BKGT[..., None] * acc_BKGTH + jnp.einsum(
        "BKGTc,BcKH->BKGTH", p_BKGTc.astype(v_BSKH.dtype), v_BcKH,
        preferred_element_type=jnp.float32,
    )
    return (m_new_BKGT, l_BKGT, acc_BKGTH), None

  init = (
      jnp.full((B, K, G, T), -jnp.inf, jnp.float32),
      jnp.zeros((B, K, G, T), jnp.float32),
      jnp.zeros((B, K, G, T, H), jnp.float32),
  )
  (m_BKGT, l_BKGT, acc_BKGTH), _ = jax.lax.scan(
      step, init, _key_blocks(k_BSKH, v_BSKH, k_pos_BS, k_seg_BS, block_k))
  seen_BKGT = l_BKGT > 0
  l_safe_BKGT = jnp.where(seen_BKGT, l_BKGT, 1.0)
  out_BKGTH = acc_BKGTH / l_safe_BKGT[..., None]
  # A row that saw no key gets lse = +inf, so its backward probabilities are 0.
  lse_BKGT = jnp.where(seen_BKGT, m_BKGT + jnp.log(l_safe_BKGT), jnp.inf)
  out_BTNH = jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H)
  return out_BTNH.astype(q_BTNH.dtype), lse_BKGT


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _chunked(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, causal, window,
             scale, block_k):
  return _chunked_forward(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS,
                          causal, window, scale, block_k)[0]


def _chunked_fwd(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, causal, window,
                 scale, block_k):
  out_BTNH, lse_BKGT = _chunked_forward(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT,
                                        k_seg_BS, causal, window, scale, block_k)
  return out_BTNH, (q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, out_BTNH,
                    lse_BKGT)


def _chunked_bwd(causal, window, scale, block_k, res, dout_BTNH):
  q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, out_BTNH, lse_BKGT = res
  K = k_BSKH.shape[2]
  q_BTKGH = group_queries(q_BTNH, K)
  do_BTKGH = group_queries(dout_BTNH, K)
  # D_t = sum_h dO_th O_th: the softmax Jacobian's diagonal correction.
  delta_BTKG = jnp.sum(
      do_BTKGH.astype(jnp.float32) * group_queries(out_BTNH, K).astype(jnp.float32), axis=-1
  )
  delta_BKGT = jnp.transpose(delta_BTKG, (0, 2, 3, 1))

  # dS and P enter their products in the wider dtype of the pair each meets: a float32 q's
  # dQ = dS K over bfloat16 keys rounded dS to bfloat16 until 2026-12-06 (the reference's
  # did not); with one dtype for q, k and v nothing changes.
  qk_dtype = jnp.promote_types(q_BTNH.dtype, k_BSKH.dtype)
  pv_dtype = jnp.promote_types(do_BTKGH.dtype, v_BSKH.dtype)

  def step(dq_BTKGH, x):
    k_BcKH, v_BcKH, k_pos_Bc, k_seg_Bc = x
    s_BKGTc = _block_scores(q_BTKGH, k_BcKH, q_pos_BT, k_pos_Bc, q_seg_BT, k_seg_Bc, causal,
                            window, scale)
    p_BKGTc = jnp.exp(s_BKGTc - lse_BKGT[..., None])
    dv_BcKH = jnp.einsum("BKGTc,BTKGH->BcKH", p_BKGTc.astype(pv_dtype), do_BTKGH,
                         preferred_element_type=jnp.float32)
    dp_BKGTc = jnp.einsum("BTKGH,BcKH->BKGTc", do_BTKGH, v_BcKH,
                          preferred_element_type=jnp.float32)
    ds_BKGTc = p_BKGTc * (dp_BKGTc - delta_BKGT[..., None]) * scale
    dq_BTKGH = dq_BTKGH + jnp.einsum("BKGTc,BcKH->BTKGH", ds_BKGTc.astype(qk_dtype), k_BcKH,
                                     preferred_element_type=jnp.float32)
    dk_BcKH = jnp.einsum("BKGTc,BTKGH->BcKH", ds_BKGTc.astype(qk_dtype), q_BTKGH,
                         preferred_element_type=jnp.float32)
    return dq_BTKGH, (dk_BcKH, dv_BcKH)

  dq_BTKGH, (dk_nBcKH, dv_nBcKH) = jax.lax.scan(
      step, jnp.zeros(q_BTKGH.shape, jnp.float32),
      _key_blocks(k_BSKH, v_BSKH, k_pos_BS, k_seg_BS, block_k))

  def unblock(x_nBcKH):
    return jnp.swapaxes(x_nBcKH, 0, 1).reshape(k_BSKH.shape)

  return (
      dq_BTKGH.reshape(q_BTNH.shape).astype(q_BTNH.dtype),
      unblock(dk_nBcKH).astype(k_BSKH.dtype),
      unblock(dv_nBcKH).astype(v_BSKH.dtype),
      None, None, None, None,
  )


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
