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
import numpy as np


def position_mask(q_pos, k_pos, *, causal: bool, window: int | None):
  """The position predicate: broadcasts ``q_pos`` against ``k_pos``.

  Works on Python ints, NumPy arrays and traced JAX arrays alike (the kernels
  call it on block indices as well as on positions), and is exact on int32 whatever
  the positions: a distance of 2**31 or more (a query near -2**31, a key near 0) is
  past every window, though its difference wraps (until 2026-12-06 such a key was seen).
  """
  ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), dtype=bool)
  if causal:
    ok = ok & (k_pos <= q_pos)
  if window is not None:
    ok = ok & jnp.logical_not(_exceeds(q_pos, k_pos, window - 1))
    if not causal:
      ok = ok & jnp.logical_not(_exceeds(k_pos, q_pos, window - 1))
  return ok


def segment_mask(q_segment_ids_BT, kv_segment_ids_BS):
  """[B, T, S] True where the query and the key belong to the same segment."""
  return q_segment_ids_BT[:, :, None] == kv_segment_ids_BS[:, None, :]


def _exceeds(a, b, c):
  """a - b > c for integers a, b and c >= 0, exact on int32 (traced) where a - b wraps: a
  difference of 2**31 or more wraps negative, and is more than any int32 c."""
  if isinstance(a, int) and isinstance(b, int):
    return a - b > c
  d = a - b
  return (a > b) & ((d > c) | (d < 0))


def _where(cond, a, b):
  # Python ints stay Python ints (static ranges for trace-time loops).
  if isinstance(cond, bool):
    return a if cond else b
  # A traced choice: a Python-int side past int32 (a static key's end past the last
  # position) is never the one chosen, but jnp.where would refuse it: clamped first. Python
  # ints go in as int32: with both sides weakly typed, Pallas' Triton lowering typed the
  # result as the condition (i1), and the kernels' `hi <= lo` on it failed to lower (every
  # non-causal call without a window, until 2026-12-07).
  a, b = (np.int32(min(max(x, -2**31), 2**31 - 1)) if isinstance(x, int) else x
          for x in (a, b))
  return jnp.where(cond, a, b)


def key_range(q_first, q_last, *, causal: bool, window: int | None, kv_len: int):
  """Half-open range [lo, hi) of key positions in [0, kv_len) that the queries at positions
  q_first..q_last (both included) can see; empty (hi <= lo) when q_last < q_first.

  The bounds follow from ``position_mask``: blocks wholly outside the range need neither
  be loaded nor computed. Works on traced integers, exact on int32 for every q_first <=
  q_last (the last query may sit at 2**31 - 1: an exclusive end would not fit, which
  emptied the kernels' last query block at the highest q_offset until 2026-12-06) and any
  window up to 2**31 - 1 (``checks.MAX_WINDOW``). Python ints give Python ints.
  """
  lo, hi = 0, kv_len
  if causal:  # keys <= q_last
    hi = _where(q_last < kv_len, q_last + 1, kv_len)
  if window is not None:  # keys > q_first - window; without causal, keys < q_last + window
    lo = _where(q_first > window - 1, q_first - (window - 1), 0)
    if not causal:
      hi = _where(q_last < kv_len - window, q_last + window, kv_len)
  return lo, _where(q_last < q_first, lo, hi)


def query_range(k_first, k_last, *, causal: bool, window: int | None, q_first, q_last):
  """Which of the queries at positions q_first..q_last (both included) see some key at
  k_first..k_last (key positions, >= 0): a half-open range of query INDICES [lo, hi),
  counted from q_first (0 <= lo <= hi <= q_last - q_first + 1; (0, 0) when none does).

  The transpose of ``key_range``, also derived from ``position_mask``: the dK/dV kernel
  visits only the query blocks of this range for a key block. Exact on int32 as
  ``key_range`` is (indices, not positions, come back: q_last + 1 may not fit). Works on
  traced integers; Python ints give Python ints.
  """
  lo, last = q_first, q_last
  if causal:  # queries >= k_first
    lo = _where(k_first > lo, k_first, lo)
  if window is not None:
    # queries < k_last + window: last = min(last, k_last + window - 1)
    last = _where(_exceeds(last, k_last, window - 1), k_last + (window - 1), last)
    if not causal:  # queries > k_first - window: lo = max(lo, k_first - window + 1)
      lo = _where(_exceeds(k_first, lo, window - 1), k_first - (window - 1), lo)
  empty = (last < lo) | (k_last < k_first)
  return _where(empty, 0, lo - q_first), _where(empty, 0, last - q_first + 1)


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
      positions (a ring-buffer cache, whose slots are not in order), in place of
      ``q_offset`` and the default ``arange(S)``: the ops refuse a ``q_offset``
      other than 0 beside ``q_positions`` (``checks.check_offset_or_positions``;
      ignored until 2026-12-07). A negative key position marks an empty slot.
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
