"""Beam search with a length penalty, as in the translation papers.

The 2017 Transformer decodes with beam size 4 and length penalty alpha=0.6
(Wu et al. 2016, GNMT): a finished hypothesis Y scores
``log P(Y | X) / lp(|Y|)`` with ``lp(n) = ((5 + n) / 6)^alpha``.

Two sets per source, as in tensor2tensor: ``W`` alive hypotheses ranked by
raw log probability, and ``W`` finished ones ranked by penalized score. Each
step expands the alive beams into W x V candidates and keeps the best 2W:
those ending in eos compete for the finished set, the best W of the others
stay alive (2W guarantees W of them exist). Search ends at ``max_len`` or
once no alive beam can beat the best finished one: log P only falls as a
hypothesis grows, so an alive beam scores at most ``logp / lp(max_len)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def length_penalty_factor(length, alpha: float):
  """GNMT's lp(n) = ((5 + n) / 6)^alpha; 1 for alpha = 0."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def beam_search(step_fn, cache, *, batch: int, beam_size: int, max_len: int, bos_id: int,
                eos_id: int | None, length_penalty: float = 0.6, pad_id: int = 0):
  """The best hypothesis per source, int32 [batch, max_len] (eos included, pad after).

  Args:
    step_fn: ``(tokens_X, cache) -> (log_probs_XV, cache)`` for X = batch x
      beam_size rows (row ``b * beam_size + w`` is beam w of source b); every
      leaf of ``cache`` has X as its leading axis, so beams are reordered by
      gathering rows.
    cache: the initial cache (all beams of a source identical).
    batch, beam_size, max_len: B, W and the longest hypothesis.
    bos_id: the first input token; eos_id: ends a hypothesis (None or -1 =
      never). Either may be a traced int32 scalar.
    length_penalty: alpha; 0 ranks finished hypotheses by log P alone.
    pad_id: fills a hypothesis after its eos.
  """
  B, W, L = batch, beam_size, max_len
  neg_inf = jnp.float32(-jnp.inf)
  # Only beam 0 is live at the start, so the first expansion has no duplicates.
  alive_logp_BW = jnp.where(jnp.arange(W) == 0, 0.0, neg_inf)[None].repeat(B, 0)
  alive_seq_BWL = jnp.full((B, W, L), pad_id, jnp.int32)
  last_BW = jnp.full((B, W), bos_id, jnp.int32)
  fin_score_BW = jnp.full((B, W), neg_inf)
  fin_seq_BWL = jnp.full((B, W, L), pad_id, jnp.int32)
  best_possible = lambda alive_logp_BW: alive_logp_BW[:, 0] / length_penalty_factor(
      L, length_penalty)

  def cond(carry):
    step, alive_logp_BW, _, _, fin_score_BW, *_ = carry
    undecided_B = fin_score_BW[:, 0] < best_possible(alive_logp_BW)
    return (step < L) & jnp.any(undecided_B)

  def body(carry):
    step, alive_logp_BW, alive_seq_BWL, last_BW, fin_score_BW, fin_seq_BWL, cache = carry
    logp_XV, cache = step_fn(last_BW.reshape(B * W), cache)
    V = logp_XV.shape[-1]
    cand_BWV = alive_logp_BW[:, :, None] + logp_XV.reshape(B, W, V)
    top_logp_BC, top_idx_BC = jax.lax.top_k(cand_BWV.reshape(B, W * V), 2 * W)
    beam_BC, token_BC = top_idx_BC // V, top_idx_BC % V
    seq_BCL = jnp.take_along_axis(alive_seq_BWL, beam_BC[:, :, None], axis=1)
    seq_BCL = seq_BCL.at[:, :, step].set(token_BC)
    is_eos_BC = (token_BC == eos_id) if eos_id is not None else jnp.zeros_like(token_BC, bool)

    # Alive: the best W candidates that did not end.
    alive_logp_BW, keep_BW = jax.lax.top_k(jnp.where(is_eos_BC, neg_inf, top_logp_BC), W)
    alive_seq_BWL = jnp.take_along_axis(seq_BCL, keep_BW[:, :, None], axis=1)
    last_BW = jnp.take_along_axis(token_BC, keep_BW, axis=1)
    parent_BW = jnp.take_along_axis(beam_BC, keep_BW, axis=1)
    rows_X = (jnp.arange(B)[:, None] * W + parent_BW).reshape(B * W)
    cache = jax.tree.map(lambda x: jnp.take(x, rows_X, axis=0), cache)

    # Finished: merge the candidates that ended with the finished set.
    new_score_BC = jnp.where(is_eos_BC, top_logp_BC / length_penalty_factor(
        step + 1, length_penalty), neg_inf)
    all_score = jnp.concatenate([fin_score_BW, new_score_BC], axis=1)
    all_seq = jnp.concatenate([fin_seq_BWL, seq_BCL], axis=1)
    fin_score_BW, pick_BW = jax.lax.top_k(all_score, W)
    fin_seq_BWL = jnp.take_along_axis(all_seq, pick_BW[:, :, None], axis=1)
    return step + 1, alive_logp_BW, alive_seq_BWL, last_BW, fin_score_BW, fin_seq_BWL, cache

  carry = (jnp.int32(0), alive_logp_BW, alive_seq_BWL, last_BW, fin_score_BW, fin_seq_BWL, cache)
  step, alive_logp_BW, alive_seq_BWL, _, fin_score_BW, fin_seq_BWL, _ = jax.lax.while_loop(
      cond, body, carry)
  # A source with no finished hypothesis (or a better unfinished one cut at
  # max_len) returns its best alive beam, scored as if it ended there.
  alive_score_B = alive_logp_BW[:, 0] / length_penalty_factor(step, length_penalty)
  use_alive_B = alive_score_B > fin_score_BW[:, 0]
  return jnp.where(use_alive_B[:, None], alive_seq_BWL[:, 0], fin_seq_BWL[:, 0])
