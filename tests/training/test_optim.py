"""Schedules, label smoothing and loss masks of the loss function (the train
step itself, with gradient accumulation, is checked in test_steps.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.config import TrainConfig
from attnlab.training.optim import (
    cross_entropy,
    inverse_sqrt_schedule,
    make_optimizer,
    make_schedule,
    update_dtype,
)


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



def test_inverse_sqrt_config_is_the_papers_schedule_times_the_learning_rate():
  fn = make_schedule(TrainConfig(schedule="inverse_sqrt", warmup_steps=50, learning_rate=2.0),
                     64)
  for count in (0, 49, 50, 500):
    want = 2.0 * 64**-0.5 * min((count + 1) ** -0.5, (count + 1) * 50**-1.5)
    np.testing.assert_allclose(float(fn(count)), want, rtol=1e-6)


def test_constant_schedule_warms_up_linearly_then_holds():
  fn = make_schedule(TrainConfig(schedule="constant", warmup_steps=10, learning_rate=3.0), 64)
  np.testing.assert_allclose([float(fn(c)) for c in (0, 5, 10, 11, 10_000)],
                             [0.0, 1.5, 3.0, 3.0, 3.0], rtol=1e-6)
  fn = make_schedule(TrainConfig(schedule="constant", warmup_steps=0, learning_rate=3.0), 64)
  np.testing.assert_allclose([float(fn(0)), float(fn(7))], [3.0, 3.0], rtol=1e-6)


def test_cosine_schedule_shorter_than_its_warmup_decays_one_step_after_it():
  fn = make_schedule(TrainConfig(schedule="cosine", steps=5, warmup_steps=10, learning_rate=1.0,
                                 min_lr_ratio=0.25), 64)
  np.testing.assert_allclose([float(fn(5)), float(fn(10)), float(fn(11)), float(fn(50))],
                             [0.5, 1.0, 0.25, 0.25], atol=1e-6)


def test_masked_and_smoothed_loss_counts_the_kept_tokens_only():
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(2, 4, 5)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 5, (2, 4)))
  mask = jnp.asarray([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
  keep = np.asarray(mask, bool)
  loss, nll, w = cross_entropy(logits, targets, mask, 0.2)
  logp = np.asarray(jax.nn.log_softmax(logits), np.float64)[keep]
  q = 0.8 * np.eye(5)[np.asarray(targets)[keep]] + 0.2 / 5
  np.testing.assert_allclose(loss, -np.sum(q * logp), rtol=1e-5)
  assert float(w) == 4
  loss0, nll0, _ = cross_entropy(logits, targets, mask)  # no smoothing by default
  np.testing.assert_allclose(loss0, nll0, rtol=1e-7)
  np.testing.assert_allclose(nll0, nll, rtol=1e-7)


def updates(tcfg, params, *grads):
  """The optimizer's update for each of ``grads``, applied in turn from a fresh state."""
  tx, _ = make_optimizer(tcfg, 64)
  state = tx.init(params)
  out = []
  for g in grads:
    u, state = tx.update(g, state, params)
    out.append(jax.tree.map(np.asarray, u))
  return out


PARAMS = {"w": jnp.full((2, 3), 2.0), "b": jnp.full((3,), 2.0)}
LR = dict(schedule="constant", warmup_steps=0, learning_rate=0.1, grad_clip=0.0)


