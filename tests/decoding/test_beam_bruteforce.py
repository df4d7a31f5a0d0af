"""Beam search against brute-force enumeration on a tiny stateful model.

The model's next-token distribution depends on the source and on the WHOLE
history of its row (a hash of every token so far, kept in the cache), not on
the last token alone: a beam search that does not reorder the cache rows
with their beams scores continuations under another beam's history and
returns a different sequence.

With a beam wide enough to keep every candidate (2W >= W x V at every step),
beam search is exhaustive, so its result must be the best hypothesis under
GNMT's length-penalized score ``log P(Y) / ((5 + |Y|) / 6)^alpha`` among all
sequences enumerated here, with ``beam_search``'s documented eos handling:
a hypothesis ends at its first eos (eos counted in |Y|, pad after it), and
one that reaches ``max_len`` without eos competes as if it ended there.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.decoding.beam import beam_search

V, L, BATCH = 5, 4, 2
PAD, BOS, EOS = 0, 1, 2
HASH_MOD = 1009
# Logits of every hashed state: wide enough that long and short hypotheses
# trade places as alpha changes.
TABLE_HV = np.random.default_rng(7).standard_normal((HASH_MOD, V), np.float32) * 2.0


def _hash(src, history):
  """The state of a row: its source and every input token so far (bos first)."""
  h = 17 * (src + 1)
  for tok in history:
    h = (h * 31 + int(tok) + 1) % HASH_MOD
  return h


def _log_probs(src, history):
  logits = TABLE_HV[_hash(src, history)].astype(np.float64)
  return logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()


def _step_fn(tokens_X, cache):
  """The same model in JAX: cache = (source id, running hash) per row."""
  src_X, h_X = cache
  h_X = (h_X * 31 + tokens_X + 1) % HASH_MOD
  return jax.nn.log_softmax(jnp.asarray(TABLE_HV)[h_X], axis=-1), (src_X, h_X)


def _start(beam_size):
  """The cache of every row at the start: (its source, the hash of the empty history)."""
  src_X = jnp.repeat(jnp.arange(BATCH, dtype=jnp.int32), beam_size)
  return src_X, 17 * (src_X + 1)


@functools.cache
def _search(beam_size, eos_id):
  """The jitted search, alpha a traced argument: one compiled program for every alpha."""
  return jax.jit(lambda cache, alpha: beam_search(
      _step_fn, cache, batch=BATCH, beam_size=beam_size, max_len=L, bos_id=BOS, eos_id=eos_id,
      length_penalty=alpha, pad_id=PAD))


def _beam(beam_size, alpha, eos_id):
  out = np.asarray(_search(beam_size, eos_id)(_start(beam_size), jnp.float32(alpha)))
  assert out.shape == (BATCH, L)
  return out


def _enumerate(src, alpha, eos_id):
  """Every hypothesis of at most L tokens with its GNMT score, best first (``eos_id``: one
  id, a tuple of them, any ending a hypothesis, or None)."""
  lp = lambda n: ((5.0 + n) / 6.0) ** alpha
  stops = () if eos_id is None else eos_id if isinstance(eos_id, tuple) else (eos_id,)
  scored = []
  for n in range(1, L + 1):
    for toks in itertools.product(range(V), repeat=n):
      ended = toks[-1] in stops
      if any(t in stops for t in toks[:-1]):
        continue  # a hypothesis ends at its first eos
      if not ended and n < L:
        continue  # unfinished hypotheses compete only once cut at max_len
      history, logp = [BOS], 0.0
      for tok in toks:
        logp += _log_probs(src, history)[tok]
        history.append(tok)
      scored.append((logp / lp(n), list(toks) + [PAD] * (L - n)))
  scored.sort(key=lambda x: -x[0])
  return scored


# Exhaustive: each step keeps its best 2W candidates and W alive rows. With eos,
# at most (V - 1)^s rows are alive at step s, giving V (V - 1)^s candidates
# (<= 320 = 2W at the last step); without eos 5^s rows, 5^(s+1) candidates, all
# kept before the last step (125 <= W), whose best is kept anyway.
WIDE = V * (V - 1) ** (L - 1) // 2 + 1


@pytest.mark.parametrize("eos_id", [EOS, None, (EOS, 4)])
def test_exhaustive_beam_returns_the_best_enumerated_hypothesis(eos_id):
  """(EOS, 4): two stop ids, either ending a hypothesis (generate passes them as an array;
  one id only until 2026-12-04)."""
  answers = {}
  for alpha in (0.0, 0.6, 1.0, 2.0):
    got = _beam(WIDE, alpha, eos_id)
    for src in range(BATCH):
      ranked = _enumerate(src, alpha, eos_id)
      (best, best_seq), (second, _) = ranked[0], ranked[1]
      assert best - second > 1e-4, "a near tie: pick another table seed"
      assert got[src].tolist() == best_seq, (alpha, src, ranked[:3])
      answers[(src, alpha)] = tuple(best_seq)
  if eos_id == EOS:
    # The case must exercise the length penalty: some source's best changes with alpha.
    assert any(len({answers[(s, a)] for a in (0.0, 0.6, 1.0, 2.0)}) > 1 for s in range(BATCH))


def test_history_matters():
  """Without the cache, the same last token gives different distributions."""
  assert not np.allclose(_log_probs(0, [BOS, 3, 4]), _log_probs(0, [BOS, 4, 4]))
  assert not np.allclose(_log_probs(0, [BOS, 3]), _log_probs(1, [BOS, 3]))


@pytest.mark.parametrize("beam_size", [1, 2, 3])
def test_narrow_beam_scores_no_better_than_the_best(beam_size):
  """A narrow beam returns an enumerated hypothesis, scored at most the best one."""
  for alpha in (0.0, 0.6, 1.0):
    got = _beam(beam_size, alpha, EOS)
    for src in range(BATCH):
      ranked = _enumerate(src, alpha, EOS)
      scores = {tuple(seq): score for score, seq in ranked}
      assert tuple(got[src].tolist()) in scores
      assert scores[tuple(got[src].tolist())] <= ranked[0][0] + 1e-6


def test_length_penalty_factor_is_gnmts():
  """lp(n) = ((5 + n) / 6)^alpha: 1 at n = 1 for every alpha (a constant factor would not
  change which hypothesis wins, so the exhaustive test cannot see it), 2 at n = 7, alpha 1."""
  from attnlab.decoding.beam import length_penalty_factor

  for alpha in (0.0, 0.6, 2.0):
    assert float(length_penalty_factor(1, alpha)) == pytest.approx(1.0)
  assert float(length_penalty_factor(7, 1.0)) == pytest.approx(2.0)
  assert float(length_penalty_factor(jnp.int32(13), 0.5)) == pytest.approx(3 ** 0.5)


def test_defaults_are_alpha_0_6_and_pad_0():
  """Called without length_penalty / pad_id: GNMT's alpha 0.6, and pad id 0 after eos."""
  got = np.asarray(jax.jit(lambda cache: beam_search(
      _step_fn, cache, batch=BATCH, beam_size=WIDE, max_len=L, bos_id=BOS, eos_id=EOS))(
          _start(WIDE)))
  for src in range(BATCH):
    assert got[src].tolist() == _enumerate(src, 0.6, EOS)[0][1]  # pad after eos is 0 (PAD)
  assert any(EOS in row.tolist()[:-1] for row in got)  # some row does end early and pad


