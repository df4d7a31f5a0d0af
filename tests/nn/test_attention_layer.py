"""The attention layer (``attnlab.nn.attention.Attention``) on its own: against the
projections and the attention written out in NumPy, its defaults, dtypes, attention
dropout, and a cache's default positions and padding."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab.nn.attention import Attention
from attnlab.nn.kv_cache import KVCache
from tests import random_arrays
from tests.ops.naive import naive_attention

D, N, K, H = 16, 4, 2, 8


@nnx.jit
def call(layer, x, **kw):
  return layer(x, **kw)


def _x(B=2, T=6, seed=0):
  return random_arrays.normal(seed, (B, T, D))


def _rope(x_BTNH, pos_T, theta):
  """Half-split RoPE in NumPy: pair (i, i + H/2) turns by pos * theta^(-2i/H)."""
  half = x_BTNH.shape[-1] // 2
  angle = pos_T[None, :, None, None] * theta ** (-2.0 * np.arange(half) / x_BTNH.shape[-1])
  a, b = x_BTNH[..., :half], x_BTNH[..., half:]
  return np.concatenate([a * np.cos(angle) - b * np.sin(angle),
                         b * np.cos(angle) + a * np.sin(angle)], axis=-1)


def _by_hand(layer, x, *, causal=False, rope_theta=None, pairing="half", context=None,
             q_seg=None, kv_seg=None):
  """The layer in NumPy float64: projections (+ biases), RoPE, the textbook
  attention (``naive_attention``), the output projection. Keys and values come
  from ``context`` if given (cross-attention)."""
  x = np.asarray(x, np.float64)
  src = x if context is None else np.asarray(context, np.float64)
  f64 = lambda a: np.asarray(a, np.float64)

  def project(p, eq, inp):
    y = np.einsum(eq, inp, f64(p.w[...]))
    return y if p.b is None else y + f64(p.b[...])

  q = project(layer.q_proj, "btd,dnh->btnh", x)
  k = project(layer.k_proj, "btd,dkh->btkh", src)
  v = project(layer.v_proj, "btd,dkh->btkh", src)
  T, S = x.shape[1], src.shape[1]
  if rope_theta is not None:
    if pairing == "adjacent":  # pairs (2i, 2i+1) moved to (i, i + H/2): scores are unchanged
      perm = np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])
      q, k = q[..., perm], k[..., perm]
    q, k = _rope(q, np.arange(T), rope_theta), _rope(k, np.arange(S), rope_theta)
  if q_seg is not None or kv_seg is not None:  # the side left out is all one segment
    q_seg = np.ones((x.shape[0], T)) if q_seg is None else np.asarray(q_seg)
    kv_seg = np.ones((x.shape[0], S)) if kv_seg is None else np.asarray(kv_seg)
  out = naive_attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg)
  y = np.einsum("btnh,nhd->btd", out, f64(layer.o_proj.w[...]))
  return y if layer.o_proj.b is None else y + f64(layer.o_proj.b[...])


def _set_biases(layer):
  for i, p in enumerate((layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)):
    if p.b is not None:
      p.b[...] = random_arrays.normal(100 + i, p.b.shape)


def test_defaults_bidirectional_no_rope_no_bias_no_dropout_auto():
  layer = Attention(D, N, K, H, rngs=nnx.Rngs(0))
  assert (layer.causal, layer.window, layer.rope_theta, layer.rope_pairing) == (
      False, None, None, "half")
  assert layer.implementation == "auto" and layer.dropout_rate == 0.0
  assert layer.dropout_rngs is None and layer.deterministic is False
  assert all(p.b is None for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj))
  x = _x()
  np.testing.assert_allclose(call(layer, x), _by_hand(layer, x), atol=1e-5, rtol=1e-5)
  assert layer.q_proj.w.shape == (D, N, H) and layer.k_proj.w.shape == (D, K, H)
  assert layer.o_proj.w.shape == (N, H, D)


@pytest.mark.parametrize("o_bias", [None, False])
def test_causal_rope_and_biases_against_numpy(o_bias):
  """``use_bias`` puts biases [N, H] / [K, H] / [D] on the four projections;
  ``o_bias=False`` leaves the output projection without one (Qwen2)."""
  layer = Attention(D, N, K, H, causal=True, rope_theta=500.0, use_bias=True, o_bias=o_bias,
                    rngs=nnx.Rngs(1))
  assert layer.q_proj.b.shape == (N, H) and layer.k_proj.b.shape == (K, H)
  assert (layer.o_proj.b is None) == (o_bias is False)
  _set_biases(layer)
  x = _x(seed=1)
  np.testing.assert_allclose(call(layer, x), _by_hand(layer, x, causal=True, rope_theta=500.0),
                             atol=1e-5, rtol=1e-5)


def test_heads_that_do_not_group_are_refused_by_name():
  with pytest.raises(ValueError, match=r"^num_heads=6 must be a multiple of num_kv_heads=4$"):
    Attention(D, 6, 4, H, rngs=nnx.Rngs(0))
  # A size of 0 (0 KV heads was a ZeroDivisionError) or not an int, named.
  for args, name in (((D, 4, 0, H), "num_kv_heads=0"), ((D, 0, 1, H), "num_heads=0"),
                     ((D, 4, 2, 0), "head_dim=0"), ((D, 4, 2.0, H), "num_kv_heads=2.0"),
                     ((0, 4, 2, H), "d_model=0")):
    with pytest.raises(ValueError, match=f"^{name} must be a positive integer$"):
      Attention(*args, rngs=nnx.Rngs(0))


def test_a_direct_call_with_inputs_that_do_not_fit_is_refused_by_name():
  """The layer called on its own (a model of the user's): an input width other than d_model,
  positions that are not int or not [B, T] / [1, T], a context of another batch or width, a
  context beside a cache: each a ValueError naming it (errors from inside JAX, RoPE turned by
  float positions, or a context dropped without a word until 2026-12-07). What fits runs:
  [1, T] positions broadcast over the batch, as the models take them."""
  layer = Attention(D, N, K, H, causal=True, rope_theta=100.0, rngs=nnx.Rngs(0))
  x = _x(B=2, T=5)
  ints = lambda shape: jnp.zeros(shape, jnp.int32)
  cases = [
      (dict(x=_x(B=2, T=5)[..., :8]), re.escape(
          f"x_BTD has shape (2, 5, 8); give [B, T, D] with D = d_model = {D}")),
      (dict(x=x[0]), re.escape(f"x_BTD has shape (5, {D}); give [B, T, D]")),
      (dict(positions_BT=jnp.zeros((2, 5))), re.escape(
          "positions_BT has dtype float32; give int positions [B, T] "
          "(jnp.asarray(positions, jnp.int32))")),
      (dict(positions_BT=[[0, 1, 2, 3, 4]] * 2), "positions_BT has a list; give int"),
      (dict(positions_BT=ints((2, 6))), re.escape(
          "positions_BT has shape (2, 6); it must be x_BTD's [B, T] = (2, 5) or [1, T]")),
      (dict(positions_BT=ints((5,))), re.escape("positions_BT has shape (5,);")),
      (dict(context_BSD=_x(B=3, T=4)), re.escape(
          f"context_BSD has shape (3, 4, {D}); give the encoder output [B, S, D] with B = 2 "
          f"(x_BTD's) and D = d_model = {D}")),
      (dict(context_BSD=_x(B=2, T=4)[..., :8]), re.escape("context_BSD has shape (2, 4, 8);")),
      # The whole message (traced, JAX's note on its filtered traceback follows it).
      (dict(context_BSD=_x(B=2, T=4), cache=KVCache.init(2, 8, K, H)), re.escape(
          "context_BSD is not read with a cache: a CrossKVCache holds the projected context "
          "(Attention.cross_kv(context_BSD, segment_ids_BS))") + r"(\n|$)"),
  ]
  for kw, message in cases:
    kw = dict(kw)
    inp = kw.pop("x", x)
    for run in (layer, functools.partial(call, layer)):  # eager, and traced by nnx.jit
      with pytest.raises(ValueError, match="^" + message):
        run(inp, **kw)
  pos = jnp.arange(5, dtype=jnp.int32)
  np.testing.assert_allclose(call(layer, x, positions_BT=pos[None]),
                             call(layer, x, positions_BT=jnp.stack([pos, pos])), rtol=0, atol=0)
  np.testing.assert_allclose(call(layer, x, positions_BT=pos[None]),
                             _by_hand(layer, x, causal=True, rope_theta=100.0),
                             atol=1e-5, rtol=1e-5)


def test_the_layer_runs_the_attention_implementation_it_was_built_with(monkeypatch):
  """``implementation`` reaches the op on every call without dropout (the implementations
  agree to rounding, so parity cannot tell which ran: the op's arguments are recorded; the
  layer runs eagerly, as a program another test compiled would not call the op again)."""
  import attnlab.nn.attention as attention_module
  from attnlab.nn import kv_cache

  seen, op = [], attention_module.attention
  monkeypatch.setattr(attention_module, "attention",
                      lambda *a, **kw: seen.append(kw.get("implementation")) or op(*a, **kw))
  for impl in ("reference", "chunked", "xla"):
    layer = Attention(D, N, K, H, causal=True, implementation=impl, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(layer(_x()), _by_hand(layer, _x(), causal=True),
                               atol=1e-5, rtol=1e-5)
  assert seen == ["reference", "chunked", "xla"]
  # Over a cache: a prefill (a cache flagged empty, as ``kv_cache.as_empty`` makes: the op),
  # a step over the cache and over a cross-attention cache
  # (their own ``attend``), the same implementation each time.
  for cls in (kv_cache.KVCache, kv_cache.CrossKVCache):
    monkeypatch.setattr(cls, "attend", lambda self, *a, _attend=cls.attend, **kw: (
        seen.append((type(self).__name__, kw["implementation"])) or _attend(self, *a, **kw)))
  seen.clear()
  layer = Attention(D, N, K, H, causal=True, implementation="chunked", rngs=nnx.Rngs(0))
  x, ctx = _x(B=2, T=3, seed=14), _x(B=2, T=5, seed=15)
  _, cache = layer(x, cache=KVCache.init(2, 8, K, H).replace(empty=True))
  layer(x, cache=cache)
  layer(x, cache=kv_cache.CrossKVCache(layer.k_proj(ctx), layer.v_proj(ctx),
                                       jnp.ones((2, 5), jnp.int32)))
  assert seen == ["chunked", ("KVCache", "chunked"), ("CrossKVCache", "chunked")]


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_compute_dtype_and_parameter_dtype(param_dtype):
  layer = Attention(D, N, K, H, use_bias=True, dtype=jnp.bfloat16, param_dtype=param_dtype,
                    rngs=nnx.Rngs(2))
  for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
    assert p.w.dtype == param_dtype and p.b.dtype == param_dtype
  x = _x(seed=2)
  out = call(layer, x)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), _by_hand(layer, x), atol=5e-2,
                             rtol=5e-2)


def test_attention_dropout_is_on_in_training_unbiased_and_off_in_eval():
  """Dropout on the probabilities (the reference op), from the layer's own
  ``dropout`` stream: two calls differ, the same seed repeats the same draws,
  the output is linear in the probabilities so the mean over draws is the
  undropped output, and ``eval()`` turns it off (equal to a layer without
  dropout and the same parameters)."""
  make = lambda rate: Attention(D, N, K, H, causal=True, dropout_rate=rate,
                                implementation="reference", rngs=nnx.Rngs(params=3, dropout=4))
  layer, again, plain = make(0.5), make(0.5), make(0.0)
  for a, b in zip(jax.tree.leaves(nnx.state(layer, nnx.Param)),
                  jax.tree.leaves(nnx.state(plain, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  x = _x(seed=3)
  want = np.asarray(call(plain, x))
  draws = np.stack([np.asarray(call(layer, x)) for _ in range(200)])
  np.testing.assert_array_equal(np.asarray(call(again, x)), draws[0])
  assert not np.allclose(draws[0], draws[1]) and not np.allclose(draws[0], want, atol=1e-3)
  spread = np.abs(draws - want).mean()
  assert np.abs(draws.mean(0) - want).mean() < 0.2 * spread  # 200 draws: ~0.07 expected
  layer.eval()
  np.testing.assert_allclose(call(layer, x), want, atol=1e-6)
  layer.train()
  assert not np.allclose(call(layer, x), want, atol=1e-3)


def test_a_model_with_attention_dropout_drops_in_training_only():
  cfg = dict(vocab_size=32, d_model=D, num_layers=2, num_heads=N, num_kv_heads=K, d_ff=32,
             attention_impl="reference")
  build = lambda rate: attnlab.build_model(attnlab.ModelConfig(**cfg, attention_dropout_rate=rate),
                                           rngs=nnx.Rngs(params=0, dropout=1))
  model, plain = build(0.3), build(0.0)
  tokens = random_arrays.randint(5, (2, 8), 1, 32)
  want = np.asarray(call(plain, tokens))
  first, second = np.asarray(call(model, tokens)), np.asarray(call(model, tokens))
  assert not np.allclose(first, want, atol=1e-3) and not np.allclose(first, second, atol=1e-3)
  model.eval()
  np.testing.assert_allclose(call(model, tokens), want, atol=1e-5)


def test_with_a_cache_positions_default_to_the_lengths_and_no_segment_ids_means_no_padding():
  """Over a cache, the positions default to the cache lengths + 0..T-1 (RoPE
  depends on them) and missing segment ids to all tokens real: the same
  outputs and cache as passing them, and the same outputs as the uncached
  layer over the whole sequence."""
  layer = Attention(D, N, K, H, causal=True, rope_theta=100.0, implementation="reference",
                    rngs=nnx.Rngs(6))
  x = _x(B=2, T=7, seed=6)
  full = np.asarray(call(layer, x))
  outs = {}
  for explicit in (False, True):
    cache, got = KVCache.init(2, 16, K, H), []
    for lo, hi in [(0, 4), (4, 5), (5, 7)]:
      kw = {}
      if explicit:
        kw = dict(positions_BT=jnp.broadcast_to(jnp.arange(lo, hi), (2, hi - lo)),
                  segment_ids_BT=jnp.ones((2, hi - lo), jnp.int32))
      out, cache = call(layer, x[:, lo:hi], cache=cache, **kw)
      got.append(np.asarray(out))
    np.testing.assert_array_equal(cache.lengths_B, [7, 7])
    outs[explicit] = (np.concatenate(got, axis=1), cache)
  np.testing.assert_allclose(outs[False][0], full, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(outs[False][0], outs[True][0])
  for a, b in zip(jax.tree.leaves(outs[False][1]), jax.tree.leaves(outs[True][1])):
    np.testing.assert_array_equal(a, b)


def test_packed_documents_attend_only_within_themselves():
  """Segment ids [1, 1, 1, 2, 2, 2, 0]: each document, with positions restarting,
  gives what it gives alone; the padding (segment 0) changes nothing."""
  layer = Attention(D, N, K, H, causal=True, rope_theta=100.0, rngs=nnx.Rngs(7))
  x = _x(B=1, T=7, seed=7)
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 0]])
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 0]])
  packed = np.asarray(call(layer, x, positions_BT=pos, segment_ids_BT=seg))
  np.testing.assert_allclose(packed[:, :3], call(layer, x[:, :3]), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[:, 3:6], call(layer, x[:, 3:6]), atol=1e-5, rtol=1e-5)


def test_with_a_cache_explicit_positions_are_used():
  """Positions that are not the cache's default (here 0, 3, 6, ...: RoPE sees
  other distances) give what the uncached layer gives with them."""
  layer = Attention(D, N, K, H, causal=True, rope_theta=100.0, rngs=nnx.Rngs(8))
  x = _x(B=2, T=5, seed=8)
  pos = jnp.broadcast_to(3 * jnp.arange(5), (2, 5))
  want = np.asarray(call(layer, x, positions_BT=pos))
  assert not np.allclose(want, call(layer, x), atol=1e-4)
  cache, got = KVCache.init(2, 8, K, H), []
  for lo, hi in [(0, 3), (3, 4), (4, 5)]:
    out, cache = call(layer, x[:, lo:hi], positions_BT=pos[:, lo:hi], cache=cache)
    got.append(np.asarray(out))
  np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-5, rtol=1e-5)


def test_rope_pairing_adjacent_against_numpy():
  layer = Attention(D, N, K, H, causal=True, rope_theta=300.0, rope_pairing="adjacent",
                    rngs=nnx.Rngs(9))
  x = _x(seed=9)
  want = _by_hand(layer, x, causal=True, rope_theta=300.0, pairing="adjacent")
  np.testing.assert_allclose(call(layer, x), want, atol=1e-5, rtol=1e-5)
  assert not np.allclose(want, _by_hand(layer, x, causal=True, rope_theta=300.0), atol=1e-3)


def test_cross_attention_sees_the_whole_context_but_its_padding():
  """Cross-attention: keys and values from the context, never causal, no RoPE;
  context segment 0 is padding; with segment ids on one side only, the other
  side is all one segment (a padded query then sees nothing: zeros in, o_proj's
  bias out)."""
  layer = Attention(D, N, K, H, use_bias=True, rngs=nnx.Rngs(10))
  _set_biases(layer)
  x, ctx = _x(B=2, T=5, seed=10), _x(B=2, T=7, seed=11)
  ctx_seg = jnp.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
  got = call(layer, x, context_BSD=ctx, context_segment_ids_BS=ctx_seg)
  np.testing.assert_allclose(got, _by_hand(layer, x, context=ctx, kv_seg=ctx_seg),
                             atol=1e-5, rtol=1e-5)
  q_seg = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
  got = call(layer, x, segment_ids_BT=q_seg, context_BSD=ctx)
  want = _by_hand(layer, x, context=ctx, q_seg=q_seg)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got[0, 4], layer.o_proj.b[...], atol=1e-6)


def test_with_a_cache_right_padding_is_not_stored():
  layer = Attention(D, N, K, H, causal=True, rngs=nnx.Rngs(12))
  x = _x(B=2, T=3, seed=12)
  _, cache = call(layer, x, segment_ids_BT=jnp.array([[1, 1, 1], [1, 1, 0]]),
                  cache=KVCache.init(2, 8, K, H))
  np.testing.assert_array_equal(cache.lengths_B, [3, 2])


def test_a_prefills_segment_ids_only_mark_its_right_padding():
  """In a prefill (a cache flagged empty) every nonzero id is the one sequence the cache
  holds: ids 1, 2, 2, 0 attend as 1, 1, 1, 0 do, and as the uncached layer over the three
  real tokens; the cache stores those three."""
  layer = Attention(D, N, K, H, causal=True, rope_theta=100.0, rngs=nnx.Rngs(13))
  x = _x(B=2, T=4, seed=13)
  out = {}
  for ids in ([[1, 2, 2, 0], [3, 3, 5, 5]], [[1, 1, 1, 0], [1, 1, 1, 1]]):
    out[ids[0][1]], cache = call(layer, x, segment_ids_BT=jnp.array(ids),
                                 cache=KVCache.init(2, 8, K, H).replace(empty=True))
    np.testing.assert_array_equal(cache.lengths_B, [3, 4])
  np.testing.assert_array_equal(out[2], out[1])
  np.testing.assert_allclose(out[2][0, :3], call(layer, x[:1, :3])[0], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out[2][1], call(layer, x[1:])[0], atol=1e-5, rtol=1e-5)


def test_projections_carry_their_logical_axes_and_fan_in_init():
  """Logical axes (mapped onto the mesh by the training code) and a variance of
  1 / fan-in: D for q / k / v, N x H for the output projection."""
  d, n, k, h = 64, 8, 2, 16
  layer = Attention(d, n, k, h, use_bias=True, rngs=nnx.Rngs(13))
  want = {"q_proj": (("embed", "heads", "head_dim"), d),
          "k_proj": (("embed", "kv_heads", "head_dim"), d),
          "v_proj": (("embed", "kv_heads", "head_dim"), d),
          "o_proj": (("heads", "head_dim", "embed"), n * h)}
  for name, (axes, fan_in) in want.items():
    p = getattr(layer, name)
    assert p.w.get_metadata()["axes"] == axes, name
    std = float(jnp.std(p.w[...]))
    assert abs(std * np.sqrt(fan_in) - 1) < 0.06, (name, std)
  assert layer.q_proj.b.get_metadata()["axes"] == ("heads", "head_dim")
  assert layer.k_proj.b.get_metadata()["axes"] == ("kv_heads", "head_dim")
  assert layer.o_proj.b.get_metadata()["axes"] == ("embed",)


def test_attention_dropout_applies_over_caches_too_in_training():
  """A cached call in training mode drops too (self- and cross-attention caches);
  in eval mode it equals the layer without dropout."""
  from attnlab.nn.kv_cache import CrossKVCache

  layer = Attention(D, N, K, H, causal=True, dropout_rate=0.5, implementation="reference",
                    rngs=nnx.Rngs(params=14, dropout=15))
  x, ctx = _x(B=2, T=3, seed=14), _x(B=2, T=5, seed=15)
  cross = CrossKVCache(layer.k_proj(ctx), layer.v_proj(ctx), jnp.ones((2, 5), jnp.int32))
  for cache in (KVCache.init(2, 8, K, H), cross):
    layer.eval()
    want, _ = call(layer, x, cache=cache)
    layer.train()
    got, _ = call(layer, x, cache=cache)
    assert not np.allclose(got, want, atol=1e-3), type(cache).__name__
