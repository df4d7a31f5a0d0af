"""Attention masks as predicates over positions.

A mask is a function ``(q_pos, k_pos) -> bool``: True where query position
``q_pos`` may attend to key position ``k_pos``. The reference op, the chunked
op, the Pallas kernels' block skipping and the ring-buffer cache all call the
same predicate, so they cannot disagree about which keys a query sees.

Conventions:
  * ``causal``: a query sees keys at its own position and before.
  * ``window=w``: a query sees keys less than ``w`` positions away, its own
    included (``window=1`` sees only itself). With ``causal`` that is the
    Mistral band ``q - w < k <= q``; without it, the symmetric band
    ``|q - k| < w``.
  * segment ids: a query sees a key only if their segment ids are equal
    (packing several documents in one row). Padding is segment id 0 on the
    key side; a padded query sees nothing from real segments.
"""

from __future__ import annotations

import jax.numpy as jnp


def position_mask(q_pos, k_pos, *, causal: bool, window: int | None):
  """The position predicate: broadcasts ``q_pos`` against ``k_pos``.

  Works on Python ints, NumPy arrays and traced JAX arrays alike (the kernels
  call it on block indices as well as on positions).
  """
  ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), dtype=bool)
  if causal:
    ok = ok & (k_pos <= q_pos)
  if window is not None:
    ok = ok & (q_pos - k_pos < window)
    if not causal:
      ok = ok & (k_pos - q_pos < window)
  return ok


def segment_mask(q_segment_ids_BT, kv_segment_ids_BS):
  """[B, T, S] True where the query and the key belong to the same segment."""
  return q_segment_ids_BT[:, :, None] == kv_segment_ids_BS[:, None, :]


def _minimum(a, b):
  # Python ints stay Python ints (static ranges for trace-time loops).
  return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _maximum(a, b):
  return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def key_range(q_lo, q_hi, *, causal: bool, window: int | None, kv_len: int):
  """Half-open range of key positions that queries in [q_lo, q_hi) can see.

  The bounds follow from ``position_mask``: blocks wholly outside the range
  need neither be loaded nor computed. Works on traced integers; Python ints
  give Python ints.
  """
  lo = 0
  hi = kv_len
  if causal:
    hi = _minimum(hi, q_hi)  # keys <= q_hi - 1
  if window is not None:
    # max(lo, q_lo - window + 1) and min(hi, q_hi - 1 + window), written so that no sum
    # leaves int32 however wide the window (up to 2**31 - 1, ``checks.MAX_WINDOW``).
    lo = _maximum(lo, q_lo + 1 - _minimum(window, q_lo + 1))
    if not causal:
      hi = _minimum(hi, q_hi - 1 + _minimum(window, hi - q_hi + 1))
  return lo, hi


def query_range(k_lo, k_hi, *, causal: bool, window: int | None, q_lo, q_hi):
  """Half-open range of query positions in [q_lo, q_hi) that see some key in [k_lo, k_hi).

  The transpose of ``key_range``, also derived from ``position_mask``: the
  dK/dV kernel visits only the query blocks of this range for a key block.
  Works on traced integers; Python ints give Python ints.
  """
  lo, hi = q_lo, q_hi
  if causal:
    lo = _maximum(lo, k_lo)  # q >= k for some k >= k_lo
  if window is not None:  # the sums kept inside int32, as in ``key_range``
    # min(hi, k_hi - 1 + window): q - k < window for some k <= k_hi - 1
    hi = _minimum(hi, k_hi - 1 + _minimum(window, hi - k_hi + 1))
    if not causal:
      # max(lo, k_lo - window + 1): k - q < window for some k >= k_lo
      lo = _maximum(lo, k_lo + 1 - _minimum(window, k_lo + 1 - lo))
  return lo, hi


def make_attention_mask(
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    window: int | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_offset=0,
    q_positions=None,
    kv_positions=None,
):
  """The full boolean mask [B, T, S] for a request (for the reference op).

  Args:
    batch, q_len, kv_len: B, T, S.
    causal, window: the position predicate (see ``position_mask``).
    q_segment_ids, kv_segment_ids: optional int [B, T] and [B, S].
    q_offset: int or int [B]: the position of the first query when queries
      are the tail of a longer sequence (decoding against a cache).
    q_positions, kv_positions: optional explicit int [B, T] / [B, S]
      positions (a ring-buffer cache, whose slots are not in order). Override
      ``q_offset`` and the default ``arange(S)``. A negative key position
      marks an empty slot.
  """
  if q_positions is None:
    offset_B = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (batch,))
    q_positions = offset_B[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
  if kv_positions is None:
    kv_positions = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
  mask_BTS = position_mask(
      q_positions[:, :, None], kv_positions[:, None, :], causal=causal, window=window
  )
  mask_BTS = mask_BTS & (kv_positions >= 0)[:, None, :]
  if q_segment_ids is not None or kv_segment_ids is not None:
    if q_segment_ids is None or kv_segment_ids is None:
      raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    mask_BTS = mask_BTS & segment_mask(q_segment_ids, kv_segment_ids)
  return jnp.broadcast_to(mask_BTS, (batch, q_len, kv_len))
