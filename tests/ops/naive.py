"""The textbook attention in NumPy float64, one query at a time: the independent
definition the reference op and the attention layer are tested against."""

import itertools

import numpy as np


def naive_attention(q, k, v, *, causal=False, window=None, q_seg=None, kv_seg=None, q_offset=0,
                    scale=None, q_pos=None, kv_pos=None):
  """One query at a time in NumPy float64: the textbook definition. ``q_pos`` /
  ``kv_pos`` ([B, T] / [B, S]) replace q_offset + t and s; a negative key
  position is an empty slot."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(H) if scale is None else scale
  out = np.zeros_like(q)
  for b, t, n in itertools.product(range(B), range(T), range(N)):
    kv_head = n // (N // K)
    qpos = q_offset + t if q_pos is None else q_pos[b, t]
    scores, values = [], []
    for s in range(S):
      kpos = s if kv_pos is None else kv_pos[b, s]
      if kpos < 0:
        continue
      if causal and kpos > qpos:
        continue
      if window is not None and (qpos - kpos >= window or (not causal and kpos - qpos >= window)):
        continue
      if q_seg is not None and q_seg[b, t] != kv_seg[b, s]:
        continue
      scores.append(q[b, t, n] @ k[b, s, kv_head] * scale)
      values.append(v[b, s, kv_head])
    if scores:
      w = np.exp(np.array(scores) - max(scores))
      out[b, t, n] = (w / w.sum()) @ np.array(values)
  return out


def naive_attention_grads(q, k, v, do, scale=None):
  """Unmasked attention and its gradients in NumPy float64, by the textbook formulas:
  (out, dq, dk, dv) for the output cotangent ``do`` (GQA: dk / dv summed over each KV
  head's query heads)."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  G = q.shape[2] // k.shape[2]
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  kq, vq = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # a KV head per query head
  s = np.einsum("btnh,bsnh->bnts", q, kq) * scale
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p, vq)
  dp = np.einsum("btnh,bsnh->bnts", do, vq)
  ds = p * (dp - np.einsum("btnh,btnh->bnt", do, out)[..., None])  # softmax's pullback
  dq = np.einsum("bnts,bsnh->btnh", ds, kq) * scale
  per_kv_head = lambda x: x.reshape(*x.shape[:2], k.shape[2], G, x.shape[-1]).sum(3)
  dk = per_kv_head(np.einsum("bnts,btnh->bsnh", ds, q) * scale)
  dv = per_kv_head(np.einsum("bnts,btnh->bsnh", p, do))
  return out, dq, dk, dv
