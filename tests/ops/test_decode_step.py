"""The XLA decode step (``attnlab.ops.decode.decode_step_attention``) against the reference.

The reference sees the same keys as one list: the cache transposed to
[B, S, K, H] (dequantized when int8) with the new key appended, at explicit
positions (-1 = empty), through ``reference_attention``'s mask.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.nn.kv_cache import dequantize, quantize
from attnlab.ops.decode import decode_step_attention
from attnlab.ops.reference import reference_attention
from tests import random_arrays
from tests.ops.tolerances import assert_bf16_close


@functools.partial(jax.jit, static_argnames=("window",))
def _step(q, k_new, v_new, k, v, q_pos, new_pos, kv_pos, ks, vs, *, window):
  return decode_step_attention(q, k_new, v_new, k, v, q_positions_B=q_pos,
                               new_positions_B=new_pos, kv_positions_BS=kv_pos, window=window,
                               k_scale_BKS=ks, v_scale_BKS=vs)


@functools.partial(jax.jit, static_argnames=("window",))
def _reference(q, k_new, v_new, k, v, q_pos, new_pos, kv_pos, *, window):
  k_BSKH = jnp.concatenate([jnp.swapaxes(k, 1, 2), k_new[:, None]], axis=1)
  v_BSKH = jnp.concatenate([jnp.swapaxes(v, 1, 2), v_new[:, None]], axis=1)
  positions = jnp.concatenate([kv_pos, new_pos[:, None]], axis=1)
  return reference_attention(q[:, None], k_BSKH, v_BSKH, causal=True, window=window,
                             q_positions=q_pos[:, None], kv_positions=positions)[:, 0]


def _assert_matches_reference(q, k_new, v_new, k, v, q_pos, new_pos, kv_pos, *, window,
                              scales=(None, None), reference_kv=None):
  """The step over (k, v[, scales]) equals the reference over ``reference_kv`` (default k, v)."""
  got = _step(q, k_new, v_new, k, v, q_pos, new_pos, kv_pos, *scales, window=window)
  want = _reference(q, k_new, v_new, *(reference_kv or (k, v)), q_pos, new_pos, kv_pos,
                    window=window)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _inputs(B, S, N, K, H, seed):
  rng = random_arrays.rng(seed)
  q = random_arrays.normal(rng, (B, N, H))
  k_new, v_new = (random_arrays.normal(rng, (B, K, H)) for _ in range(2))
  k, v = (jax.device_put(3 * rng.standard_normal((B, K, S, H), np.float32)) for _ in range(2))
  return q, k_new, v_new, k, v


# (B, S, N, K, H, window, int8): MHA, GQA, MQA; windows that cut the cache; int8
CASES = [
    (2, 12, 4, 4, 8, None, False),
    (3, 20, 8, 2, 16, 5, False),
    (2, 9, 6, 1, 8, 1, False),
    (2, 16, 8, 2, 8, 7, True),
    (1, 33, 4, 1, 16, None, True),
]


@pytest.mark.parametrize("B,S,N,K,H,window,int8", CASES)
def test_decode_step_matches_reference(B, S, N, K, H, window, int8):
  q, k_new, v_new, k, v = _inputs(B, S, N, K, H, seed=S)
  rng = np.random.default_rng(S)
  # Cached positions out of order (a ring), some empty (-1); queries at distinct positions.
  kv_pos = np.stack([rng.permutation(S) - (S // 4) for _ in range(B)])
  kv_pos = jnp.asarray(np.where(kv_pos < 0, -1, kv_pos), jnp.int32)
  q_pos = jnp.asarray(rng.integers(S // 2, S, size=B), jnp.int32)
  if not int8:
    _assert_matches_reference(q, k_new, v_new, k, v, q_pos, q_pos, kv_pos, window=window)
    return
  (k8, ks), (v8, vs) = quantize(k), quantize(v)
  _assert_matches_reference(q, k_new, v_new, k8, v8, q_pos, q_pos, kv_pos, window=window,
                            scales=(ks, vs),
                            reference_kv=(dequantize(k8, ks), dequantize(v8, vs)))


def test_decode_step_keys_after_the_query_and_a_missing_new_key():
  B, S, N, K, H = 2, 10, 4, 2, 8
  q, k_new, v_new, k, v = _inputs(B, S, N, K, H, seed=1)
  kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  q_pos = jnp.array([4, 7], jnp.int32)
  # Row 0 has no new key (padding); slots at or past the query's position are
  # later keys a causal query must not see.
  new_pos = jnp.array([-1, 7], jnp.int32)
  _assert_matches_reference(q, k_new, v_new, k, v, q_pos, new_pos, kv_pos, window=None)


def test_decode_step_with_no_visible_key_returns_zeros():
  B, S, N, K, H = 1, 6, 4, 2, 8
  q, k_new, v_new, k, v = _inputs(B, S, N, K, H, seed=2)
  got = _step(q, k_new, v_new, k, v, jnp.array([3]), jnp.array([-1]),
              jnp.full((B, S), -1, jnp.int32), None, None, window=None)
  assert np.array_equal(np.asarray(got), np.zeros((B, N, H)))


def test_decode_step_bfloat16_error_is_the_references_own():
  """bfloat16 inputs: the step's error against float32 is at most a few times the
  reference op's own bfloat16 error (``tests/ops/tolerances.py``)."""
  B, S, N, K, H = 2, 24, 8, 2, 16
  bf = lambda x: x.astype(jnp.bfloat16)
  q, k_new, v_new, k, v = (bf(x) for x in _inputs(B, S, N, K, H, seed=3))
  kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  pos = jnp.array([S, S], jnp.int32)
  got = _step(q, k_new, v_new, k, v, pos, pos, kv_pos, None, None, window=None)
  assert got.dtype == jnp.bfloat16
  f32 = lambda x: x.astype(jnp.float32)
  ref_f32 = _reference(*(f32(x) for x in (q, k_new, v_new, k, v)), pos, pos, kv_pos, window=None)
  ref_bf16 = _reference(q, k_new, v_new, k, v, pos, pos, kv_pos, window=None)
  assert_bf16_close(got, ref_bf16, ref_f32, "decode step")
  # Values that cancel between the cache and the new token (equal scores: each of the 25
  # keys weighs 1 / 25): the sum over the cache is float32 (a bfloat16 one rounds 1000 + 1
  # to 1000, and the output to 0). Compiled without excess precision, as eager dispatch
  # runs it: by default XLA may keep a bfloat16 intermediate in float32, which hides it.
  cancelling = (jnp.zeros_like(q), k_new, jnp.full_like(v_new, -1000), k,
                jnp.zeros_like(v).at[:, :, 0].set(1000).at[:, :, 1].set(1))
  step = jax.jit(lambda *x: decode_step_attention(
      *x, q_positions_B=pos, new_positions_B=pos, kv_positions_BS=kv_pos)).lower(
          *cancelling).compile(compiler_options={"xla_allow_excess_precision": False})
  ref_f32 = _reference(*(f32(x) for x in cancelling), pos, pos, kv_pos, window=None)
  ref_bf16 = _reference(*cancelling, pos, pos, kv_pos, window=None)
  assert_bf16_close(step(*cancelling), ref_bf16, ref_f32, "decode step, cancelling values")


