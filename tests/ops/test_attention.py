"""The attention operator: reference against independent definitions, and
every other implementation against the reference, forward and gradients."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.ops import masks
from attnlab.ops.chunked import chunked_attention
from attnlab.ops.dispatch import attention, auto_implementation
from attnlab.ops.reference import blocked_attention, reference_attention
from tests import random_arrays
from tests.ops.naive import naive_attention, naive_attention_grads


def jit_call(fn, q, k, v, **kw):
  """fn(q, k, v, **kw) under jit (the keyword arguments closed over): one compilation,
  not one per op as op-by-op execution on the CPU would cost."""
  return jax.jit(lambda q, k, v: fn(q, k, v, **kw))(q, k, v)


def make_qkv(B, T, S, N, K, H, seed=0, dtype=jnp.float32):
  rng = random_arrays.rng(seed)
  q = random_arrays.normal(rng, (B, T, N, H), dtype)
  k = random_arrays.normal(rng, (B, S, K, H), dtype)
  v = random_arrays.normal(rng, (B, S, K, H), dtype)
  return q, k, v


NAIVE_CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, window=3),
    dict(window=2),
    dict(causal=True, q_offset=4),
    dict(segments=True),
    dict(causal=True, segments=True),
    dict(scale=0.3),
    dict(causal=True, scale=2.5),
    dict(causal=True, positions=True),
    dict(causal=True, window=3, positions=True),
    dict(window=2, positions=True),
]

# Ring-buffer-like explicit positions: queries at 10..14 and 3..7, keys out of
# order with an empty slot (-1) in each row.
Q_POS = np.array([[10, 11, 12, 13, 14], [3, 4, 5, 6, 7]])
KV_POS = np.array([[12, -1, 10, 14, 11], [7, 3, 5, -1, 4]])


def naive_case(case, N, K, seed=0, dtype=jnp.float32):
  """q, k, v of a NAIVE_CASES entry, the op's keyword arguments and the naive result."""
  case = dict(case)
  B, T, H = 2, 5, 8
  S = T + case.get("q_offset", 0)
  q, k, v = make_qkv(B, T, S, N, K, H, seed=seed, dtype=dtype)
  kw = {}
  if case.pop("segments", False):
    q_seg = np.array([[1, 1, 2, 2, 2], [1, 1, 1, 1, 0]])
    kv_seg = q_seg.copy()
    kw = dict(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
    case.update(q_seg=q_seg, kv_seg=kv_seg)
  if case.pop("positions", False):
    kw = dict(q_positions=jnp.asarray(Q_POS), kv_positions=jnp.asarray(KV_POS))
    case.update(q_pos=Q_POS, kv_pos=KV_POS)
  want = naive_attention(q, k, v, **case)
  for name in ("q_seg", "kv_seg", "q_pos", "kv_pos"):
    case.pop(name, None)
  return (q, k, v), {**case, **kw}, want


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (4, 1)])
def test_reference_equals_naive_loop(N, K):
  """Every NAIVE_CASES entry, all in one program (the keyword arguments closed over)."""
  cases = [naive_case(case, N, K) for case in NAIVE_CASES]
  gots = jax.jit(lambda qkvs: [reference_attention(*qkv, **kw)
                               for qkv, (_, kw, _) in zip(qkvs, cases, strict=True)])(
      [qkv for qkv, _, _ in cases])
  for case, (_, _, want), got in zip(NAIVE_CASES, cases, gots, strict=True):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=str(case))


@pytest.mark.parametrize("impl", ["reference", "blocked", "chunked", "xla", "pallas", "auto"])
def test_the_dispatcher_passes_every_argument_to_every_implementation(impl):
  """``attention(..., implementation=impl)`` against the naive loop on every case the
  implementation takes (explicit positions: "reference", "chunked" and "auto" only):
  a scale, window, offset, segment ids or positions that the dispatcher dropped or
  replaced on its way to the op fails here. (A kernel's own tests call it directly.)"""
  takes_positions = impl in ("reference", "chunked", "auto")
  cases = []
  for case in NAIVE_CASES:
    if case.get("positions") and not takes_positions:
      continue
    if impl == "blocked" and not (case.get("causal") or "window" in case):
      continue  # nothing to skip: "blocked" is the reference in one block there
    cases.append((case, *naive_case(case, 4, 2, seed=3)))
  # One program for every case (the keyword arguments closed over): one compilation.
  gots = jax.jit(lambda qkvs: [attention(*qkv, implementation=impl, **kw)
                               for qkv, (_, _, kw, _) in zip(qkvs, cases, strict=True)])(
      [qkv for _, qkv, _, _ in cases])
  for (case, _, _, want), got in zip(cases, gots, strict=True):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=str(case))


@pytest.mark.parametrize("impl", ["reference", "blocked", "chunked", "xla", "pallas", "auto"])
def test_the_output_has_the_dtype_of_the_queries(impl):
  qkv, kw, want = naive_case(dict(causal=True, window=3), 4, 2, seed=4, dtype=jnp.bfloat16)
  got = jit_call(attention, *qkv, implementation=impl, **kw)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("impl", ["reference", "blocked", "chunked", "xla", "pallas", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_no_queries_or_no_keys_give_zeros_everywhere(impl, causal):
  """An empty query or key axis (or no batch rows, or no query heads): every
  implementation returns the queries' shape and dtype, zeros (a query that sees no key),
  and zero gradients. (`blocked` and so `auto` failed on T = 0, `chunked` and the
  reference on S = 0; "pallas" on B = 0 or N = 0 until 2026-12-04.)"""
  shapes = [(0, 9, 2, 4), (9, 0, 2, 4), (0, 0, 2, 4), (9, 9, 0, 4), (9, 9, 2, 0)]  # T, S, B, N
  qkvs = [(jnp.ones((B, T, N, 8), jnp.bfloat16), *[jnp.ones((B, S, 2, 8), jnp.bfloat16)] * 2)
          for T, S, B, N in shapes]
  fn = lambda q, k, v: attention(q, k, v, causal=causal, implementation=impl)
  grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), (0, 1, 2))
  # The forward passes and the gradients of every shape in one program: one compilation.
  results = jax.jit(lambda qkvs: [(fn(*qkv), grad(*qkv)) for qkv in qkvs])(qkvs)
  for shape, (q, k, v), (out, grads) in zip(shapes, qkvs, results, strict=True):
    assert out.shape == q.shape and out.dtype == q.dtype, shape
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape], shape
    assert not np.asarray(out, np.float32).any(), shape
    assert not any(np.asarray(g, np.float32).any() for g in grads), shape


@pytest.mark.parametrize("impl", ["blocked", "xla", "pallas"])
@pytest.mark.parametrize("given", ["q_positions", "kv_positions", "both"])
def test_explicit_positions_are_refused_by_name_where_unsupported(impl, given):
  (q, k, v), kw, _ = naive_case(dict(causal=True, positions=True), 4, 2)
  if given != "both":
    kw = {"causal": True, given: kw[given]}
  with pytest.raises(ValueError) as e:
    attention(q, k, v, implementation=impl, **kw)
  assert str(e.value) == (f"q_positions/kv_positions are supported by implementation="
                          f"'reference' or 'chunked', not {impl!r}")


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(causal=True), dict(causal=True, window=4), dict(window=3),
     dict(causal=True, q_offset=6), dict(segments=True, causal=True)],
    ids=str,
)
@pytest.mark.parametrize("N,K", [(8, 8), (8, 2), (8, 1)])
def test_reference_equals_jax_nn_xla(kw, N, K):
  kw = dict(kw)
  B, T, H = 2, 11, 16
  S = T + kw.get("q_offset", 0)
  q, k, v = make_qkv(B, T, S, N, K, H, seed=1)
  if kw.pop("segments", False):
    seg = jnp.array([[1] * 6 + [2] * 5, [1] * 9 + [0] * 2])
    kw.update(q_segment_ids=seg, kv_segment_ids=seg)
  want, got = jax.jit(lambda q, k, v: (  # one program: one compilation
      reference_attention(q, k, v, **kw), attention(q, k, v, implementation="xla", **kw)))(
      q, k, v)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _loss(impl, kw):
  def f(q, k, v):
    out = attention(q, k, v, implementation=impl, **kw)
    # A fixed random projection so every output element has its own weight.
    w = random_arrays.normal(9, out.shape)
    return jnp.sum(out.astype(jnp.float32) * w)

  return f


CHUNKED_CASES = [
    # (B, T, S, N, K, H, block, kwargs)
    (2, 37, 37, 8, 8, 16, 8, dict(causal=True)),
    (2, 37, 53, 8, 2, 16, 16, dict()),
    (1, 19, 45, 4, 1, 8, 7, dict(causal=True, q_offset=26)),
    (2, 33, 33, 8, 4, 16, 8, dict(causal=True, window=5)),
    (2, 33, 33, 4, 2, 16, 16, dict(window=9)),
    (2, 30, 30, 4, 1, 8, 8, dict(causal=True, segments=True)),
    (2, 30, 30, 8, 2, 8, 32, dict(segments=True)),
    (2, 1, 40, 8, 2, 16, 16, dict(causal=True, q_offset=39)),
]


