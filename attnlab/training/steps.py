"""The functional train and eval steps, jitted with shardings and donation.

The model is split once into (graphdef, params, rest); the steps merge it
back inside ``jax.jit``. Dropout keys are ``fold_in(seed_key(seed), step)``, so a
step's randomness depends only on its number: a resumed run draws exactly
what an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attnlab.config import ModelConfig, TrainConfig, seed_key
from attnlab.nn.partitioning import activation_sharding
from attnlab.nn.transformer import build_model
from attnlab.training import sharding as shd
from attnlab.training.optim import cross_entropy, make_optimizer, schedule_count, update_dtype

log = logging.getLogger(__name__)


def model_logits(model, batch):
  """Logits [B, T, V] of a batch for either architecture (teacher forcing)."""
  if model.cfg.arch == "decoder_only":
    return model(batch["tokens_BT"], positions_BT=batch["positions_BT"],
                 segment_ids_BT=batch["segment_ids_BT"])
  return model(batch["src_BS"], batch["tgt_in_BT"],
               src_segment_ids_BS=batch.get("src_segment_ids_BS"),
               tgt_segment_ids_BT=batch["tgt_segment_ids_BT"])


def with_dropout_key(rest, key):
  """Fresh copies of the non-parameter variables, every RNG stream keyed by
  ``fold_in(key, i)``.

  The copies are made inside the traced function: NNX forbids mutating
  (dropout bumps its counter) a Variable created outside the current trace.
  """
  is_var = lambda x: isinstance(x, nnx.Variable)
  leaves, treedef = jax.tree.flatten(rest, is_leaf=is_var)
  out, i = [], 0
  for v in leaves:
    if isinstance(v, nnx.RngKey):
      out.append(v.replace(jax.random.fold_in(key, i)))
      i += 1
    elif is_var(v):
      out.append(v.replace(v.get_value()))
    else:
      out.append(v)
  return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass
class TrainSetup:
  """Everything the loop needs to run steps on a mesh."""

  mesh: jax.sharding.Mesh
  graphdef: object
  rest: object
  tx: optax.GradientTransformation
  schedule: object
  state_shardings: dict
  batch_sharding: jax.sharding.NamedSharding

  def abstract_state(self, state) -> dict:
    """ShapeDtypeStructs (with this mesh's shardings) of a train state."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, self.state_shardings)

  def fresh_rest(self, params) -> dict:
    """The optimizer state and step a run starts ``params`` with: ``tx.init`` (whose state
    depends on the parameters' shapes, not their values: zero moments, count 0) and step 0,
    placed on the mesh."""
    return {"opt_state": jax.jit(self.tx.init,
                                 out_shardings=self.state_shardings["opt_state"])(params),
            "step": jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings["step"])}


def model_rngs(seed: int) -> nnx.Rngs:
  """The model's RNG streams for ``seed``: parameters from ``seed_key(seed)``, dropout from a
  key folded out of it (training replaces the dropout keys each step: ``with_dropout_key``).
  Until 2026-12-04 dropout took the int ``seed + 1``, seed S+1's parameter key, which
  overflowed at the largest seed, and a seed kept only its low 32 bits."""
  key = seed_key(seed)
  return nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1))


def _split_model(mcfg: ModelConfig, tcfg: TrainConfig):
  """(graphdef, params, rest) of the model ``tcfg.seed`` initializes, on the host."""
  return nnx.split(build_model(mcfg, rngs=model_rngs(tcfg.seed)), nnx.Param, ...)


def init_params(mcfg: ModelConfig, tcfg: TrainConfig, setup: TrainSetup):
  """The parameters ``init_train`` initializes, placed on ``setup``'s mesh (for a state
  ``init_train`` made abstract)."""
  return jax.device_put(_split_model(mcfg, tcfg)[1], setup.state_shardings["params"])


