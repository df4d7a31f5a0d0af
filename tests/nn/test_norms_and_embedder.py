"""RMSNorm, LayerNorm and the Embedder against NumPy with parameters away from their
initial values (a scale of 1 and a bias of 0 hide a divided scale or a subtracted bias),
inputs whose variance is near eps, their dtypes and their logical axes."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab.nn.layers import Embedder, LayerNorm, RMSNorm, make_norm
from attnlab.nn.partitioning import activation_sharding
from tests import random_arrays

D = 16


def _inputs(dtype=jnp.float32):
  x = np.random.default_rng(0).standard_normal((2, 3, D), np.float32)
  x[0, 0] *= 1e-4  # variance 1e-8: eps (1e-6) dominates, its sign matters
  return jnp.asarray(x, dtype)


def _set(p, seed, shift):
  p[...] = jax.device_put((shift + 0.5 * np.random.default_rng(seed).standard_normal(
      p.shape, np.float32)).astype(p.dtype))


@pytest.mark.parametrize("dtype,param_dtype", [(jnp.float32, jnp.float32),
                                               (jnp.bfloat16, jnp.bfloat16)])
def test_rmsnorm_against_numpy(dtype, param_dtype):
  norm = RMSNorm(D, eps=1e-6, dtype=dtype, param_dtype=param_dtype)
  assert norm.scale.dtype == param_dtype and norm.scale.get_metadata()["axes"] == ("embed",)
  np.testing.assert_array_equal(norm.scale[...], 1.0)
  _set(norm.scale, 1, 1.0)
  x = _inputs(dtype)
  got = jax.jit(lambda x: norm(x))(x)
  assert got.dtype == dtype
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  want = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(
      norm.scale[...].astype(jnp.float32), np.float64)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,param_dtype", [(jnp.float32, jnp.float32),
                                               (jnp.bfloat16, jnp.bfloat16)])
def test_layernorm_against_numpy(dtype, param_dtype):
  norm = LayerNorm(D, eps=1e-6, dtype=dtype, param_dtype=param_dtype)
  for p in (norm.scale, norm.bias):
    assert p.dtype == param_dtype and p.get_metadata()["axes"] == ("embed",)
  np.testing.assert_array_equal(norm.scale[...], 1.0)
  np.testing.assert_array_equal(norm.bias[...], 0.0)
  _set(norm.scale, 2, 1.0)
  _set(norm.bias, 3, 0.0)
  x = _inputs(dtype)
  got = jax.jit(lambda x: norm(x))(x)
  assert got.dtype == dtype
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  mean = xf.mean(-1, keepdims=True)
  var = ((xf - mean) ** 2).mean(-1, keepdims=True)
  f64 = lambda p: np.asarray(p[...].astype(jnp.float32), np.float64)
  want = (xf - mean) / np.sqrt(var + 1e-6) * f64(norm.scale) + f64(norm.bias)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("scale_embeddings", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_embedder_encodes_rows_scaled_and_decodes_with_the_tied_or_own_head(scale_embeddings,
                                                                             tied):
  V = 11
  emb = Embedder(V, D, tied=tied, scale_embeddings=scale_embeddings, dtype=jnp.bfloat16,
                 rngs=nnx.Rngs(4))
  table = np.asarray(emb.embed_tokens[...], np.float64)
  assert emb.embed_tokens.get_metadata()["axes"] == ("vocab", "embed")
  assert abs(table.std() * math.sqrt(D) - 1) < 0.15  # std D^-1/2
  tokens = jnp.array([[0, 3, 10], [5, 5, 1]])
  x = jax.jit(emb.encode)(tokens)
  assert x.dtype == jnp.bfloat16
  want = table[np.asarray(tokens)] * (math.sqrt(D) if scale_embeddings else 1.0)
  np.testing.assert_allclose(np.asarray(x.astype(jnp.float32)), want, rtol=1e-2, atol=1e-2)
  h = random_arrays.normal(5, (2, 3, D), jnp.bfloat16)
  logits = jax.jit(emb.decode)(h)
  assert logits.dtype == jnp.float32 and logits.shape == (2, 3, V)
  head = table.T if tied else np.asarray(emb.lm_head[...], np.float64)
  if not tied:
    assert emb.lm_head.get_metadata()["axes"] == ("embed", "vocab")
  want = np.asarray(h.astype(jnp.float32), np.float64) @ np.asarray(
      jnp.asarray(head, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,cls", [("rmsnorm", RMSNorm), ("layernorm", LayerNorm)])
def test_make_norm_builds_the_kind_with_its_eps_and_dtypes(kind, cls):
  norm = make_norm(kind, D, eps=0.25, dtype=jnp.bfloat16, param_dtype=jnp.float16)
  assert type(norm) is cls and norm.eps == 0.25 and norm.dtype == jnp.bfloat16
  assert cls(D).eps == 1e-6  # the default
  assert norm.scale.dtype == jnp.float16 and norm.scale.shape == (D,)
  with pytest.raises(ValueError, match=re.escape(
      "norm='batchnorm' is not one of 'rmsnorm', 'layernorm'")):
    make_norm("batchnorm", D, eps=0.25, dtype=jnp.float32, param_dtype=jnp.float32)


def test_embedder_defaults_param_dtype_and_the_heads_init():
  emb = Embedder(11, D, rngs=nnx.Rngs(0))  # tied, no scaling, float32
  assert emb.tied and emb.lm_head is None and emb.scale == 1.0
  assert emb.embed_tokens.dtype == jnp.float32
  tokens = jnp.array([[1, 2, 3]])
  np.testing.assert_array_equal(emb.encode(tokens), emb.embed_tokens[...][tokens])
  V = 512  # the own head's init: fan-in D (std D^-1/2), whatever V is
  emb = Embedder(V, D, tied=False, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  assert emb.embed_tokens.dtype == emb.lm_head.dtype == jnp.bfloat16
  head = np.asarray(emb.lm_head[...].astype(jnp.float32), np.float64)
  assert head.shape == (D, V) and abs(head.std() * math.sqrt(D) - 1) < 0.05


def test_embeddings_of_d_model_4_are_scaled_by_2():
  emb = Embedder(11, 4, scale_embeddings=True, rngs=nnx.Rngs(0))
  tokens = jnp.array([[1, 2, 3]])
  np.testing.assert_allclose(emb.encode(tokens), 2 * emb.embed_tokens[...][tokens], rtol=1e-6)


def test_the_model_declares_the_logical_axes_of_its_activations():
  """Under ``activation_sharding`` the embedder and the stack constrain their activations
  by logical axes (what the trainer maps to mesh axes); recorded here on one device."""
  cfg = attnlab.ModelConfig(vocab_size=11, d_model=D, num_layers=2, num_heads=2, d_ff=32,
                            max_len=8)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  seen = []
  replicated = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), jax.sharding.PartitionSpec())

  def resolve(axes, shape):
    seen.append((axes, shape))
    return replicated

  tokens = jnp.ones((2, 5), jnp.int32)
  with activation_sharding(resolve):
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(logits, model(tokens), rtol=1e-6, atol=1e-6)
  activations = ("batch", "length", "embed")
  assert seen == [(("vocab", None), (11, D)), (activations, (2, 5, D)),
                  (activations, (2, 5, D)), (activations, (2, 5, D)),  # after each layer
                  (("batch", "length", "vocab"), (2, 5, 11))]
