"""The mask predicate and its block bounds on traced int32 (what the kernels compute), at
small positions and at the int32 limits, against closed forms in Python ints (exact)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.ops import masks

BANDS = [(True, None), (False, 3), (True, 3), (False, None)]
TOP, BOTTOM = 2**31 - 1, -2**31
# (kv_len, query positions, key positions): small ones, and ones up to both int32 limits,
# where a difference or an end past the last position does not fit int32.
SMALL = (23, list(range(-5, 31, 3)), list(range(0, 26, 3)))
NEAR_LIMIT = (TOP - 1, [BOTTOM, BOTTOM + 1, BOTTOM + 5, -2**30, -7, -1, 0, 5, 2**30, TOP - 12,
                        TOP - 3, TOP - 2, TOP - 1, TOP],
              [0, 1, 5, 2**30, TOP - 12, TOP - 3, TOP - 2])
CASES = ([(c, w, SMALL) for c, w in BANDS]
         + [(c, w, NEAR_LIMIT) for c, w in ((False, 10), (True, 10), (False, TOP), (True, TOP),
                                            (False, 2**30), (True, None), (False, None),
                                            (False, 1))])
IDS = [f"{c}-{w}-{'small' if p is SMALL else 'near_int32_limits'}" for c, w, p in CASES]


def _sees(q, k, causal, window):
  """The definition, on Python ints."""
  return (not causal or k <= q) and (window is None or abs(q - k) < window or (
      causal and q - k < window))


def _key_range(q_first, q_last, causal, window, kv_len):
  """Closed form: the keys some query in [q_first, q_last] sees; None when empty."""
  lo, hi = 0, kv_len
  if causal:
    hi = min(hi, q_last + 1)
  if window is not None:
    lo = max(lo, q_first - window + 1)
    if not causal:
      hi = min(hi, q_last + window)
  return (lo, hi) if q_first <= q_last and lo < hi else None


def _query_range(k_first, k_last, causal, window, q_first, q_last):
  """Closed form: the query indices (from q_first) that see some key in [k_first, k_last]."""
  lo, last = q_first, q_last
  if causal:
    lo = max(lo, k_first)
  if window is not None:
    last = min(last, k_last + window - 1)
    if not causal:
      lo = max(lo, k_first - window + 1)
  return (lo - q_first, last - q_first + 1) if k_first <= k_last and lo <= last else (0, 0)


@pytest.mark.parametrize("causal,window,positions", CASES, ids=IDS)
def test_position_mask_on_int32_is_the_definition(causal, window, positions):
  """Every (query, key) pair, traced on int32 and on Python ints, against the definition:
  a query near -2**31 and a key near 0 are 2**31 apart, past every window, though their
  difference wraps (such keys were seen without causal until 2026-12-06)."""
  _, qs, ks = positions
  pairs = list(itertools.product(qs, ks))
  q_P, k_P = (jnp.array(x, jnp.int32) for x in zip(*pairs))
  traced = jax.jit(lambda q, k: masks.position_mask(q, k, causal=causal, window=window))(q_P,
                                                                                        k_P)
  want = [_sees(q, k, causal, window) for q, k in pairs]
  assert np.asarray(traced).tolist() == want
  assert [bool(masks.position_mask(q, k, causal=causal, window=window)) for q, k in pairs] == want


@pytest.mark.parametrize("causal,window,positions", CASES, ids=IDS)
def test_ranges_on_int32_are_the_closed_forms(causal, window, positions):
  """key_range / query_range, traced on int32 (in a kernel) and on Python ints, against
  their closed forms in Python ints: also with the last query at 2**31 - 1, where the end
  after it does not fit (the kernels' last query block at the highest q_offset saw no key
  until 2026-12-06), and queries near -2**31. Python ints must stay Python ints: the
  blocked op unrolls its loop over them."""
  kv_len, qs, ks = positions
  q_spans = [(a, b) for a, b in itertools.product(qs, qs) if a <= b] + [(5, 3)]
  k_spans = [(a, b) for a, b in itertools.product(ks, ks) if a <= b] + [(5, 3)]
  first, last = (jnp.array(x, jnp.int32) for x in zip(*q_spans))
  keys = jax.jit(jax.vmap(lambda a, b: masks.key_range(
      a, b, causal=causal, window=window, kv_len=kv_len)))(first, last)
  for p, (a, b) in enumerate(q_spans):
    want = _key_range(a, b, causal, window, kv_len)
    for got in ((int(keys[0][p]), int(keys[1][p])),
                masks.key_range(a, b, causal=causal, window=window, kv_len=kv_len)):
      assert all(type(x) is int for x in got)
      assert got == want if want else got[1] <= got[0], ("keys", a, b, got, want)
  k_first, k_last = (jnp.array(x, jnp.int32) for x in zip(*k_spans))
  # Query spans of up to 2**31 - 1 queries (the indices that come back fit int32).
  spans = ([(-5, 29), (1, 22), (4, 28)] if positions is SMALL else
           [(BOTTOM, BOTTOM + 5), (TOP - 12, TOP), (-7, 5), (0, 2**30), (2**30, TOP),
            (-2**30, 2**30 - 2), (BOTTOM, -2)])
  for q_first, q_last in spans:
    queries = jax.jit(jax.vmap(lambda a, b, c, d: masks.query_range(
        a, b, causal=causal, window=window, q_first=c, q_last=d), in_axes=(0, 0, None, None)))(
        k_first, k_last, jnp.int32(q_first), jnp.int32(q_last))
    for p, (a, b) in enumerate(k_spans):
      want = _query_range(a, b, causal, window, q_first, q_last)
      got = masks.query_range(a, b, causal=causal, window=window, q_first=q_first,
                              q_last=q_last)
      assert all(type(x) is int for x in got)
      assert (int(queries[0][p]), int(queries[1][p])) == got == want, ("queries", a, b,
                                                                        q_first, q_last)
  # Python-int keys against traced queries (a kernel's static key block): mixed operands
  # wrap as traced ones do.
  q_first, q_last = (jnp.array(x, jnp.int32) for x in zip(*spans))
  for a, b in k_spans[::7]:
    queries = jax.jit(jax.vmap(lambda c, d, a=a, b=b: masks.query_range(
        a, b, causal=causal, window=window, q_first=c, q_last=d)))(q_first, q_last)
    for p, (c, d) in enumerate(spans):
      assert (int(queries[0][p]), int(queries[1][p])) == _query_range(
          a, b, causal, window, c, d), ("queries of static keys", a, b, c, d)
