"""Positions: the 2017 sinusoidal formula, RoPE's formula and relative-position property,
the learned table."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab.nn.positions import LearnedPositions, apply_rope, sinusoidal_positions
from tests import random_arrays

# Jitted for the float32 checks: op by op, every new shape compiles each op on its own.
# (The bfloat16 check calls apply_rope as it is: under jit XLA may keep float32 between ops.)
rope = jax.jit(apply_rope, static_argnames=("theta", "pairing"))


@pytest.mark.parametrize("pos,i", [(0, 0), (1, 0), (7, 3), (50, 10), (123, 31)])
def test_sinusoidal_table_equals_paper_formula(pos, i):
  d_model = 64
  table = np.asarray(jax.jit(sinusoidal_positions, static_argnums=1)(jnp.arange(200)[None],
                                                                      d_model))[0]
  angle = pos / 10000 ** (2 * i / d_model)
  assert math.isclose(float(table[pos, 2 * i]), math.sin(angle), abs_tol=1e-5)
  assert math.isclose(float(table[pos, 2 * i + 1]), math.cos(angle), abs_tol=1e-5)


@pytest.mark.parametrize("pairing", ["half", "adjacent"])
def test_rope_score_depends_only_on_relative_position(pairing):
  rng = random_arrays.rng(0)
  q = random_arrays.normal(rng, (1, 1, 2, 32))
  k = random_arrays.normal(rng, (1, 1, 2, 32))

  def score(m, n):
    qm = np.asarray(rope(q, jnp.array([[m]]), pairing=pairing))
    kn = np.asarray(rope(k, jnp.array([[n]]), pairing=pairing))
    return np.sum(qm * kn, axis=-1)

  base = score(5, 2)
  for shift in (1, 17, 300):
    np.testing.assert_allclose(score(5 + shift, 2 + shift), base, atol=1e-4, rtol=1e-4)
  assert not np.allclose(score(5, 3), base, atol=1e-3)


@pytest.mark.parametrize("pairing", ["half", "adjacent"])
def test_rope_preserves_norms_and_is_identity_at_zero(pairing):
  x = random_arrays.normal(1, (2, 6, 3, 16))
  pos = jnp.asarray(np.broadcast_to(np.arange(6) * 37, (2, 6)))
  y = rope(x, pos, pairing=pairing)
  np.testing.assert_allclose(np.linalg.norm(np.asarray(y), axis=-1),
                             np.linalg.norm(np.asarray(x), axis=-1), rtol=1e-5)
  np.testing.assert_allclose(rope(x, jnp.zeros((2, 6), jnp.int32), pairing=pairing), x)


def test_rope_pairings_are_a_permutation_of_each_other():
  """Half-split RoPE is adjacent-pair RoPE on features reordered (0,H/2,1,H/2+1,...)."""
  H = 8
  x = np.asarray(random_arrays.normal(2, (1, 4, 1, H)))
  pos = jnp.arange(4)[None]
  interleave = np.stack([np.arange(H // 2), np.arange(H // 2) + H // 2], axis=1).reshape(-1)
  half = np.asarray(rope(jnp.asarray(x), pos, pairing="half"))
  adjacent = rope(jnp.asarray(x[..., interleave]), pos, pairing="adjacent")
  np.testing.assert_allclose(half[..., interleave], adjacent, atol=1e-6)


def test_rope_rotates_the_first_pair_by_position_times_one():
  """Frequency 0 has inverse frequency theta^0 = 1: the pair rotates by pos radians."""
  x = np.zeros((1, 1, 1, 4), np.float32)
  x[..., 0] = 1.0
  y = np.asarray(rope(jnp.asarray(x), jnp.array([[2]]), pairing="adjacent"))
  np.testing.assert_allclose(y[0, 0, 0, :2], [math.cos(2), math.sin(2)], atol=1e-6)


@pytest.mark.parametrize("pairing", ["half", "adjacent"])
@pytest.mark.parametrize("theta", [None, 500.0])
def test_rope_rotates_pair_i_by_position_times_theta_to_the_minus_2i_over_h(pairing, theta):
  """Every pair, against the formula in numpy: pair i (features (i, i + H/2) with
  "half", (2i, 2i + 1) with "adjacent") turns by pos * theta^(-2i/H); theta
  defaults to 10000."""
  H, pos = 16, np.array([[0, 3, 41, 1000]])
  x = np.random.default_rng(3).standard_normal((1, 4, 2, H), np.float32)
  kw = {} if theta is None else {"theta": theta}
  got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), pairing=pairing, **kw))
  i = np.arange(H // 2)
  angle = pos[..., None, None] * (theta or 10000.0) ** (-2.0 * i / H)  # [1, T, 1, H/2]
  a, b = (i, i + H // 2) if pairing == "half" else (2 * i, 2 * i + 1)
  want = np.empty_like(x)
  want[..., a] = x[..., a] * np.cos(angle) - x[..., b] * np.sin(angle)
  want[..., b] = x[..., b] * np.cos(angle) + x[..., a] * np.sin(angle)
  np.testing.assert_allclose(got, want, atol=2e-4)


def test_rope_pairs_halves_by_default_and_keeps_the_input_dtype():
  x = random_arrays.normal(4, (1, 3, 2, 8))
  pos = jnp.array([[1, 2, 70]])
  np.testing.assert_array_equal(apply_rope(x, pos), apply_rope(x, pos, pairing="half"))
  # bfloat16 in, bfloat16 out: computed in float32, rounded once at the end.
  y = apply_rope(x.astype(jnp.bfloat16), pos)
  assert y.dtype == jnp.bfloat16
  want = apply_rope(x.astype(jnp.bfloat16).astype(jnp.float32), pos).astype(jnp.bfloat16)
  np.testing.assert_array_equal(y.astype(jnp.float32), want.astype(jnp.float32))


def test_odd_sizes_and_unknown_pairings_are_refused_by_name():
  with pytest.raises(ValueError, match=r"^head_dim=7 must be even for RoPE$"):
    apply_rope(jnp.zeros((1, 1, 1, 7)), jnp.zeros((1, 1), jnp.int32))
  with pytest.raises(ValueError, match=r"^pairing='interleaved' is not one of 'half', "
                                       r"'adjacent'$"):
    apply_rope(jnp.zeros((1, 1, 1, 8)), jnp.zeros((1, 1), jnp.int32), pairing="interleaved")
  with pytest.raises(ValueError, match=r"^d_model=33 must be even for sinusoidal positions$"):
    sinusoidal_positions(jnp.zeros((1, 1), jnp.int32), 33)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_learned_positions_read_their_table_row_by_position(param_dtype):
  """Row p of the table ``embed_positions`` [max_len, D] at position p (a packed
  row restarts its positions), initialized N(0, 0.02^2) in ``param_dtype``,
  its model axis sharded like the embeddings."""
  table = LearnedPositions(512, 64, param_dtype=param_dtype, rngs=nnx.Rngs(0))
  assert table.max_len == 512
  w = table.embed_positions
  assert w.shape == (512, 64) and w.dtype == param_dtype
  assert w.get_metadata()["axes"] == (None, "embed")
  std = float(jnp.std(w[...].astype(jnp.float32)))
  assert 0.019 < std < 0.021 and abs(float(jnp.mean(w[...].astype(jnp.float32)))) < 1e-3
  pos = jnp.array([[0, 1, 2, 511], [5, 0, 1, 2]])
  np.testing.assert_array_equal(table(pos), w[...][pos])
  # Past the table (a padded or idle row): the last row, finite, not NaN.
  np.testing.assert_array_equal(table(jnp.array([[512, 9999]])), w[...][jnp.array([[511, 511]])])
  other = LearnedPositions(512, 64, param_dtype=param_dtype, rngs=nnx.Rngs(1))
  assert not np.array_equal(other.embed_positions[...], w[...])