def test_decode_step_rejects_half_an_int8_cache():
  q, k_new, v_new, k, v = _inputs(1, 4, 4, 2, 8, seed=4)
  pos = jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match=r"^k_scale_BKS and v_scale_BKS must be given together "
                     r"\(int8 cache\) or not$"):
    decode_step_attention(q, k_new, v_new, k, v, q_positions_B=pos, new_positions_B=pos,
                          kv_positions_BS=jnp.zeros((1, 4), jnp.int32),
                          k_scale_BKS=jnp.ones((1, 2, 4)))


def test_decode_step_rejects_a_window_that_is_not_positive():
  """Returned zeros (no key seen) until 2026-12-05, where ``attention`` refuses it."""
  q, k_new, v_new, k, v = _inputs(1, 4, 4, 2, 8, seed=4)
  pos = jnp.zeros((1,), jnp.int32)
  for window in (0, -1, 2.5):
    with pytest.raises(ValueError, match=f"^window={window} must be a positive integer or None$"):
      decode_step_attention(q, k_new, v_new, k, v, q_positions_B=pos, new_positions_B=pos,
                            kv_positions_BS=jnp.zeros((1, 4), jnp.int32), window=window)


def test_decode_step_rejects_query_heads_that_do_not_group():
  q, k_new, v_new, k, v = _inputs(1, 4, 6, 4, 8, seed=4)
  pos = jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match="num_heads=6 must be a multiple of the cache's "
                     "num_kv_heads=4"):
    decode_step_attention(q, k_new, v_new, k, v, q_positions_B=pos, new_positions_B=pos,
                          kv_positions_BS=jnp.zeros((1, 4), jnp.int32))


def test_decode_step_first_token_at_position_0_sees_only_itself():
  """An empty cache and the sequence's first token: its own key (position 0) is the one
  key, so every head returns its KV head's new value."""
  B, S, N, K, H = 2, 5, 4, 2, 8
  q, k_new, v_new, k, v = _inputs(B, S, N, K, H, seed=5)
  zero = jnp.zeros((B,), jnp.int32)
  got = _step(q, k_new, v_new, k, v, zero, zero, jnp.full((B, S), -1, jnp.int32), None, None,
              window=None)
  np.testing.assert_allclose(np.asarray(got), np.repeat(np.asarray(v_new), N // K, axis=1),
                             rtol=1e-6)


def test_decode_step_softmax_is_stabilized_per_row():
  """Rows whose scores lie hundreds apart: each row's softmax subtracts its own max (one max
  over the batch would underflow the lower row to zeros)."""
  B, S, N, K, H = 2, 8, 4, 2, 8
  q, k_new, v_new, k, v = _inputs(B, S, N, K, H, seed=6)
  q = q * jnp.array([60.0, -60.0])[:, None, None]
  kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  pos = jnp.full((B,), S, jnp.int32)
  _assert_matches_reference(q, k_new, v_new, k, v, pos, pos, kv_pos, window=None)


def test_decode_step_custom_scale():
  """``scale=s`` is the default step on queries scaled by s * sqrt(H)."""
  B, S, N, K, H = 2, 6, 4, 2, 8
  q, k_new, v_new, k, v = _inputs(B, S, N, K, H, seed=7)
  kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  pos = jnp.full((B,), S, jnp.int32)
  kw = dict(q_positions_B=pos, new_positions_B=pos, kv_positions_BS=kv_pos)
  got = decode_step_attention(q, k_new, v_new, k, v, scale=0.9, **kw)
  want = decode_step_attention(q * 0.9 * np.sqrt(H), k_new, v_new, k, v, **kw)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  assert not np.allclose(np.asarray(got), np.asarray(decode_step_attention(q, k_new, v_new, k,
                                                                           v, **kw)))
