"""Optimizers, learning-rate schedules and the training loss.

The schedules are functions of optax's update count (0 for the first
update); ``inverse_sqrt_schedule`` evaluates the paper's formula at step =
count + 1, since the paper counts steps from 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from attnlab.config import TrainConfig


def paper_learning_rate(step, d_model: int, warmup_steps: int):
  """Vaswani et al. (2017), eq. 3: d^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
  step = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)
  return d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)


def inverse_sqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0):
  """The paper's schedule as an optax schedule of the 0-based update count."""
  return lambda count: scale * paper_learning_rate(count + 1, d_model, warmup_steps)


def make_schedule(tcfg: TrainConfig, d_model: int):
  if tcfg.schedule == "inverse_sqrt":
    return inverse_sqrt_schedule(d_model, tcfg.warmup_steps, tcfg.learning_rate)
  peak = tcfg.learning_rate
  if tcfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, peak, warmup_steps=tcfg.warmup_steps,
        decay_steps=max(tcfg.steps, tcfg.warmup_steps + 1), end_value=peak * tcfg.min_lr_ratio)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, max(tcfg.warmup_steps, 1)), optax.constant_schedule(peak)],
      [tcfg.warmup_steps])


# Parameters weight decay leaves alone, by name, whatever their shape: a q/k/v projection's
# bias is [heads, head_dim] (attnlab.nn.layers: biases are "b" / "bias", norm gains "scale").
NO_DECAY = frozenset({"b", "bias", "scale"})


def decay_mask(params):
  """True for the parameters AdamW decays: the weights of two or more dimensions (matrices,
  embeddings, [d, heads, head_dim] projections), not biases or norm scales of any shape."""
  def decays(path, p):
    names = [k.key for k in path if isinstance(getattr(k, "key", None), str)]
    return p.ndim > 1 and not (names and names[-1] in NO_DECAY)

  return jax.tree_util.tree_map_with_path(decays, params)


def update_dtype(dtype):
  """The dtype the optimizer reads a parameter's gradient in: float32 for a float16 or
  bfloat16 parameter (``in_float32``), the parameter's own otherwise."""
  return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def in_float32(tx):
  """``tx`` with its state and its arithmetic in float32 for float16 and bfloat16 leaves
  (gradients and parameters are widened before it reads them; its updates come out
  float32, which ``optax.apply_updates`` adds in float32 and rounds to the parameter's
  dtype).

  float16 cannot hold Adam's state: ``eps=1e-9`` rounds to 0 there, a gradient below
  2.4e-4 squares to 0, and a parameter with no gradient (a byte id the data never holds)
  divides 0 by 0. Until 2026-12-05 every update of float16 parameters under adam / adamw
  was non-finite and a run stopped at its first step. bfloat16 has float32's range but 8
  bits of mantissa: a decay rate of 0.999 (Adam's usual ``b2``) is 1.0 there, so its
  moments never decayed (until 2026-12-07: the second moment only grew, SGD's momentum
  lasted forever). The parameters themselves stay in their dtype: an update under half
  their ulp (lr 1e-3 on a norm scale of 1) leaves them as they were."""
  def widen(tree):  # (None, no parameters, stays None)
    return jax.tree.map(lambda x: x.astype(update_dtype(x.dtype)), tree)

  def init(params):
    return tx.init(widen(params))

  def update(updates, state, params=None):
    return tx.update(widen(updates), state, widen(params))

  return optax.GradientTransformation(init, update)


def make_optimizer(tcfg: TrainConfig, d_model: int):
  """(optax transformation, schedule). Weight decay skips biases and norm scales
  (``decay_mask``): decaying them only hurts. float16 and bfloat16 parameters are updated
  in float32 (``in_float32``)."""
  schedule = make_schedule(tcfg, d_model)
  if tcfg.optimizer == "sgd":
    opt = optax.sgd(schedule, momentum=tcfg.b1)
  elif tcfg.optimizer == "adam":
    opt = optax.adam(schedule, b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps)
  else:
    opt = optax.adamw(schedule, b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps,
                      weight_decay=tcfg.weight_decay,
                      mask=decay_mask)
  parts = [optax.clip_by_global_norm(tcfg.grad_clip)] if tcfg.grad_clip > 0 else []
  return in_float32(optax.chain(*parts, opt)), schedule


def schedule_count(opt_state):
  """The update count the optimizer's schedule reads next (``ScaleByScheduleState.count``):
  the number of updates applied, which a skipped (non-finite) step does not advance."""
  counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
  for path, count in counts:
    if getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState":
      return count
  raise ValueError(f"the optimizer state has no schedule count (found {len(counts)} counts)")


def cross_entropy(logits_BTV, targets_BT, loss_mask_BT, label_smoothing: float = 0.0):
  """Masked token cross-entropy, as sums (so micro-batches add up exactly).

  With label smoothing e the target distribution is (1 - e) one_hot + e / V
  (the paper: e = 0.1). The loss mask only weights the loss; attention masks
  are the model's business (segment ids).

  Returns:
    (loss_sum, nll_sum, weight_sum): the smoothed loss, the plain negative
    log-likelihood (for perplexity) and the number of counted tokens.
  """
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  mask_BT = loss_mask_BT.astype(jnp.float32)
  if label_smoothing > 0:
    loss_BT = (1.0 - label_smoothing) * nll_BT - label_smoothing * jnp.mean(logp_BTV, axis=-1)
  else:
    loss_BT = nll_BT
  return jnp.sum(loss_BT * mask_BT), jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT)
