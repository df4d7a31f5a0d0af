"""The encoder-decoder against an independent NumPy (float64) implementation of the
2017 Transformer and its pre-LN variant, with every parameter randomized (biases, norm
scales and offsets included). The decoder-only models have transformers as their
reference (tests/convert/test_hf.py); this is the encoder-decoder's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab

B, S, T = 2, 7, 6
PAD = 0


def layernorm(x, p, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def rmsnorm(x, p, eps):
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * p["scale"]


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def sinusoids(L, D):
  """PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(...)."""
  pe = np.zeros((L, D))
  for p in range(L):
    for i in range(0, D, 2):
      pe[p, i] = np.sin(p / 10000 ** (i / D))
      pe[p, i + 1] = np.cos(p / 10000 ** (i / D))
  return pe


def attention(p, x, ctx, allowed):
  """Multi-head attention of one sequence: x [T, D] over ctx [S, D]; allowed [T, S]."""
  q = np.einsum("td,dnh->tnh", x, p["q_proj"]["w"]) + p["q_proj"]["b"]
  k = np.einsum("sd,dkh->skh", ctx, p["k_proj"]["w"]) + p["k_proj"]["b"]
  v = np.einsum("sd,dkh->skh", ctx, p["v_proj"]["w"]) + p["v_proj"]["b"]
  N, H = q.shape[1:]
  group = N // k.shape[1]
  out = np.zeros_like(q)
  for n in range(N):
    scores = q[:, n] @ k[:, n // group].T / np.sqrt(H)
    scores = np.where(allowed, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    out[:, n] = (w / w.sum(-1, keepdims=True)) @ v[:, n // group]
  return np.einsum("tnh,nhd->td", out, p["o_proj"]["w"]) + p["o_proj"]["b"]


def mlp(p, x, kind):
  h = x @ p["up_proj"]["w"] + p["up_proj"]["b"]
  h = np.maximum(h, 0) if kind == "relu" else gelu_tanh(h)
  return h @ p["down_proj"]["w"] + p["down_proj"]["b"]


def self_attention(p, allowed):
  return lambda h: attention(p, h, h, allowed)


def cross_attention(p, ctx, allowed):
  return lambda h: attention(p, h, ctx, allowed)


def feed_forward(p, kind):
  return lambda h: mlp(p, h, kind)


def numpy_encoder_decoder(cfg, params, src, tgt):
  """Logits [B, T, V] in float64."""
  return np.stack([numpy_sequence(cfg, params, s, t) for s, t in zip(src, tgt, strict=True)])


def numpy_sequence(cfg, params, src, tgt):
  """Logits [T, V] of one source / target pair."""
  def norm(x, p):
    if cfg.norm == "layernorm":
      return layernorm(x, p, cfg.norm_eps)
    return rmsnorm(x, p, cfg.norm_eps)

  def residual(x, p_norm, f):
    if cfg.norm_position == "pre":
      return x + f(norm(x, p_norm))
    return norm(x + f(x), p_norm)

  E = params["embedder"]["embed_tokens"]
  scale = np.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
  real = (src != PAD)[None, :]
  x = E[src] * scale + sinusoids(len(src), cfg.d_model)
  for blk in params["encoder"]["layers"].values():
    x = residual(x, blk["input_layernorm"], self_attention(blk["self_attn"], real))
    x = residual(x, blk["post_attention_layernorm"], feed_forward(blk["mlp"], cfg.mlp))
  if cfg.norm_position == "pre":
    x = norm(x, params["encoder"]["norm"])
  causal = np.tril(np.ones((len(tgt), len(tgt)), bool))
  y = E[tgt] * scale + sinusoids(len(tgt), cfg.d_model)
  for blk in params["decoder"]["layers"].values():
    y = residual(y, blk["input_layernorm"], self_attention(blk["self_attn"], causal))
    y = residual(y, blk["cross_attn_layernorm"], cross_attention(blk["cross_attn"], x, real))
    y = residual(y, blk["post_attention_layernorm"], feed_forward(blk["mlp"], cfg.mlp))
  if cfg.norm_position == "pre":
    y = norm(y, params["decoder"]["norm"])
  return y @ (E.T if cfg.tie_embeddings else params["embedder"]["lm_head"])


CONFIGS = {
    # The paper's model: post-LN, layer norm, ReLU, tied embeddings scaled by sqrt(D).
    "paper": dict(norm_position="post", norm="layernorm", mlp="relu", tie_embeddings=True,
                  scale_embeddings=True),
    # Its pre-LN variant (a final norm per stack), RMSNorm, GELU, an output projection.
    "pre_ln": dict(norm_position="pre", norm="rmsnorm", mlp="gelu", tie_embeddings=False,
                   scale_embeddings=False),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_encoder_decoder_equals_the_numpy_transformer(name):
  cfg = attnlab.ModelConfig(
      arch="encoder_decoder", vocab_size=19, d_model=16, num_heads=4, num_kv_heads=2, d_ff=24,
      num_layers=2, num_encoder_layers=2, pos="sinusoidal", use_bias=True, norm_eps=1e-5,
      pad_id=PAD, attention_impl="reference", **CONFIGS[name])
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  # Every parameter random (the initialization has zero biases and unit norm scales).
  nnx.update(model, jax.tree.unflatten(treedef, [
      0.4 * jax.random.normal(kk, x.shape, x.dtype) for kk, x in zip(keys, leaves)]))
  params = jax.tree.map(lambda x: np.asarray(x, np.float64),
                        nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  rng = np.random.default_rng(2)
  src = rng.integers(1, cfg.vocab_size, (B, S))
  src[1, 4:] = PAD  # a padded source: masked in the encoder and in cross-attention
  tgt = rng.integers(1, cfg.vocab_size, (B, T))
  got = jax.jit(lambda m, s, t: m(s, t))(model, jnp.asarray(src), jnp.asarray(tgt))
  want = numpy_encoder_decoder(cfg, params, src, tgt)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