@pytest.mark.parametrize("B,T,S,N,K,H,block,kw", CHUNKED_CASES, ids=str)
def test_chunked_equals_reference_forward_and_gradients(B, T, S, N, K, H, block, kw):
  kw = dict(kw)
  q, k, v = make_qkv(B, T, S, N, K, H, seed=2)
  if kw.pop("segments", False):
    # Two packed documents, then padding (segment 0) at the end of the row.
    seg_T = jnp.array([1] * (T // 2) + [2] * (T - T // 2 - 3) + [0] * 3)
    seg = jnp.stack([seg_T, jnp.roll(seg_T, 4)])
    kw.update(q_segment_ids=seg, kv_segment_ids=seg)

  def chunked(q, k, v):
    return chunked_attention(q, k, v, block_k=block, **kw)

  w = random_arrays.normal(9, (B, T, N, H))

  @jax.jit  # both forward passes and both gradients in one program: one compilation
  def run(q, k, v):
    return (reference_attention(q, k, v, **kw), chunked(q, k, v),
            jax.grad(_loss("reference", kw), argnums=(0, 1, 2))(q, k, v),
            jax.grad(lambda q, k, v: jnp.sum(chunked(q, k, v) * w), argnums=(0, 1, 2))(q, k, v))

  want, got, g_ref, g_chk = run(q, k, v)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for name, a, b in zip("qkv", g_chk, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("impl", [reference_attention, blocked_attention, chunked_attention],
                         ids=["reference", "blocked", "chunked"])
def test_an_explicit_scale_replaces_one_over_sqrt_h(impl):
  q, k, v = make_qkv(2, 9, 9, 4, 2, 8, seed=12)
  for scale in (0.05, 1.7):
    want = naive_attention(q, k, v, causal=True, scale=scale)
    np.testing.assert_allclose(jit_call(impl, q, k, v, causal=True, scale=scale), want,
                               atol=1e-5, rtol=1e-5)


def test_the_edges_of_what_the_checks_accept():
  """An integer 0-d array scale (traced: "reference" takes one) scales as its value does,
  and the lowest q_offset accepted, -2**31, is accepted (here without causal or window,
  so it changes nothing), as is the highest, 2**31 - T, whose last query sits at 2**31 - 1
  (causal: every query sees the 5 keys at 0..4). Until 2026-12-05 no test gave the first two:
  a validator that refused integer array scales, or -2**31, passed. The largest scale
  accepted is float32's largest number."""
  q, k, v = make_qkv(1, 3, 5, 2, 1, 8, seed=13)
  int_scale, plain, lowest, highest = jax.jit(lambda q, k, v, s: (
      attention(q, k, v, scale=s), attention(q, k, v, scale=2.0),
      attention(q, k, v, q_offset=np.int64(-2**31)),
      attention(q, k, v, causal=True, q_offset=2**31 - 3)))(q, k, v, jnp.int32(2))
  np.testing.assert_allclose(int_scale, plain, rtol=1e-6, atol=0)
  np.testing.assert_allclose(lowest, naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(highest, naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
  # The largest scale accepted, float32's largest number (over zero scores: uniform weights).
  zeros = jnp.zeros_like(q)
  np.testing.assert_allclose(attention(zeros, k, v, scale=float(np.finfo(np.float32).max)),
                             naive_attention(zeros, k, v), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", [reference_attention, blocked_attention, chunked_attention],
                         ids=["reference", "blocked", "chunked"])
def test_large_scores_and_rows_far_apart_stay_exact(impl):
  """Scores of +-50..100: each row needs its own max (one max for all rows
  underflows the low row to 0 / 0) and the max must be subtracted, not added
  (exp(200) overflows float32)."""
  x = np.linspace(0.5, 1.0, 6)
  q = jnp.asarray(np.array([100.0, -100.0]).reshape(1, 2, 1, 1) * np.ones((1, 2, 2, 1)),
                  jnp.float32)
  k = jnp.asarray(x.reshape(1, 6, 1, 1), jnp.float32)
  v = random_arrays.normal(13, (1, 6, 1, 4))
  v1 = v[..., :1]
  want = naive_attention(q, k, v1)
  got = jit_call(impl, q, k, v1)
  assert np.all(np.abs(want) > 1e-3)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_reference_in_bfloat16_matches_the_definition():
  """The bfloat16 path (scores scaled after the product, float32 softmax): a
  bfloat16 result close to the float64 definition on the same rounded inputs."""
  q, k, v = make_qkv(2, 12, 12, 8, 2, 32, seed=14, dtype=jnp.bfloat16)
  for kw in (dict(causal=True), dict(window=3), dict(causal=True, scale=0.6)):
    got = jit_call(reference_attention, q, k, v, **kw)
    assert got.dtype == jnp.bfloat16
    want = naive_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                           v.astype(jnp.float32), **kw)
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
    assert np.abs(np.asarray(got.astype(jnp.float32)) - want).mean() < 4e-3


def test_float32_queries_over_bfloat16_values_sum_the_values_in_float32():
  """Mixed dtypes (float32 q and k, bfloat16 v; "reference" and "chunked" take them): the
  weighted sum of the values accumulates and stays in float32 up to the float32 output.
  With q = 0 each key a query sees weighs exactly 1 (in bfloat16 too), so a causal row is
  the mean of the values it sees, which NumPy gives exactly; the P V product returned in
  v's dtype rounded the row sum 1 + 2**-8 to 1 (an error of 2**-9 in a mean of 1 / 2)."""
  B, T, N, K, H = 1, 4, 2, 1, 4
  q = jnp.zeros((B, T, N, H), jnp.float32)
  k = random_arrays.normal(18, (B, T, K, H))
  v_S = np.array([1.0, 2.0**-8, 3 * 2.0**-8, 2.0**-6])  # each exact in bfloat16
  v = jnp.asarray(v_S[None, :, None, None] * np.arange(1, H + 1), jnp.bfloat16)
  v32 = np.asarray(v, np.float32)
  want = np.cumsum(v32, axis=1) / np.arange(1, T + 1)[None, :, None, None]  # [B, T, K=1, H]
  want = np.broadcast_to(want, (B, T, N, H))
  np.testing.assert_allclose(naive_attention(q, k, v32, causal=True), want, rtol=1e-12)
  got = jax.jit(lambda q, k, v: [fn(q, k, v, causal=True)  # one program: one compilation
                                 for fn in (reference_attention, chunked_attention)])(q, k, v)
  for name, out in zip(["reference", "chunked"], got, strict=True):
    assert out.dtype == jnp.float32, name
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=0, err_msg=name)


def test_float32_queries_over_bfloat16_keys_get_a_float32_dq_from_every_implementation():
  """dQ = dS K with float32 q and bfloat16 k: "chunked" and the Pallas kernels (GPU-style and
  TPU, interpret mode) rounded dS to k's bfloat16 before the product (dq off by ~2e-3 of its
  largest entry until 2026-12-06, found by a review), where "reference" computes it in
  float32. Against float64 NumPy on the same (bfloat16-exact) keys: dq and dv (float32) to
  float32's precision, dk (returned in k's bfloat16) to its rounding."""
  from attnlab.ops.pallas import flash

  B, T, N, K, H = 1, 64, 2, 1, 64
  q, k, v = make_qkv(B, T, T, N, K, H, seed=24)
  k = k.astype(jnp.bfloat16)
  do = random_arrays.normal(25, (B, T, N, H))
  _, want_dq, want_dk, want_dv = naive_attention_grads(q, k.astype(jnp.float32), v, do)
  fns = {"reference": reference_attention,
         "chunked": lambda q, k, v: chunked_attention(q, k, v, block_k=16),
         "pallas": lambda q, k, v: flash.flash_attention(q, k, v, block_q=16, block_k=16,
                                                         interpret=True),
         "pallas tpu": lambda q, k, v: flash.flash_attention(q, k, v, block_q=16, block_k=16,
                                                             backend="tpu", interpret=True)}
  grads = jax.jit(lambda q, k, v, do: {name: jax.vjp(fn, q, k, v)[1](do)
                                       for name, fn in fns.items()})(q, k, v, do)
  for name, (dq, dk, dv) in grads.items():
    assert (dq.dtype, dk.dtype, dv.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32), name
    for what, got, want, rtol in (("dq", dq, want_dq, 2e-6), ("dv", dv, want_dv, 2e-6),
                                  ("dk", dk, want_dk, 2.0**-8)):
      err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
      assert err <= rtol, (name, what, err)


def test_chunked_dk_dv_of_bfloat16_queries_over_float32_keys_are_summed_in_float32():
  """Mixed dtypes the other way (bfloat16 q, so a bfloat16 output cotangent; float32 k and
  v): dK and dV are float32 and each key block's dS^T Q and P^T dO accumulate in float32.
  Two equal keys (every probability 1 / 2) with opposite values (the output 0, so D = 0) make
  dS = +-1 / 4 exactly: dK and dV are a quarter and a half of sums over the two query heads
  that need more bits than bfloat16 has (1 + 3 * 2**-8, ...); a product returned in its
  operands' bfloat16 rounded them."""
  B, S, K, H = 1, 2, 1, 4  # one query, two query heads
  q = jnp.asarray([[[[1.0] * H, [2.0**-8 * (2 * h + 1) for h in range(H)]]]], jnp.bfloat16)
  k = jnp.tile(random_arrays.normal(19, (B, 1, K, H)), (1, S, 1, 1))
  v = jnp.asarray(np.eye(H)[0] * np.array([1.0, -1.0])[:, None], jnp.float32)[None, :, None]
  do = jnp.asarray([[[[1.0] * H, [1.0, 2.0**-8, 3 * 2.0**-8, 2.0**-6]]]], jnp.bfloat16)
  _, want_dq, want_dk, want_dv = naive_attention_grads(
      q.astype(jnp.float32), k, v, do.astype(jnp.float32))
  dq, dk, dv = jax.jit(lambda q, k, v, do: jax.vjp(
      lambda q, k, v: chunked_attention(q, k, v, block_k=1), q, k, v)[1](do))(q, k, v, do)
  assert (dq.dtype, dk.dtype, dv.dtype) == (jnp.bfloat16, jnp.float32, jnp.float32)
  for name, got, want in [("dq", dq, want_dq), ("dk", dk, want_dk), ("dv", dv, want_dv)]:
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-6, atol=0,
                               err_msg=name)


def test_positions_and_segment_ids_past_2_to_the_24_are_compared_exactly():
  """Positions (a stream past 16.7M tokens: q_offset goes up to 2**31 - 1) and segment ids
  (document ids, say) are compared as int32. In float32, 2**30 + 10 ... 2**30 + 15 are one
  number (its spacing there is 128), so a causal query saw later keys, and segment ids
  2**24 and 2**24 + 1 were one document."""
  q, k, v = make_qkv(1, 4, 6, 2, 1, 8, seed=21)
  P = 2**30 + 10
  kv_pos = np.array([[P + 5, P - 1, P + 2, -1, P, P + 3]])  # a ring's slots, one empty
  q_seg = 2**24 + np.array([[0, 1, 0, 1]])
  kv_seg = 2**24 + np.array([[0, 1, 1, 0, 0, 1]])
  cases = [
      (dict(causal=True, q_offset=P, kv_positions=jnp.asarray(kv_pos)),
       naive_attention(q, k, v, causal=True, q_offset=P, kv_pos=kv_pos)),
      (dict(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg)),
       naive_attention(q, k, v, q_seg=q_seg, kv_seg=kv_seg)),
  ]
  fns = (reference_attention, chunked_attention)
  # Every call in one program (the keyword arguments closed over): one compilation.
  gots = jax.jit(lambda q, k, v: [[fn(q, k, v, **kw) for fn in fns] for kw, _ in cases])(
      q, k, v)
  for (kw, want), outs in zip(cases, gots, strict=True):
    for fn, got in zip(fns, outs, strict=True):
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5,
                                 err_msg=f"{fn.__name__} {sorted(kw)}")


