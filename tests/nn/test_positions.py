"""Positions: the 2017 sinusoidal formula, RoPE's relative-position property."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.nn.positions import apply_rope, sinusoidal_positions


@pytest.mark.parametrize("pos,i", [(0, 0), (1, 0), (7, 3), (50, 10), (123, 31)])
def test_sinusoidal_table_equals_paper_formula(pos, i):
  d_model = 64
  table = sinusoidal_positions(jnp.arange(200)[None], d_model)[0]
  angle = pos / 10000 ** (2 * i / d_model)
  assert math.isclose(float(table[pos, 2 * i]), math.sin(angle), abs_tol=1e-5)
  assert math.isclose(float(table[pos, 2 * i + 1]), math.cos(angle), abs_tol=1e-5)


@pytest.mark.parametrize("pairing", ["half", "adjacent"])
def test_rope_score_depends_only_on_relative_position(pairing):
  kq, kk = jax.random.split(jax.random.key(0))
  q = jax.random.normal(kq, (1, 1, 2, 32))
  k = jax.random.normal(kk, (1, 1, 2, 32))

  def score(m, n):
    qm = apply_rope(q, jnp.array([[m]]), pairing=pairing)
    kn = apply_rope(k, jnp.array([[n]]), pairing=pairing)
    return np.asarray(jnp.sum(qm * kn, axis=-1))

  base = score(5, 2)
  for shift in (1, 17, 300):
    np.testing.assert_allclose(score(5 + shift, 2 + shift), base, atol=1e-4, rtol=1e-4)
  assert not np.allclose(score(5, 3), base, atol=1e-3)


@pytest.mark.parametrize("pairing", ["half", "adjacent"])
def test_rope_preserves_norms_and_is_identity_at_zero(pairing):
  x = jax.random.normal(jax.random.key(1), (2, 6, 3, 16))
  pos = jnp.broadcast_to(jnp.arange(6) * 37, (2, 6))
  y = apply_rope(x, pos, pairing=pairing)
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1),
                             rtol=1e-5)
  np.testing.assert_allclose(apply_rope(x, jnp.zeros((2, 6), jnp.int32), pairing=pairing), x)


def test_rope_pairings_are_a_permutation_of_each_other():
  """Half-split RoPE is adjacent-pair RoPE on features reordered (0,H/2,1,H/2+1,...)."""
  H = 8
  x = jax.random.normal(jax.random.key(2), (1, 4, 1, H))
  pos = jnp.arange(4)[None]
  interleave = np.stack([np.arange(H // 2), np.arange(H // 2) + H // 2], axis=1).reshape(-1)
  half = apply_rope(x, pos, pairing="half")
  adjacent = apply_rope(x[..., interleave], pos, pairing="adjacent")
  np.testing.assert_allclose(half[..., interleave], adjacent, atol=1e-6)


def test_rope_rotates_the_first_pair_by_position_times_one():
  """Frequency 0 has inverse frequency theta^0 = 1: the pair rotates by pos radians."""
  x = jnp.zeros((1, 1, 1, 4)).at[..., 0].set(1.0)
  y = apply_rope(x, jnp.array([[2]]), pairing="adjacent")
  np.testing.assert_allclose(y[0, 0, 0, :2], [math.cos(2), math.sin(2)], atol=1e-6)
