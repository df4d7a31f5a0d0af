"""The models against an independent NumPy (float64) implementation: the 2017
encoder-decoder Transformer and its pre-LN variant, and decoder-only models in the
layouts transformers has no counterpart for here (post-LN, sinusoidal or learned
positions, RoFormer's adjacent RoPE pairs with a sliding window, MQA). Every parameter
is randomized (biases, norm scales and offsets included). tests/convert/test_hf.py
checks the Llama / Mistral / Qwen2 / GPT-2 layouts against transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from tests import random_arrays

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


def sinusoids(positions, D):
  """PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(...), at each position."""
  pe = np.zeros((len(positions), D))
  for row, p in enumerate(positions):
    for i in range(0, D, 2):
      pe[row, i] = np.sin(p / 10000 ** (i / D))
      pe[row, i + 1] = np.cos(p / 10000 ** (i / D))
  return pe


def rope(x, positions, theta, pairing):
  """x [T, N, H] rotated by its positions: pairs (i, i + H/2) ("half") or (2i, 2i + 1)."""
  T, _, H = x.shape
  out = np.empty_like(x)
  for t in range(T):
    for i in range(H // 2):
      a, b = (i, i + H // 2) if pairing == "half" else (2 * i, 2 * i + 1)
      angle = positions[t] * theta ** (-2 * i / H)
      out[t, :, a] = x[t, :, a] * np.cos(angle) - x[t, :, b] * np.sin(angle)
      out[t, :, b] = x[t, :, b] * np.cos(angle) + x[t, :, a] * np.sin(angle)
  return out


def bias(p, on):
  """The projection's bias if the config gives it one (the model must have it then, and
  must not otherwise)."""
  assert ("b" in p) == on, (sorted(p), on)
  return p["b"] if on else 0.0


def attention(cfg, p, x, ctx, allowed, rotary=None):
  """Multi-head attention of one sequence: x [T, D] over ctx [S, D]; allowed [T, S];
  ``rotary`` = (theta, pairing, q positions [T], k positions [S]) rotates q and k."""
  qkv = cfg.has_bias("qkv")
  q = np.einsum("td,dnh->tnh", x, p["q_proj"]["w"]) + bias(p["q_proj"], qkv)
  k = np.einsum("sd,dkh->skh", ctx, p["k_proj"]["w"]) + bias(p["k_proj"], qkv)
  v = np.einsum("sd,dkh->skh", ctx, p["v_proj"]["w"]) + bias(p["v_proj"], qkv)
  if rotary is not None:
    theta, pairing, q_pos, k_pos = rotary
    q, k = rope(q, q_pos, theta, pairing), rope(k, k_pos, theta, pairing)
  N, H = q.shape[1:]
  group = N // k.shape[1]
  out = np.zeros_like(q)
  for n in range(N):
    scores = q[:, n] @ k[:, n // group].T / np.sqrt(H)
    scores = np.where(allowed, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    out[:, n] = (w / w.sum(-1, keepdims=True)) @ v[:, n // group]
  return np.einsum("tnh,nhd->td", out, p["o_proj"]["w"]) + bias(p["o_proj"], cfg.has_bias("o"))


def mlp(cfg, p, x):
  on = cfg.has_bias("mlp")
  h = x @ p["up_proj"]["w"] + bias(p["up_proj"], on)
  assert ("gate_proj" in p) == (cfg.mlp == "swiglu")
  if cfg.mlp == "swiglu":
    g = x @ p["gate_proj"]["w"] + bias(p["gate_proj"], on)
    h = g / (1 + np.exp(-g)) * h
  else:
    h = np.maximum(h, 0) if cfg.mlp == "relu" else gelu_tanh(h)
  return h @ p["down_proj"]["w"] + bias(p["down_proj"], on)


def self_attention(cfg, p, allowed, rotary=None):
  return lambda h: attention(cfg, p, h, h, allowed, rotary)


def cross_attention(cfg, p, ctx, allowed):
  return lambda h: attention(cfg, p, h, ctx, allowed)


def feed_forward(cfg, p):
  return lambda h: mlp(cfg, p, h)


def numpy_encoder_decoder(cfg, params, src, tgt):
  """Logits [B, T, V] in float64."""
  return np.stack([numpy_sequence(cfg, params, s, t) for s, t in zip(src, tgt, strict=True)])


def norm_and_residual(cfg):
  def norm(x, p):
    if cfg.norm == "layernorm":
      return layernorm(x, p, cfg.norm_eps)
    return rmsnorm(x, p, cfg.norm_eps)

  def residual(x, p_norm, f):
    if cfg.norm_position == "pre":
      return x + f(norm(x, p_norm))
    return norm(x + f(x), p_norm)

  return norm, residual


def embed(cfg, params, stack, tokens, positions=None):
  """Token embeddings (scaled by sqrt(D) if asked) plus the additive positions, if any."""
  positions = np.arange(len(tokens)) if positions is None else positions
  x = params["embedder"]["embed_tokens"][tokens]
  x = x * (np.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0)
  if cfg.pos == "sinusoidal":
    x = x + sinusoids(positions, cfg.d_model)
  elif cfg.pos == "learned":
    x = x + params[stack]["learned_positions"]["embed_positions"][positions]
  return x


def unembed(cfg, params, y):
  E = params["embedder"]["embed_tokens"]
  return y @ (E.T if cfg.tie_embeddings else params["embedder"]["lm_head"])


def run_stack(cfg, params, name, x, allowed, rotary=None, context=None):
  """The blocks of stack ``name`` over x [T, D] (self-attention where ``allowed``, then
  cross-attention to ``context`` = (ctx [S, D], allowed [T, S]) if given, then the MLP),
  and its final norm in the pre-LN position."""
  norm, residual = norm_and_residual(cfg)
  for blk in params[name]["layers"].values():
    x = residual(x, blk["input_layernorm"], self_attention(cfg, blk["self_attn"], allowed,
                                                           rotary))
    if context is not None:
      x = residual(x, blk["cross_attn_layernorm"], cross_attention(cfg, blk["cross_attn"],
                                                                   *context))
    x = residual(x, blk["post_attention_layernorm"], feed_forward(cfg, blk["mlp"]))
  return norm(x, params[name]["norm"]) if cfg.norm_position == "pre" else x


def numpy_sequence(cfg, params, src, tgt, src_seg=None, tgt_seg=None, src_pos=None,
                   tgt_pos=None):
  """Logits [T, V] of one source / target pair: by default one document each, the source's
  pad tokens masked. Packed pairs: target document j attends to source document j."""
  src_seg = (src != PAD).astype(int) if src_seg is None else src_seg
  tgt_seg = np.ones(len(tgt), int) if tgt_seg is None else tgt_seg
  # Keys of the query's own segment, never padding (a padding query's row is never read:
  # it sees the real keys, to stay finite).
  sees = lambda q, k: np.where(q[:, None] == 0, k[None] != 0,
                               (q[:, None] == k[None]) & (k[None] != 0))
  enc = run_stack(cfg, params, "encoder", embed(cfg, params, "encoder", src, src_pos),
                  sees(src_seg, src_seg))
  rows = np.arange(len(tgt))
  causal = sees(tgt_seg, tgt_seg) & (rows[None] <= rows[:, None])
  y = run_stack(cfg, params, "decoder", embed(cfg, params, "decoder", tgt, tgt_pos), causal,
                context=(enc, sees(tgt_seg, src_seg)))
  return unembed(cfg, params, y)


def numpy_decoder_only(cfg, params, tokens, positions, segments):
  """Logits [T, V] of one row of packed documents (``segments``): a token sees the earlier
  tokens of its own document, within the window. Masks count rows (the library's contract);
  ``positions`` (any: restarting per document, with gaps) only rotate or add to the
  embeddings."""
  p, q = np.arange(len(tokens))[:, None], np.arange(len(tokens))[None, :]
  allowed = (segments[:, None] == segments[None, :]) & (q <= p)
  if cfg.window:
    allowed &= p - q < cfg.window
  rotary = (cfg.rope_theta, cfg.rope_pairing, positions, positions) if cfg.pos == "rope" else None
  x = run_stack(cfg, params, "decoder", embed(cfg, params, "decoder", tokens, positions),
                allowed, rotary)
  return unembed(cfg, params, x)


def randomized(cfg):
  """The model of ``cfg`` with every parameter drawn at random, and its float64 params."""
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
  rng = random_arrays.rng(1)
  # The initialization has zero biases and unit norm scales: draw them all.
  nnx.update(model, jax.tree.unflatten(treedef, [
      jax.device_put(0.4 * rng.standard_normal(x.shape, np.float32).astype(x.dtype))
      for x in leaves]))
  params = jax.tree.map(lambda x: np.asarray(x, np.float64),
                        nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return model, params


CONFIGS = {
    # The paper's model: post-LN, layer norm, ReLU, tied embeddings scaled by sqrt(D).
    "paper": dict(norm_position="post", norm="layernorm", mlp="relu", tie_embeddings=True,
                  scale_embeddings=True),
    # Its pre-LN variant (a final norm per stack), RMSNorm, GELU, an output projection.
    "pre_ln": dict(norm_position="pre", norm="rmsnorm", mlp="gelu", tie_embeddings=False,
                   scale_embeddings=False),
}


def encoder_decoder_config(name):
  """GQA, sinusoidal positions, biases, 2 + 2 layers, in the layout ``CONFIGS[name]``."""
  return attnlab.ModelConfig(
      arch="encoder_decoder", vocab_size=19, d_model=16, num_heads=4, num_kv_heads=2, d_ff=24,
      num_layers=2, num_encoder_layers=2, pos="sinusoidal", use_bias=True, norm_eps=1e-5,
      pad_id=PAD, attention_impl="reference", **CONFIGS[name])


@pytest.mark.parametrize("name", CONFIGS)
def test_encoder_decoder_equals_the_numpy_transformer(name):
  cfg = encoder_decoder_config(name)
  model, params = randomized(cfg)
  rng = np.random.default_rng(2)
  src = rng.integers(1, cfg.vocab_size, (B, S))
  src[1, 4:] = PAD  # a padded source: masked in the encoder and in cross-attention
  tgt = rng.integers(1, cfg.vocab_size, (B, T))
  got = jax.jit(lambda m, s, t: m(s, t))(model, jnp.asarray(src), jnp.asarray(tgt))
  want = numpy_encoder_decoder(cfg, params, src, tgt)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_encoder_decoder_equals_the_numpy_transformer(name):
  """Row 0 packs two source / target pairs (segments 1 and 2, positions restarting per
  document): each target document sees its own earlier tokens and its own source. Row 1 is
  one pair, its source padded (explicit segment 0) and its target at gapped positions."""
  cfg = encoder_decoder_config(name)
  model, params = randomized(cfg)
  rng = np.random.default_rng(4)
  src = rng.integers(1, cfg.vocab_size, (B, S))
  tgt = rng.integers(1, cfg.vocab_size, (B, T))
  src_seg = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0]])
  tgt_seg = np.array([[1, 1, 2, 2, 2, 2], [1] * T])
  src_pos = np.array([[0, 1, 2, 0, 1, 2, 3], list(range(S))])
  tgt_pos = np.array([[0, 1, 0, 1, 2, 3], [0, 1, 2, 5, 6, 7]])
  got = jax.jit(lambda m, *a: m(a[0], a[1], src_segment_ids_BS=a[2], tgt_segment_ids_BT=a[3],
                                src_positions_BS=a[4], tgt_positions_BT=a[5]))(
      model, *map(jnp.asarray, (src, tgt, src_seg, tgt_seg, src_pos, tgt_pos)))
  want = np.stack([numpy_sequence(cfg, params, *row) for row in
                   zip(src, tgt, src_seg, tgt_seg, src_pos, tgt_pos, strict=True)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


DECODER_CONFIGS = {
    # RoFormer's adjacent pairs, a sliding window of 3, SwiGLU, RMSNorm, no biases.
    "rope_adjacent_window": dict(pos="rope", rope_pairing="adjacent", rope_theta=500.0,
                                 window=3, mlp="swiglu", norm="rmsnorm", tie_embeddings=False),
    # Post-LN with learned positions, layer norm, GELU, biases, tied and scaled embeddings.
    "post_ln_learned": dict(pos="learned", norm_position="post", norm="layernorm", mlp="gelu",
                            use_bias=True, scale_embeddings=True),
    # MQA with sinusoidal positions, ReLU, biases on the q / k / v projections only.
    "mqa_sinusoidal": dict(pos="sinusoidal", num_kv_heads=1, mlp="relu", norm="layernorm",
                           qkv_bias=True),
}


@pytest.mark.parametrize("name", DECODER_CONFIGS)
def test_decoder_only_equals_the_numpy_transformer(name):
  kw = {"num_kv_heads": 2, "norm_eps": 1e-5, **DECODER_CONFIGS[name]}
  cfg = attnlab.ModelConfig(vocab_size=19, d_model=16, num_heads=4, d_ff=24, num_layers=2,
                            attention_impl="reference", **kw)
  model, params = randomized(cfg)
  tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (B, T))
  # Row 0 one document at positions with a gap (0, 1, 2, 5, 6, 7: the masks count rows, the
  # positions rotate or add); row 1 two packed documents, positions restarting.
  segments = np.array([[1] * T, [1] * 4 + [2] * (T - 4)])
  positions = np.array([[0, 1, 2, 5, 6, 7], list(range(4)) + list(range(T - 4))])
  got = jax.jit(lambda m, t, p, s: m(t, positions_BT=p, segment_ids_BT=s))(
      model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
  want = np.stack([numpy_decoder_only(cfg, params, *row)
                   for row in zip(tokens, positions, segments, strict=True)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