def test_no_hypothesis_longer_than_max_len():
  """Search stops at max_len tokens: a hypothesis that would end with eos one token later
  (and win) must not be considered. max_len 2; [3, 3] is the best 2-token hypothesis; after
  it every token is unlikely, while after the worse [4, 4] eos is almost certain, so
  [4, 4, eos] would beat [3, 3] if a third step ran."""
  base = 8  # history code: h -> h * 8 + token + 1 (bos first), unique for short histories

  def code(*tokens):
    h = 0
    for t in (BOS, *tokens):
      h = h * base + t + 1
    return h

  probs = np.full((base ** 4, V), 0.2)
  probs[code()] = [0.02, 0.02, 0.01, 0.5, 0.45]  # after bos: 3 or 4
  probs[code(3)] = [0.03, 0.03, 0.01, 0.9, 0.03]
  probs[code(4)] = [0.03, 0.03, 0.01, 0.03, 0.9]
  probs[code(3, 3)] = [0.2475, 0.2475, 0.01, 0.2475, 0.2475]
  probs[code(4, 4)] = [0.0025, 0.0025, 0.99, 0.0025, 0.0025]
  logp = jnp.asarray(np.log(probs), jnp.float32)

  def step_fn(tokens_X, h_X):
    h_X = h_X * base + tokens_X + 1
    return logp[h_X], h_X

  out = jax.jit(lambda h: beam_search(step_fn, h, batch=1, beam_size=2, max_len=2, bos_id=BOS,
                                      eos_id=EOS, length_penalty=0.0, pad_id=PAD))(
      jnp.zeros((2,), jnp.int32))
  assert np.asarray(out).tolist() == [[3, 3]]


def test_the_first_token_comes_from_bos_or_from_given_log_probs_not_both():
  """``first_log_probs_XV`` (a decoder-only prompt's last logits) takes bos's place: the
  search started from the log probabilities that feeding bos would give equals the search
  fed bos; asking for both, or neither, is an error."""
  cache = _start(WIDE)
  kw = dict(batch=BATCH, beam_size=WIDE, max_len=L, eos_id=EOS, length_penalty=0.6)
  fed = _beam(WIDE, 0.6, EOS)  # beam_search(_step_fn, cache, bos_id=BOS, **kw), alpha traced

  @jax.jit
  def given(cache):
    first_XV, after_bos = _step_fn(jnp.full((BATCH * WIDE,), BOS, jnp.int32), cache)
    return beam_search(_step_fn, after_bos, first_log_probs_XV=first_XV, **kw)

  np.testing.assert_array_equal(given(cache), fed)
  first_XV = np.zeros((BATCH * WIDE, V), np.float32)  # refused before it is read
  for both_or_neither in (dict(bos_id=BOS, first_log_probs_XV=first_XV), {}):
    with pytest.raises(ValueError, match="^give bos_id or first_log_probs_XV, not both or "
                                         "neither$"):
      beam_search(_step_fn, cache, **both_or_neither, **kw)