def init_train(mcfg: ModelConfig, tcfg: TrainConfig, mesh, *,
               abstract: bool = False) -> tuple[TrainSetup, dict]:
  """Build the model, the optimizer and the sharded train state on ``mesh``.

  The state is ``{"params", "opt_state", "step"}``; parameters are created
  on the host from ``tcfg.seed`` (the same values whatever the mesh), then
  placed by the rules table. ``abstract``: the state as ``jax.ShapeDtypeStruct``s with
  their shardings, nothing initialized (the model's RNG streams apart, made in one jitted
  call): for a caller that restores a checkpoint's parameters over it (an evaluation,
  where the eager initialization cost ~1.6-2.2 s of a 3.3-4.0 s demo-sized eval).
  """
  build = lambda: build_model(mcfg, rngs=model_rngs(tcfg.seed))
  if abstract:
    graphdef, params, _ = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2])()
  else:
    graphdef, params, rest = _split_model(mcfg, tcfg)
  tx, schedule = make_optimizer(tcfg, mcfg.d_model)
  p_sh = shd.param_shardings(params, mesh)
  for warning in shd.idle_axes([s.spec for s in jax.tree.leaves(p_sh)], mesh):
    if jax.process_index() == 0:
      log.warning("%s", warning)
  rep = shd.replicated(mesh)
  if abstract:
    shaped = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    params = jax.tree.map(shaped, params, p_sh)
    opt_shapes = jax.eval_shape(tx.init, params)
    o_sh = shd.tree_shardings_like(opt_shapes, params, p_sh, mesh)
    state = {"params": params, "opt_state": jax.tree.map(shaped, opt_shapes, o_sh),
             "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)}
  else:
    params = jax.device_put(params, p_sh)
    o_sh = shd.tree_shardings_like(jax.eval_shape(tx.init, params), params, p_sh, mesh)
  setup = TrainSetup(mesh, graphdef, rest, tx, schedule,
                     {"params": p_sh, "opt_state": o_sh, "step": rep}, shd.batch_sharding(mesh))
  if not abstract:
    state = {"params": params, **setup.fresh_rest(params)}
  return setup, state


# The loss sum a micro-batch differentiates weighs at most this many tokens (a power of two).
GRADIENT_SUM_TOKENS = 4096


def gradient_scale(num_tokens: int) -> float:
  """The power of two (at most 1) the loss sum of a micro-batch of ``num_tokens`` token
  positions is multiplied by before it is differentiated, so that its gradient sums at
  most ``GRADIENT_SUM_TOKENS`` tokens' worth (more than half that when it scales): a
  float16 weight gradient summed over every token of a large batch overflowed (until
  2026-12-07: at ~260K tokens a micro-batch, every step of a float16 run was non-finite).
  A power of two scales float32 and bfloat16 gradients exactly; the step multiplies them
  back in float32."""
  return 2.0 ** -((num_tokens - 1) // GRADIENT_SUM_TOKENS).bit_length()


def make_train_step(setup: TrainSetup, tcfg: TrainConfig):
  """``step(state, batch) -> (state, metrics)``, jitted; ``state`` is donated.

  A non-finite loss or gradient leaves the parameters and optimizer state
  unchanged (the step counter still advances) and sets ``metrics["finite"]``
  to False; the loop decides whether to stop or skip.
  """
  graphdef, rest, tx = setup.graphdef, setup.rest, setup.tx
  accum, smoothing = tcfg.grad_accum, tcfg.label_smoothing

  def loss_fn(params, batch, key):
    model = nnx.merge(graphdef, params, with_dropout_key(rest, key))
    with activation_sharding(shd.activation_resolver(setup.mesh)):
      logits_BTV = model_logits(model, batch)
    loss_sum, nll_sum, weight = cross_entropy(logits_BTV, batch["targets_BT"],
                                              batch["loss_mask_BT"], smoothing)
    return loss_sum * gradient_scale(batch["targets_BT"].size), (loss_sum, nll_sum, weight)

  def grad_fn(params, batch, key):
    (_, (loss_sum, nll_sum, weight)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch, key)
    return (loss_sum, (nll_sum, weight)), grads

  def step(state, batch):
    params = state["params"]
    key = jax.random.fold_in(seed_key(tcfg.seed), state["step"])
    if accum == 1:
      (loss_sum, (nll_sum, weight)), grads = grad_fn(params, batch, key)
    else:
      # Micro-batch i takes rows i, i + A, ...: every data shard contributes
      # to every micro-batch, so no rows move between devices.
      micro = jax.tree.map(
          lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), batch)

      def body(carry, xs):
        i, mb = xs
        (l, (n, w)), g = grad_fn(params, mb, jax.random.fold_in(key, i))
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), carry, (l, n, w, g)), None

      # The sum in float32 whatever the parameters' dtype: bfloat16 sums of many
      # micro-batches lose the low bits of each (8 bits of mantissa).
      zeros = (0.0, 0.0, 0.0, jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
      (loss_sum, nll_sum, weight, grads), _ = jax.lax.scan(
          body, zeros, (jnp.arange(accum), micro))
    # Gradients of the mean over all counted tokens of all micro-batches, scaled back,
    # divided and measured in float32; the optimizer gets them in the dtype it updates in
    # (float32 for float16 / bfloat16 parameters: optim.in_float32).
    denom = jnp.maximum(weight, 1.0)
    unscale = 1.0 / gradient_scale(batch["targets_BT"].size // accum)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * unscale / denom, grads)
    loss = loss_sum / denom
    grad_norm = optax.tree.norm(grads)
    grads = jax.tree.map(lambda g, p: g.astype(update_dtype(p.dtype)), grads, params)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    # The update too: a finite gradient times a rate past float32's range (1e39) is not.
    # Element by element: the norm of a huge but finite update (1e30) overflows.
    # And the parameters an update of a wider dtype was rounded into (float16 ones, updated
    # in float32: optim.in_float32): a finite float32 update can overflow float16.
    rounded = [p for p, u in zip(jax.tree.leaves(new_params), jax.tree.leaves(updates))
               if p.dtype != u.dtype]
    finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm)
              & jnp.all(jnp.stack([jnp.isfinite(x).all()
                                   for x in jax.tree.leaves(updates) + rounded])))
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = {"params": keep(new_params, params),
                 "opt_state": keep(opt_state, state["opt_state"]),
                 "step": state["step"] + 1}
    # The rate of this update: the schedule at the optimizer's own count, which
    # skipped (non-finite) steps do not advance; state["step"] counts those too.
    lr = setup.schedule(schedule_count(state["opt_state"]))
    metrics = {"loss": loss, "nll": nll_sum / denom, "tokens": weight,
               "grad_norm": grad_norm, "learning_rate": lr,
               "finite": finite}
    return new_state, metrics

  return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                 out_shardings=(setup.state_shardings, shd.replicated(setup.mesh)),
                 donate_argnums=0)


