"""Sampling filters and beam search."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab.decoding.beam import beam_search
from attnlab.decoding.generate import GenerateInputError
from attnlab.decoding.sampling import Sampling, filtered_logits, sample
from tests import random_arrays
from tests.decoding.tiny_models import (
  SRC_SHAPE,
  TGT_LEN,
  decoder_forward,
  decoder_model,
  encdec_forward,
  encdec_model,
  random_tokens,
)

DRAWS = 2000


def _draws(logits_V, sampling, seed=0):
  logits_XV = jnp.broadcast_to(logits_V, (DRAWS, logits_V.shape[0]))
  return np.asarray(jax.jit(sample, static_argnums=2)(logits_XV, jax.random.key(seed), sampling))


def test_top_k_never_emits_a_token_outside_the_k_most_likely():
  logits = random_arrays.normal(1, (40,)) * 2.0
  allowed = set(np.argsort(-np.asarray(logits))[:5].tolist())
  tokens = _draws(logits, Sampling(temperature=1.5, top_k=5))
  assert set(tokens.tolist()) <= allowed
  assert len(set(tokens.tolist())) == 5  # and it does draw from all of them


def test_top_p_draws_only_from_the_smallest_set_reaching_p():
  probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
  # Sorted: 0.4, 0.3, 0.15 | 0.1, 0.05: the first three reach 0.8 (0.85).
  tokens = _draws(jnp.log(probs), Sampling(temperature=1.0, top_p=0.8))
  assert set(tokens.tolist()) == {1, 3, 4}
  # Renormalized within the set.
  freq = np.bincount(tokens, minlength=5)[[1, 3, 4]] / DRAWS
  np.testing.assert_allclose(freq, np.array([0.4, 0.3, 0.15]) / 0.85, atol=0.04)
  # p below the top token's mass keeps only the top token.
  assert set(_draws(jnp.log(probs), Sampling(temperature=1.0, top_p=0.3)).tolist()) == {1}


def test_top_p_one_keeps_every_token_even_where_float32_mass_rounds_to_one():
  # Tokens 1 and 2 have probability ~2e-9: the mass before them, 1 - 4e-9, is 1.0 in
  # float32; top_p = 1 keeps them anyway (an exact cumulative sum stays short of 1).
  logits = jnp.array([[0.0, -20.0, -20.0]])
  probs = jax.nn.softmax(logits)
  assert float(jnp.cumsum(probs)[0]) == 1.0  # the rounding the filter must not act on
  np.testing.assert_array_equal(filtered_logits(logits, Sampling(temperature=1.0, top_p=1.0)),
                                logits)
  np.testing.assert_array_equal(
      np.isfinite(filtered_logits(logits, Sampling(temperature=1.0, top_p=0.5))), [[1, 0, 0]])


def test_top_k_and_top_p_combine():
  probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
  kept = filtered_logits(jnp.log(probs)[None], Sampling(temperature=1.0, top_k=2, top_p=0.99))
  # top_k=2 leaves {1, 3}; renormalized they are 4/7 and 3/7, both needed for 0.99.
  np.testing.assert_array_equal(np.isfinite(np.asarray(kept[0])), [0, 1, 0, 1, 0])


def test_temperature_zero_is_greedy_and_same_seed_same_tokens():
  model = decoder_model("mha_rope", varied=True)
  prompt = random_tokens(30, (2, 6))
  greedy = attnlab.generate(model, prompt, max_new_tokens=8, eos_id=None)
  zero = attnlab.generate(model, prompt, max_new_tokens=8, eos_id=None,
                          sampling=Sampling(temperature=0.0), rng=jax.random.key(7))
  np.testing.assert_array_equal(greedy, zero)
  hot = Sampling(temperature=2.0, top_p=0.95)
  a = attnlab.generate(model, prompt, max_new_tokens=8, eos_id=None, sampling=hot,
                       rng=jax.random.key(5))
  b = attnlab.generate(model, prompt, max_new_tokens=8, eos_id=None, sampling=hot,
                       rng=jax.random.key(5))
  c = attnlab.generate(model, prompt, max_new_tokens=8, eos_id=None, sampling=hot,
                       rng=jax.random.key(6))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)  # the seed is actually used


def test_eos_stops_each_sequence_and_pads_after_it():
  model = decoder_model("mha_rope", varied=True)
  prompt = random_tokens(31, (2, 6))
  free = np.asarray(attnlab.generate(model, prompt, max_new_tokens=8, eos_id=None))
  eos = int(free[0, 2])  # make the third token of row 0 the end
  out = np.asarray(attnlab.generate(model, prompt, max_new_tokens=8, eos_id=eos))
  for row_free, row in zip(free, out):
    hits = np.flatnonzero(row_free == eos)
    end = hits[0] + 1 if hits.size else 8
    np.testing.assert_array_equal(row[:end], row_free[:end])
    assert (row[end:] == model.cfg.pad_id).all()


def _greedy_runs(arch, cache):
  """(pad id, run): ``run(eos_id)`` is greedy ``generate`` of 8 tokens for two rows of a
  small model of ``arch`` with ``cache``."""
  if arch == "decoder_only":
    model, prompt = decoder_model("mha_rope", varied=True), random_tokens(31, (2, 6))
  else:
    model, prompt = encdec_model("paper_gqa", varied=True), random_tokens(1, SRC_SHAPE)
  return model.cfg.pad_id, lambda eos_id: np.asarray(attnlab.generate(
      model, prompt, max_new_tokens=8, cache=cache, eos_id=eos_id))


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_eos_as_the_first_generated_token_ends_that_row_at_once(arch, cache):
  """A row whose very first token (drawn from the prefill's logits, before the loop) is the
  eos stops there: the rest of it is pad_id, while the other row runs on as without an eos.
  Catches the first token left out of the done flags (the row would go on generating)."""
  pad, run = _greedy_runs(arch, cache)
  free = run(None)
  eos = int(free[0, 0])
  # Without the eos, row 0 goes on with real tokens; row 1 never emits that token.
  assert (free[0, 1:] != pad).any() and eos not in free[1]
  out = run(eos)
  np.testing.assert_array_equal(out[0], [eos] + [pad] * 7)
  np.testing.assert_array_equal(out[1], free[1])


def _cut_at(row, stops, pad):
  """``row`` up to and including its first token in ``stops``, then pad."""
  hits = [j for j, t in enumerate(row) if t in stops]
  return row if not hits else np.concatenate([row[:hits[0] + 1], [pad] * (len(row) - hits[0] - 1)])


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_several_stop_ids_end_each_row_at_the_first_of_them(arch, cache):
  """eos_id as a list (Llama 3 stops at <|end_of_text|> or <|eot_id|>): each row ends at
  the first of its tokens that is any of them, the rest pad, as the free run cut there; one
  program for one id or several (the ids are traced, padded to MAX_STOP_IDS). Before
  2026-12-04 eos_id was one int."""
  from attnlab.decoding import generate as generate_lib
  from attnlab.decoding.generate import MAX_STOP_IDS

  program = getattr(generate_lib, f"_sample_{arch}")
  pad, run = _greedy_runs(arch, cache)
  free = run(None)
  compiled = program._cache_size()
  # A stop that row 0 reaches late and one that row 1 reaches (or none it reaches).
  stops = [int(free[0, 5]), int(free[1, 2])]
  want = np.stack([_cut_at(r, stops, pad) for r in free])
  assert not np.array_equal(want, free)
  for eos_id in (stops, tuple(stops), np.asarray(stops), stops + [stops[0]]):
    np.testing.assert_array_equal(run(eos_id), want)
  np.testing.assert_array_equal(run([stops[0]]), run(stops[0]))
  np.testing.assert_array_equal(run(list(range(MAX_STOP_IDS - 1)) + [stops[1]]), np.stack(
      [_cut_at(r, list(range(MAX_STOP_IDS - 1)) + [stops[1]], pad) for r in free]))
  assert program._cache_size() == compiled  # no eos, one id or several: one program


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_the_models_mode_the_prompts_int_dtype_and_alpha_compile_nothing(arch):
  """A model in train mode decodes as in eval mode with the same programs, a prompt of any
  integer dtype as int32, and beam searches of any length_penalty share one program; the
  caller's model keeps its mode. Until 2026-12-07 each compiled its own: the mode is part
  of a module's pytree structure (``build_model`` gives a train-mode model,
  ``load_checkpoint`` an eval-mode one), the prompt's dtype reached the program, and
  ``length_penalty`` was a static argument."""
  from attnlab.decoding import generate as generate_lib

  if arch == "decoder_only":
    shared, prompt = decoder_model("mha_rope", varied=True), random_tokens(31, (2, 6))
  else:
    shared, prompt = encdec_model("paper_gqa", varied=True), random_tokens(1, SRC_SHAPE)
  model = nnx.merge(*nnx.split(shared))  # its own modes; the shared model's stay as they are
  programs = lambda: (getattr(generate_lib, f"_sample_{arch}")._cache_size(),
                      getattr(generate_lib, f"_beam_{arch}")._cache_size())
  greedy = lambda m, p: np.asarray(attnlab.generate(m, p, max_new_tokens=6, eos_id=None))
  beam = lambda m, p, alpha: np.asarray(attnlab.generate(
      m, p, max_new_tokens=6, beam_size=3, length_penalty=alpha, eos_id=3))
  model.eval()
  eval_structure = jax.tree.structure(model)
  want_greedy, want_beam = greedy(model, prompt), beam(model, prompt, 0.6)
  before = programs()
  model.train()
  train_structure = jax.tree.structure(model)
  assert train_structure != eval_structure  # the mode is in the structure
  for dtype in (np.int32, np.int64, np.uint16, np.uint8, np.int16):
    np.testing.assert_array_equal(greedy(model, prompt.astype(dtype)), want_greedy)
    np.testing.assert_array_equal(beam(model, prompt.astype(dtype), 0.6), want_beam)
  assert jax.tree.structure(model) == train_structure  # still in train mode
  for alpha in (0.0, 1.0, np.float32(2.5)):
    beam(model, prompt, alpha)
  assert programs() == before  # (generate's alpha against beam_search's: tests below)


def test_pages_a_finished_sequence_frees_go_to_the_others():
  """Row 0 ends at its first token (the prefill's: 6 prompt positions, 3 pages of 2) or at
  its second (6 + 1 fed: 4 pages), row 1 runs all 8 (13 positions: 7 pages): 8 pages hold
  both only if row 0's pages go back to the pool when it ends, before the loop or in it, and
  it asks for none after; as the contiguous run with the same eos (one paged program: the
  eos is traced)."""
  _, run = _greedy_runs("decoder_only", "contiguous")  # compiled by the tests above
  free = run(None)
  model, prompt = decoder_model("mha_rope", varied=True), random_tokens(31, (2, 6))
  for end in (0, 1):
    eos = int(free[0, end])
    assert eos not in free[0, :end] and eos not in free[1]  # row 0 ends there, row 1 never
    got = attnlab.generate(model, prompt, max_new_tokens=8, eos_id=eos, cache="paged",
                           page_size=2, num_pages=8)
    np.testing.assert_array_equal(np.asarray(got), run(eos), err_msg=f"row 0 ends at {end}")


def test_sampling_draws_every_step_with_the_next_key_of_the_split_chain():
  """generate's sampled tokens are, step by step, ``categorical(sub, filtered logits)`` of the
  uncached forward pass over the tokens so far, where ``key, sub = split(key)`` before every
  draw (the first from the prefill's logits). Catches one key reused for every step. (The
  sampling, prompt and budget of test_temperature_zero_is_greedy_and_same_seed_same_tokens:
  its compiled program.)"""
  model, forward = decoder_model("mha_rope", varied=True), decoder_forward("mha_rope", True)
  prompt, L = random_tokens(30, (2, 6)), 8
  sampling, key = Sampling(temperature=2.0, top_p=0.95), jax.random.key(11)
  got = np.asarray(attnlab.generate(model, prompt, max_new_tokens=L, eos_id=None,
                                    sampling=sampling, rng=key))
  seq_BT = np.zeros((2, 64), np.int32)  # one shape: one compiled forward (causal)
  seq_BT[:, :6] = prompt

  @jax.jit  # one program, not one per op
  def draw(key, logits_BV):
    key, sub = jax.random.split(key)
    return key, jax.random.categorical(sub, filtered_logits(logits_BV, sampling), axis=-1)

  for j in range(L):
    key, seq_BT[:, 6 + j] = draw(key, forward(seq_BT)[:, 5 + j])
  np.testing.assert_array_equal(got, seq_BT[:, 6:6 + L])
  # It does sample: the tokens are not greedy's.
  assert not np.array_equal(got, attnlab.generate(model, prompt, max_new_tokens=L, eos_id=None))


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=1e-40), dict(top_k=0),
                                 dict(top_k=2.5),
                                 dict(top_k=True), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=np.True_), dict(top_k=np.float64(2.0)),
                                 dict(top_p=np.True_), dict(temperature=np.float32("inf")),
                                 # not a number, a bool, not finite: named, not a TypeError
                                 # or an accepted value (inf made every logit 0)
                                 dict(temperature="1.0"), dict(top_p="0.9"),
                                 dict(temperature=True), dict(top_p=True),
                                 dict(temperature=float("inf")), dict(top_p=float("nan"))])
def test_sampling_rejects_bad_values(bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    Sampling(**bad)


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.5), dict(top_k=50, top_p=0.9)])
def test_greedy_sampling_refuses_filters(filters):
  """temperature 0 (the default) is greedy, which the filters cannot change: refused, as
  DecodeConfig refuses it (until 2026-12-06 ``Sampling(top_k=50)`` decoded greedily
  without a word); with a temperature they are taken."""
  full = {"top_k": None, "top_p": None, **filters}
  with pytest.raises(ValueError, match="^" + re.escape(
      f"top_k={full['top_k']!r}, top_p={full['top_p']!r} filter what is sampled, and "
      "temperature=0 is greedy (no sampling): give a temperature > 0, e.g. "
      "Sampling(temperature=1.0, top_k=50), or leave them unset") + "$"):
    Sampling(**filters)
  assert Sampling(temperature=1.0, **filters).top_k == full["top_k"]


def test_numpy_numbers_are_stored_as_the_python_numbers_they_hold():
  """Accepted (they were refused as not numbers), and equal and hashed alike: a Sampling
  is a static argument of the jitted loop, so a NumPy one must not compile anew."""
  got = Sampling(temperature=np.float32(1.5), top_k=np.int64(40), top_p=np.float32(0.5))
  want = Sampling(temperature=1.5, top_k=40, top_p=0.5)
  assert got == want and hash(got) == hash(want)
  assert (type(got.temperature), type(got.top_k), type(got.top_p)) == (float, int, float)


@pytest.mark.parametrize("beam_size", [0, True, 2.0, "2"])
def test_generate_rejects_a_beam_size_that_is_not_a_positive_integer(beam_size):
  model = decoder_model("mha_rope")
  with pytest.raises(GenerateInputError, match=re.escape(
      f"beam_size={beam_size!r} must be a positive integer")):
    attnlab.generate(model, np.ones((1, 3), np.int32), max_new_tokens=2, beam_size=beam_size)


def test_the_edges_of_the_allowed_values_are_accepted():
  assert Sampling(temperature=1.0, top_k=1, top_p=1.0).top_k == 1
  # The coldest temperature allowed keeps large logits finite: it draws the argmax.
  cold = filtered_logits(jnp.array([[-3e3, 1e3, 999.0]]), Sampling(temperature=1e-6, top_p=0.9))
  assert np.asarray(cold).tolist() == [[-np.inf, 1e9, -np.inf]]
  # top_k=1 keeps the most likely token alone; top_p=1.0 keeps every token.
  logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
  kept = np.isfinite(np.asarray(filtered_logits(logits, Sampling(temperature=1.0, top_k=1))))
  np.testing.assert_array_equal(kept, [[False, True, False]])
  every = filtered_logits(logits, Sampling(temperature=1.0, top_p=1.0))
  assert np.isfinite(np.asarray(every)).all()


def test_temperature_divides_the_logits_in_float32():
  logits = jnp.array([[1.0, -2.0, 0.5]], jnp.bfloat16)
  got = filtered_logits(logits, Sampling(temperature=2.0))
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), [[0.5, -1.0, 0.25]])


def test_top_p_stops_once_the_kept_mass_reaches_p_exactly():
  """Probabilities 1/2, 1/4, 1/8, 1/8 (exact in float32): with p = 3/4 the first two reach
  p, so the third, whose more likely tokens already hold 3/4, is dropped."""
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.125, 0.125]], jnp.float32))
  np.testing.assert_array_equal(np.asarray(jax.nn.softmax(logits)), [[0.5, 0.25, 0.125, 0.125]])
  kept = np.isfinite(np.asarray(filtered_logits(logits, Sampling(temperature=1.0, top_p=0.75))))
  np.testing.assert_array_equal(kept, [[True, True, False, False]])


# ----------------------------------------------------------------------------
# Beam search
# ----------------------------------------------------------------------------

PAD, BOS, EOS, A, B_ = 0, 1, 2, 3, 4
# A Markov toy: the next token depends only on the last one.
#   bos -> a 0.6, b 0.4;  a -> eos 0.4, a 0.3, b 0.3;  b -> eos 0.9, a 0.05, b 0.05.
# Greedy: a, eos = 0.6 * 0.4 = 0.24.  Beam 2 finds b, eos = 0.4 * 0.9 = 0.36.
TABLE = np.full((5, 5), 1e-9)
TABLE[BOS, [A, B_]] = [0.6, 0.4]
TABLE[A, [EOS, A, B_]] = [0.4, 0.3, 0.3]
TABLE[B_, [EOS, A, B_]] = [0.9, 0.05, 0.05]
TABLE[EOS, EOS] = TABLE[PAD, PAD] = 1.0
LOG_TABLE = jnp.log(jnp.asarray(TABLE / TABLE.sum(1, keepdims=True), jnp.float32))


def _toy_beam(beam_size, length_penalty=0.0):
  # The cache counts steps per row, to check that beams carry their own rows.
  def step_fn(tokens_X, steps_X):
    return LOG_TABLE[tokens_X], steps_X + 1

  run = jax.jit(lambda c: beam_search(step_fn, c, batch=1, beam_size=beam_size, max_len=4,
                                      bos_id=BOS, eos_id=EOS, length_penalty=length_penalty,
                                      pad_id=PAD))
  return np.asarray(run(jnp.zeros(beam_size, jnp.int32)))[0].tolist()


def test_beam_finds_the_better_sequence_on_a_toy():
  assert _toy_beam(1) == [A, EOS, PAD, PAD]  # greedy's choice, probability 0.24
  assert _toy_beam(2) == [B_, EOS, PAD, PAD]  # probability 0.36
  assert _toy_beam(3, length_penalty=0.6) == [B_, EOS, PAD, PAD]


def _logp(src, tgt, eos=None):
  """log P(tgt | src) per row under ``encdec_model("paper_gqa", varied=True)``, by teacher
  forcing on the shared compiled forward (target padded to TGT_LEN; causal); with ``eos``,
  the padding after a row's first eos does not count."""
  tgt_in = np.zeros((2, TGT_LEN), np.int32)
  tgt_in[:, 0], tgt_in[:, 1:tgt.shape[1]] = 1, tgt[:, :-1]
  logits = encdec_forward("paper_gqa", varied=True)(src, tgt_in)[:, :tgt.shape[1]]
  lp_BJV = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  lp_BJ = np.take_along_axis(lp_BJV, tgt[..., None], -1)[..., 0]
  if eos is not None:
    after_eos_BJ = (np.cumsum(tgt == eos, axis=1) - (tgt == eos)) > 0
    lp_BJ = np.where(after_eos_BJ, 0.0, lp_BJ)
  return lp_BJ.sum(1)


def _greedy_and_beam(src, beam_size, eos=None):
  """8 tokens of greedy decoding and of beam search (no length penalty) of ``src`` with the
  varied paper_gqa model."""
  model = encdec_model("paper_gqa", varied=True)
  run = lambda **kw: np.asarray(attnlab.generate(model, src, max_new_tokens=8, eos_id=eos, **kw))
  return run(), run(beam_size=beam_size, length_penalty=0.0)


def test_beam_size_one_without_eos_is_greedy():
  greedy, beam = _greedy_and_beam(random_tokens(32, SRC_SHAPE), 1)
  np.testing.assert_array_equal(beam, greedy)


def test_beam_size_one_with_eos_returns_an_early_end_that_beats_greedy():
  """Beam 1 is not greedy once a hypothesis can end: of each step's two best candidates,
  the best that does not end stays alive (greedy's token, unless that is eos) and one that
  ends enters the finished set, which wins if its log P beats the alive beam's. So its
  answer follows greedy's path, then ends in eos where that was more likely than anything
  greedy goes on to."""
  src = random_tokens(36, SRC_SHAPE)  # beam 1 ends rows of this source early (asserted below)
  free, _ = _greedy_and_beam(src, 1)
  eos = int(free[1, 3])  # eos is traced: the same compiled program as eos_id=None
  greedy, beam = _greedy_and_beam(src, 1, eos)
  pad = encdec_model("paper_gqa", varied=True).cfg.pad_id
  for b in range(2):
    row = beam[b].tolist()
    end = row.index(eos) if eos in row else len(row)
    assert row[:end] == free[b, :end].tolist()  # greedy's path up to its end
    assert all(t == pad for t in row[end + 1:])
  assert (_logp(src, beam, eos) >= _logp(src, greedy, eos) - 1e-5).all()
  # Here an early eos does win in some row (so the test tells beam 1 from greedy).
  assert not np.array_equal(beam, greedy)


def test_beam_search_on_a_model_scores_at_least_greedy():
  """Beam 4 (no length penalty) finds a hypothesis at least as likely as greedy's."""
  src = random_tokens(33, SRC_SHAPE)
  greedy, beam = _greedy_and_beam(src, 4)
  assert (_logp(src, beam) >= _logp(src, greedy) - 1e-5).all()


def test_beam_search_through_the_cache_equals_the_search_over_full_forward_passes():
  """``generate(beam_size=3)`` = ``beam_search`` driven by a step that runs the whole
  teacher-forced forward pass over each hypothesis so far (no cache): the cross K/V repeated
  for every beam, the self-attention rows reordered with their beams, a log-softmax per row,
  and eos, pad and the length penalty passed through. The model (MQA, RoPE, a window of 4
  target keys) pads with id 5, not 0; the eos is a token of the search without eos, and it
  changes the answer (with per-row log-softmax). The length penalty is 2, and then a second
  eos is one where it decides the answer: the search with the default 0.6 differs (with
  the first check's eos, and with none, alphas 0, 0.6, 1 and 2 give the same answer, so a
  penalty left out of the encoder-decoder's search passed this test until 2026-12-05)."""
  from tests.decoding.tiny_models import ENCDEC_CONFIGS, PARAM_SCALE, make_cfg

  cfg = make_cfg("encoder_decoder", ENCDEC_CONFIGS["mqa_rope_window4"]).replace(pad_id=5)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  model = nnx.merge(graphdef, jax.tree.map(lambda x: x * PARAM_SCALE, params), rest)
  graphdef, state = nnx.split(model)
  src = random_tokens(34, SRC_SHAPE)
  B, Z, J, alpha = SRC_SHAPE[0], 3, 8, 2.0

  def full_forward_step(tokens_X, carry):
    tgt_XL, pos_X = carry  # every hypothesis so far, bos first
    tgt_XL = tgt_XL.at[jnp.arange(B * Z), pos_X].set(tokens_X)
    logits_XLV = nnx.merge(graphdef, state)(jnp.repeat(src, Z, axis=0), tgt_XL)
    logits_XV = jnp.take_along_axis(logits_XLV, pos_X[:, None, None], axis=1)[:, 0]
    return jax.nn.log_softmax(logits_XV, axis=-1), (tgt_XL, pos_X + 1)

  start = (jnp.full((B * Z, J), cfg.pad_id, jnp.int32), jnp.zeros((B * Z,), jnp.int32))
  # The eos and alpha traced (eos -1: none, as beam_search documents for None): one
  # compiled search.
  search = jax.jit(lambda eos_id, a: beam_search(full_forward_step, start, batch=B,
                                                 beam_size=Z, max_len=J, bos_id=1,
                                                 eos_id=eos_id, length_penalty=a,
                                                 pad_id=cfg.pad_id))
  reference = lambda eos_id, a=alpha: np.asarray(
      search(jnp.int32(-1 if eos_id is None else eos_id), jnp.float32(a)))

  run = lambda eos_id: np.asarray(attnlab.generate(model, src, max_new_tokens=J, eos_id=eos_id,
                                                   beam_size=Z, length_penalty=alpha))
  _equal_with_and_without_eos(run, reference, cfg.pad_id)
  free = reference(None)
  decided = [e for e in dict.fromkeys(free[:, :-1].ravel().tolist())
             if not np.array_equal(reference(e), reference(e, 0.6))]
  assert decided, "no eos of this model makes the length penalty decide: pick another alpha"
  np.testing.assert_array_equal(run(decided[0]), reference(decided[0]))


def _equal_with_and_without_eos(run, reference, pad_id) -> int:
  """``run(eos_id)`` (generate's beam search) equals ``reference(eos_id)`` without an eos and
  with one (a token of the search without) that ends a row early, the padding after it
  ``pad_id``; returns that eos."""
  free = run(None)
  np.testing.assert_array_equal(free, reference(None))
  eos = int(free[0, 2])
  ended = run(eos)
  np.testing.assert_array_equal(ended, reference(eos))
  assert not np.array_equal(ended, free)
  row = ended[0].tolist()
  assert eos in row[:-1] and set(row[row.index(eos) + 1:]) == {pad_id}, row
  return eos


@pytest.mark.parametrize("name", ["gqa_sinusoidal", "mqa_rope_window3"])
def test_decoder_only_beam_search_equals_the_search_over_full_forward_passes(name):
  """A decoder-only model's ``generate(beam_size=3)`` = ``beam_search`` driven by the
  teacher-forced forward pass over each row's prompt and hypothesis so far, its first tokens
  chosen from the prompt's last logits: prompts of different lengths (one of a single
  token), with and without an eos that changes the answer, a length
  penalty of 1 (and 0), a pad id of 5, not 0, and more new tokens than the default page
  size; a sliding window (the ring cache's rows reordered with their beams too)."""
  from flax import nnx

  from tests.decoding.tiny_models import DECODER_CONFIGS, PARAM_SCALE, make_cfg

  cfg = make_cfg("decoder_only", DECODER_CONFIGS[name]).replace(pad_id=5)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  model = nnx.merge(graphdef, jax.tree.map(lambda x: x * PARAM_SCALE, params), rest)
  graphdef, state = nnx.split(model)
  B, Z, J, alpha = 3, 3, 14, 1.0
  lengths = np.array([5, 1, 3])
  prompt = random_tokens(41, (B, 5))
  prompt[np.arange(5)[None, :] >= lengths[:, None]] = model.cfg.pad_id
  W = 5 + J

  def log_probs_at(seq_XW, pos_X):
    logits_XWV = nnx.merge(graphdef, state)(seq_XW)
    logits_XV = jnp.take_along_axis(logits_XWV, pos_X[:, None, None], axis=1)[:, 0]
    return jax.nn.log_softmax(logits_XV, axis=-1)

  def full_forward_step(tokens_X, carry):
    seq_XW, pos_X = carry  # each row's prompt and hypothesis so far; pos: the fed token's
    seq_XW = seq_XW.at[jnp.arange(B * Z), pos_X].set(tokens_X)
    return log_probs_at(seq_XW, pos_X), (seq_XW, pos_X + 1)

  seq = np.full((B, W), model.cfg.pad_id, np.int32)
  seq[:, :5] = prompt
  seq_XW, pos_X = jnp.repeat(jnp.asarray(seq), Z, axis=0), jnp.repeat(jnp.asarray(lengths), Z)
  # The eos (-1: none, as beam_search documents for None) and alpha traced: one compiled
  # search for every call.
  search = jax.jit(lambda eos_id, alpha: beam_search(
      full_forward_step, (seq_XW, pos_X), batch=B, beam_size=Z, max_len=J,
      first_log_probs_XV=log_probs_at(seq_XW, pos_X - 1), eos_id=eos_id,
      length_penalty=alpha, pad_id=model.cfg.pad_id))
  reference = lambda eos_id, alpha=alpha: np.asarray(search(
      jnp.int32(-1 if eos_id is None else eos_id), jnp.float32(alpha)))

  cache = "ring" if model.cfg.window else "contiguous"
  run = lambda eos_id, z=Z, alpha=alpha: np.asarray(attnlab.generate(
      model, prompt, max_new_tokens=J, prompt_lengths_B=lengths, eos_id=eos_id, beam_size=z,
      length_penalty=alpha, cache=cache))
  eos = _equal_with_and_without_eos(run, reference, pad_id=5)
  np.testing.assert_array_equal(run(eos, alpha=0.0), reference(eos, alpha=0.0))
  # A beam of 1 without an eos is greedy decoding.
  greedy = np.asarray(attnlab.generate(model, prompt, max_new_tokens=J, prompt_lengths_B=lengths,
                                       eos_id=None, cache=cache))
  np.testing.assert_array_equal(run(None, 1), greedy)


@pytest.mark.parametrize("cache_dtype", ["int8", "bfloat16"])
def test_a_decoder_only_beam_of_one_is_greedy_through_a_rounded_cache(cache_dtype):
  """Beam search prefills the prompt as greedy decoding does and takes its first tokens from
  the same logits: with an int8 / bfloat16 cache too, where a search that fed the last
  prompt token through the cache read rounded K/V for it and could start otherwise."""
  model = decoder_model("mqa_rope_window3", varied=True)
  prompt = random_tokens(5, (32, 6))
  lengths = np.random.default_rng(0).integers(1, 7, 32).astype(np.int32)
  kw = dict(prompt_lengths_B=lengths, max_new_tokens=12, eos_id=None, cache_dtype=cache_dtype)
  greedy = np.asarray(attnlab.generate(model, prompt, **kw))
  np.testing.assert_array_equal(np.asarray(attnlab.generate(model, prompt, beam_size=1, **kw)),
                                greedy)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_generate_decodes_without_dropout_and_leaves_a_training_model_training(arch):
  """``generate`` hands the model itself to ``jax.jit`` and sets eval mode on the traced
  copy: a model in train mode (dropout 0.5) decodes as its eval-mode self, twice alike,
  and is still in train mode afterwards."""
  from flax import nnx

  cfg = attnlab.ModelConfig(arch=arch, vocab_size=50, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, d_ff=64, max_len=32, dropout_rate=0.5)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  model.train()
  dropouts = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Dropout)]
  assert dropouts and not any(d.deterministic for d in dropouts)
  prompt = random_tokens(31, (2, 5)) % 50
  run = lambda: np.asarray(attnlab.generate(model, prompt, max_new_tokens=6, eos_id=None))
  first, second = run(), run()
  assert not any(d.deterministic for d in dropouts)  # the caller's model: still training
  model.eval()
  np.testing.assert_array_equal(first, second)
  np.testing.assert_array_equal(first, run())


@pytest.mark.parametrize("cache_dtype", ["int8", "bfloat16"])
def test_an_encoder_decoders_bos_step_is_the_uncached_models_through_a_rounded_cache(
    cache_dtype):
  """The bos step runs as a prefill (the decoder-only prompt's way): it attends to its own K/V
  as computed, not rounded to the cache dtype, so the first token is the uncached model's
  argmax for every source, and a beam of 1 is greedy decoding. Until 2026-12-04 it read its
  K/V back from the cache (12 of these 1024 first tokens differed through int8, 4 through
  bfloat16)."""
  model = encdec_model("mqa_rope_window4", varied=True)
  src = random_tokens(11, (1024, 5))
  want = np.argmax(encdec_forward("mqa_rope_window4", varied=True)(
      src, np.ones((len(src), 1), np.int32))[:, 0], axis=-1)
  kw = dict(max_new_tokens=8, eos_id=None, cache_dtype=cache_dtype)
  greedy = np.asarray(attnlab.generate(model, src, **kw))
  np.testing.assert_array_equal(greedy[:, 0], want)
  np.testing.assert_array_equal(
      np.asarray(attnlab.generate(model, src, beam_size=1, **kw)), greedy)