def test_attention_dropout_drops_probabilities_at_the_rate_and_rescales_the_rest():
  """With one-hot values (v[s] = e_s) the output row is the probability row:
  each entry is either dropped (0) or the undropped probability / (1 - rate);
  about ``rate`` of them are dropped; a key reproduces its mask, another key
  draws another; the average over keys is the undropped output."""
  B, T, N, K, S, rate = 2, 16, 4, 1, 16, 0.25
  q, k, _ = make_qkv(B, T, S, N, K, S, seed=15)
  v = jnp.broadcast_to(jnp.eye(S)[None, :, None, :], (B, S, K, S))
  drop = jax.jit(lambda key: reference_attention(q, k, v, dropout_rate=rate, dropout_rng=key))
  p = np.asarray(jit_call(reference_attention, q, k, v))
  np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_array_equal(jit_call(reference_attention, q, k, v, dropout_rate=0.0,
                                         dropout_rng=jax.random.key(0)), p)
  outs = np.stack([np.asarray(drop(jax.random.key(i))) for i in range(48)])
  kept = outs != 0
  np.testing.assert_allclose(outs[kept], np.broadcast_to(p / (1 - rate), outs.shape)[kept],
                             rtol=1e-5)
  assert abs((1 - kept.mean()) - rate) < 0.01  # 98,304 entries: sd 0.0014
  np.testing.assert_array_equal(drop(jax.random.key(3)), outs[3])
  assert (outs[3] != outs[4]).any()
  assert abs(outs.mean(0).sum() / p.sum() - 1) < 0.01


def test_blocked_visits_each_query_block_against_exactly_the_keys_it_sees(monkeypatch):
  """Default blocks of max(64, ceil(T / 16)) queries; each against the key range
  its queries can see (from the mask, brute force), a block that sees no key
  not computed (zeros), the rest equal to the reference."""
  import attnlab.ops.reference as ref_module

  calls = []
  real = ref_module.reference_attention

  def spy(q, k, v, **kw):
    calls.append((q.shape[1], k.shape[1], kw["q_offset"], kw["scale"]))
    return real(q, k, v, **kw)

  monkeypatch.setattr(ref_module, "reference_attention", spy)
  for T, S, kw in [(256, 256, dict(causal=True, window=40)), (1040, 1040, dict(causal=True)),
                   (1040, 1040, dict(window=100)), (200, 80, dict(causal=True, q_offset=-90)),
                   (128, 64, dict(causal=True, q_offset=-64)), (400, 80, dict(window=100)),
                   (48, 48, dict())]:
    block = max(64, -(-T // 16))
    q_pos = np.arange(T) + kw.get("q_offset", 0)
    mask = np.asarray(masks.position_mask(q_pos[:, None], np.arange(S)[None], causal=kw.get(
        "causal", False), window=kw.get("window")))
    want_calls = []
    for lo in range(0, T, block):
      seen = np.nonzero(mask[lo:lo + block].any(axis=0))[0]
      if seen.size:
        want_calls.append((min(block, T - lo), seen.max() + 1 - seen.min(),
                           kw.get("q_offset", 0) + lo - seen.min(), 0.3))
    for dtype in (jnp.float32, jnp.bfloat16):
      q, k, v = make_qkv(1, T, S, 1, 1, 4, seed=16, dtype=dtype)
      calls.clear()
      # One program with the unspied reference: one compilation, not two.
      got, want = jax.jit(lambda q, k, v, kw=kw: (blocked_attention(q, k, v, scale=0.3, **kw),
                                                  real(q, k, v, scale=0.3, **kw)))(q, k, v)
      assert calls == want_calls, (T, S, kw)
      assert got.dtype == dtype
      np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32),
                                 atol=1e-5, rtol=1e-5)
      blind = ~mask.any(axis=1)  # queries that see no key: zeros
      assert blind.any() == (len(want_calls) < -(-T // block)), (T, S, kw)
      np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32))[:, blind], 0.0)


def test_blocked_takes_one_offset_per_row_as_a_numpy_array_and_refuses_a_jax_one():
  """Per-row NumPy offsets far apart (a block's key range is the union of its rows'):
  blocked equals the reference for causal, windowed and plain attention, blocks of 8 and
  of all the queries, with segment ids, GQA, and a row whose queries see no key; a JAX
  array (traced or not) is refused naming why and the implementations that take one."""
  q, k, v = make_qkv(3, 20, 40, 4, 2, 8, seed=5)
  seg_q = jnp.asarray(np.repeat([[1] * 12 + [2] * 8], 3, axis=0))
  seg_k = jnp.asarray(np.repeat([[1] * 25 + [2] * 15], 3, axis=0))
  for offsets in (np.array([0, 15, 3]), np.array([25, 0, 50], np.int64), np.array(7)):
    for kw in (dict(causal=True), dict(causal=True, window=4), dict(window=6), dict(),
               dict(causal=True, q_segment_ids=seg_q, kv_segment_ids=seg_k)):
      want = jit_call(reference_attention, q, k, v, q_offset=offsets, **kw)
      for block_q in (8, None):
        got = jit_call(blocked_attention, q, k, v, q_offset=offsets, block_q=block_q, **kw)
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6,
                                   err_msg=f"{offsets} {kw} {block_q}")
  # Row 2 at offset 50 with a window of 4 sees no key of 40: zeros.
  got = jit_call(blocked_attention, q, k, v, q_offset=np.array([0, 15, 50]), causal=True,
                 window=4)
  np.testing.assert_array_equal(np.asarray(got)[2], 0.0)
  advice = ("its query blocks are cut when traced; 'reference' and 'chunked' take a JAX "
            "array (traced too)")
  with pytest.raises(ValueError) as e:
    blocked_attention(q, k, v, causal=True, q_offset=jnp.int32(2))
  assert re.fullmatch(r"implementation='blocked' needs an int q_offset or a NumPy array of "
                      r"them, got <class 'jax.*Array.*'>: " + re.escape(advice),
                      str(e.value)), e.value
  with pytest.raises(ValueError) as e:  # traced, through the dispatcher
    jax.jit(lambda o: attention(q, k, v, causal=True, q_offset=o,
                                implementation="blocked"))(jnp.array([1, 2, 3]))
  assert "needs an int q_offset or a NumPy array of them" in str(e.value)
  assert str(e.value).endswith(advice)
  with pytest.raises(ValueError, match=r"^q_offset shape \(2,\) must be \(\) or \[B\] = \(3,\)$"):
    blocked_attention(q, k, v, causal=True, q_offset=np.array([1, 2]))


def test_chunked_bfloat16_close_to_float32_reference():
  q, k, v = make_qkv(2, 40, 40, 8, 2, 32, seed=3)
  want = jit_call(reference_attention, q, k, v, causal=True)
  got = jit_call(chunked_attention, *(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=True,
                 block_k=16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)


def test_chunked_in_bfloat16_is_as_accurate_as_the_reference_forward_and_backward():
  """bfloat16 inputs, float32 scores, statistics and accumulators: the chunked
  output and gradients are bfloat16 and as close to the float32 computation on
  the same rounded inputs as the reference's own bfloat16 results: within 10%
  of its mean error, where a product rounded to bfloat16 inside (the scores,
  P V, dO V^T, a block's share of dQ) raised the worst ratio to 1.13-1.73 (32 key
  blocks; 0.97-1.04 as written)."""
  B, T, N, K, H = 1, 512, 4, 1, 64
  q, k, v = make_qkv(B, T, T, N, K, H, seed=3, dtype=jnp.bfloat16)
  w = random_arrays.normal(9, (B, T, N, H))

  def run(fn, *args):
    f = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
    out = jax.jit(fn)(*args)
    return [out, *jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*args)]

  chunked = run(lambda q, k, v: chunked_attention(q, k, v, causal=True, block_k=16), q, k, v)
  ref = run(lambda q, k, v: reference_attention(q, k, v, causal=True), q, k, v)
  exact = run(lambda q, k, v: reference_attention(q, k, v, causal=True),
              *(x.astype(jnp.float32) for x in (q, k, v)))
  def err(x, e):
    return float(np.abs(np.asarray(x.astype(jnp.float32)) - np.asarray(e)).mean())

  for name, c, r, e in zip(["out", "dq", "dk", "dv"], chunked, ref, exact):
    assert c.dtype == jnp.bfloat16, name
    assert err(c, e) < 1.1 * err(r, e), (name, err(c, e), err(r, e))