def test_sgd_uses_b1_as_momentum():
  g = {"w": jnp.full((2, 3), 1.0), "b": jnp.full((3,), -2.0)}
  u1, u2 = updates(TrainConfig(optimizer="sgd", b1=0.5, **LR), PARAMS, g, g)
  for k in g:
    np.testing.assert_allclose(u1[k], -0.1 * np.asarray(g[k]), rtol=1e-6)
    np.testing.assert_allclose(u2[k], -0.1 * 1.5 * np.asarray(g[k]), rtol=1e-6)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adams_first_step_moves_each_weight_by_the_learning_rate(optimizer):
  g = {"w": jnp.full((2, 3), 3.0), "b": jnp.full((3,), -0.5)}
  tcfg = TrainConfig(optimizer=optimizer, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.0, **LR)
  (u,) = updates(tcfg, PARAMS, g)
  np.testing.assert_allclose(u["w"], -0.1, rtol=1e-5)  # m / sqrt(v) = sign(g) at step 1
  np.testing.assert_allclose(u["b"], 0.1, rtol=1e-5)
  # eps is the config's: with eps as large as |g| the step halves.
  (u,) = updates(tcfg.replace(eps=3.0), PARAMS, g)
  np.testing.assert_allclose(u["w"], -0.05, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_moments_use_the_configs_b1_and_b2(optimizer):
  g1, g2 = 3.0, -1.0
  grads = [{"w": jnp.full((2, 3), g), "b": jnp.full((3,), g)} for g in (g1, g2)]
  tcfg = TrainConfig(optimizer=optimizer, b1=0.5, b2=0.75, eps=1e-8, weight_decay=0.0, **LR)
  _, u = updates(tcfg, PARAMS, *grads)
  m = (0.5 * 0.5 * g1 + 0.5 * g2) / (1 - 0.5**2)  # bias-corrected moments after two steps
  v = (0.75 * 0.25 * g1**2 + 0.25 * g2**2) / (1 - 0.75**2)
  np.testing.assert_allclose(np.asarray(u["w"]), -0.1 * m / (np.sqrt(v) + 1e-8), rtol=1e-5)


def test_adamw_decays_matrices_and_leaves_vectors_alone():
  zero = {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}
  (u,) = updates(TrainConfig(optimizer="adamw", weight_decay=0.5, **LR), PARAMS, zero)
  np.testing.assert_allclose(u["w"], -0.1 * 0.5 * 2.0, rtol=1e-6)
  np.testing.assert_array_equal(u["b"], 0.0)
  (u,) = updates(TrainConfig(optimizer="adam", **LR), PARAMS, zero)
  np.testing.assert_array_equal(u["w"], 0.0)  # adam has no decay (and refuses a weight_decay)


def test_adamw_leaves_every_bias_and_norm_scale_of_a_real_model_alone():
  """A model with biases: the q/k/v biases are [heads, head_dim] (2-D) and were decayed
  until 2026-12-04 (the mask was ndim > 1); now no bias or norm scale is, every weight of
  two or more dimensions is (a zero gradient: the update is the decay alone)."""
  from flax import nnx

  import attnlab

  cfg = attnlab.ModelConfig(vocab_size=32, d_model=16, num_heads=2, num_layers=1, d_ff=32,
                            use_bias=True)
  _, params, _ = nnx.split(attnlab.build_model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  params = jax.tree.map(jnp.ones_like, params)
  (u,) = updates(TrainConfig(optimizer="adamw", weight_decay=0.5, **LR), params,
                 jax.tree.map(jnp.zeros_like, params))
  seen = {}
  for path, x in jax.tree_util.tree_leaves_with_path(u):
    name = [k.key for k in path if isinstance(getattr(k, "key", None), str)][-1]
    decayed = bool(np.all(x == -0.1 * 0.5))
    assert decayed == (name not in ("b", "bias", "scale")) and (decayed or not x.any()), path
    seen.setdefault(name, set()).add(x.ndim)
  assert seen["b"] >= {1, 2} and {"scale", "w", "embed_tokens"} <= set(seen)  # 2-D biases too


def test_grad_clip_scales_the_global_norm_down_to_it():
  g = {"w": jnp.full((2, 3), 4.0), "b": jnp.full((3,), 4.0)}  # global norm 12
  for clip in (3.0, 0.6):  # a clip below 1 clips too
    (u,) = updates(TrainConfig(optimizer="sgd", b1=0.0, **dict(LR, grad_clip=clip)), PARAMS, g)
    np.testing.assert_allclose(u["w"], -0.1 * 4.0 * clip / 12.0, rtol=1e-6)
  (u,) = updates(TrainConfig(optimizer="sgd", b1=0.0, **dict(LR, grad_clip=100.0)), PARAMS, g)
  np.testing.assert_allclose(u["w"], -0.1 * 4.0, rtol=1e-6)  # below the clip: untouched


def test_the_optimizer_follows_the_schedule_of_its_config():
  g = {"w": jnp.full((2, 3), 1.0), "b": jnp.full((3,), 1.0)}
  tcfg = TrainConfig(optimizer="sgd", b1=0.0, schedule="inverse_sqrt", warmup_steps=4,
                     learning_rate=2.0, grad_clip=0.0)
  (u,) = updates(tcfg, PARAMS, g)
  np.testing.assert_allclose(u["w"], -2.0 * 64**-0.5 * 4**-1.5, rtol=1e-6)  # d_model = 64


def test_a_vector_weight_is_not_decayed_whatever_its_name():
  """AdamW decays the weights of two or more dimensions only: a 1-D weight that is no bias
  or norm scale by name is left alone too (``decay_mask``)."""
  params = {**PARAMS, "v": jnp.full((4,), 2.0)}
  zero = jax.tree.map(jnp.zeros_like, params)
  (u,) = updates(TrainConfig(optimizer="adamw", weight_decay=0.5, **LR), params, zero)
  np.testing.assert_allclose(u["w"], -0.1 * 0.5 * 2.0, rtol=1e-6)
  np.testing.assert_array_equal(u["v"], 0.0)


def test_narrow_parameters_are_updated_in_float32():
  """Adam's state and updates of float16 and bfloat16 parameters are float32 (``in_float32``):
  a gradient of 1e-4 squares to 0 in float16 and eps=1e-9 rounds to 0, so the update would
  be inf; bfloat16 state was bfloat16 until 2026-12-07 (see the next test)."""
  assert update_dtype(np.dtype("float64")) == np.float64  # the parameter's own (an x64 run)
  for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
    want = jnp.dtype(jnp.float32)
    params = jax.tree.map(lambda x, dtype=dtype: x.astype(dtype), PARAMS)
    g = {"w": jnp.full((2, 3), 1e-4, dtype), "b": jnp.full((3,), -1e-4, dtype)}
    tx, _ = make_optimizer(TrainConfig(optimizer="adam", eps=1e-9, **LR), 64)
    state = tx.init(params)
    moments = [x for x in jax.tree.leaves(state) if x.ndim]
    assert len(moments) == 4 and {x.dtype for x in moments} == {want}, dtype
    u, _ = tx.update(g, state, params)
    assert {x.dtype for x in jax.tree.leaves(u)} == {want}, dtype
    np.testing.assert_allclose(np.asarray(u["w"], np.float32), -0.1, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(u["b"], np.float32), 0.1, rtol=1e-2)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_bfloat16_parameters_take_the_float32_parameters_updates(optimizer):
  """The decay rates are float32's: b1 = b2 = 0.999 are 1.0 in bfloat16, where the state
  was kept until 2026-12-07 (Adam's second moment never decayed, SGD's momentum never
  did: after 10 steps of gradient 1 and 490 of 0 its update stayed -0.1, where float32's
  is 0.999**490 of that, -0.06). Reference: the same optimizer on float32 parameters of the
  same values, over 500 steps of gradients that bfloat16 holds exactly; every update equal."""
  tcfg = TrainConfig(optimizer=optimizer, b1=0.999, b2=0.999,
                     weight_decay=0.1 if optimizer == "adamw" else 0.0,
                     learning_rate=1e-2, schedule="constant", warmup_steps=0, grad_clip=0.0,
                     steps=500)
  t = jnp.arange(500)
  grads = {"w": jnp.where(t < 10, 1.0, 0.0)[:, None] * jnp.asarray([1.0, -0.5, 0.25]),
           "b": jnp.where(t < 100, 1.0, 0.125)[:, None] * jnp.asarray([0.5, 2.0])}

  def run(dtype):
    tx, _ = make_optimizer(tcfg, 64)
    params = {"w": jnp.asarray([[0.5, 1.0, -2.0]], dtype), "b": jnp.asarray([1.0, 0.75], dtype)}

    def body(state, g):
      g = jax.tree.map(lambda x, p: x.astype(p.dtype).reshape(p.shape), g, params)
      u, state = tx.update(g, state, params)
      return state, u

    return jax.jit(lambda s: jax.lax.scan(body, s, grads)[1])(tx.init(params))

  got, want = run(jnp.bfloat16), run(jnp.float32)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(g, w)
  if optimizer == "sgd":  # and the momentum did decay, by b1 a step after the last gradient
    np.testing.assert_allclose(float(got["w"][-1, 0, 0] / got["w"][9, 0, 0]), 0.999**490,
                               rtol=1e-4)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_schedule_count_is_the_number_of_updates_applied(optimizer):
  """``schedule_count`` reads the schedule's own count (``ScaleByScheduleState``), behind
  the clip and inside ``in_float32``; a state without one is refused by name."""
  import optax

  from attnlab.training.optim import schedule_count

  tx, _ = make_optimizer(TrainConfig(optimizer=optimizer, **{**LR, "grad_clip": 1.0}), 64)
  state = tx.init(PARAMS)
  g = {"w": jnp.ones((2, 3)), "b": jnp.ones((3,))}
  for k in range(3):
    assert int(schedule_count(state)) == k
    _, state = tx.update(g, state, PARAMS)
  assert int(schedule_count(state)) == 3
  with pytest.raises(ValueError, match=r"^the optimizer state has no schedule count "
                                       r"\(found 1 counts\)$"):
    schedule_count(optax.adam(0.1).init(PARAMS))


def test_without_smoothing_a_token_of_probability_zero_elsewhere_leaves_the_loss_finite():
  """A -inf logit (a vocabulary entry masked out) away from the target: without label
  smoothing the loss is the target's negative log-likelihood, finite; the smoothing term
  (the mean log-probability, -inf here) is not added times 0 (which is NaN)."""
  logits = jnp.asarray([[[0.0, 1.0, -jnp.inf, 2.0]]])
  loss, nll, w = cross_entropy(logits, jnp.asarray([[1]]), jnp.ones((1, 1)))
  want = -jax.nn.log_softmax(jnp.asarray([0.0, 1.0, 2.0]))[1]
  np.testing.assert_allclose([loss, nll], [want, want], rtol=1e-6)
  assert float(w) == 1
