"""Block skipping: the Pallas kernels never read a block that the mask excludes.

Masking inside a tile hides a read of an excluded block from a parity test
with finite inputs (``where(mask, s, -inf)`` zeroes its probabilities), so
these tests poison what must not be read:

* NaN in K / V at keys no query sees (before the window band, past the
  causal end, past a decode length), laid out so that every poisoned
  position lies in a block that the kernel must skip entirely. A kernel that
  visits such a block computes ``0 * NaN = NaN`` in ``p @ V`` (forward, dQ's
  ``dO V^T``) or ``dS^T Q`` (dK/dV) and the NaN reaches the output.
* NaN in Q and dO at query rows that see no key: the dK/dV kernel must not
  visit their query blocks.
* A tile mask that turns a wholly masked tile into a fully visible one: the
  result changes iff the kernel computes a tile in which no query sees any
  key, which catches bounds that are too wide by a single block even where
  the skipped block holds keys that other blocks legitimately read.

Every result is compared with the reference op on the clean inputs (the
reference masks with ``where`` after ``Q K^T`` and multiplies masked
probabilities by V, so NaN would leak into it too).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.ops.pallas import common, decode, flash, flash_gpu
from attnlab.ops.reference import reference_attention
from tests import random_arrays
from tests.ops.flash_inputs import decode_reference

# The contiguous decode kernel picks its tile (at most 128 keys in interpret
# mode, a power of two): positions aligned to 128 are tile boundaries.
DECODE_TILE_ALIGN = 128


def _normal(seed, shape):
  return random_arrays.normal(seed, shape)


def _value_and_grads(fn):
  def run(q, k, v, do):
    out, pullback = jax.vjp(fn, q, k, v)
    return (out, *pullback(do))

  return jax.jit(run)


def _assert_matches(got, want, names, atol=2e-5):
  for name, a, b in zip(names, got, want):
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.isfinite(a)), f"{name}: NaN/inf leaked from a block that must be skipped"
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=atol, err_msg=name)


def _flash_vs_reference(q, k, v, do, clean, kw, block_q, block_k):
  """(out, dq, dk, dv) of the kernel on (q, k, v, do) vs the reference on ``clean``, both
  in one program (one compilation, not two)."""
  reference = _value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))
  kernel = _value_and_grads(lambda q, k, v: flash.flash_attention(
      q, k, v, block_q=block_q, block_k=block_k, **kw))
  got, want = jax.jit(lambda args, clean: (kernel(*args), reference(*clean)))((q, k, v, do),
                                                                               clean)
  _assert_matches(got, want, ("out", "dq", "dk", "dv"))


# (causal, window, q_offset_B, T, S): queries [off, off + T) of a longer
# sequence; keys no query of a row sees form whole 16-key blocks.
DEAD_KEY_CASES = [
    (True, 16, (64, 40), 32, 128),   # live keys [49, 96) and [25, 72)
    (False, 9, (64, 40), 32, 128),   # symmetric band: [56, 104) and [32, 80)
    (True, None, (0, 32), 32, 128),  # causal end: [0, 32) and [0, 64)
]


@pytest.mark.parametrize("causal,window,offsets,T,S", DEAD_KEY_CASES)
def test_flash_never_reads_key_blocks_outside_the_band(causal, window, offsets, T, S):
  """Forward, dQ and dK/dV kernels: NaN K / V in dead key blocks do not leak."""
  B, N, K, H, bq, bk = 2, 4, 2, 16, 8, 16
  q, k, v, do = (_normal(i, s) for i, s in enumerate(
      [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)]))
  off_B = np.array(offsets, np.int32)
  q_pos_BT = off_B[:, None] + np.arange(T)
  k_pos = np.arange(S)
  # Key s is live for row b if some query of the row sees it; a key block is
  # dead if none of its keys is live. Poison every key of every dead block (in NumPy).
  seen_BTS = np.ones((B, T, S), bool)
  if causal:
    seen_BTS &= k_pos <= q_pos_BT[:, :, None]
  if window is not None:
    seen_BTS &= q_pos_BT[:, :, None] - k_pos < window
    if not causal:
      seen_BTS &= k_pos - q_pos_BT[:, :, None] < window
  live_block_BJ = seen_BTS.any(axis=1).reshape(B, S // bk, bk).any(axis=2)
  dead_BS = ~np.repeat(live_block_BJ, bk, axis=1)
  assert int(dead_BS.sum()) >= 3 * bk, "the case must have dead key blocks to poison"
  poison = lambda x: jax.device_put(np.where(dead_BS[:, :, None, None], np.float32(np.nan),
                                             np.asarray(x)))
  kw = dict(causal=causal, window=window, q_offset=jnp.asarray(off_B))
  _flash_vs_reference(q, poison(k), poison(v), do, (q, k, v, do), kw, bq, bk)


# S = 25: the last key block is part padding (keys 25..31), whose rows a bound taken
# from the padded block's end (32 + window - 1) would visit one query block too far.
@pytest.mark.parametrize("causal,S", [(True, 32), (False, 32), (True, 25)])
def test_flash_dkv_never_reads_query_blocks_that_see_nothing(causal, S):
  """Rows at positions >= S + window - 1 see no key: NaN Q / dO there do not leak."""
  B, T, N, K, H, window, bq, bk = 1, 64, 4, 2, 16, 8, 8, 16
  q, k, v, do = (_normal(10 + i, s) for i, s in enumerate(
      [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)]))
  first_dead = -(-(S + window - 1) // bq) * bq  # the first query block with no live row
  dead_T = np.arange(T) >= first_dead
  poison = lambda x: jax.device_put(np.where(dead_T[None, :, None, None], np.float32(np.nan),
                                             np.asarray(x)))
  kw = dict(causal=causal, window=window)
  _flash_vs_reference(poison(q), k, v, poison(do), (q, k, v, do), kw, bq, bk)


# (B, T, N, K, H, causal, window, q_offset, block_q, block_k)
TILE_CASES = [
    (2, 40, 4, 2, 16, True, 11, (0, 23), 8, 8),
    (1, 24, 2, 1, 16, False, 5, 0, 8, 4),
    (1, 33, 4, 4, 16, True, None, 0, 4, 8),
    (2, 9, 8, 2, 16, True, 6, (30, 0), 4, 4),
    # Row 1's last query block holds one real query (position 8) and 7 padding rows: its
    # key blocks end at the real queries' end, not at the padded block's (key block 3).
    (2, 9, 8, 2, 16, True, 6, (30, 0), 8, 4),
    # The same last block at offset 1: its one query (position 9) sees keys from 4, the
    # first of key block 1; a first position taken one row early (8) would visit block 0.
    (1, 9, 8, 2, 16, True, 6, 1, 8, 4),
]


@pytest.mark.parametrize("B,T,N,K,H,causal,window,q_offset,block_q,block_k", TILE_CASES)
def test_flash_visits_only_tiles_with_a_visible_key(B, T, N, K, H, causal, window, q_offset,
                                                   block_q, block_k, monkeypatch):
  """No kernel computes a tile in which no query sees any key.

  The tile mask is replaced by one that makes a wholly masked tile fully
  visible, so any such tile that a kernel visits changes its result. The
  bounds from ``masks.key_range`` / ``query_range`` are exact, so with
  positions alone (no segment ids) every tile a kernel should visit has a
  visible pair and the result must still equal the reference's.
  """
  tile_mask = flash_gpu.tile_mask

  def poisoned_tile_mask(*args):
    ok = tile_mask(*args)
    return ok | ~jnp.any(ok)

  monkeypatch.setattr(flash_gpu, "tile_mask", poisoned_tile_mask)
  S = max(T + np.max(q_offset), 1) if causal else T
  q, k, v, do = (_normal(20 + i, s) for i, s in enumerate(
      [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)]))
  kw = dict(causal=causal, window=window, q_offset=jnp.broadcast_to(jnp.array(q_offset), (B,)))
  _flash_vs_reference(q, k, v, do, (q, k, v, do), kw, block_q, block_k)


def _dead_positions(S, lengths_B, T, window, align):
  """[B, S] True at keys in ``align``-aligned blocks wholly before the band or past the length
  (in NumPy)."""
  lengths_B = np.asarray(lengths_B)
  pos = np.arange(S)
  band_lo_B = lengths_B - T - (window - 1 if window is not None else lengths_B)
  before_B = (np.maximum(band_lo_B, 0) // align) * align
  past_B = -(-lengths_B // align) * align
  return (pos < before_B[:, None]) | (pos >= past_B[:, None])


@pytest.mark.parametrize("window,num_splits", [(None, 3), (150, 1), (150, 4)])
def test_decode_never_reads_tiles_outside_the_band(window, num_splits):
  """NaN K / V in tiles wholly before the window band or past the length do not leak."""
  B, T, S, N, K, H = 3, 2, 512, 4, 2, 16
  q, k, v = _normal(30, (B, T, N, H)), _normal(31, (B, S, K, H)), _normal(32, (B, S, K, H))
  lengths_B = jnp.array([500, 250, 2], jnp.int32)
  dead_BS = _dead_positions(S, lengths_B, T, window, DECODE_TILE_ALIGN)
  assert bool(dead_BS[0, :128].all()) == (window is not None) and bool(dead_BS[1, 256:].all())
  poison = lambda x: jax.device_put(np.where(dead_BS[:, :, None, None], np.float32(np.nan),
                                             np.asarray(x)))
  got, want = jax.jit(lambda q, k, v, l, clean_k, clean_v: (  # one program: one compilation
      decode.decode_attention(q, k, v, l, window=window, num_splits=num_splits),
      decode_reference(q, clean_k, clean_v, l, window)))(
          q, poison(k), poison(v), lengths_B, k, v)
  _assert_matches([got], [want], ["out"])


@pytest.mark.parametrize("window,pages_per_split", [(None, 3), (20, 1), (20, None)])
def test_paged_decode_never_reads_pages_outside_the_band(window, pages_per_split):
  """NaN pages before the window band, and past the length, are never read.

  Table entries past a sequence's last page point at NaN pages (the kernel
  must not read them whatever they hold); a sequence's own pages wholly
  before its window band hold NaN too.
  """
  B, T, N, K, H, C, M = 2, 3, 4, 2, 16, 8, 12
  S = M * C
  q, k, v = _normal(40, (B, T, N, H)), _normal(41, (B, S, K, H)), _normal(42, (B, S, K, H))
  lengths_B = jnp.array([90, 35], jnp.int32)
  dead_BS = _dead_positions(S, lengths_B, T, window, C)
  poison = lambda x: np.where(dead_BS[:, :, None, None], np.float32(np.nan), np.asarray(x))
  # Sequence b's page m is pool page b * M + m; a spare NaN page P - 1 fills
  # the table past the length. (In NumPy: no program per op.)
  P = B * M + 1
  table_BM = np.arange(B * M, dtype=np.int32).reshape(B, M)
  pages_used_B = -(-np.asarray(lengths_B) // C)
  table_BM = jax.device_put(np.where(np.arange(M) < pages_used_B[:, None], table_BM,
                                     np.int32(P - 1)))

  def pool(x_BSKH):
    pages = x_BSKH.reshape(B * M, C, K, H)
    return jax.device_put(np.concatenate([pages, np.full((1, C, K, H), np.nan, np.float32)],
                                         axis=0))

  got, want = jax.jit(lambda q, k_pages, v_pages, table, l, k, v: (  # one program
      decode.paged_decode_attention(q, k_pages, v_pages, table, l, window=window,
                                    pages_per_split=pages_per_split),
      decode_reference(q, k, v, l, window)))(
          q, pool(poison(k)), pool(poison(v)), table_BM, lengths_B, k, v)
  _assert_matches([got], [want], ["out"])


@pytest.mark.parametrize("lo,hi,block,want", [
    (0, 8, 4, (0, 2)), (5, 9, 4, (1, 3)), (3, 4, 4, (0, 1)),  # partial blocks count
    (5, 5, 4, (0, 0)), (6, 5, 4, (0, 0)), (0, 0, 4, (0, 0)),  # empty: no block at all
    (-3, 0, 4, (0, 0)), (-3, 2, 4, (0, 1)),  # a window reaching before position 0
    (-5, 2, 4, (0, 1)),  # more than a block before 0: not block -1 (-5 // 4 truncates to -1)
])
def test_block_bounds_cover_exactly_the_blocks_of_the_range(lo, hi, block, want):
  """The loop bounds of every kernel: [lo, hi) -> blocks [first, last) that hold a
  position of the range, and (0, 0) for an empty range (no block visited)."""
  first, last = common.block_bounds(lo, hi, block)
  assert (int(first), int(last)) == want