@pytest.mark.parametrize("block_k", [1, 5, 512])
def test_chunked_block_sizes_from_one_up_and_the_default_of_512(block_k):
  q, k, v = make_qkv(1, 7, 513, 2, 1, 8, seed=17)
  kw = dict(causal=True, q_offset=506)
  want = jit_call(reference_attention, q, k, v, **kw)
  np.testing.assert_allclose(jit_call(chunked_attention, q, k, v, block_k=block_k, **kw), want,
                             atol=1e-5, rtol=1e-5)
  # A scan over blocks of the size asked for (513, 103, 2 blocks), not of another size.
  asked = jax.make_jaxpr(lambda q, k, v: chunked_attention(q, k, v, block_k=block_k, **kw))(
      q, k, v)
  assert _scan_lengths(asked) == [-(-513 // block_k)]
  if block_k == 512:  # the default: two key blocks over 513 keys
    jaxpr = jax.make_jaxpr(lambda q, k, v: chunked_attention(q, k, v, **kw))(q, k, v)
    assert _scan_lengths(jaxpr) == [2]


def _scan_lengths(closed_jaxpr):
  """The lengths of every lax.scan in a jaxpr, nested calls included."""
  out = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan":
        out.append(eqn.params["length"])
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
          if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            walk(sub)

  walk(closed_jaxpr.jaxpr)
  return out


def test_chunked_and_blocked_called_directly_name_a_bad_block_and_bad_heads():
  """Until 2026-12-04 block_k=2.5, block_q=0 and N not a multiple of K, in a direct call
  (``attention()`` checks its own arguments), raised errors naming no argument."""
  q, k, v = make_qkv(1, 4, 4, 1, 1, 4)
  for bad in (0, 2.5, None, True):
    with pytest.raises(ValueError, match=rf"^block_k={bad!r} must be a positive integer$"):
      chunked_attention(q, k, v, block_k=bad)
  for bad in (0, 2.5, True):
    with pytest.raises(ValueError, match=rf"^block_q={bad!r} must be a positive integer or None$"):
      blocked_attention(q, k, v, block_q=bad)
  q3, k2, v2 = make_qkv(1, 4, 4, 3, 2, 4)
  for op in (chunked_attention, blocked_attention):
    with pytest.raises(ValueError, match=r"num heads of q_BTNH \(N=3\) must be a multiple of "
                                         r"num_kv_heads of k_BSKH \(K=2\)"):
      op(q3, k2, v2)


@pytest.mark.parametrize("impl", ["reference", "chunked", "xla"])
def test_fully_masked_rows_are_zero_with_finite_gradients(impl):
  q, k, v = make_qkv(1, 6, 6, 4, 2, 8, seed=4)
  # Query segment 3 has no key of its segment: those rows see nothing.
  q_seg = jnp.array([[1, 1, 3, 3, 2, 2]])
  kv_seg = jnp.array([[1, 1, 2, 2, 2, 2]])
  kw = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=True)
  out = jit_call(attention, q, k, v, implementation=impl, **kw)
  np.testing.assert_array_equal(out[0, 2:4], 0.0)
  assert np.all(np.abs(np.asarray(out[0, [0, 1, 4, 5]])) > 0)
  grads = jax.jit(jax.grad(_loss(impl, kw), argnums=(0, 1, 2)))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(grads[0][0, 2:4], 0.0)


def test_self_attention_is_permutation_equivariant():
  """Without positions or masks, attention(PX) = P attention(X)."""
  x_BTD = random_arrays.normal(5, (1, 9, 16))
  w = random_arrays.normal(6, (3, 16, 4, 8))

  def self_attention(x_BTD):
    q, k, v = (jnp.einsum("BTD,DNH->BTNH", x_BTD, w_i) for w_i in w)
    return attention(q, k, v)

  perm = np.random.default_rng(0).permutation(9)
  self_attention = jax.jit(self_attention)
  np.testing.assert_allclose(
      self_attention(x_BTD[:, perm]), self_attention(x_BTD)[:, perm], atol=1e-5, rtol=1e-5)


def test_gqa_equals_mha_with_repeated_kv():
  """GQA is MHA whose K/V heads are shared: repeating them (in the test only)
  must give the same output."""
  q, k, v = make_qkv(2, 10, 10, 8, 2, 16, seed=7)
  gqa = jit_call(reference_attention, q, k, v, causal=True)
  mha = jit_call(reference_attention, q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2),
                 causal=True)
  np.testing.assert_allclose(gqa, mha, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_window_at_least_length_equals_causal(impl):
  q, k, v = make_qkv(2, 12, 12, 4, 2, 8, seed=8)
  causal = jit_call(attention, q, k, v, causal=True, implementation=impl)
  for window in (12, 13, 100):
    windowed = jit_call(attention, q, k, v, causal=True, window=window, implementation=impl)
    np.testing.assert_allclose(windowed, causal, atol=1e-6)
  narrower = jit_call(attention, q, k, v, causal=True, window=11, implementation=impl)
  assert not np.allclose(narrower[:, -1], causal[:, -1], atol=1e-3)


@pytest.mark.parametrize("impl", ["reference", "chunked", "xla"])
def test_window_one_attends_to_itself_only(impl):
  q, k, v = make_qkv(2, 7, 7, 4, 4, 8, seed=10)
  out = jit_call(attention, q, k, v, causal=True, window=1, implementation=impl)
  np.testing.assert_allclose(out, v, atol=1e-6)


def test_mask_predicates_and_key_range_agree():
  for causal, window in itertools.product([False, True], [None, 1, 3, 8]):
    q_pos = np.arange(20)[:, None]
    k_pos = np.arange(20)[None, :]
    mask = np.asarray(masks.position_mask(q_pos, k_pos, causal=causal, window=window))
    for lo_q in range(0, 20, 4):
      lo, hi = masks.key_range(lo_q, lo_q + 3, causal=causal, window=window, kv_len=20)
      visible = np.nonzero(mask[lo_q:lo_q + 4].any(axis=0))[0]
      assert lo <= visible.min() and visible.max() < hi
      assert visible.min() == lo and visible.max() == hi - 1


BAD_INPUTS = [
    # (q shape, k shape, v shape, keyword arguments, the whole message)
    ((2, 4, 8), (2, 4, 4, 8), None, {},
     "q_BTNH must be rank 4 (q [B, T, N, H], k and v [B, S, K, H]); got shapes "
     "(2, 4, 8), (2, 4, 4, 8), (2, 4, 4, 8)"),
    ((2, 4, 4, 8), (2, 4, 4, 8, 1), None, {},
     "k_BSKH must be rank 4 (q [B, T, N, H], k and v [B, S, K, H]); got shapes "
     "(2, 4, 4, 8), (2, 4, 4, 8, 1), (2, 4, 4, 8, 1)"),
    ((2, 4, 4, 8), (2, 4, 4, 8), (2, 4, 32), {},
     "v_BSKH must be rank 4 (q [B, T, N, H], k and v [B, S, K, H]); got shapes "
     "(2, 4, 4, 8), (2, 4, 4, 8), (2, 4, 32)"),
    ((2, 4, 4, 8), (2, 4, 4, 8), (2, 5, 4, 8), {},
     "k_BSKH shape (2, 4, 4, 8) and v_BSKH shape (2, 5, 4, 8) must match"),
    ((2, 4, 4, 8), (3, 5, 4, 8), None, {},
     "batch of q_BTNH (2) and k_BSKH (3) must match"),
    ((2, 4, 4, 8), (2, 4, 4, 16), None, {},
     "head dim of q_BTNH (8) and of k_BSKH (16) must match (q, k and v share one head_dim H)"),
    ((2, 4, 6, 8), (2, 4, 4, 8), None, {},
     "num heads of q_BTNH (N=6) must be a multiple of num_kv_heads of k_BSKH (K=4): each KV "
     "head serves G = N / K query heads, so N must be a multiple of the num kv heads"),
    ((2, 4, 4, 8), (2, 4, 4, 8), None, dict(window=0),
     "window=0 must be a positive integer or None"),
    ((2, 4, 4, 8), (2, 4, 4, 8), None, dict(window=2.5),
     "window=2.5 must be a positive integer or None"),
    ((2, 4, 4, 8), (2, 4, 4, 8), None, dict(window=True),
     "window=True must be a positive integer or None"),
    ((2, 4, 4, 8), (2, 4, 4, 8), None, dict(window="3"),
     "window='3' must be a positive integer or None"),
    ((2, 4, 4, 8), (2, 4, 4, 8), None, dict(q_segment_ids=(2, 4)),
     "q_segment_ids and kv_segment_ids must be given together"),
    ((2, 4, 4, 8), (2, 4, 4, 8), None, dict(kv_segment_ids=(2, 4)),
     "q_segment_ids and kv_segment_ids must be given together"),
    ((2, 4, 4, 8), (2, 6, 4, 8), None, dict(q_segment_ids=(2, 5), kv_segment_ids=(2, 6)),
     "q_segment_ids shape (2, 5) must be [B, T] = (2, 4)"),
    ((2, 4, 4, 8), (2, 6, 4, 8), None, dict(q_segment_ids=(2, 4), kv_segment_ids=(2, 4)),
     "kv_segment_ids shape (2, 4) must be [B, S] = (2, 6)"),
    ((2, 4, 4, 8), (2, 4, 4, 8), None, dict(implementation="flash9"),
     "implementation='flash9' is not one of 'reference', 'blocked', 'chunked', 'xla', "
     "'cudnn', 'pallas' or 'auto'"),
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,kw,message", BAD_INPUTS, ids=str)
def test_bad_input_raises_clear_errors(q_shape, k_shape, v_shape, kw, message):
  kw = {name: (jnp.zeros(value, jnp.int32) if name.endswith("segment_ids") else value)
        for name, value in kw.items()}
  kw.setdefault("implementation", "reference")
  q, k = jnp.zeros(q_shape), jnp.zeros(k_shape)
  v = k if v_shape is None else jnp.zeros(v_shape)
  with pytest.raises(ValueError) as e:
    attention(q, k, v, **kw)
  assert str(e.value) == message


CPU_IMPLEMENTATIONS = ("reference", "blocked", "chunked", "xla", "pallas", "auto")
BAD_CAUSAL_OR_OFFSET = [
    # (keyword arguments, the whole message); B = 2
    (dict(causal="false"), "causal='false' must be True or False"),  # was truthy: causal
    (dict(causal=None), "causal=None must be True or False"),
    (dict(causal=1), "causal=1 must be True or False"),
    (dict(causal=True, q_offset=1.5),  # was truncated to 1
     "q_offset=1.5 must be an integer or an integer array of shape () or [B] = (2,)"),
    (dict(causal=True, q_offset=True),
     "q_offset=True must be an integer or an integer array of shape () or [B] = (2,)"),
    (dict(causal=True, q_offset=[1, 2]),
     "q_offset=[1, 2] must be an integer or an integer array of shape () or [B] = (2,)"),
    (dict(causal=True, q_offset=np.array([1.0, 2.0], np.float32)),
     "q_offset (shape (2,), dtype float32) must be an integer or an integer array of shape () "
     "or [B] = (2,)"),
    (dict(causal=True, q_offset=np.array([1, 2, 3])),  # was jax's broadcasting error
     "q_offset shape (3,) must be () or [B] = (2,)"),
    (dict(causal=True, q_offset=np.zeros((2, 1), np.int32)),
     "q_offset shape (2, 1) must be () or [B] = (2,)"),
    # An OverflowError naming no argument until 2026-12-05.
    (dict(causal=True, q_offset=2**31),
     "q_offset=2147483648 must be in [-2**31, 2**31): positions are int32"),
    (dict(causal=True, q_offset=np.int64(-2**31 - 1)),
     "q_offset=-2147483649 must be in [-2**31, 2**31): positions are int32"),
    # Query t sits at q_offset + t: past 2**31 - 1 it wrapped to a negative position (a
    # causal query saw no key) until 2026-12-05. T = 4 here.
    (dict(causal=True, q_offset=2**31 - 3),
     "q_offset=2147483645 puts query 3 at position 2147483648, past 2**31 - 1: positions are "
     "int32 (give q_offset <= 2147483644)"),
    (dict(causal=True, q_offset=np.array([0, 2**31 - 1])),
     "q_offset holds 2147483647, which puts query 3 at position 2147483650, past 2**31 - 1: "
     "positions are int32 (give q_offset <= 2147483644)"),
    (dict(causal=True, q_offset=np.array([-2**31 - 1, 0])),
     "q_offset holds -2147483649, below -2**31: positions are int32"),
]


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
def test_causal_and_q_offset_are_checked_once_for_every_implementation(impl):
  q, k = jnp.zeros((2, 4, 2, 8)), jnp.zeros((2, 6, 1, 8))
  for kw, message in BAD_CAUSAL_OR_OFFSET:
    with pytest.raises(ValueError) as e:
      attention(q, k, k, implementation=impl, **kw)
    assert str(e.value) == message, kw


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
def test_a_q_offset_array_of_a_narrow_integer_type_is_its_values(impl):
  """An int8 / uint8 / int16 q_offset array (NumPy, or JAX where the implementation takes
  one) is the offsets it holds: "blocked" (and "auto", which sends it there on the CPU)
  computed its per-block offsets in the array's own type, where 100 + 64 overflowed int8,
  until 2026-12-06."""
  q, k, v = make_qkv(2, 128, 256, 2, 1, 8, seed=23)
  offsets = [np.array([100, 60], dtype) for dtype in (np.int8, np.uint8, np.int16)]
  if impl not in ("blocked", "auto"):  # a JAX array too (blocked cuts its blocks by value)
    offsets.append(jnp.array([100, 60], jnp.int8))
  run = jax.jit(lambda: [attention(q, k, v, causal=True, q_offset=o, implementation=impl)
                         for o in [np.array([100, 60], np.int32), *offsets]])
  want, *gots = run()
  for o, got in zip(offsets, gots, strict=True):
    np.testing.assert_array_equal(got, want, err_msg=str(o.dtype))
  np.testing.assert_allclose(  # and the int32 one is right
      want, naive_attention(q, k, v, causal=True,
                            q_pos=np.array([[100], [60]]) + np.arange(128)), atol=1e-5,
      rtol=1e-5)


def test_blocked_called_directly_checks_the_request_as_attention_does():
  """A lone kv_segment_ids was ignored (the padding mask dropped) and a lone q_segment_ids
  a TypeError inside the blocks until 2026-12-06."""
  q, k = jnp.zeros((2, 4, 2, 8)), jnp.zeros((2, 6, 1, 8))
  for kw in (dict(kv_segment_ids=jnp.zeros((2, 6), jnp.int32)),
             dict(q_segment_ids=jnp.zeros((2, 4), jnp.int32))):
    with pytest.raises(ValueError, match="^q_segment_ids and kv_segment_ids must be given "
                                         "together$"):
      blocked_attention(q, k, k, **kw)
  with pytest.raises(ValueError, match=re.escape("kv_segment_ids shape (2, 5) must be [B, S]")):
    blocked_attention(q, k, k, q_segment_ids=jnp.zeros((2, 4), jnp.int32),
                      kv_segment_ids=jnp.zeros((2, 5), jnp.int32))


def test_the_reference_and_chunked_ops_check_causal_and_q_offset_when_called_directly():
  """The caches call them without ``attention``'s check: a float offset was truncated
  (chunked) or compared as a float (reference) and causal="false" masked as causal until
  2026-12-04."""
  from attnlab.ops.chunked import chunked_attention
  from attnlab.ops.reference import reference_attention

  q, k = jnp.zeros((2, 4, 2, 8)), jnp.zeros((2, 6, 1, 8))
  seg = jnp.zeros((2, 4), jnp.int32)
  bad = BAD_CAUSAL_OR_OFFSET + [  # chunked: an AttributeError on None until 2026-12-04
      (dict(q_segment_ids=seg), "q_segment_ids and kv_segment_ids must be given together"),
      # NumPy int64 past int32: two segments to one, one to the other until 2026-12-06
      (dict(q_segment_ids=np.full((2, 4), 2**32 + 1), kv_segment_ids=np.ones((2, 6), int)),
       "q_segment_ids holds 4294967297, outside int32's range [-2**31, 2**31 - 1]: the "
       "attention ops read it as int32"),
      (dict(kv_positions=np.full((2, 6), -2**31 - 1)),
       "kv_positions holds -2147483649, outside int32's range [-2**31, 2**31 - 1]: the "
       "attention ops read it as int32")]
  for op in (reference_attention, chunked_attention):
    for kw, message in bad:
      with pytest.raises(ValueError) as e:
        op(q, k, k, **kw)
      assert str(e.value) == message, (op, kw)


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
def test_dtypes_of_qkv_segment_ids_and_positions_are_checked_for_every_implementation(impl):
  """Until 2026-12-04 float segment ids were two segments to "reference" / "xla" and one
  to "chunked" / "pallas" (cast to int32: 0.2 and 0.7 are both 0); float or misshaped
  positions met an error naming no argument, or were truncated by "chunked"; int q / k / v
  gave an int output; no KV heads was a ZeroDivisionError."""
  q, k = jnp.zeros((2, 4, 2, 8)), jnp.zeros((2, 6, 1, 8))
  seg_q, seg_k = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 6), jnp.int32)
  pos_q, pos_k = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 6), jnp.int32)
  cases = [
      ((q.astype(jnp.int32), k, k), {},
       "q_BTNH must be a floating-point array (float32, bfloat16, float16, ...), got dtype "
       "int32"),
      ((q, k.astype(jnp.int8), k), {},
       "k_BSKH must be a floating-point array (float32, bfloat16, float16, ...), got dtype int8"),
      ((q, k, k.astype(jnp.uint8)), {},
       "v_BSKH must be a floating-point array (float32, bfloat16, float16, ...), got dtype "
       "uint8"),
      ((q, jnp.zeros((2, 6, 0, 8)), jnp.zeros((2, 6, 0, 8))), {},
       "k_BSKH has no heads (K=0): give at least one KV head"),
      ((jnp.zeros((2, 4, 2, 0)), jnp.zeros((2, 6, 1, 0)), jnp.zeros((2, 6, 1, 0))), {},
       "k_BSKH has heads of no dimensions (H=0): give H >= 1"),  # a ZeroDivisionError
      # A scale that is not one real number (a string was taken as float("0.5")).
      ((q, k, k), dict(scale="0.5"),
       "scale='0.5' must be a real number (or a 0-d array), got str"),
      ((q, k, k), dict(scale=True), "scale=True must be a real number (or a 0-d array), got bool"),
      ((q, k, k), dict(scale=jnp.array([0.5, 0.5])),
       "scale must be one real number (shape ()), got an array of shape (2,) and dtype float32"),
      ((q, k, k), dict(scale=jnp.array(True)),
       "scale must be one real number (shape ()), got an array of shape () and dtype bool"),
      # Not finite in float32 (NaN from some implementations, zeros from others until
      # 2026-12-06).
      ((q, k, k), dict(scale=float("nan")),
       "scale=nan must be finite and within float32's range (|scale| <= 3.402823e+38)"),
      ((q, k, k), dict(scale=jnp.float32(-jnp.inf)),
       "scale=-inf must be finite and within float32's range (|scale| <= 3.402823e+38)"),
      ((q, k, k), dict(scale=np.float64(1e39)),
       "scale=1e+39 must be finite and within float32's range (|scale| <= 3.402823e+38)"),
      # Not arrays (an AttributeError until 2026-12-06).
      ((q.tolist(), k, k), {}, "q_BTNH must be an array (JAX or NumPy), got list"),
      ((q, k, k), dict(q_segment_ids=seg_q.tolist(), kv_segment_ids=seg_k),
       "q_segment_ids must be an array [B, T] (JAX or NumPy), got list"),
      ((q, k, k), dict(q_segment_ids=seg_q + 0.2, kv_segment_ids=seg_k),
       "q_segment_ids must be an integer or bool array, got dtype float32"),
      ((q, k, k), dict(q_segment_ids=seg_q, kv_segment_ids=seg_k.astype(jnp.float16)),
       "kv_segment_ids must be an integer or bool array, got dtype float16"),
      ((q, k, k), dict(q_positions=pos_q - 0.5),
       "q_positions must be an integer array, got dtype float32"),
      ((q, k, k), dict(q_positions=pos_q.astype(bool)),
       "q_positions must be an integer array, got dtype bool"),
      ((q, k, k), dict(kv_positions=pos_k[:, :4]),
       "kv_positions shape (2, 4) must be [B, S] = (2, 6)"),
      ((q, k, k), dict(q_positions=pos_q[:1]),
       "q_positions shape (1, 4) must be [B, T] = (2, 4)"),
      # NumPy ints past int32 (its default int64): read as int32, ids 1 and 2**32 + 1 were
      # one segment to "chunked" / "pallas" and two to "reference" until 2026-12-06
      ((q, k, k), dict(q_segment_ids=np.full((2, 4), 2**32 + 1), kv_segment_ids=seg_k),
       "q_segment_ids holds 4294967297, outside int32's range [-2**31, 2**31 - 1]: the "
       "attention ops read it as int32"),
      ((q, k, k), dict(q_segment_ids=seg_q, kv_segment_ids=np.full((2, 6), -2**31 - 1)),
       "kv_segment_ids holds -2147483649, outside int32's range [-2**31, 2**31 - 1]: the "
       "attention ops read it as int32"),
      ((q, k, k), dict(kv_positions=np.full((2, 6), 2**31, np.uint32)),
       "kv_positions holds 2147483648, outside int32's range [-2**31, 2**31 - 1]: the "
       "attention ops read it as int32"),
  ]
  for args, kw, message in cases:
    with pytest.raises(ValueError) as e:
      attention(*args, implementation=impl, **kw)
    assert str(e.value) == message, (impl, kw)
  # Bool segment ids are segments 0 / 1 on every path, equal to their int32 values.
  qq, kk, vv = make_qkv(2, 4, 6, 2, 1, 8, seed=3)
  seg_b_q = jnp.array([[True, True, False, False]] * 2)
  seg_b_k = jnp.array([[True, False, True, False, True, False]] * 2)
  seg_i_q, seg_i_k = seg_b_q.astype(jnp.int32), seg_b_k.astype(jnp.int32)
  # ... and NumPy int64 ids within int32's range (its lowest two, its highest two) are the
  # same segments
  shifted = [tuple(np.asarray(x, np.int64) + shift for x in (seg_i_q, seg_i_k))
             for shift in (-2**31, 2**31 - 2)]
  want, got, *got_64 = jax.jit(lambda: (  # one program (the segment ids closed over, as given)
      attention(qq, kk, vv, q_segment_ids=seg_i_q, kv_segment_ids=seg_i_k,
                implementation=impl),
      attention(qq, kk, vv, q_segment_ids=seg_b_q, kv_segment_ids=seg_b_k,
                implementation=impl),
      *[attention(qq, kk, vv, q_segment_ids=q_ids, kv_segment_ids=kv_ids, implementation=impl)
        for q_ids, kv_ids in shifted]))()
  np.testing.assert_array_equal(got, want)
  for out in got_64:  # the same mask, compiled apart
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
def test_numpy_scalars_are_taken_like_the_python_numbers_they_hold(impl):
  """NumPy ints / bools (a value read from an array) were refused as not integers."""
  q, k, v = make_qkv(2, 4, 9, 2, 1, 8, seed=13)
  traced = impl in ("reference", "chunked", "auto")  # an integer array offset may be traced

  @jax.jit  # one program for every call (the NumPy scalars closed over, as given)
  def outputs(offsets):
    want = attention(q, k, v, causal=True, window=3, q_offset=5, implementation=impl)
    got = [attention(q, k, v, causal=np.True_, window=np.int64(3), q_offset=np.int32(5),
                     implementation=impl)]
    if impl == "blocked":  # unrolled over a static offset: a NumPy int is one
      got.append(blocked_attention(q, k, v, causal=True, window=3, q_offset=np.int64(5)))
    return want, got, [attention(q, k, v, causal=True, window=3, q_offset=o,
                                 implementation=impl) for o in offsets]

  want, got, from_traced = outputs([jnp.int32(5), jnp.array([5, 5])] if traced else [])
  for out in got:
    np.testing.assert_array_equal(out, want)
  for out in from_traced:
    np.testing.assert_allclose(out, want, atol=1e-6)


