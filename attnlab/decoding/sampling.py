"""Choosing the next token: greedy, temperature, top-k, top-p (nucleus).

The filters compose in the usual order: logits are divided by the
temperature, then restricted to the ``top_k`` most likely tokens, then to the
smallest set of those whose probability mass reaches ``top_p``; a token is
drawn from what is left, renormalized. ``temperature=0`` is greedy (argmax)
and takes no filters (refused: until 2026-12-06 ``Sampling(top_k=50)``, whose
temperature is 0 by default, decoded greedily without a word).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attnlab.config import _check_types, check_temperature, is_integer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """How to pick the next token (hashable: a static argument of the jitted loop).

  Attributes:
    temperature: 0 = greedy (the default); otherwise logits are divided by it.
    top_k: keep only the k most likely tokens; None = all. Needs a temperature > 0.
    top_p: keep the smallest set of most likely tokens whose probability
      reaches p, in (0, 1]; None = all. Needs a temperature > 0.
  """

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    _check_types(self)  # numbers, finite, not bools, NumPy ones as Python's: before comparing
    check_temperature(self.temperature)
    if self.top_k is not None and (not is_integer(self.top_k) or self.top_k < 1):
      raise ValueError(f"top_k={self.top_k!r} must be a positive integer or None")
    if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] or None")
    if self.temperature == 0.0 and (self.top_k is not None or self.top_p is not None):
      raise ValueError(f"top_k={self.top_k!r}, top_p={self.top_p!r} filter what is sampled, "
                       "and temperature=0 is greedy (no sampling): give a temperature > 0, "
                       "e.g. Sampling(temperature=1.0, top_k=50), or leave them unset")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def filtered_logits(logits_BV, sampling: Sampling):
  """Float32 logits [B, V] after temperature, top-k and top-p; dropped tokens are -inf."""
  logits_BV = logits_BV.astype(jnp.float32) / sampling.temperature
  V = logits_BV.shape[-1]
  k = V if sampling.top_k is None else min(sampling.top_k, V)
  # Sorted descending; lax.top_k breaks ties by the lower index, so exactly k survive.
  vals_BV, idx_BV = jax.lax.top_k(logits_BV, k)
  # top_p = 1 keeps every token (each one's more likely mass is short of 1); the float32
  # cumulative sum can round to 1 before the least likely tokens, so it is not computed.
  if sampling.top_p is not None and sampling.top_p < 1.0:
    probs_BV = jax.nn.softmax(vals_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # Keep a token while the mass of the more likely ones is still short of p:
    # the smallest prefix whose mass reaches p (the most likely is always kept).
    vals_BV = jnp.where(mass_before_BV < sampling.top_p, vals_BV, -jnp.inf)
  out_BV = jnp.full_like(logits_BV, -jnp.inf)
  return out_BV.at[jnp.arange(logits_BV.shape[0])[:, None], idx_BV].set(vals_BV)


def sample(logits_BV, rng, sampling: Sampling):
  """Next tokens int32 [B] from logits [B, V]."""
  if sampling.greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(rng, filtered_logits(logits_BV, sampling), axis=-1).astype(
      jnp.int32)


def sample_rows(logits_BV, keys_B, sampling: Sampling):
  """Next tokens int32 [B] from logits [B, V], row b drawn with its own key ``keys_B[b]``
  (so a row's token does not depend on the other rows of the batch)."""
  if sampling.greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = filtered_logits(logits_BV, sampling)
  return jax.vmap(jax.random.categorical)(keys_B, logits_BV).astype(jnp.int32)


def is_stop(token, stop_E):
  """Whether each of ``token`` (any shape) is one of the stop ids ``stop_E`` (a traced
  ``generate.stop_array``: padded with -1, which matches no token)."""
  return (token[..., None] == stop_E).any(-1)
