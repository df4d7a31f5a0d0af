"""Tiny models shared by the decoding tests (built and compiled once per process).

Compiling dominates these tests on the CPU, so every jitted function here is
cached per model: the full forward passes that the cached paths are compared
with are compiled once per model and shape, whichever test asks first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attnlab

VOCAB = 61
# (name, ModelConfig overrides): MHA / GQA / MQA, RoPE / sinusoidal, windows
# smaller than the prompt (3) and smaller than prompt + generation (10).
DECODER_CONFIGS = {
    "mha_rope": dict(num_heads=4, num_kv_heads=4),
    "gqa_sinusoidal": dict(num_heads=4, num_kv_heads=2, pos="sinusoidal"),
    "mqa_rope_window3": dict(num_heads=4, num_kv_heads=1, window=3),
    "gqa_rope_window10": dict(num_heads=4, num_kv_heads=2, window=10, rope_pairing="adjacent"),
}
ENCDEC_CONFIGS = {
    # The 2017 paper's layout: post-LN, layer norm, ReLU, sinusoidal, scaled embeddings.
    "paper_gqa": dict(num_heads=4, num_kv_heads=2, pos="sinusoidal", norm="layernorm",
                      norm_position="post", mlp="relu", scale_embeddings=True),
    "mqa_rope_window4": dict(num_heads=4, num_kv_heads=1, window=4),
}
# ``varied=True`` models have every parameter scaled by this after the default
# initialization. At the default scale these tiny models decode greedily to one token
# repeated (e.g. [60, 60, 60, ...] whatever the prompt), which cannot tell one request, row
# or step from another: a scheduler or cache that mixed them up would still match, and a
# chosen eos ends every sequence at once. Scaled, their tokens vary with the prompt and the
# step. Tests that compare logits use the default models (the scaled ones amplify rounding
# and int8 error beyond the tolerances of DESIGN.md); tests that compare tokens use these.
PARAM_SCALE = 2.0
# Shapes shared by the encoder-decoder tests, so that they share compiled functions.
SRC_SHAPE = (2, 9)
TGT_LEN = 20


def make_cfg(arch, overrides, attention_impl="reference"):
  return attnlab.ModelConfig(arch=arch, vocab_size=VOCAB, d_model=32, num_layers=2, d_ff=64,
                             max_len=64, attention_impl=attention_impl, **overrides)


def _scaled(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x * PARAM_SCALE, params), rest)


@functools.cache
def decoder_model(name, attention_impl="reference", varied=False):
  """The same parameters whatever ``attention_impl`` (same config, same seed);
  ``varied``: scaled by ``PARAM_SCALE``."""
  cfg = make_cfg("decoder_only", DECODER_CONFIGS[name], attention_impl)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  return _scaled(model) if varied else model


@functools.cache
def encdec_model(name, attention_impl="reference", varied=False):
  cfg = make_cfg("encoder_decoder", ENCDEC_CONFIGS[name], attention_impl)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(1))
  return _scaled(model) if varied else model


def random_tokens(seed, shape):
  return np.random.default_rng(seed).integers(3, VOCAB, shape, dtype=np.int32)


@functools.cache
def decoder_forward(name, varied=False):
  """The jitted full forward of ``decoder_model(name, varied=varied)``: tokens [B, T] ->
  logits [B, T, V]."""
  graphdef, state = nnx.split(decoder_model(name, varied=varied))
  run = jax.jit(lambda tokens_BT: nnx.merge(graphdef, state)(tokens_BT))
  return lambda tokens_BT: np.asarray(run(jnp.asarray(tokens_BT)))


@functools.cache
def encdec_forward(name, varied=False):
  """The jitted teacher-forced forward of ``encdec_model(name, varied=varied)``: (src,
  tgt_in) -> logits."""
  graphdef, state = nnx.split(encdec_model(name, varied=varied))
  run = jax.jit(lambda src_BS, tgt_BT: nnx.merge(graphdef, state)(src_BS, tgt_BT))
  return lambda src_BS, tgt_BT: np.asarray(run(jnp.asarray(src_BS), jnp.asarray(tgt_BT)))


def assert_greedy(logits_fn, prefix_BT, prefix_lengths_B, generated_BJ):
  """``generated_BJ`` is what greedy decoding that recomputes everything would emit.

  One teacher-forced pass over prefix ++ generated: by induction over the
  steps, every generated token being the argmax of the logits before it is
  exactly "recompute the full forward pass for every token, take the argmax".

  Args:
    logits_fn: tokens [B, T] -> logits [B, T, V] (causal: what follows a
      position cannot change its logits).
    prefix_BT: int [B, T]; row b's first ``prefix_lengths_B[b]`` tokens are
      its prefix, the rest is room (T >= length + J - 1).
    generated_BJ: the tokens to check.
  """
  B, J = generated_BJ.shape
  seq_BT = np.array(prefix_BT)
  for b in range(B):
    n = prefix_lengths_B[b]
    seq_BT[b, n:] = 0
    seq_BT[b, n:n + J - 1] = generated_BJ[b, :-1]
  want_BT = np.argmax(logits_fn(seq_BT), axis=-1)
  for b in range(B):
    n = prefix_lengths_B[b]
    np.testing.assert_array_equal(generated_BJ[b], want_BT[b, n - 1:n - 1 + J], err_msg=f"row {b}")