def test_the_decode_kernels_query_check_names_their_cache():
  """``check_query_heads`` on its own (the decode kernels' entry: they name their cache)."""
  from attnlab.ops import checks

  cases = [
      ((2, 1, 8), dict(), "q_BTNH must be rank 4 [B, T, N, H], got shape (2, 1, 8)"),
      ((2, 1, 4, 8), dict(head_dim=16, kv_name="pages"),
       "head dim of q_BTNH (8) and of pages (16) must match (q, k and v share one head_dim H)"),
      ((2, 1, 6, 8), dict(num_kv_heads=4),
       "num heads of q_BTNH (N=6) must be a multiple of num_kv_heads of k_BSKH (K=4): each KV "
       "head serves G = N / K query heads, so N must be a multiple of the num kv heads"),
  ]
  for shape, kw, message in cases:
    kw = {"num_kv_heads": 2, "head_dim": 8, **kw}
    with pytest.raises(ValueError) as e:
      checks.check_query_heads(jnp.zeros(shape), **kw)
    assert str(e.value) == message
  checks.check_query_heads(jnp.zeros((2, 1, 6, 8)), num_kv_heads=3, head_dim=8)


def test_cudnn_without_gpu_is_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("has a GPU")
  q, k, v = make_qkv(1, 4, 4, 2, 2, 8)
  with pytest.raises(ValueError) as e:
    attention(q, k, v, implementation="cudnn")
  assert str(e.value) == (f"implementation='cudnn' needs a CUDA GPU; the default backend is "
                          f"{jax.default_backend()!r}. Use 'xla', 'chunked' or 'reference'.")