def make_eval_step(setup: TrainSetup):
  """``eval_step(params, batch) -> (nll_sum, weight)`` with dropout off."""

  def step(params, batch):
    model = nnx.merge(setup.graphdef, params, setup.rest)
    model.eval()
    with activation_sharding(shd.activation_resolver(setup.mesh)):
      logits_BTV = model_logits(model, batch)
    _, nll_sum, weight = cross_entropy(logits_BTV, batch["targets_BT"], batch["loss_mask_BT"])
    return nll_sum, weight

  return jax.jit(step, in_shardings=(setup.state_shardings["params"], setup.batch_sharding),
                 out_shardings=shd.replicated(setup.mesh))


def put_batch(batch: dict, setup: TrainSetup) -> dict:
  """Place a global host batch (numpy: every process holds all of it, as every process
  reads the same stream) on the mesh, split over data x fsdp: each device takes the rows
  its shard holds, whichever process it is on.

  Until 2026-12-04 each process passed rows ``[pid * n, (pid + 1) * n)``
  (``make_array_from_process_local_data``), which is the global batch only when the
  processes own separate blocks of the batch axis: a mesh whose batch axis is replicated
  across processes (``(1, 1, 4)`` over two hosts) got a global batch of B / 2 rows, filled
  differently by each process, and their "replicated" gradients drifted apart.
  """
  return {k: jax.make_array_from_callback(v.shape, setup.batch_sharding,
                                          lambda index, v=v: v[index])
          for k, v in batch.items()}
