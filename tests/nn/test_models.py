"""The models: head sharing, causality, padding, norms, and that they learn."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import attnlab
from attnlab import ModelConfig
from tests import random_arrays

TINY = dict(vocab_size=32, d_model=32, num_layers=2, num_heads=4, head_dim=8, d_ff=64,
            max_len=64)


def tokens(B, T, seed=0, low=1, high=32):
  return random_arrays.randint(seed, (B, T), low, high)


def build(**kw):
  return attnlab.build_model(ModelConfig(**{**TINY, **kw}), rngs=nnx.Rngs(0))


# Jitted calls: op-by-op execution compiles every op of the model on first use (~10x
# the time of compiling the whole forward once on the CPU).
@nnx.jit
def run(model, *args):
  return model(*args)


def test_gqa_with_k_equal_n_is_mha():
  mha = build(num_kv_heads=None)
  gqa = build(num_kv_heads=4)
  x = tokens(2, 10)
  np.testing.assert_array_equal(run(mha, x), run(gqa, x))


@pytest.mark.parametrize("K", [1, 2])
def test_gqa_equals_mha_with_each_kv_head_copied_to_its_group(K):
  """Query head n must read KV head n // G: copying each KV projection to the G
  query heads of its group turns the GQA model into an equivalent MHA model."""
  gqa = build(num_kv_heads=K)
  mha = build(num_kv_heads=None)
  G = 4 // K
  gqa_params = nnx.state(gqa, nnx.Param)
  mha_params = nnx.state(mha, nnx.Param)

  def copy(path, g, m):
    # The path ends (..., "k_proj", "w", .value): name the projection anywhere in it.
    if any(getattr(p, "key", None) in ("k_proj", "v_proj") for p in path):
      return jnp.repeat(g, G, axis=1)
    return g

  new = jax.tree.map_with_path(copy, gqa_params, mha_params)
  nnx.update(mha, new)
  # Still an MHA model (the copy did not hand it the GQA model's own K heads).
  k_shape = mha.decoder.layers[0].self_attn.k_proj.w[...].shape
  assert k_shape == (TINY["d_model"], TINY["num_heads"], TINY["head_dim"])
  x = tokens(2, 12)
  np.testing.assert_allclose(run(mha, x), run(gqa, x), atol=1e-5)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_kv_projection_parameters_scale_with_num_kv_heads(K):
  model = build(num_kv_heads=K)
  kv_params = sum(
      x.size for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
      if any(getattr(p, "key", None) in ("k_proj", "v_proj") for p in path)
  )
  # layers x (K and V) x D x K x H
  assert kv_params == 2 * 2 * 32 * K * 8


def test_mqa_model_runs_and_differs_in_size_from_mha():
  mqa, mha = build(num_kv_heads=1), build()
  out = run(mqa, tokens(2, 9))
  assert out.shape == (2, 9, 32) and np.all(np.isfinite(out))
  assert attnlab.count_params(mha) - attnlab.count_params(mqa) == 2 * 2 * 32 * 3 * 8


@pytest.mark.parametrize(
    "kw",
    [dict(pos="rope"), dict(pos="sinusoidal", norm_position="post", norm="layernorm"),
     dict(pos="learned", mlp="relu"), dict(pos="rope", window=3, num_kv_heads=2),
     dict(pos="none", mlp="gelu")],
    ids=str,
)
def test_decoder_only_is_causal(kw):
  model = build(**kw)
  x = tokens(2, 12)
  y = x.at[:, 7:].set(tokens(2, 5, seed=1))
  a, b = run(model, x), run(model, y)
  np.testing.assert_allclose(a[:, :7], b[:, :7], atol=1e-6)
  assert not np.allclose(a[:, 7:], b[:, 7:], atol=1e-3)


def test_logits_at_gives_each_rows_logits_at_its_index_only():
  model = build(pos="rope", num_kv_heads=2)
  x = tokens(3, 10)
  at_B = jnp.array([9, 0, 4])
  full, got = nnx.jit(lambda m, x: (m(x), m(x, logits_at_B=at_B)))(model, x)  # one program
  assert got.shape == (3, 1, TINY["vocab_size"])
  np.testing.assert_allclose(got[:, 0], np.asarray(full)[np.arange(3), np.asarray(at_B)],
                             atol=1e-6, rtol=1e-6)


def test_logits_at_that_is_not_one_index_of_the_tokens_per_row_is_refused_by_name():
  """Until 2026-12-07 an index past T gave NaN logits, -1 the last token's, floats were
  truncated and another shape was an error from inside JAX. The dtype and shape are checked
  as traced; the range where the indices are concrete. A list of ints is taken as before."""
  model = build(pos="rope")
  x = tokens(3, 10)

  def refused(at, message):
    def trace():
      with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        model(x, logits_at_B=at)
    jax.eval_shape(trace)  # no op runs: the check comes first

  refused(jnp.array([9.0, 0.0, 4.0]), "logits_at_B has dtype float32; give int indices [B], "
          "one token per row")
  refused(jnp.array([True, False, True]), "logits_at_B has dtype bool; give int indices [B], "
          "one token per row")
  for shape in ((3, 1), (4,), ()):
    refused(jnp.zeros(shape, jnp.int32), f"logits_at_B has shape {shape}; give int indices [B] "
            "= (3,), one token per row")
  for at, b in (([9, 10, 4], 1), ([-1, 0, 4], 0)):
    refused(jnp.array(at), f"logits_at_B[{b}]={at[b]} is not an index of the 10 tokens: give "
            "0 <= logits_at_B < 10")
  as_array, as_list = nnx.jit(lambda m, x: (m(x, logits_at_B=jnp.array([9, 0, 4])),
                                            m(x, logits_at_B=[9, 0, 4])))(model, x)
  np.testing.assert_array_equal(as_array, as_list)


def test_encoder_decoder_decoder_is_causal():
  model = build(arch="encoder_decoder", pos="sinusoidal", norm_position="post")
  src, tgt = tokens(2, 8), tokens(2, 10, seed=2)
  tgt2 = tgt.at[:, 6:].set(tokens(2, 4, seed=3))
  np.testing.assert_allclose(run(model, src, tgt)[:, :6], run(model, src, tgt2)[:, :6],
                             atol=1e-6)


@pytest.mark.parametrize("pos", ["sinusoidal", "rope", "learned"])
def test_encoder_ignores_pad_tokens(pos):
  model = build(arch="encoder_decoder", pos=pos)
  src = tokens(2, 6)
  padded = jnp.concatenate([src, jnp.zeros((2, 5), src.dtype)], axis=1)  # pad_id = 0
  tgt = tokens(2, 7, seed=4)
  enc, enc_padded, out, out_padded = nnx.jit(lambda m: (  # one program: one compilation
      m.encode(src), m.encode(padded), m(src, tgt), m(padded, tgt)))(model)
  np.testing.assert_allclose(enc_padded[:, :6], enc, atol=1e-5)
  np.testing.assert_allclose(out_padded, out, atol=1e-5)


def test_window_at_least_length_equals_full_causal_model():
  full = build(window=None)
  windowed = build(window=12)
  narrow = build(window=4)
  x = tokens(2, 12)
  want, narrowed = run(full, x), run(narrow, x)
  np.testing.assert_allclose(run(windowed, x), want, atol=1e-6)
  np.testing.assert_allclose(narrowed[:, :4], want[:, :4], atol=1e-6)
  assert not np.allclose(narrowed[:, 4:], want[:, 4:], atol=1e-3)


def test_post_ln_block_output_is_layer_normalized():
  """The paper's post-LN: each sublayer's output is LayerNorm(x + f(x)), so with
  the norm at its initial scale 1 / bias 0 every position has mean 0, var 1."""
  model = build(norm="layernorm", norm_position="post", pos="sinusoidal")
  x_BTD = random_arrays.normal(0, (2, 5, 32))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  y = np.asarray(nnx.jit(lambda block: block(x_BTD, pos, None))(model.decoder.layers[0]))
  np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-3)


def test_every_norm_divides_by_the_configured_eps():
  """norm_eps reaches every norm of the model and is the epsilon it divides by: on inputs of
  mean square ~1e-2 an eps of 1e-2 halves the squared output scale, against NumPy (the
  library's default 1e-6 in its place would not)."""
  from attnlab.nn.layers import LayerNorm, RMSNorm

  x = np.asarray(random_arrays.normal(0, (2, 3, TINY["d_model"]))) * 0.1
  for kind in ("rmsnorm", "layernorm"):
    norms = [m for _, m in nnx.iter_modules(build(norm=kind, norm_eps=1e-2))
             if isinstance(m, RMSNorm | LayerNorm)]
    assert len(norms) == 2 * TINY["num_layers"] + 1  # two per block, the final one
    c = x - x.mean(-1, keepdims=True) if kind == "layernorm" else x
    want = c / np.sqrt(np.mean(np.square(c), -1, keepdims=True) + 1e-2)
    for got in nnx.jit(lambda ns: [n(x) for n in ns])(norms):  # one program per kind
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["chunked", "xla"])
def test_model_with_other_attention_impl_matches_reference(impl):
  ref = build(num_kv_heads=2, window=5, attention_impl="reference")
  other = build(num_kv_heads=2, window=5, attention_impl=impl)
  x = tokens(2, 11)

  def loss(m):
    return jnp.mean(jax.nn.log_softmax(m(x))[..., 3])

  outputs = nnx.jit(lambda m: (m(x), nnx.grad(loss)(m)))  # one program per model
  (out_ref, g_ref), (out_other, g_other) = outputs(ref), outputs(other)
  np.testing.assert_allclose(out_other, out_ref, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g_other), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def dot_operand_dtypes(jaxpr):
  """The operand dtypes of every ``dot_general`` in a jaxpr, its sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple | list) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found += dot_operand_dtypes(sub)
  return found


def test_bfloat16_compute_keeps_float32_params():
  model = build(dtype="bfloat16")
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  fp32 = build()
  x = tokens(2, 8)
  out = run(model, x)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, run(fp32, x), atol=0.1)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_bfloat16_compute_runs_every_matmul_in_bfloat16(arch):
  """dtype='bfloat16': every projection, both attention products and the logits multiply
  bfloat16 by bfloat16 (float32 parameters are cast), in both stacks of an encoder-decoder.
  A layer that missed the dtype would multiply in float32."""
  L = TINY["num_layers"]
  extra = {"num_encoder_layers": 1, "mlp": "relu"} if arch == "encoder_decoder" else {}
  model = build(arch=arch, dtype="bfloat16", attention_impl="reference", **extra)
  graphdef, state = nnx.split(model)
  x = tokens(2, 8)
  call = lambda st: nnx.merge(graphdef, st)(*((x,) if arch == "decoder_only" else (x, x)))
  dots = dot_operand_dtypes(jax.make_jaxpr(call)(state).jaxpr)
  # q, k, v, o, scores, weighted values; swiglu 3 matmuls, relu 2; the logits.
  want = L * (6 + 3) + 1 if arch == "decoder_only" else 1 * (6 + 2) + L * (12 + 2) + 1
  assert dots == [("bfloat16", "bfloat16")] * want


@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
def test_positions_are_added_in_the_activation_dtype(pos):
  """The positions are added in bfloat16, and the embedding dropout drops their sum with the
  embeddings (the paper's 5.4): in training each entry is 0 or (x + pe) / (1 - rate)."""
  stack = build(pos=pos, dtype="bfloat16", dropout_rate=0.5).decoder
  x_BTD = jnp.ones((2, 5, TINY["d_model"]), jnp.bfloat16)
  pos_BT = jnp.broadcast_to(jnp.arange(5), (2, 5))
  out = stack.add_positions(x_BTD, pos_BT)
  assert out.dtype == jnp.bfloat16
  stack.eval()
  summed = np.asarray(stack.add_positions(x_BTD, pos_BT).astype(jnp.float32))
  out = np.asarray(out.astype(jnp.float32))
  dropped = out == 0
  assert dropped.any() and not dropped.all()
  np.testing.assert_allclose(out[~dropped], 2 * summed[~dropped], rtol=1e-6)


# The logical axes of every parameter (training/sharding.py maps them to the mesh), by the
# last two names of its path; norm scales and offsets are ("embed",).
PARAM_AXES = {
    ("q_proj", "w"): ("embed", "heads", "head_dim"), ("q_proj", "b"): ("heads", "head_dim"),
    ("k_proj", "w"): ("embed", "kv_heads", "head_dim"), ("k_proj", "b"): ("kv_heads", "head_dim"),
    ("v_proj", "w"): ("embed", "kv_heads", "head_dim"), ("v_proj", "b"): ("kv_heads", "head_dim"),
    ("o_proj", "w"): ("heads", "head_dim", "embed"), ("o_proj", "b"): ("embed",),
    ("up_proj", "w"): ("embed", "mlp"), ("up_proj", "b"): ("mlp",),
    ("gate_proj", "w"): ("embed", "mlp"), ("gate_proj", "b"): ("mlp",),
    ("down_proj", "w"): ("mlp", "embed"), ("down_proj", "b"): ("embed",),
    ("embedder", "embed_tokens"): ("vocab", "embed"), ("embedder", "lm_head"): ("embed", "vocab"),
    ("learned_positions", "embed_positions"): (None, "embed"),
}
EVERY_PARAM = {
    "decoder_only": dict(pos="learned", mlp="swiglu", tie_embeddings=False, use_bias=True),
    "encoder_decoder": dict(num_encoder_layers=1, mlp="relu", norm="layernorm", use_bias=True),
}


@pytest.mark.parametrize("arch", EVERY_PARAM)
def test_every_parameter_has_the_param_dtype_its_logical_axes_and_a_fan_in_init(arch):
  """param_dtype reaches every parameter (the learned position table included); each
  names its logical axes; each projection weight has std 1 / sqrt(fan-in) (F != D, so a
  fan-in taken over the wrong axis shows)."""
  D, N, K, H, F = 64, 4, 2, 16, 96
  model = attnlab.build_model(ModelConfig(
      arch=arch, vocab_size=40, d_model=D, num_heads=N, num_kv_heads=K, head_dim=H, d_ff=F,
      num_layers=1, max_len=32, param_dtype="bfloat16", **EVERY_PARAM[arch]), rngs=nnx.Rngs(0))
  fan_in = dict(q_proj=D, k_proj=D, v_proj=D, o_proj=N * H, up_proj=D, gate_proj=D, down_proj=F)
  seen = set()
  for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = tuple(map(str, path))
    axes = ("embed",) if names[-1] in ("scale", "bias") else PARAM_AXES[names[-2:]]
    assert (p.dtype, p.get_metadata()["axes"]) == (jnp.bfloat16, axes), names
    if names[-1] == "w":
      w = np.asarray(p.get_value().astype(jnp.float32), np.float64)
      assert abs(w.std() * np.sqrt(fan_in[names[-2]]) - 1) < 0.1, (names, w.std())
    seen.add(names[-2] if names[-1] in ("w", "b") else names[-1])
  projections = {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}
  if arch == "decoder_only":
    assert seen >= projections | {"gate_proj", "embed_positions", "embed_tokens", "lm_head"}
  else:
    assert seen >= projections and "gate_proj" not in seen
    assert any("cross_attn" in map(str, path) for path, _ in
               nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_count_params_is_the_hand_count():
  """Untied SwiGLU decoder, no biases, RMSNorm: embeddings + lm_head, per layer q, k, v, o,
  three MLP matrices and two norm scales, then the final norm; learned positions add a
  max_len x D table, RoPE nothing. Only parameters count (not the RNG state)."""
  V, D, L, N, K, H, F = 32, 32, 2, 4, 2, 8, 64
  hand = 2 * V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + 2 * D) + D
  kw = dict(num_kv_heads=K, tie_embeddings=False, dropout_rate=0.1)
  assert attnlab.count_params(build(**kw)) == hand
  assert attnlab.count_params(build(pos="learned", **kw)) == hand + TINY["max_len"] * D


def test_models_refuse_another_architecture_by_name():
  enc_dec = ModelConfig(**TINY, arch="encoder_decoder", num_encoder_layers=1)
  with pytest.raises(ValueError, match=re.escape(
      "DecoderOnly needs arch='decoder_only', got arch='encoder_decoder'")):
    attnlab.DecoderOnly(enc_dec, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=re.escape(
      "EncoderDecoder needs arch='encoder_decoder', got arch='decoder_only'")):
    attnlab.EncoderDecoder(ModelConfig(**TINY), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="^build_model needs a ModelConfig, got dict$"):
    attnlab.build_model(dict(TINY), rngs=nnx.Rngs(0))
  # An AttributeError inside Flax until 2026-12-06 (convert_heads builds through it too)
  for rngs in (0, jax.random.key(0), None):
    with pytest.raises(ValueError, match="^" + re.escape(
        "rngs must be an nnx.Rngs (nnx.Rngs(0), or nnx.Rngs(params=0, dropout=1)), got "
        f"{type(rngs).__name__}") + "$"):
      attnlab.build_model(ModelConfig(**TINY), rngs=rngs)
  with pytest.raises(ValueError, match="^count_params needs a model"):  # an IndexError
    attnlab.count_params(ModelConfig(**TINY))
  for not_a_model in ("runs/lm", ModelConfig(**TINY)):  # an AttributeError until 2026-12-06
    with pytest.raises(ValueError, match="^" + re.escape(
        "convert_heads needs a model (a DecoderOnly or EncoderDecoder: build_model(cfg, "
        "rngs=...) or load_checkpoint(workdir)), got " + type(not_a_model).__name__) + "$"):
      attnlab.convert_heads(not_a_model, 1, "mean")
  # ... and a model's state is counted as the model (a split or restored one)
  model = attnlab.build_model(ModelConfig(**TINY), rngs=nnx.Rngs(0))
  assert attnlab.count_params(nnx.state(model)) == attnlab.count_params(
      nnx.split(model)[1]) == attnlab.count_params(model) > 0


def test_the_model_classes_check_their_config_and_rngs_as_build_model_does():
  """DecoderOnly / EncoderDecoder themselves (AttributeErrors until 2026-12-07: 'dict' has no
  'arch', 'int' has no 'params')."""
  for cls in (attnlab.DecoderOnly, attnlab.EncoderDecoder):
    with pytest.raises(ValueError, match=f"^{cls.__name__} needs a ModelConfig, got dict$"):
      cls({"arch": "decoder_only"}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="^" + re.escape(
        "rngs must be an nnx.Rngs (nnx.Rngs(0), or nnx.Rngs(params=0, dropout=1)), got int")
        + "$"):
      cls(ModelConfig(**TINY), rngs=0)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_rngs_without_a_dropout_stream_build_a_model_without_dropout(arch):
  """nnx.Rngs(params=0): Flax's KeyError "No RngStream named 'dropout'" until 2026-12-07, at
  every dropout rate. At rate 0 the model needs no stream and is the model of nnx.Rngs(
  params=0, dropout=1) (the parameters draw from 'params' alone); a rate > 0 names the
  stream it needs."""
  cfg = ModelConfig(**TINY, **(dict(arch=arch, num_encoder_layers=1)
                               if arch == "encoder_decoder" else {}))
  got = attnlab.build_model(cfg, rngs=nnx.Rngs(params=0))
  want = attnlab.build_model(cfg, rngs=nnx.Rngs(params=0, dropout=1))
  for a, b in zip(jax.tree.leaves(nnx.state(got, nnx.Param)),
                  jax.tree.leaves(nnx.state(want, nnx.Param)), strict=True):
    np.testing.assert_array_equal(a, b)
  for rates, named in ((dict(dropout_rate=0.1), "dropout_rate=0.1"),
                       (dict(attention_dropout_rate=0.2), "attention_dropout_rate=0.2"),
                       (dict(dropout_rate=0.1, attention_dropout_rate=0.2),
                        "dropout_rate=0.1 and attention_dropout_rate=0.2")):
    with pytest.raises(ValueError, match="^" + re.escape(
        f"{named}: the masks are drawn from a 'dropout' RNG stream, and rngs has none (its "
        "streams: params): give one, nnx.Rngs(params=0, dropout=1), or one seed for all, "
        "nnx.Rngs(0)") + "$"):
      attnlab.build_model(cfg.replace(**rates), rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match=re.escape("(its streams: none)")):
    attnlab.build_model(cfg, rngs=nnx.Rngs())
  with pytest.raises(ValueError, match="^" + re.escape(
      "the parameters are drawn from a 'params' RNG stream, and rngs has none (its streams: "
      "dropout)")):
    attnlab.build_model(cfg, rngs=nnx.Rngs(dropout=1))


def test_residual_and_embedding_dropout_drop_in_training_only():
  """dropout_rate: a model in training mode draws new masks on every call (so two calls
  differ from each other and from the dropout-free model); in eval mode it is that model."""
  model, plain = build(dropout_rate=0.3), build()
  x = tokens(2, 8)
  want = np.asarray(run(plain, x))
  first, second = np.asarray(run(model, x)), np.asarray(run(model, x))
  assert not np.allclose(first, want, atol=1e-3) and not np.allclose(first, second, atol=1e-3)
  model.eval()
  np.testing.assert_allclose(run(model, x), want, atol=1e-5)


@pytest.mark.parametrize("kept", ["residual", "embedding"])
@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_residual_dropout_and_embedding_dropout_each_drop_on_their_own(arch, kept):
  """Each dropout site drops by itself: with every other dropout module switched off, the
  blocks' residual dropout (``Block.dropout``) alone, or the embedding dropout
  (``Stack.embed_dropout``) alone, still moves a training-mode forward away from the
  eval-mode one. Catches either removed while the other still makes the model random (which
  ``test_residual_and_embedding_dropout_drop_in_training_only`` does not)."""
  from attnlab.nn.transformer import Block, Stack

  # The encoder-decoder in the paper's post-LN (norm(x + dropout(f(x)))), the decoder pre-LN.
  extra = ({"num_encoder_layers": 1, "norm_position": "post"} if arch == "encoder_decoder"
           else {})
  model = build(arch=arch, dropout_rate=0.3, **extra)
  x = tokens(2, 8)
  args = (x,) if arch == "decoder_only" else (x, x)
  model.eval()
  want = np.asarray(run(model, *args))
  model.train()
  sites = 0
  for _, m in nnx.iter_modules(model):
    if isinstance(m, Block):
      m.dropout.deterministic = kept != "residual"
      sites += kept == "residual"
    elif isinstance(m, Stack):
      m.embed_dropout.deterministic = kept != "embedding"
      sites += kept == "embedding"
  assert sites  # the kept site is in the model
  assert not np.allclose(run(model, *args), want, atol=1e-3)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_remat_recomputes_the_same_logits_and_gradients(arch):
  """remat=True (each block's activations recomputed in the backward pass) changes no
  number: the same logits and gradients as without it, on packed documents at gapped
  positions (decoder-only) and a padded source with a padded target (encoder-decoder)."""
  extra = {"num_encoder_layers": 2} if arch == "encoder_decoder" else {}
  plain, remat = build(arch=arch, **extra), build(arch=arch, remat=True, **extra)
  x = tokens(2, 8)
  if arch == "decoder_only":
    seg = jnp.array([[1] * 8, [1] * 3 + [2] * 5])
    pos = jnp.array([[0, 1, 2, 5, 6, 7, 8, 9], [0, 1, 2, 0, 1, 2, 3, 4]])
    forward = lambda m: m(x, positions_BT=pos, segment_ids_BT=seg)
  else:
    src = x.at[1, 5:].set(0)
    tgt_seg = jnp.array([[1] * 8, [1] * 6 + [0] * 2])
    forward = lambda m: m(src, x, tgt_segment_ids_BT=tgt_seg)
  loss = lambda m: jnp.mean(jax.nn.log_softmax(forward(m))[..., 3])
  # Everything a model computes here in one program: one compilation per model.
  outputs = nnx.jit(lambda m: (nnx.value_and_grad(loss)(m), forward(m),
                               m(x) if arch == "decoder_only" else m(src, x)))
  ((l_plain, g_plain), f_plain, _), ((l_remat, g_remat), f_remat, unsegmented) = [
      outputs(m) for m in (plain, remat)]
  np.testing.assert_allclose(f_remat, f_plain, atol=1e-6)
  np.testing.assert_allclose(l_remat, l_plain, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_remat), jax.tree.leaves(g_plain), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # The inputs reach the blocks: other segment ids change the logits.
  assert not np.allclose(f_remat, unsegmented, atol=1e-3)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_remat_under_jax_grad_of_the_split_model(arch):
  """A training step of one's own differentiates a loss of ``nnx.merge(graphdef, params,
  rest)`` with ``jax.grad``. With remat=True that raised TraceContextError ("Cannot mutate
  RngCount from a different trace level": ``nnx.remat`` wrote back the RNG stream each
  block's dropout held, at rate 0 too) until 2026-12-07. Without dropout: the gradients of
  ``nnx.grad``. With dropout, the RNG variables made fresh inside the trace
  (``steps.with_dropout_key``, as the trainer does): the same loss and gradients as
  without remat, and other than without dropout (the key reaches the masks)."""
  from attnlab.training.steps import with_dropout_key

  extra = {"num_encoder_layers": 2} if arch == "encoder_decoder" else {}
  x = tokens(2, 8)
  forward = (lambda m: m(x)) if arch == "decoder_only" else (lambda m: m(x, x))
  loss = lambda m: jnp.mean(jax.nn.log_softmax(forward(m))[..., 3])

  def split_grad(model, key=None):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fresh = (lambda r: r) if key is None else (lambda r: with_dropout_key(r, key))
    f = lambda p, r: loss(nnx.merge(graphdef, p, fresh(r)))
    return jax.jit(jax.value_and_grad(f))(params, rest)

  model = build(arch=arch, remat=True, **extra)
  (value, grads), want = split_grad(model), nnx.jit(nnx.value_and_grad(loss))(model)
  np.testing.assert_allclose(value, want[0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.state(want[1], nnx.Param)),
                  strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # The parameters do not depend on the dropout rate, from one seed (``nnx.Rngs(0)``: the
  # parameters and dropout draw from one stream, which each dropout forks at any rate).
  with_dropout = build(arch=arch, dropout_rate=0.3, **extra)
  for a, b in zip(jax.tree.leaves(nnx.state(with_dropout, nnx.Param)),
                  jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True):
    np.testing.assert_array_equal(a, b)
  assert not jax.tree.leaves(nnx.state(model, nnx.RngState))  # no RNG state without dropout
  key = jax.random.key(7)
  dropped = [split_grad(build(arch=arch, remat=remat, dropout_rate=0.3, **extra), key)
             for remat in (True, False)]
  np.testing.assert_allclose(dropped[0][0], dropped[1][0], rtol=1e-6)
  for a, b in zip(*(jax.tree.leaves(g) for _, g in dropped), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert not np.allclose(dropped[0][0], value, rtol=1e-3)


def test_activations_declare_their_logical_axes_inside_activation_sharding():
  """Under ``activation_sharding`` (the training steps' trace) the embedding table, the
  embedded tokens, every block's output and the logits name their logical axes; outside it
  nothing is constrained."""
  from attnlab.nn.partitioning import activation_sharding

  declared = []

  def resolve(axes, shape):
    declared.append((axes, tuple(shape)))
    return jax.sharding.make_single_device_sharding(jax.devices()[0])

  model = build(arch="encoder_decoder", num_encoder_layers=1)
  graphdef, state = nnx.split(model)
  x = tokens(2, 8)
  want = run(model, x, x)
  with activation_sharding(resolve):
    got = jax.jit(lambda st: nnx.merge(graphdef, st)(x, x))(state)
  np.testing.assert_array_equal(got, want)
  D, V = TINY["d_model"], TINY["vocab_size"]
  table = (("vocab", None), (V, D))
  hidden = (("batch", "length", "embed"), (2, 8, D))
  # The encoder: its table, the embedded source, its one block; the decoder: the table, the
  # embedded target, its blocks; the logits.
  assert declared == ([table, hidden, hidden] + [table, hidden] + [hidden] * TINY["num_layers"]
                      + [(("batch", "length", "vocab"), (2, 8, V))])
  declared.clear()
  jax.jit(lambda st: nnx.merge(graphdef, st)(x, x))(state)  # a new trace, outside
  assert declared == []


def test_logical_constraint_refuses_axes_of_another_rank_inside_activation_sharding():
  from attnlab.nn.partitioning import activation_sharding, logical_constraint

  x = jnp.zeros((2, 3))
  one_device = jax.sharding.make_single_device_sharding(jax.devices()[0])
  resolve = lambda axes, shape: one_device  # noqa: E731
  assert logical_constraint(x, ("batch",)) is x  # outside: a no-op, nothing checked
  with activation_sharding(resolve), pytest.raises(ValueError, match=re.escape(
      "axes ('batch',) must name every dimension of shape (2, 3)")):
    logical_constraint(x, ("batch",))


def test_mlp_defaults_to_swiglu_without_biases_and_names_the_kinds():
  from attnlab.nn.mlp import MLP

  mlp = MLP(8, 16, rngs=nnx.Rngs(0))
  assert mlp.kind == "swiglu" and mlp.gate_proj is not None
  assert mlp.up_proj.b is None and mlp.gate_proj.b is None and mlp.down_proj.b is None
  with pytest.raises(ValueError, match=re.escape(
      "mlp kind='geglu' is not one of 'relu', 'gelu', 'swiglu'")):
    MLP(8, 16, kind="geglu", rngs=nnx.Rngs(0))


def overfit(model, batch, loss_fn, steps):
  """Adam on one batch for ``steps`` steps; the loss of the last step.

  All steps run in one compiled loop: calling an ``nnx.jit`` step 150 times
  spent ~0.1 s a call flattening the model and optimizer graphs in Python.
  """
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  @jax.jit
  def run(state):
    def step(_, carry):
      model, optimizer = nnx.merge(graphdef, carry[0])
      loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, *batch))(model)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), loss

    return jax.lax.fori_loop(0, steps, step, (state, jnp.float32(jnp.inf)))  # no step: inf

  _, loss = run(state)
  return float(loss)