def test_xla_in_float16_takes_every_argument():
  """float16 "xla" (on the CPU, XLA has no float16 dot with a float32 result: the op runs
  in float32 and casts back): every case's window, segment ids, offset and scale reach
  it, in one program, against the naive loop on the same float16 inputs."""
  cases = [(case, *naive_case(case, 4, 2, seed=5, dtype=jnp.float16))
           for case in NAIVE_CASES if not case.get("positions")]
  gots = jax.jit(lambda qkvs: [attention(*qkv, implementation="xla", **kw)
                               for qkv, (_, _, kw, _) in zip(qkvs, cases, strict=True)])(
      [qkv for _, qkv, _, _ in cases])
  for (case, _, _, want), got in zip(cases, gots, strict=True):
    assert got.dtype == jnp.float16, case
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2e-3, rtol=2e-3,
                               err_msg=str(case))


BLOCKED_CASES = [
    # (T, S, N, K, block_q, kwargs)
    (37, 37, 8, 2, 8, dict(causal=True)),
    (40, 40, 4, 1, 16, dict(causal=True, window=5)),
    (33, 33, 4, 4, 8, dict(window=4)),
    (19, 45, 4, 2, 8, dict(causal=True, q_offset=26)),
    (30, 30, 8, 2, 8, dict(causal=True, segments=True)),
    (24, 24, 4, 2, 8, dict(causal=True, window=1)),
]


@pytest.mark.parametrize("T,S,N,K,block_q,kw", BLOCKED_CASES, ids=str)
def test_blocked_equals_reference_forward_and_gradients(T, S, N, K, block_q, kw):
  kw = dict(kw)
  q, k, v = make_qkv(2, T, S, N, K, 8, seed=11)
  if kw.pop("segments", False):
    seg = jnp.stack([jnp.array([1] * 12 + [2] * 15 + [0] * 3), jnp.array([1] * 30)])
    kw.update(q_segment_ids=seg, kv_segment_ids=seg)
  w = random_arrays.normal(9, q.shape)

  def loss(fn):
    def f(q, k, v):
      out = fn(q, k, v)
      return jnp.sum(out * w), out

    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

  ref = loss(lambda q, k, v: reference_attention(q, k, v, **kw))
  blk = loss(lambda q, k, v: blocked_attention(q, k, v, block_q=block_q, **kw))
  # Both in one program: one compilation, not two.
  ((_, want), g_ref), ((_, got), g_blk) = jax.jit(lambda q, k, v: (ref(q, k, v), blk(q, k, v)))(
      q, k, v)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for name, a, b in zip("qkv", g_blk, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=f"d{name}")


def test_auto_on_cpu_picks_blocked_for_bands_and_chunked_for_long():
  assert auto_implementation(256, 256, backend="cpu") == "blocked"
  assert auto_implementation(2048, 2048, backend="cpu") == "blocked"
  assert auto_implementation(2048, 2049, backend="cpu") == "chunked"
  assert auto_implementation(16384, 16384, backend="cpu") == "chunked"
  assert auto_implementation(16384, 16384, backend="gpu") == "xla"
  assert auto_implementation(256, 256, backend="tpu") == "xla"


def _spy_implementations(monkeypatch):
  """Record which implementation ``attention`` calls first (the spies call the real ops)."""
  from attnlab.ops import dispatch, reference

  calls = []
  # The dispatcher's names, and the reference op blocked_attention calls per block.
  for module, name in ((dispatch, "reference_attention"), (dispatch, "blocked_attention"),
                       (dispatch, "chunked_attention"), (reference, "reference_attention")):
    real = getattr(module, name)

    def spy(*args, _real=real, _name=name, **kwargs):
      calls.append(_name.split("_")[0])
      return _real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
  return calls


