"""int8 K/V cache: per-token, per-KV-head float32 scales, on every cache kind."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlab
from attnlab.cli import main
from attnlab.decoding import batching
from attnlab.nn import kv_cache as cache_lib
from tests.decoding.test_cache_parity import TOKENS, decoder_cached
from tests.decoding.tiny_models import (
  decoder_forward,
  decoder_model,
  encdec_model,
  random_tokens,
)

NAME = "gqa_rope_window10"  # GQA with a window: all three cache kinds apply
# int8 keeps ~8 bits like bfloat16: the bfloat16 tolerance of DESIGN.md (2e-2),
# relative to the scale of the logits.
REL_TOL = 2e-2


def test_quantize_round_trip_error_is_at_most_half_a_scale():
  x = jax.device_put(np.random.default_rng(0).standard_normal((6, 3, 32), np.float32)
                     * np.array([1e-3, 1.0, 50.0], np.float32)[:, None])
  x = x.at[0, 0].set(0.0)  # an all-zero vector gets scale 1 and zeros
  q, scale = cache_lib.quantize(x)
  assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (6, 3)
  err = np.abs(np.asarray(cache_lib.dequantize(q, scale)) - np.asarray(x))
  assert (err <= np.asarray(scale)[..., None] / 2 * (1 + 1e-6)).all()
  # Symmetric: the largest |x| of each vector maps to 127.
  np.testing.assert_array_equal(np.abs(np.asarray(q)).max(-1)[1:], 127)
  assert (np.asarray(q)[0, 0] == 0).all() and float(scale[0, 0]) == 1.0
  # A vector whose largest |x| / 127 is below float32's smallest normal number: XLA:CPU
  # flushes that quotient to 0, so until 2026-12-06 the scale was 0 and every value came
  # back 0 (an error of |x| against a bound of 0). The bound holds now.
  tiny = jnp.asarray([[1e-37, -5e-38, 2e-38, 0.0], [1e-30, 3e-31, 0.0, -1e-30]], jnp.float32)
  q, scale = cache_lib.quantize(tiny)
  assert (np.asarray(scale) > 0).all()
  err = np.abs(np.asarray(cache_lib.dequantize(q, scale)) - np.asarray(tiny))
  assert (err <= np.asarray(scale)[:, None] / 2 * (1 + 1e-6)).all(), (err, scale)
  assert np.asarray(q)[1].tolist() == [127, 38, 0, -127]
  # A NaN or an infinity is not hidden: the vector dequantizes to non-finite values, as a
  # float cache holds them (a NaN gave scale 1 and zeros until 2026-12-06).
  bad = jnp.asarray([[0.3, jnp.nan, -0.02, 0.2], [0.3, jnp.inf, -0.02, 0.2]], jnp.float32)
  back = np.asarray(cache_lib.dequantize(*cache_lib.quantize(bad)))
  assert (~np.isfinite(back)).all(), back


@pytest.mark.parametrize("kind", cache_lib.CACHE_KINDS)
def test_int8_prefill_and_decode_match_the_full_forward(kind):
  got, cache = decoder_cached(NAME, kind, dtype="int8")
  leaves = jax.tree.leaves(cache)
  assert sum(x.dtype == jnp.int8 for x in leaves) == 2 * len(cache)  # K and V of every layer
  assert sum(x.dtype == jnp.float32 for x in leaves) == 2 * len(cache)  # and their scales
  full = decoder_forward(NAME)(TOKENS)
  err = np.abs(got - full).max()
  assert 1e-5 < err <= REL_TOL * np.abs(full).max(), err  # quantized, and close


@pytest.mark.parametrize("kind", ["contiguous", "ring"])
def test_int8_decode_step_equals_the_reference_over_the_same_cache(kind):
  """The XLA decode step (``attnlab.ops.decode``) applies the int8 scales to the
  scores and probabilities instead of dequantizing the cache: the same numbers
  as the reference path, which reads the dequantized cache."""
  got, _ = decoder_cached(NAME, kind, "auto", dtype="int8")
  want, _ = decoder_cached(NAME, kind, dtype="int8")
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_generate_and_generate_requests_with_an_int8_cache_agree(kind, monkeypatch):
  model = decoder_model(NAME, varied=True)
  prompts = [random_tokens(40 + i, (n,)).tolist() for i, n in enumerate([3, 11, 6])]
  got = attnlab.generate_requests(model, prompts, 7, slots=2, cache=kind, page_size=4,
                                  cache_dtype="int8", eos_id=None)
  prompt_BT = np.zeros((3, 11), np.int32)
  for b, p in enumerate(prompts):
    prompt_BT[b, :len(p)] = p
  want = attnlab.generate(model, prompt_BT, max_new_tokens=7, prompt_lengths_B=[3, 11, 6],
                          eos_id=None, cache=kind, page_size=4, cache_dtype="int8")
  np.testing.assert_array_equal(np.stack(got), want)
  # And the serving cache is int8: values of 1 byte plus a float32 scale per H = 8 values
  # (12 of the float32 cache's 32 bytes per head and token), with the same page table: the
  # int8 cache of the slots, the longest request's 11 + 7 - 1 positions and their pages, not
  # the float32 one (made here, not served: a float32 run compiles programs of its own).
  _, stats = batching.serve_requests(model, prompts, 7, slots=2, cache=kind, page_size=4,
                                     cache_dtype="int8", eos_id=None, bucket=False)
  made = {dtype: cache_lib.cache_bytes(cache_lib.init_cache(
      model.cfg, kind, 2, 17, page_size=4, num_pages=2 * 5 if kind == "paged" else None,
      dtype=dtype)) for dtype in ("int8", None)}
  assert stats.cache_bytes == made["int8"]
  assert model.cfg.head_dim == 8
  assert 0.37 < made["int8"] / made[None] < 0.40
  # Without cache_dtype the serving cache is the model's dtype: the cache it asks for is
  # seen, and nothing is compiled or served.
  asked = []

  class Built(Exception):
    pass

  def init_cache(*args, dtype=None, **kwargs):
    asked.append(dtype)
    raise Built

  monkeypatch.setattr(batching.cache_lib, "init_cache", init_cache)
  with pytest.raises(Built):
    batching.serve_requests(model, prompts, 7, slots=2, cache=kind, page_size=4, eos_id=None)
  assert asked == [None]


@pytest.mark.parametrize("program", ["decoder_only", "encoder_decoder", "beam",
                                     "decoder_only_beam"])
def test_every_generate_program_caches_in_the_dtype_asked_for(program):
  """Each of ``generate``'s four compiled programs (sampling and beam search of either
  architecture) builds its K/V cache as int8 when asked, and only then: int8
  arrays appear in the traced program with ``cache_dtype="int8"`` and in none without.
  (Its tokens would hardly tell: int8 error rarely flips a greedy choice.)"""
  from attnlab.decoding import generate as gen

  def traced(cache_dtype):
    static = dict(max_new_tokens=4, kind="contiguous", page_size=4, cache_len=8,
                  cache_dtype=cache_dtype)
    key, eos, bos = jax.random.key(0), jnp.int32(-1), jnp.int32(1)
    if program == "decoder_only":
      model, prompt = decoder_model(NAME), jnp.asarray(random_tokens(3, (2, 5)))
      return gen._sample_decoder_only.trace(model, prompt, jnp.array([5, 3]), key, eos,
                                            sampling=gen.GREEDY, num_pages=None, **static)
    if program == "decoder_only_beam":
      model, prompt = decoder_model(NAME), jnp.asarray(random_tokens(3, (2, 5)))
      return gen._beam_decoder_only.trace(model, prompt, jnp.array([5, 3]), eos, beam_size=2,
                                          length_penalty=0.6, **static)
    model, src = encdec_model("paper_gqa"), jnp.asarray(random_tokens(3, (2, 5)))
    seg = jnp.ones_like(src)
    if program == "encoder_decoder":
      return gen._sample_encoder_decoder.trace(model, src, seg, key, eos, bos,
                                               sampling=gen.GREEDY, num_pages=None, **static)
    return gen._beam_encoder_decoder.trace(model, src, seg, eos, bos, beam_size=2,
                                           length_penalty=0.6, **static)

  assert "i8[" in str(traced("int8").jaxpr)
  assert "i8[" not in str(traced(None).jaxpr)


def test_bytes_per_token_count_the_scales(capsys):
  cfg = attnlab.ModelConfig(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                            head_dim=128, dtype="bfloat16")
  per_token = cfg.kv_cache_bytes_per_token("int8")
  assert per_token == 2 * 32 * 8 * (128 + 4)  # int8 values + a float32 scale per KV head
  assert per_token / cfg.kv_cache_bytes_per_token("bfloat16") == pytest.approx(0.516, abs=1e-3)
  assert main(["kv-size", "--layers", "32", "--seq", "8192", "--kv_heads", "8", "--head_dim",
               "128", "--dtype", "int8"]) == 0
  assert capsys.readouterr().out.startswith("528.00 MiB")
  # The arrays of a real int8 cache hold exactly that per token (plus the int32 lengths).
  small = decoder_model(NAME).cfg
  cache = cache_lib.init_cache(small, "contiguous", 1, 16, dtype="int8")
  lengths_bytes = 4 * small.num_layers
  assert cache_lib.cache_bytes(cache) - lengths_bytes == 16 * small.kv_cache_bytes_per_token(
      "int8")


def test_bad_cache_dtype_is_a_value_error():
  with pytest.raises(ValueError, match="cache_dtype='int4'"):
    attnlab.generate(decoder_model(NAME), np.ones((1, 3), np.int32), cache_dtype="int4")
  with pytest.raises(ValueError, match="cache_dtype='int4'"):
    attnlab.generate_requests(decoder_model(NAME), [[3, 4]], 2, cache_dtype="int4")