def _by_step(logits_SV):
  """A step function whose next-token logits depend on the step alone (row s of
  ``logits_SV`` after s fed tokens; cache = that count per row)."""
  table = jnp.asarray(logits_SV, jnp.float32)

  def step_fn(tokens_X, count_X):
    return jax.nn.log_softmax(table[count_X], axis=-1), count_X + 1

  return step_fn


def test_the_length_penalty_divides_a_finished_hypothesis_and_bounds_the_early_stop():
  """[EOS] (log P -0.669) against [3, EOS] (-0.819): alpha 0 takes the shorter, alpha 2 the
  longer (-0.819 / (7/6)^2 = -0.602). A finished score multiplied by lp, or a search that
  stops once the finished [EOS] beats the alive [3] times lp(max_len) instead of over it,
  returns [EOS] at alpha 2."""
  step_fn = _by_step([[-9, -9, 0.0, -0.05, -9],    # after bos: EOS or 3
                      [-9, -9, 0.0, -2.25, -9]])   # after 3: EOS, log P -0.0999
  search = jax.jit(lambda count_X, alpha: beam_search(
      step_fn, count_X, batch=BATCH, beam_size=count_X.shape[0] // BATCH, max_len=2,
      bos_id=BOS, eos_id=EOS, length_penalty=alpha))  # one program per width, alpha traced
  run = lambda alpha, z: np.asarray(search(jnp.zeros((BATCH * z,), jnp.int32), alpha))
  for z in (1, 2):
    assert run(0.0, z).tolist() == [[EOS, PAD]] * BATCH
    assert run(2.0, z).tolist() == [[3, EOS]] * BATCH


def test_each_step_weighs_the_best_two_beam_widths_of_candidates():
  """U = 2Z candidates a step (tensor2tensor's rule): with one beam, an eos that is only the
  third most likely first token never enters the finished set, so the search returns the
  alive hypothesis cut at max_len, although [EOS] alone would have scored higher. An eos
  second most likely does enter (U = 2, not Z = 1), and wins."""
  step_fn = _by_step([[-9, -9, -0.02, 0.0, -0.01],  # EOS third, behind 3 and 4
                      [-9, -9, -9, 0.0, 0.0]])      # then 3 or 4, never EOS
  got = np.asarray(beam_search(step_fn, jnp.zeros((BATCH,), jnp.int32), batch=BATCH,
                               beam_size=1, max_len=2, bos_id=BOS, eos_id=EOS,
                               length_penalty=0.0))
  assert got.tolist() == [[3, 3]] * BATCH  # log P -1.78; [EOS] alone would be -1.11
  step_fn = _by_step([[-9, -9, -0.01, 0.0, -9],  # EOS second, behind 3
                      [-9, -9, -9, 0.0, 0.0]])   # then 3 or 4, never EOS
  got = np.asarray(beam_search(step_fn, jnp.zeros((BATCH,), jnp.int32), batch=BATCH,
                               beam_size=1, max_len=2, bos_id=BOS, eos_id=EOS,
                               length_penalty=0.0))
  assert got.tolist() == [[EOS, PAD]] * BATCH  # log P -0.70; [3, 3] -1.38


def test_several_stop_ids_never_crowd_out_the_alive_beams():
  """Four stop ids, each 0.2 after bos, and token 4 (0.19), after which stop 2 is certain:
  [4, 2] (log P -1.66, alpha 1: -1.42) beats every one-token stop (-1.61). The best 2Z = 4
  candidates of the first step are all stops; the alive beams come from all candidates
  (until 2026-12-04 only from those 2Z, which left no alive beam: [2] came back)."""
  stops = [2, 3, 5, 6]
  probs = np.full((8, 8), 1e-9)
  probs[BOS, [2, 3, 5, 6, 4, 7]] = [0.2, 0.2, 0.2, 0.2, 0.19, 0.01]
  for s in stops + [0]:
    probs[s, s] = 1.0
  probs[4, 2] = probs[7, 2] = 1.0
  logp = jnp.log(jnp.asarray(probs / probs.sum(1, keepdims=True), jnp.float32))
  search = jax.jit(lambda c: beam_search(  # one program per width
      lambda tok, c: (logp[tok], c), c, batch=1, beam_size=c.shape[0], max_len=3,
      bos_id=BOS, eos_id=jnp.asarray(stops, jnp.int32), length_penalty=1.0))
  for z in (1, 2, 3):
    assert np.asarray(search(jnp.zeros((z,)))).tolist() == [[4, 2, 0]], z