def xent(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_decoder_only_overfits_a_fixed_batch(norm_position):
  model = build(norm_position=norm_position, dropout_rate=0.0)
  seq = tokens(4, 17, seed=5)
  loss = overfit(model, (seq[:, :-1], seq[:, 1:]), lambda m, x, y: xent(m(x), y), 150)
  # Random tokens from 31 ids: chance is ln(31) = 3.43; memorized is near 0.
  assert loss < 0.1, loss


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_encoder_decoder_overfits_a_fixed_batch(norm_position):
  model = build(arch="encoder_decoder", pos="sinusoidal", norm="layernorm",
                norm_position=norm_position, mlp="relu", scale_embeddings=True)
  src = tokens(4, 10, seed=6)
  tgt = jnp.concatenate([jnp.ones((4, 1), src.dtype), src[:, ::-1]], axis=1)  # reverse task
  loss = overfit(model, (src, tgt[:, :-1], tgt[:, 1:]),
                 lambda m, s, ti, to: xent(m(s, ti), to), 150)
  assert loss < 0.1, loss


def test_build_model_rejects_non_config():
  with pytest.raises(ValueError, match="ModelConfig"):
    attnlab.build_model({"d_model": 3}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("arch,pos", [("decoder_only", "learned"), ("decoder_only", "rope"),
                                      ("encoder_decoder", "sinusoidal")])
def test_a_sequence_longer_than_max_len_is_refused_by_name(arch, pos):
  """The learned table has max_len rows: a longer input would read its last row at
  every later position, silently. Every model refuses one (the encoder's and the
  decoder's inputs alike); max_len tokens run."""
  model = build(arch=arch, pos=pos, max_len=8)
  ok = tokens(1, 8)
  run(model, *([ok, ok] if arch == "encoder_decoder" else [ok]))
  msg = r"^a sequence of 9 tokens is longer than ModelConfig.max_len=8: raise max_len or "
  long = tokens(1, 9)
  with pytest.raises(ValueError, match=msg):
    run(model, *([long, ok] if arch == "encoder_decoder" else [long]))
  if arch == "encoder_decoder":
    with pytest.raises(ValueError, match=msg):
      run(model, ok, long)
