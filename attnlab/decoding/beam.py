"""Beam search with a length penalty, as in the translation papers.

The 2017 Transformer decodes with beam size 4 and length penalty alpha=0.6
(Wu et al. 2016, GNMT): a finished hypothesis Y scores
``log P(Y | X) / lp(|Y|)`` with ``lp(n) = ((5 + n) / 6)^alpha``.

Two sets per source, as in tensor2tensor: ``Z`` alive hypotheses ranked by
raw log probability, and ``Z`` finished ones ranked by penalized score. Each
step expands the alive beams into Z x V candidates: the best Z that do not end
stay alive, and those among the best U = 2Z that end (in eos, or any of the stop
ids) compete for the finished set. With one eos the best 2Z hold Z that do not
end (tensor2tensor's rule); with several stop ids they may all end, so the alive
ones are taken from every candidate (until 2026-12-04 from the 2Z, and a search
with 2Z stops among them lost every alive beam). Search ends at ``max_len`` or
once no alive beam can beat the best finished one: log P only falls as a
hypothesis grows, so an alive beam scores at most ``logp / lp(max_len)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.decoding.sampling import is_stop


def length_penalty_factor(length, alpha: float):
  """GNMT's lp(n) = ((5 + n) / 6)^alpha; 1 for alpha = 0."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def beam_search(step_fn, cache, *, batch: int, beam_size: int, max_len: int,
                bos_id: int | None = None, eos_id, length_penalty: float = 0.6,
                pad_id: int = 0, first_log_probs_XV=None):
  """The best hypothesis per source, int32 [batch, max_len] (eos included, pad after).

  Args:
    step_fn: ``(tokens_X, cache) -> (log_probs_XV, cache)`` for X = batch x
      beam_size rows (row ``b * beam_size + z`` is beam z of source b); every
      leaf of ``cache`` has X as its leading axis, so beams are reordered by
      gathering rows.
    cache: the initial cache (all beams of a source identical).
    batch, beam_size, max_len: B, Z and J, the longest hypothesis.
    bos_id: the first input token, fed to ``step_fn`` first; eos_id: ends a
      hypothesis (None or -1 = never), or an int32 array of such ids (any ends it; -1
      pads). Either may be traced.
    length_penalty: alpha; 0 ranks finished hypotheses by log P alone.
    pad_id: fills a hypothesis after its eos.
    first_log_probs_XV: instead of ``bos_id``, the log probabilities of the
      first token (a decoder-only prompt's, from its prefill; the rows of a
      source alike): the first tokens are chosen from them, and ``step_fn``
      first sees those.
  """
  if (bos_id is None) == (first_log_probs_XV is None):
    raise ValueError("give bos_id or first_log_probs_XV, not both or neither")
  B, Z, J = batch, beam_size, max_len
  neg_inf = jnp.float32(-jnp.inf)
  # Only beam 0 is live at the start, so the first expansion has no duplicates.
  alive_logp_BZ = jnp.where(jnp.arange(Z) == 0, 0.0, neg_inf)[None].repeat(B, 0)
  alive_seq_BZJ = jnp.full((B, Z, J), pad_id, jnp.int32)
  last_BZ = jnp.full((B, Z), pad_id if bos_id is None else bos_id, jnp.int32)
  fin_score_BZ = jnp.full((B, Z), neg_inf)
  fin_seq_BZJ = jnp.full((B, Z, J), pad_id, jnp.int32)
  best_possible = lambda alive_logp_BZ: alive_logp_BZ[:, 0] / length_penalty_factor(
      J, length_penalty)

  def cond(carry):
    step, alive_logp_BZ, _, _, fin_score_BZ, *_ = carry
    undecided_B = fin_score_BZ[:, 0] < best_possible(alive_logp_BZ)
    return (step < J) & jnp.any(undecided_B)

  def body(carry):
    last_BZ, cache = carry[3], carry[6]
    logp_XV, cache = step_fn(last_BZ.reshape(B * Z), cache)
    return expand(carry[:6] + (cache,), logp_XV)

  def expand(carry, logp_XV):
    """One step of the search given the next token's log probabilities of every row."""
    step, alive_logp_BZ, alive_seq_BZJ, last_BZ, fin_score_BZ, fin_seq_BZJ, cache = carry
    V = logp_XV.shape[-1]
    cand_BZV = alive_logp_BZ[:, :, None] + logp_XV.reshape(B, Z, V)
    stop_V = (is_stop(jnp.arange(V), jnp.atleast_1d(jnp.asarray(eos_id))) if eos_id is not None
              else jnp.zeros((V,), bool))
    prev_seq_BZJ = alive_seq_BZJ
    extend = lambda beam_K, token_K: jnp.take_along_axis(
        prev_seq_BZJ, beam_K[:, :, None], axis=1).at[:, :, step].set(token_K)

    # Alive: the best Z candidates that do not end, of all Z x V.
    alive_logp_BZ, keep_BZ = jax.lax.top_k(
        jnp.where(stop_V, neg_inf, cand_BZV).reshape(B, Z * V), Z)
    parent_BZ, last_BZ = keep_BZ // V, keep_BZ % V
    alive_seq_BZJ = extend(parent_BZ, last_BZ)
    rows_X = (jnp.arange(B)[:, None] * Z + parent_BZ).reshape(B * Z)
    cache = jax.tree.map(lambda x: jnp.take(x, rows_X, axis=0), cache)

    # Finished: those of the best 2Z candidates that end, merged with the finished set.
    top_logp_BU, top_idx_BU = jax.lax.top_k(cand_BZV.reshape(B, Z * V), 2 * Z)
    token_BU = top_idx_BU % V
    seq_BUJ = extend(top_idx_BU // V, token_BU)
    is_eos_BU = stop_V[token_BU]
    new_score_BU = jnp.where(is_eos_BU, top_logp_BU / length_penalty_factor(
        step + 1, length_penalty), neg_inf)
    all_score = jnp.concatenate([fin_score_BZ, new_score_BU], axis=1)
    all_seq = jnp.concatenate([fin_seq_BZJ, seq_BUJ], axis=1)
    fin_score_BZ, pick_BZ = jax.lax.top_k(all_score, Z)
    fin_seq_BZJ = jnp.take_along_axis(all_seq, pick_BZ[:, :, None], axis=1)
    return step + 1, alive_logp_BZ, alive_seq_BZJ, last_BZ, fin_score_BZ, fin_seq_BZJ, cache

  carry = (jnp.int32(0), alive_logp_BZ, alive_seq_BZJ, last_BZ, fin_score_BZ, fin_seq_BZJ, cache)
  if first_log_probs_XV is not None:
    carry = expand(carry, first_log_probs_XV)
  step, alive_logp_BZ, alive_seq_BZJ, _, fin_score_BZ, fin_seq_BZJ, _ = jax.lax.while_loop(
      cond, body, carry)
  # A source with no finished hypothesis (or a better unfinished one cut at
  # max_len) returns its best alive beam, scored as if it ended there.
  alive_score_B = alive_logp_BZ[:, 0] / length_penalty_factor(step, length_penalty)
  use_alive_B = alive_score_B > fin_score_BZ[:, 0]
  return jnp.where(use_alive_B[:, None], alive_seq_BZJ[:, 0], fin_seq_BZJ[:, 0])