# (T, S, kwargs, what "auto" must pick on the CPU)
AUTO_CASES = [
    (200, 200, dict(causal=True, window=30), "blocked"),  # 4 query blocks of 64
    (150, 150, dict(causal=True, q_offset=7), "blocked"),
    (200, 200, dict(), "reference"),  # no band to skip
    (20, 20, dict(causal=True, q_offset=jnp.array([3, 0])), "reference"),  # traced offset
    (150, 150, dict(causal=True, q_offset=np.array([7, 40])), "blocked"),  # NumPy, per row
    (150, 150, dict(q_offset=np.array([7, 40])), "reference"),  # no band
    (64, 65600, dict(), "chunked"),  # T * S > 2048^2
    (64, 65600, dict(causal=True, q_offset=65536), "chunked"),
    (200, 200, dict(window=30), "blocked"),  # a window alone is a band too
    # Explicit positions (ring caches): the key ranges are not static.
    (20, 20, dict(causal=True, q_positions=jnp.tile(jnp.arange(20), (2, 1))), "reference"),
    (20, 20, dict(causal=True, kv_positions=jnp.tile(jnp.arange(20), (2, 1))), "reference"),
]


@pytest.mark.parametrize("T,S,kw,want", AUTO_CASES, ids=str)
def test_auto_runs_what_it_picks_and_matches_the_reference(T, S, kw, want, monkeypatch):
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU policy")
  q, k, v = make_qkv(2, T, S, 2, 1, 8, seed=12)
  expected = jax.jit(lambda q, k, v: reference_attention(q, k, v, **kw))(q, k, v)
  calls = _spy_implementations(monkeypatch)
  # The spies record at trace time: the jitted call records what the eager one would.
  got = jax.jit(lambda q, k, v: attention(q, k, v, implementation="auto", **kw))(q, k, v)
  assert calls and calls[0] == want, calls
  if want == "blocked":
    assert calls.count("reference") > 1  # several query blocks: not the reference in one piece
  np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


def test_cache_implementation_sends_only_a_paged_pallas_decode_step_to_the_paged_kernel():
  from attnlab.ops.dispatch import cache_implementation

  for impl in ("auto", "reference", "blocked", "chunked", "xla", "cudnn", "pallas"):
    for num_queries in (1, 2, 8):
      for paged in (False, True):
        want = ("paged_decode" if (impl, num_queries, paged) == ("pallas", 1, True)
                else "reference" if impl == "reference" else "chunked")
        got = cache_implementation(impl, num_queries=num_queries, paged=paged)
        assert got == want, (impl, num_queries, paged)


CUDNN_REFUSALS = [
    # (T, keyword arguments, what the message lists)
    (8, dict(q_segment_ids="seg", kv_segment_ids="seg"), "segment ids"),
    (8, dict(causal=True, q_offset=1), "q_offset"),
    (8, dict(q_offset=jnp.array([0])), "q_offset"),  # a traced offset: not known to be 0
    (8, dict(window=3), "a non-causal window"),
    (4, dict(causal=True), "causal with T=4 != S=8"),
    (4, dict(causal=True, window=3, q_offset=2, q_segment_ids="seg", kv_segment_ids="seg"),
     "segment ids, q_offset, causal with T=4 != S=8"),
]


@pytest.mark.parametrize("T,kw,listed", CUDNN_REFUSALS, ids=str)
def test_cudnn_rejects_what_its_kernel_does_not_support(T, kw, listed, monkeypatch):
  """Checked before cuDNN is called, so the CPU can test it (the backend is faked)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q, k, v = make_qkv(1, T, 8, 2, 2, 8)
  kw = dict(kw)
  for name in ("q_segment_ids", "kv_segment_ids"):
    if name in kw:
      kw[name] = jnp.ones((1, T if name[0] == "q" else 8), jnp.int32)
  with pytest.raises(ValueError) as e:
    attention(q, k, v, implementation="cudnn", **kw)
  assert str(e.value) == (f"implementation='cudnn' does not support {listed}; "
                          "use 'pallas', 'xla' or 'chunked'")


@pytest.mark.parametrize("kw,causal,window_size", [
    (dict(), False, None),
    (dict(causal=True, q_offset=0), True, None),
    (dict(causal=True, window=5, scale=0.3), True, (4, 0)),
], ids=str)
def test_cudnn_passes_its_mask_as_cudnn_arguments(kw, causal, window_size, monkeypatch):
  """What reaches ``jax.nn.dot_product_attention`` (faked GPU, the call recorded)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  calls = []
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *args, **kwargs: calls.append((args, kwargs)) or args[0])
  q, k, v = make_qkv(1, 8, 8, 4, 2, 16)
  attention(q, k, v, implementation="cudnn", **kw)
  ((args, kwargs),) = calls
  assert all(a is b for a, b in zip(args, (q, k, v), strict=True))
  assert kwargs == dict(scale=kw.get("scale", 0.25), is_causal=causal,
                        local_window_size=window_size, implementation="cudnn")


