"""Tiny models shared by the decoding tests (built once per process)."""

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


def make_cfg(arch, overrides):
  return attnlab.ModelConfig(arch=arch, vocab_size=VOCAB, d_model=32, num_layers=2, d_ff=64,
                             max_len=64, attention_impl="reference", **overrides)


@functools.cache
def decoder_model(name):
  cfg = make_cfg("decoder_only", DECODER_CONFIGS[name])
  return attnlab.build_model(cfg, rngs=nnx.Rngs(0))


@functools.cache
def encdec_model(name):
  cfg = make_cfg("encoder_decoder", ENCDEC_CONFIGS[name])
  return attnlab.build_model(cfg, rngs=nnx.Rngs(1))


def random_tokens(seed, shape):
  return np.array(jax.random.randint(jax.random.key(seed), shape, 3, VOCAB), np.int32)


def forward_fn(model):
  """A jitted full forward of ``model``: tokens -> logits (decoder-only)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(tokens_BT):
    return nnx.merge(graphdef, state)(tokens_BT)

  return run


def greedy_recompute(model, prompt_BT, lengths_B, steps):
  """Greedy decoding that recomputes the full forward pass for every token."""
  graphdef, state = nnx.split(model)
  B, T = prompt_BT.shape

  @jax.jit
  def run(prompt_BT, lengths_B):
    m = nnx.merge(graphdef, state)
    buf_BX = jnp.concatenate([prompt_BT, jnp.zeros((B, steps), jnp.int32)], axis=1)
    rows = jnp.arange(B)

    def body(i, buf_BX):
      logits_BXV = m(buf_BX)  # causal: what follows a position cannot change it
      nxt_B = jnp.argmax(logits_BXV[rows, lengths_B + i - 1], axis=-1).astype(jnp.int32)
      return buf_BX.at[rows, lengths_B + i].set(nxt_B)

    buf_BX = jax.lax.fori_loop(0, steps, body, buf_BX)
    return buf_BX[rows[:, None], lengths_B[:, None] + jnp.arange(steps)]

  return np.asarray(run(jnp.asarray(prompt_BT), jnp.asarray(lengths_B)))
