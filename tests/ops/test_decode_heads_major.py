"""The heads-major Pallas decode kernel ([B, K, S, H], float or int8) against the reference.

Interpret mode on the CPU. The reference sees the same request as plain
attention over the (dequantized) cache transposed to [B, S, K, H]: the T
queries at positions lengths - T .. lengths - 1, causal, slots past the
length empty.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.nn.kv_cache import dequantize, quantize
from attnlab.ops.pallas import decode
from tests import random_arrays
from tests.ops.flash_inputs import decode_reference


@functools.partial(jax.jit, static_argnames=("window", "num_splits", "int8"))
def _kernel_and_reference(q, k, v, lengths, *, window, num_splits, int8):
  """(the kernel's output, the reference's) over the cache k, v [B, K, S, H] (int8: quantized
  per token, the reference over the dequantized cache), whose slots past each length hold
  garbage that a kernel reading them would not hide: float inf, which a weight of 0 does
  not hide either (0 x inf is NaN: the values past the length must be zeroed, as the paged
  kernel's are). One program: one compilation, not one per op."""
  ks = vs = None
  if int8:
    (k, ks), (v, vs) = quantize(k), quantize(v)
    k_ref, v_ref = dequantize(k, ks), dequantize(v, vs)
  else:
    k_ref, v_ref = k, v
  S = k.shape[2]
  past = jnp.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
  garbage = jnp.int8(100) if int8 else jnp.inf
  k, v = jnp.where(past, garbage, k).astype(k.dtype), jnp.where(past, garbage, v).astype(v.dtype)
  got = decode.decode_attention_heads_major(q, k, v, lengths, k_scale_BKS=ks, v_scale_BKS=vs,
                                            window=window, num_splits=num_splits,
                                            interpret=True)
  return got, decode_reference(q, jnp.swapaxes(k_ref, 1, 2), jnp.swapaxes(v_ref, 1, 2), lengths,
                               window)


# (B, T, S, N, K, H, lengths, window, num_splits, int8)
CASES = [
    (2, 1, 40, 4, 4, 16, [40, 7], None, None, False),  # MHA, one full, one short
    (2, 1, 300, 8, 2, 16, [300, 129], None, 2, False),  # GQA 4, several tiles and splits
    (1, 3, 64, 4, 1, 8, [20], 5, None, False),  # MQA, 3 queries, a window
    (2, 1, 200, 4, 2, 16, [200, 3], 33, 2, True),  # int8, GQA, window across tiles
    (2, 2, 50, 6, 3, 8, [50, 2], None, None, True),  # int8, 2 queries, GQA 2
]


@pytest.mark.parametrize("B,T,S,N,K,H,lengths,window,num_splits,int8", CASES)
def test_heads_major_decode_matches_reference(B, T, S, N, K, H, lengths, window, num_splits,
                                              int8):
  rng = random_arrays.rng(S + T)
  q = random_arrays.normal(rng, (B, T, N, H))
  k = random_arrays.normal(rng, (B, K, S, H))
  v = random_arrays.normal(rng, (B, K, S, H))
  got, want = _kernel_and_reference(q, k, v, jnp.array(lengths, jnp.int32), window=window,
                                    num_splits=num_splits, int8=int8)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_scales_must_come_with_an_int8_cache():
  q = jnp.zeros((1, 1, 2, 8))
  k = jnp.zeros((1, 1, 4, 8))
  with pytest.raises(ValueError, match=r"^k_scale_BKS / v_scale_BKS go with an int8 cache, and "
                     r"only with one \(cache dtype float32, scales given: True\)"):
    decode.decode_attention_heads_major(q, k, k, jnp.array([2]), k_scale_BKS=jnp.ones((1, 1, 4)),
                                        v_scale_BKS=jnp.ones((1, 1, 4)))
  with pytest.raises(ValueError, match=r"^k_scale_BKS / v_scale_BKS go with an int8 cache"):
    decode.decode_attention_heads_major(q, k.astype(jnp.int8), k.astype(jnp.int8), jnp.array([2]))


@pytest.mark.parametrize("kind,dtype", [("contiguous", None), ("contiguous", "int8"),
                                        ("ring", None), ("ring", "int8")])
def test_contiguous_and_ring_caches_decode_with_the_heads_major_kernel(monkeypatch, kind, dtype):
  """attention_impl="pallas": every decode step over the contiguous or ring cache runs
  the kernel (float or int8) and prefill + decode still equal the full forward. The
  ring (window 10) wraps around: 16 tokens per row."""
  from tests.decoding.test_cache_parity import TOKENS, decoder_cached
  from tests.decoding.tiny_models import decoder_forward

  calls = []
  kernel = decode.decode_attention_heads_major

  def counted(*args, **kwargs):
    calls.append(args[1].dtype)
    return kernel(*args, **kwargs)

  monkeypatch.setattr(decode, "decode_attention_heads_major", counted)
  name = "gqa_rope_window10"
  got, _ = decoder_cached.__wrapped__(name, kind, "pallas", dtype=dtype)
  assert len(calls) == 2 and all(c == (jnp.int8 if dtype else jnp.float32) for c in calls)
  full = decoder_forward(name)(TOKENS)
  tol = 1e-5 if dtype is None else 2e-2 * np.abs(full).max()  # int8: the tolerance of its tests
  np.testing.assert_allclose(got, full, atol=tol, rtol=0 if dtype else 1e-5)