def test_xla_asks_jax_nn_for_xla_with_a_mask_only_where_one_is_needed(monkeypatch):
  """"xla" pins jax.nn's implementation (left to jax, a GPU may pick cuDNN) and passes
  a mask only for a causal, windowed or segmented request."""
  real = jax.nn.dot_product_attention
  calls = []

  def spy(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  q, k, v = make_qkv(1, 4, 4, 2, 2, 16)
  seg = jnp.ones((1, 4), jnp.int32)
  for kw, masked in [(dict(), False), (dict(scale=0.5), False), (dict(causal=True), True),
                     (dict(window=2), True), (dict(q_segment_ids=seg, kv_segment_ids=seg), True)]:
    calls.clear()
    jit_call(attention, q, k, v, implementation="xla", **kw)  # the spy records as it traces
    (got,) = calls
    assert got["implementation"] == "xla" and got["scale"] == kw.get("scale", 0.25)
    assert ("mask" in got) == masked, kw


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_a_traced_scale_is_refused_by_the_implementations_that_compile_it_in(impl):
  """A learned temperature under jit: "reference" takes it (checked against a Python-number
  scale); "chunked" and the kernels make it a constant of their program and say so."""
  q, k, v = make_qkv(1, 4, 4, 2, 2, 16)
  run = jax.jit(lambda s, impl: attention(q, k, v, implementation=impl, scale=s),
                static_argnums=1)
  np.testing.assert_allclose(run(0.5, "reference"), attention(q, k, v, scale=0.5,
                                                               implementation="reference"),
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=re.escape(
      "scale must be a Python number for this implementation (a constant of its compiled "
      "program), got ") + r"\w*Tracer: " + re.escape(
      "use implementation='reference', 'blocked' or 'xla' for a traced scale, or multiply q "
      "by it")):
    run(0.5, impl)


@pytest.mark.parametrize("causal", [True, False])
def test_auto_takes_a_traced_scale_at_every_length(monkeypatch, causal):
  """"auto" picks "chunked" past 2048 x 2048 scores on the CPU (made to pick it here at
  any length), which compiles the scale in: with a traced one it takes "blocked" (or
  "reference" where blocked cannot run), whose answer equals a constant scale's. Until
  2026-12-04 the same call worked at short lengths and failed at long ones."""
  from attnlab.ops import dispatch

  q, k, v = make_qkv(2, 5, 7, 2, 1, 16)
  want = jax.jit(lambda: attention(q, k, v, causal=causal, scale=0.3,
                                   implementation="reference"))()
  monkeypatch.setattr(dispatch, "auto_implementation", lambda *a, **kw: "chunked")
  picked = []
  for name in ("blocked_attention", "reference_attention", "chunked_attention"):
    real = getattr(dispatch, name)
    monkeypatch.setattr(dispatch, name, lambda *a, _n=name, _f=real, **kw: (
        picked.append(_n), _f(*a, **kw))[1])
  run = jax.jit(lambda s, o: attention(q, k, v, causal=causal, scale=s, q_offset=o,
                                       implementation="auto"))
  np.testing.assert_allclose(run(0.3, 0), want, rtol=1e-6, atol=1e-6)
  # A traced offset cannot be blocked (it unrolls over a Python int): the reference.
  assert picked == ["reference_attention"]
  picked.clear()
  run = jax.jit(lambda s: attention(q, k, v, causal=causal, scale=s, implementation="auto"))
  np.testing.assert_allclose(run(0.3), want, rtol=1e-6, atol=1e-6)
  assert picked == ["blocked_attention"]
  picked.clear()
  constant = jax.jit(lambda: attention(q, k, v, causal=causal, scale=0.3,
                                       implementation="auto"))()  # 0.3 closed over: a constant
  np.testing.assert_allclose(constant, want, rtol=1e-5, atol=1e-6)
  assert picked == ["chunked_attention"]  # a constant scale: as picked


def test_xla_with_mixed_dtypes_names_the_arguments_and_the_ways_out():
  """jax.nn refuses q, k, v of different dtypes with a message naming neither; the
  implementations that take them ("reference" here) are named instead."""
  q, k, v = make_qkv(1, 4, 4, 2, 2, 16)
  k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  with pytest.raises(ValueError, match=re.escape(
      "implementation='xla' (jax.nn.dot_product_attention) needs q_BTNH, k_BSKH and v_BSKH of "
      "one dtype, got float32, bfloat16, bfloat16: cast them, or use 'reference', 'chunked' "
      "or 'pallas', which take mixed dtypes")):
    attention(q, k, v, implementation="xla")
  assert attention(q, k, v, implementation="reference").dtype == jnp.float32


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window=64)], ids=str)
def test_cudnn_matches_reference_forward_and_gradients(kw):
  """cuDNN's fused kernel (bfloat16) against the reference, forward and gradients."""
  from tests.ops.tolerances import assert_bf16_close

  q, k, v = make_qkv(2, 256, 256, 8, 2, 64, seed=21, dtype=jnp.bfloat16)
  w = random_arrays.normal(22, q.shape, jnp.bfloat16)

  def value_and_grads(impl):
    def loss(q, k, v):
      out = attention(q, k, v, implementation=impl, **kw)
      return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  (_, out), grads = value_and_grads("cudnn")(q, k, v)
  (_, ref), ref_grads = value_and_grads("reference")(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  (_, ref32), ref32_grads = value_and_grads("reference")(f32(q), f32(k), f32(v))
  assert_bf16_close(out, ref, ref32, "out")
  for name, a, b, c in zip(("dq", "dk", "dv"), grads, ref_grads, ref32_grads):
    assert_bf16_close(a, b, c, name)


def test_auto_with_explicit_positions_leaves_jax_nn_for_the_online_softmax(monkeypatch):
  """On a GPU or TPU "auto" is "xla", which takes no explicit positions (a ring's slots):
  such a request goes to "chunked" (a traced scale: "reference"), equal to the reference;
  until 2026-12-04 it was refused as "not 'xla'", an implementation the caller never chose."""
  from attnlab.ops import dispatch

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q, k, v = make_qkv(2, 3, 6, 4, 2, 8)
  q_pos = jnp.tile(jnp.arange(3, 6, dtype=jnp.int32), (2, 1))
  kv_pos = jnp.asarray([[4, 5, 0, 1, 2, 3], [4, -1, 0, 1, 2, 3]], jnp.int32)  # a ring
  k16 = k.astype(jnp.bfloat16)
  # Each call under jit (everything closed over, as given): one compilation, not one per op.
  want, want_scaled, want_mixed = jax.jit(lambda: (
      reference_attention(q, k, v, causal=True, window=4, q_positions=q_pos,
                          kv_positions=kv_pos),
      reference_attention(q, k, v, causal=True, window=4, q_positions=q_pos,
                          kv_positions=kv_pos, scale=0.5),
      reference_attention(q, k16, v, causal=True)))()
  picked = []
  for name in ("reference_attention", "chunked_attention", "jax_nn_attention"):
    real = getattr(dispatch, name)
    monkeypatch.setattr(dispatch, name, lambda *a, _n=name, _f=real, **kw: (
        picked.append(_n), _f(*a, **kw))[1])
  got = jax.jit(lambda: attention(q, k, v, causal=True, window=4, q_positions=q_pos,
                                  kv_positions=kv_pos, implementation="auto"))()
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  run = jax.jit(lambda s: attention(q, k, v, causal=True, window=4, q_positions=q_pos,
                                    kv_positions=kv_pos, scale=s, implementation="auto"))
  np.testing.assert_allclose(run(0.5), want_scaled, rtol=1e-6, atol=1e-6)
  assert picked == ["chunked_attention", "reference_attention"]
  # No positions: jax.nn, as before.
  jax.jit(lambda: attention(q, k, v, causal=True, implementation="auto"))()
  assert picked[-1] == "jax_nn_attention"
  # Mixed dtypes, which jax.nn refuses: the online softmax too (refused until 2026-12-04).
  got = jax.jit(lambda: attention(q, k16, v, causal=True, implementation="auto"))()
  assert picked[-1] == "chunked_attention"
  np.testing.assert_allclose(got, want_mixed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "chunked", "blocked", "pallas"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_window_wider_than_any_sequence_is_no_window(impl, causal):
  """A window of 2**31 - 1 (or past int32, or int64) sees every key, forward and backward,
  also for queries at positions past 2**30: the kernels' int32 key ranges wrapped to empty
  near 2**31 (zeroed rows, a wrong dK), and a window past 2**31 was an OverflowError naming
  no argument, until 2026-12-04 (a first fix capped windows at 2**30, which cut keys off
  queries past that position).

  A window past int32 that traces to the very program of 2**31 - 1 computes what that one
  computes: it is not compiled again (the jaxprs are compared); the rest run in one program."""
  q, k, v = make_qkv(1, 3, 5, 2, 1, 4)
  loss = lambda q, k, v, w, offset: attention(q, k, v, causal=causal, window=w,
                                              q_offset=offset, implementation=impl).sum()
  value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  program = lambda w, offset: str(jax.make_jaxpr(value_and_grad, static_argnums=(3, 4))(
      q, k, v, w, offset))
  runs = []  # (offset, window): no window, then the windows that are not 2**31 - 1's program
  for offset in (2, 2**30 + 10):
    widest = program(2**31 - 1, offset)
    runs += [(offset, None)] + [
        (offset, window) for window in (2**30 + 100, 2**31 - 1, 2**31, 2**40, np.int64(2**62))
        if not (window > 2**31 - 1 and program(window, offset) == widest)]
  # One program for all of them: one compilation, not one per window.
  results = dict(zip(runs, jax.jit(lambda q, k, v: [value_and_grad(q, k, v, w, offset)
                                                    for offset, w in runs])(q, k, v)))
  for (offset, window), got in results.items():
    want = results[offset, None]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{offset} {window}")


def test_the_ops_called_directly_check_the_window_and_dropout():
  """The layers call reference_attention directly for attention dropout, and chunked /
  blocked are public: each caps a window past int32 as attention() does (an OverflowError
  until 2026-12-04: a model with window 2**40 and attention dropout crashed) and refuses a
  window of 0 (all zeros, silently); reference_attention refuses a dropout rate outside
  [0, 1) (1.0 gave NaN gradients) and a rate without a key (a TypeError from JAX)."""
  from attnlab.ops.chunked import chunked_attention
  from attnlab.ops.reference import blocked_attention, reference_attention

  q, k, v = make_qkv(1, 6, 6, 2, 1, 4)
  want = jit_call(reference_attention, q, k, v, causal=True)
  rng = jax.random.key(0)
  for fn in (reference_attention, chunked_attention, blocked_attention):
    np.testing.assert_allclose(jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, causal=True,
                                                                 window=2**40))(q, k, v),
                               want, rtol=1e-6, atol=1e-6, err_msg=fn.__name__)
    with pytest.raises(ValueError, match="window=0 must be a positive integer"):
      fn(q, k, v, causal=True, window=0)
  with_dropout = jax.jit(lambda q, k, v: reference_attention(
      q, k, v, causal=True, window=2**40, dropout_rate=0.1, dropout_rng=rng))(q, k, v)
  assert with_dropout.shape == q.shape and np.isfinite(with_dropout).all()
  for rate in (1.0, -0.1, float("nan")):
    with pytest.raises(ValueError, match=re.escape(f"dropout_rate={rate!r} must be a number "
                                                   "in [0, 1)")):
      reference_attention(q, k, v, dropout_rate=rate, dropout_rng=rng)
  with pytest.raises(ValueError, match=re.escape("dropout_rate=0.1 needs a dropout_rng")):
    reference_attention(q, k, v, dropout_rate=0.1)
  # NumPy scalars as Python numbers (np.float32 was refused until 2026-12-06); np.float32(0.1)
  # is float(np.float32(0.1)) exactly, so the same keep mask
  drop = jax.jit(lambda key, rate: reference_attention(q, k, v, dropout_rate=rate,
                                                       dropout_rng=key), static_argnums=1)
  for rate in (np.float32(0.1), np.float64(0.1)):
    np.testing.assert_array_equal(drop(rng, rate), drop(rng, float(rate)), err_msg=repr(rate))
  assert np.abs(drop(rng, np.float32(0.5)) - drop(rng, 0.0)).max() > 1e-3  # rate taken
  with pytest.raises(ValueError, match=re.escape("dropout_rate=np.float32(1.0) must be")):
    reference_attention(q, k, v, dropout_rate=np.float32(1.0), dropout_rng=rng)


@pytest.mark.parametrize("causal", [True, False])
def test_xla_runs_float16_under_jit_on_the_cpu(causal):
  """XLA:CPU has no float16 x float16 -> float32 dot under jit: until 2026-12-04 "xla" (and
  "auto", which picks it) raised "The precision 'F16_F16_F32' is not supported" for a float16
  model. It computes in float32 there and returns float16, as "reference" does."""
  q, k, v = (x.astype(jnp.float16) for x in make_qkv(2, 5, 5, 4, 2, 8))
  loss = lambda q, k, v, impl: attention(q, k, v, causal=causal, implementation=impl).astype(
      jnp.float32).sum()
  # The output and the gradients of each implementation in one program (one compilation).
  run = jax.jit(lambda q, k, v, impl: (attention(q, k, v, causal=causal, implementation=impl),
                                       jax.grad(loss, argnums=(0, 1, 2))(q, k, v, impl)),
                static_argnums=3)
  want, ref = run(q, k, v, "reference")
  for impl in ("xla", "auto"):
    out, got = run(q, k, v, impl)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=2e-3, atol=2e-3)
    for a, b in zip(got, ref, strict=True):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
def test_q_offset_beside_q_positions_is_refused_by_every_implementation(impl):
  """"reference", "chunked" and "auto" ignored a q_offset given with q_positions (the
  positions won) until 2026-12-07; the others refused the positions by name only."""
  (q, k, v), kw, _ = naive_case(dict(causal=True, positions=True), 4, 2)
  cases = [(4, "q_offset=4"), (np.int64(-1), "q_offset=-1"),
           (np.array([1, 2]), "q_offset (shape (2,), dtype int32)"),
           (jnp.zeros((), jnp.int32), "q_offset (shape (), dtype int32)")]
  for offset, what in cases:
    with pytest.raises(ValueError) as e:
      attention(q, k, v, implementation=impl, q_offset=offset, **kw)
    assert str(e.value) == (f"{what} and q_positions cannot be given together: q_positions "
                            "are the queries' positions (add the offset to them and leave "
                            "q_offset at 0)"), offset
  if impl in ("reference", "chunked", "auto"):  # an offset of 0 is the default, as before
    want = attention(q, k, v, implementation=impl, **kw)
    np.testing.assert_array_equal(
        attention(q, k, v, implementation=impl, q_offset=np.int32(0), **kw), want)


def test_reference_and_chunked_called_directly_refuse_q_offset_beside_q_positions():
  (q, k, v), kw, _ = naive_case(dict(causal=True, positions=True), 4, 2)
  for op in (reference_attention, chunked_attention):
    with pytest.raises(ValueError, match=r"^q_offset=4 and q_positions cannot be given "):
      op(q, k, v, q_offset=4, **kw)
  # kv_positions alone keep the offset: the queries' positions are q_offset + t
  kv_kw = dict(causal=True, kv_positions=kw["kv_positions"])
  np.testing.assert_array_equal(
      reference_attention(q, k, v, q_offset=4, **kv_kw),
      reference_attention(q, k, v, q_positions=4 + jnp.zeros((2, 5), jnp.int32)
                          + jnp.arange(5), **kv_kw))
