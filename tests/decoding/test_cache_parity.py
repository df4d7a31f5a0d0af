"""Prefill + step-by-step decode == the full forward pass, for every cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab.decoding import cache as cache_lib
from attnlab.decoding.generate import _reserve
from tests.decoding.tiny_models import (
  DECODER_CONFIGS,
  decoder_model,
  encdec_model,
  forward_fn,
  greedy_recompute,
  random_tokens,
)

PAGE = 4
TOTAL = 20  # tokens per row
LENGTHS = np.array([8, 5], np.int32)  # prompt lengths (right-padded prefill)
PROMPT_WIDTH = int(LENGTHS.max())
STEPS = TOTAL - PROMPT_WIDTH


def cached_logits(model, kind, tokens_BX, lengths_B, forward=None):
  """Logits [B, X, V] from a padded prefill of ``lengths_B`` tokens, then one token per step.

  Row b's prefill logits fill positions < lengths_B[b]; step i feeds token
  ``lengths_B[b] + i`` and fills that position.
  """
  graphdef, state = nnx.split(model)
  B, X = tokens_BX.shape
  cfg = model.cfg

  @jax.jit
  def run(tokens_BX, lengths_B):
    m = nnx.merge(graphdef, state)
    call = forward or (lambda m, t, s, c: m(t, segment_ids_BT=s, cache=c))
    cache = cache_lib.init_cache(cfg, kind, B, X, page_size=PAGE)
    alloc = cache_lib.PageAllocator.init(B * X // PAGE) if kind == "paged" else None
    if alloc is not None:
      cache, alloc = _reserve(cache, alloc, lengths_B, PAGE)
    seg_BT = (jnp.arange(PROMPT_WIDTH)[None] < lengths_B[:, None]).astype(jnp.int32)
    logits_BTV, cache = call(m, tokens_BX[:, :PROMPT_WIDTH], seg_BT, cache)
    rows = jnp.arange(B)
    out_BXV = jnp.zeros((B, X, logits_BTV.shape[-1]), jnp.float32)
    out_BXV = out_BXV.at[:, :PROMPT_WIDTH].set(
        jnp.where(seg_BT[..., None] > 0, logits_BTV, 0.0))

    def step(carry, i):
      cache, alloc, out_BXV = carry
      pos_B = lengths_B + i
      live_B = (pos_B < X).astype(jnp.int32)  # rows that have run out of tokens idle
      if alloc is not None:
        cache, alloc = _reserve(cache, alloc, live_B, PAGE)
      token_B1 = tokens_BX[rows, jnp.minimum(pos_B, X - 1)][:, None]
      logits_B1V, cache = call(m, token_B1, live_B[:, None], cache)
      out_BXV = out_BXV.at[rows, pos_B].set(logits_B1V[:, 0], mode="drop")
      return (cache, alloc, out_BXV), None

    steps = X - int(min(LENGTHS))
    (cache, alloc, out_BXV), _ = jax.lax.scan(step, (cache, alloc, out_BXV), jnp.arange(steps))
    exhausted = alloc.exhausted if alloc is not None else jnp.bool_(False)
    return out_BXV, cache, exhausted

  out, cache, exhausted = run(jnp.asarray(tokens_BX), jnp.asarray(lengths_B))
  assert not bool(exhausted)
  return np.asarray(out), cache


def decoder_cases():
  for name, over in DECODER_CONFIGS.items():
    for kind in cache_lib.CACHE_KINDS:
      if kind == "ring" and over.get("window") is None:
        continue
      yield pytest.param(name, kind, id=f"{name}-{kind}")


@pytest.mark.parametrize("name,kind", list(decoder_cases()))
def test_decoder_prefill_and_decode_equal_full_forward(name, kind):
  model = decoder_model(name)
  tokens = random_tokens(0, (2, TOTAL))
  full = np.asarray(forward_fn(model)(jnp.asarray(tokens)))
  got, cache = cached_logits(model, kind, tokens, LENGTHS)
  np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(cache_lib.cache_lengths(cache), [TOTAL, TOTAL])


ENCDEC_CASES = [("paper_gqa", "contiguous"), ("paper_gqa", "paged"), ("mqa_rope_window4", "ring")]


@pytest.mark.parametrize("name,kind", ENCDEC_CASES, ids=["-".join(c) for c in ENCDEC_CASES])
def test_encoder_decoder_prefill_and_decode_equal_full_forward(name, kind):
  model = encdec_model(name)
  src = random_tokens(1, (2, 9))
  src[1, 6:] = model.cfg.pad_id  # a padded source: masked in cross-attention
  tgt = random_tokens(2, (2, TOTAL))
  full = np.asarray(jax.jit(lambda s, t: model(s, t))(src, tgt))
  src_j = jnp.asarray(src)
  forward = lambda m, t, seg, c: m(src_j, t, tgt_segment_ids_BT=seg, cache=c)
  got, cache = cached_logits(model, kind, tgt, LENGTHS, forward=forward)
  np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)


GREEDY_CASES = [("mha_rope", "contiguous"), ("gqa_sinusoidal", "paged"),
                ("mqa_rope_window3", "ring"), ("gqa_rope_window10", "ring")]


@pytest.mark.parametrize("name,kind", GREEDY_CASES, ids=["-".join(c) for c in GREEDY_CASES])
def test_greedy_generate_equals_recompute_everything(name, kind):
  model = decoder_model(name)
  prompt = random_tokens(3, (2, PROMPT_WIDTH))
  prompt[1, LENGTHS[1]:] = model.cfg.pad_id  # right padding
  want = greedy_recompute(model, prompt, LENGTHS, STEPS)
  got = attnlab.generate(model, prompt, max_new_tokens=STEPS, cache=kind, eos_id=None,
                         page_size=PAGE)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_encoder_decoder_greedy_equals_recompute_everything():
  model = encdec_model("paper_gqa")
  src = random_tokens(4, (2, 7))
  src[0, 5:] = model.cfg.pad_id
  steps, bos = 10, 1

  @jax.jit
  def recompute(src):
    def body(i, tgt_BX):
      logits = model(src, tgt_BX)
      return tgt_BX.at[:, i + 1].set(jnp.argmax(logits[:, i], axis=-1).astype(jnp.int32))

    tgt = jnp.zeros((2, steps + 1), jnp.int32).at[:, 0].set(bos)
    return jax.lax.fori_loop(0, steps, body, tgt)[:, 1:]

  want = np.asarray(recompute(jnp.asarray(src)))
  got = attnlab.generate(model, src, max_new_tokens=steps, eos_id=None, bos_id=bos)
  np.testing.assert_array_equal(np.asarray(got), want)
  beam1 = attnlab.generate(model, src, max_new_tokens=steps, eos_id=None, bos_id=bos,
                           beam_size=1, length_penalty=0.0)
  np.testing.assert_array_equal(np.asarray(beam1), want)


def test_ring_cache_memory_does_not_grow_with_length():
  cfg = decoder_model("mqa_rope_window3").cfg
  short = cache_lib.init_cache(cfg, "ring", 2, 8)
  long = cache_lib.init_cache(cfg, "ring", 2, 4096)
  assert cache_lib.cache_bytes(short) == cache_lib.cache_bytes(long)
  # K and V of W slots, their positions and the lengths, per layer: O(window).
  K, H, W, L = cfg.kv_heads, cfg.dim_per_head, cfg.window, cfg.num_layers
  assert cache_lib.cache_bytes(long) == L * (2 * 2 * K * W * H * 4 + 2 * W * 4 + 2 * 4)
  # After decoding far past the window the cache has the same shapes.
  _, after = cached_logits(decoder_model("mqa_rope_window3"), "ring",
                           random_tokens(5, (2, TOTAL)), LENGTHS)
  assert jax.tree.map(jnp.shape, after) == jax.tree.map(jnp.shape, short)
  assert cache_lib.cache_bytes(cache_lib.init_cache(cfg, "contiguous", 2, 4096)) > 100 * (
      cache_lib.cache_bytes(long))
