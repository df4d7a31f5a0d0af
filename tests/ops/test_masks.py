"""The mask predicates' block bounds on traced integers (what the kernels pass)."""

import itertools

import jax
import jax.numpy as jnp
import pytest

from attnlab.ops import masks

BANDS = [(True, None), (False, 3), (True, 3), (False, None)]


@pytest.mark.parametrize("causal,window", BANDS)
def test_ranges_on_traced_integers_equal_the_python_ints(causal, window):
  """key_range / query_range give the same bounds traced (in a kernel) as on Python ints.

  Python ints must stay Python ints: the blocked op unrolls its loop over them.
  """
  kv_len, q_start, q_stop = 23, 4, 30
  pairs = list(itertools.combinations(range(0, 31, 3), 2))
  lo_P, hi_P = (jnp.array(x, jnp.int32) for x in zip(*pairs))
  key_range = jax.jit(jax.vmap(lambda lo, hi: masks.key_range(
      lo, hi, causal=causal, window=window, kv_len=kv_len)))
  query_range = jax.jit(jax.vmap(lambda lo, hi: masks.query_range(
      lo, hi, causal=causal, window=window, q_lo=jnp.int32(q_start), q_hi=jnp.int32(q_stop))))
  traced_keys = [x.tolist() for x in key_range(lo_P, hi_P)]
  traced_queries = [x.tolist() for x in query_range(lo_P, hi_P)]
  for p, (lo, hi) in enumerate(pairs):
    k = masks.key_range(lo, hi, causal=causal, window=window, kv_len=kv_len)
    q = masks.query_range(lo, hi, causal=causal, window=window, q_lo=q_start, q_hi=q_stop)
    assert all(type(x) is int for x in k + q), (k, q)
    assert k == (traced_keys[0][p], traced_keys[1][p]), (lo, hi)
    assert q == (traced_queries[0][p], traced_queries[1][p]), (lo, hi)


@pytest.mark.parametrize("causal,window", [(False, 10), (True, 10), (False, 2**31 - 1),
                                           (True, 2**31 - 1), (False, 2**30)])
def test_ranges_near_the_int32_limit_equal_the_python_ints(causal, window):
  """The bounds' sums are written so that none leaves int32 for windows up to 2**31 - 1 and
  positions up to 2**31 - 1 (``key_range``'s comment): traced on int32 they equal the exact
  Python-int bounds there too. (Only the clamps' own terms differ near the limit, e.g.
  ``min(window, q_lo + 2)`` for ``q_lo + 1``: equal bounds everywhere else, so
  the small positions of the test above pass them.)"""
  top = 2**31 - 1
  edges = [0, 5, 2**30, top - 12, top - 3, top - 2, top - 1, top]
  pairs = list(itertools.combinations(edges, 2))
  lo_P, hi_P = (jnp.array(x, jnp.int32) for x in zip(*pairs))
  key_range = jax.jit(jax.vmap(lambda lo, hi: masks.key_range(
      lo, hi, causal=causal, window=window, kv_len=top)))
  query_range = jax.jit(jax.vmap(lambda lo, hi, q_lo, q_hi: masks.query_range(
      lo, hi, causal=causal, window=window, q_lo=q_lo, q_hi=q_hi), in_axes=(0, 0, None, None)))
  traced_keys = [x.tolist() for x in key_range(lo_P, hi_P)]
  for q_start, q_stop in ((0, top), (top - 20, top)):
    traced_queries = [x.tolist() for x in query_range(lo_P, hi_P, jnp.int32(q_start),
                                                      jnp.int32(q_stop))]
    for p, (lo, hi) in enumerate(pairs):
      k = masks.key_range(lo, hi, causal=causal, window=window, kv_len=top)
      q = masks.query_range(lo, hi, causal=causal, window=window, q_lo=q_start, q_hi=q_stop)
      assert k == (traced_keys[0][p], traced_keys[1][p]), ("keys", lo, hi, q_start)
      assert q == (traced_queries[0][p], traced_queries[1][p]), ("queries", lo, hi, q_start)
