"""The mask predicates' block bounds on traced integers (what the kernels pass)."""

import itertools

import jax
import jax.numpy as jnp
import pytest

from attnlab.ops import masks

BANDS = [(True, None), (False, 3), (True, 3), (False, None)]
TOP = 2**31 - 1
# (kv_len, (lo, hi) pairs, query spans): small positions, and positions and windows up to
# the int32 limit, where the bounds' clamps keep every sum inside int32 (``key_range``'s
# comment) and only those clamps' own terms (``min(window, q_lo + 1)``, ...) decide.
SMALL = (23, list(itertools.combinations(range(0, 31, 3), 2)), [(4, 30)])
NEAR_LIMIT = (TOP, list(itertools.combinations(
    [0, 5, 2**30, TOP - 12, TOP - 3, TOP - 2, TOP - 1, TOP], 2)), [(0, TOP), (TOP - 20, TOP)])
CASES = ([(c, w, SMALL) for c, w in BANDS]
         + [(c, w, NEAR_LIMIT) for c, w in ((False, 10), (True, 10), (False, TOP), (True, TOP),
                                            (False, 2**30))])


@pytest.mark.parametrize("causal,window,positions", CASES,
                         ids=[f"{c}-{w}-{'small' if p is SMALL else 'near_int32_limit'}"
                              for c, w, p in CASES])
def test_ranges_on_traced_integers_equal_the_python_ints(causal, window, positions):
  """key_range / query_range give the same bounds traced (in a kernel) on int32 as on
  Python ints, which are exact: also at positions and windows up to 2**31 - 1.

  Python ints must stay Python ints: the blocked op unrolls its loop over them.
  """
  kv_len, pairs, spans = positions
  lo_P, hi_P = (jnp.array(x, jnp.int32) for x in zip(*pairs))
  key_range = jax.jit(jax.vmap(lambda lo, hi: masks.key_range(
      lo, hi, causal=causal, window=window, kv_len=kv_len)))
  query_range = jax.jit(jax.vmap(lambda lo, hi, q_lo, q_hi: masks.query_range(
      lo, hi, causal=causal, window=window, q_lo=q_lo, q_hi=q_hi), in_axes=(0, 0, None, None)))
  traced_keys = [x.tolist() for x in key_range(lo_P, hi_P)]
  for q_start, q_stop in spans:
    traced_queries = [x.tolist() for x in query_range(lo_P, hi_P, jnp.int32(q_start),
                                                      jnp.int32(q_stop))]
    for p, (lo, hi) in enumerate(pairs):
      k = masks.key_range(lo, hi, causal=causal, window=window, kv_len=kv_len)
      q = masks.query_range(lo, hi, causal=causal, window=window, q_lo=q_start, q_hi=q_stop)
      assert all(type(x) is int for x in k + q), (k, q)
      assert k == (traced_keys[0][p], traced_keys[1][p]), ("keys", lo, hi)
      assert q == (traced_queries[0][p], traced_queries[1][p]), ("queries", lo, hi, q_start)
