"""Schedules, label smoothing and loss masks of the loss function (the train
step itself, with gradient accumulation, is checked in test_steps.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.config import TrainConfig
from attnlab.training.optim import cross_entropy, inverse_sqrt_schedule, make_schedule


@pytest.mark.parametrize("step", [1, 10, 3999, 4000, 4001, 20000])
def test_paper_schedule_matches_its_formula(step):
  d, w = 512, 4000
  want = d**-0.5 * min(step**-0.5, step * w**-1.5)
  # optax counts updates from 0; the paper counts steps from 1.
  np.testing.assert_allclose(float(inverse_sqrt_schedule(d, w)(step - 1)), want, rtol=1e-6)


def test_paper_schedule_peaks_at_warmup():
  fn = inverse_sqrt_schedule(512, 100)
  lrs = np.array([float(fn(c)) for c in range(300)])
  assert lrs.argmax() == 99  # step 100


def test_cosine_schedule_warms_up_and_decays():
  fn = make_schedule(TrainConfig(steps=100, warmup_steps=10, learning_rate=1.0,
                                 min_lr_ratio=0.1), 64)
  np.testing.assert_allclose([float(fn(0)), float(fn(10)), float(fn(100))], [0.0, 1.0, 0.1],
                             atol=1e-6)


def test_label_smoothing_is_its_definition():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 7, (2, 3)))
  mask = jnp.ones((2, 3))
  eps = 0.1
  loss, nll, w = cross_entropy(logits, targets, mask, eps)
  logp = jax.nn.log_softmax(logits)
  q = (1 - eps) * jax.nn.one_hot(targets, 7) + eps / 7
  np.testing.assert_allclose(loss, -jnp.sum(q * logp), rtol=1e-6)
  np.testing.assert_allclose(nll, -jnp.sum(jax.nn.one_hot(targets, 7) * logp), rtol=1e-6)
  assert float(w) == 6


def test_loss_mask_drops_exactly_the_masked_tokens():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(1, 4, 5)), jnp.float32)
  targets = jnp.asarray([[1, 2, 3, 4]])
  mask = jnp.asarray([[1.0, 0.0, 1.0, 0.0]])
  _, nll, w = cross_entropy(logits, targets, mask)
  _, nll_kept, _ = cross_entropy(logits[:, ::2], targets[:, ::2], jnp.ones((1, 2)))
  np.testing.assert_allclose(nll, nll_kept, rtol=1e-6)
  assert float(w) == 2
  # Changing a masked position's logits changes nothing.
  logits2 = logits.at[0, 1].set(100.0)
  np.testing.assert_allclose(cross_entropy(logits2, targets, mask)[1], nll, rtol=1e-6)

