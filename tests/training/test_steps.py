"""The train step against an independent computation: its loss, gradient norm
and SGD update equal those of a hand-written (label-smoothed) cross-entropy
over the whole batch, with and without gradient accumulation; a non-finite
step leaves parameters and optimizer state bitwise unchanged; dropout draws
depend on the step (the same step, the same draws) and the eval step turns
dropout off.

AdamW with clipping is invariant to a constant gradient scale, so these tests
use plain SGD (lr 1, no clipping, no momentum) and compare gradients, not
only losses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab.config import DataConfig, ModelConfig, TrainConfig
from attnlab.data import pipeline
from attnlab.training import sharding, steps

MCFG = ModelConfig(arch="encoder_decoder", d_model=32, num_layers=1, num_heads=2, d_ff=64,
                   pos="sinusoidal")
DCFG = DataConfig(task="reverse", seq_len=12, max_len=10, batch_size=8)
SGD = dict(optimizer="sgd", b1=0.0, learning_rate=1.0, schedule="constant", warmup_steps=0,
           grad_clip=0.0, steps=5)


@pytest.fixture(scope="module")
def batch():
  sources, _ = pipeline.build_sources(DCFG, MCFG)
  return next(pipeline.train_iterator(sources, DCFG))


def _host(tree):
  return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


def hand_loss(graphdef, rest, params, batch, eps, src_segments=False):
  """Mean over the counted tokens of -sum_v q_v log p_v, q = (1 - eps) one_hot + eps / V.
  The source is pad-masked (tokens equal to pad_id), or with ``src_segments`` masked by the
  batch's ``src_segment_ids_BS``."""
  model = nnx.merge(graphdef, params, rest)
  seg = dict(src_segment_ids_BS=jnp.asarray(batch["src_segment_ids_BS"])) if src_segments else {}
  logits_BTV = model(jnp.asarray(batch["src_BS"]), jnp.asarray(batch["tgt_in_BT"]),
                     tgt_segment_ids_BT=jnp.asarray(batch["tgt_segment_ids_BT"]), **seg)
  V = logits_BTV.shape[-1]
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  q_BTV = (1 - eps) * jax.nn.one_hot(batch["targets_BT"], V) + eps / V
  mask_BT = jnp.asarray(batch["loss_mask_BT"])
  return jnp.sum(-jnp.sum(q_BTV * logp_BTV, axis=-1) * mask_BT) / jnp.sum(mask_BT)


def global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("accum,eps", [(1, 0.0), (1, 0.1), (4, 0.1)])
def test_sgd_step_equals_hand_computed_smoothed_cross_entropy(batch, accum, eps):
  tcfg = TrainConfig(grad_accum=accum, label_smoothing=eps, **SGD)
  setup, state = steps.init_train(MCFG, tcfg, sharding.make_mesh((1, 1, 1)))
  before = _host(state["params"])
  # jit: op-by-op execution of the model and its gradient would compile every op separately.
  loss_fn = jax.jit(lambda params, eps: hand_loss(setup.graphdef, setup.rest, params, batch, eps))
  want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(before, eps)
  if eps:
    # The smoothing term is far above the tolerances: dropping it fails.
    plain = loss_fn(before, 0.0)
    assert abs(float(want_loss) - float(plain)) > 1e-2
  step = steps.make_train_step(setup, tcfg)
  state, m = step(state, steps.put_batch(batch, setup))
  np.testing.assert_allclose(float(m["loss"]), float(want_loss), rtol=1e-5)
  # The logged NLL (perplexity) is the unsmoothed mean, summed over the micro-batches too.
  np.testing.assert_allclose(float(m["nll"]), float(loss_fn(before, 0.0)), rtol=1e-5)
  assert float(m["tokens"]) == float(np.sum(batch["loss_mask_BT"]))
  np.testing.assert_allclose(float(m["grad_norm"]), float(global_norm(want_grads)), rtol=1e-4)
  after = _host(state["params"])
  # SGD, lr 1: the update is exactly minus the gradient of the batch mean.
  for a, b, g in zip(jax.tree.leaves(after), jax.tree.leaves(before),
                     jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a - b, -np.asarray(g), rtol=1e-3, atol=1e-6)


def test_nonfinite_step_leaves_params_and_optimizer_state_bitwise_unchanged(batch):
  tcfg = TrainConfig(steps=5, warmup_steps=0, schedule="constant", on_nonfinite="skip")
  setup, state = steps.init_train(MCFG, tcfg, sharding.make_mesh((1, 1, 1)))
  # The step counter is an int32 scalar from the start (a float32 one stops counting at
  # 2**24, and checkpoints would hold a float step).
  assert state["step"].dtype == jnp.int32 and state["step"].shape == () and state["step"] == 0
  step = steps.make_train_step(setup, tcfg)
  state, m = step(state, steps.put_batch(batch, setup))  # Adam moments become non-zero
  assert bool(m["finite"])
  good = _host(state)
  assert good["step"].dtype == np.int32 and good["step"] == 1
  bad_batch = dict(batch, loss_mask_BT=np.where(np.arange(batch["loss_mask_BT"].shape[1]) == 1,
                                                np.nan, batch["loss_mask_BT"]))
  state, m = step(state, steps.put_batch(bad_batch, setup))
  assert not bool(m["finite"]) and not np.isfinite(float(m["loss"]))
  after = _host(state)
  assert int(after["step"]) == int(good["step"]) + 1
  for part in ("params", "opt_state"):
    leaves_a, leaves_g = jax.tree.leaves(after[part]), jax.tree.leaves(good[part])
    assert len(leaves_a) == len(leaves_g) > 0
    for a, g in zip(leaves_a, leaves_g):
      np.testing.assert_array_equal(a, g, err_msg=part)
  # The next good step updates again.
  state, m = step(state, steps.put_batch(batch, setup))
  assert bool(m["finite"])
  assert any(not np.array_equal(a, g) for a, g in zip(jax.tree.leaves(_host(state["params"])),
                                                      jax.tree.leaves(good["params"])))


def test_the_logged_learning_rate_is_the_one_applied_after_a_skipped_step(batch):
  """A skipped step does not advance the optimizer's schedule; the logged rate is the rate
  the update used (SGD: the parameters move by exactly -rate x gradient), not the schedule
  at the loop's step."""
  tcfg = TrainConfig(**dict(SGD, warmup_steps=4, on_nonfinite="skip"))
  setup, state = steps.init_train(MCFG, tcfg, sharding.make_mesh((1, 1, 1)))
  step = steps.make_train_step(setup, tcfg)
  grad_fn = jax.jit(jax.grad(lambda p: hand_loss(setup.graphdef, setup.rest, p, batch, 0.0)))
  bad_batch = dict(batch, loss_mask_BT=batch["loss_mask_BT"] * np.nan)
  logged = []
  for b in (batch, bad_batch, batch, batch):
    before = _host(state["params"])
    state, m = step(state, steps.put_batch(b, setup))
    logged.append(float(m["learning_rate"]))
  # warmup 0 -> 1 over 4 updates; the skipped second step leaves the third at update 1
  np.testing.assert_allclose(logged, [0.0, 0.25, 0.25, 0.5], rtol=1e-6)
  want = jax.tree.map(lambda p, g: p - logged[-1] * np.asarray(g), before, grad_fn(before))
  for a, w in zip(jax.tree.leaves(_host(state["params"])), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-6)


@jax.custom_vjp
def _infinite_gradient(x):
  return x


_infinite_gradient.defvjp(lambda x: (x, None), lambda _, g: (g * jnp.inf,))


def test_finite_loss_with_an_infinite_gradient_is_not_applied(monkeypatch, batch):
  """Both must be finite: a step whose loss is finite but whose gradient is not
  (here the logits' gradient is made infinite) leaves the state unchanged."""
  logits = steps.model_logits
  monkeypatch.setattr(steps, "model_logits", lambda m, b: _infinite_gradient(logits(m, b)))
  tcfg = TrainConfig(steps=5, warmup_steps=0, schedule="constant", on_nonfinite="skip")
  setup, state = steps.init_train(MCFG, tcfg, sharding.make_mesh((1, 1, 1)))
  before = _host(state["params"])
  state, m = steps.make_train_step(setup, tcfg)(state, steps.put_batch(batch, setup))
  assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
  assert not bool(m["finite"])
  for a, b in zip(jax.tree.leaves(_host(state["params"])), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(a, b)


def test_dropout_draws_depend_on_the_step_and_eval_turns_dropout_off(batch):
  mcfg = MCFG.replace(dropout_rate=0.3)
  tcfg = TrainConfig(**SGD)
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  initial = _host(state)
  step = steps.make_train_step(setup, tcfg)

  def one_step(step_number):
    state = jax.device_put(dict(initial, step=np.int32(step_number)), setup.state_shardings)
    state, m = step(state, steps.put_batch(batch, setup))
    return jax.tree.leaves(_host(state["params"])), float(m["loss"])

  p3, loss3 = one_step(3)
  p3_again, loss3_again = one_step(3)
  p4, loss4 = one_step(4)
  # The same step draws the same masks (a resumed run repeats them); another
  # step draws others.
  assert loss3 == loss3_again and loss3 != loss4
  assert all(np.array_equal(a, b) for a, b in zip(p3, p3_again))
  assert not all(np.array_equal(a, b) for a, b in zip(p3, p4))
  # The eval step: the plain NLL sum of the deterministic model.
  params = jax.device_put(initial["params"], setup.state_shardings["params"])
  nll_sum, weight = steps.make_eval_step(setup)(params, steps.put_batch(batch, setup))
  model = nnx.merge(setup.graphdef, initial["params"], setup.rest)
  model.eval()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  assert float(weight) == float(np.sum(batch["loss_mask_BT"]))
  want = jax.jit(lambda params: hand_loss(graphdef, rest, params, batch, 0.0))(params)
  np.testing.assert_allclose(float(nll_sum) / float(weight), float(want), rtol=1e-5)


def test_a_source_token_with_the_pad_id_is_seen_by_the_encoder(batch):
  """The steps mask the source by the batch's ``src_segment_ids_BS`` (the pipeline's, from the
  lengths), not by comparing tokens with pad_id: a tokenizer.json may give a real token the
  pad id (0 is "!" in GPT-2's), and pad-masking hid it from the encoder and the
  cross-attention. Reference: the model given the batch's segment ids by hand; the same
  batch pad-masked gives another loss. (Both steps build their logits with
  ``model_logits``; the eval step's is checked.)"""
  # Every row's first source token, a real one (segment 1), given the pad id.
  assert (batch["src_segment_ids_BS"][:, 0] == 1).all()
  assert (batch["src_BS"][:, 0] != MCFG.pad_id).all()
  src_BS = batch["src_BS"].copy()
  src_BS[:, 0] = MCFG.pad_id
  pad_batch = dict(batch, src_BS=src_BS)
  setup, state = steps.init_train(MCFG, TrainConfig(**SGD), sharding.make_mesh((1, 1, 1)))
  hand = jax.jit(lambda params, segments: hand_loss(setup.graphdef, setup.rest, params,
                                                    pad_batch, 0.0, segments),
                 static_argnums=1)
  params = _host(state["params"])
  want = float(hand(params, True))
  assert abs(want - float(hand(params, False))) > 1e-3  # the masking matters to the loss
  nll_sum, weight = steps.make_eval_step(setup)(state["params"],
                                                steps.put_batch(pad_batch, setup))
  np.testing.assert_allclose(float(nll_sum) / float(weight), want, rtol=1e-5)


def test_decoder_only_step_on_packed_documents_equals_hand_computed_loss(tmp_path):
  """A decoder-only LM batch packs several documents per row: the train and eval steps
  must pass their positions (restarting per document) and segment ids to the model. Then
  the same programs on a batch that counts one token and on one that counts none (the
  division by the token count)."""
  for i in range(6):
    (tmp_path / f"d{i}.py").write_text(f"x{i} = {i}\n" * (i + 1))  # documents of 7..42 bytes
  # Absolute (sinusoidal) positions: under RoPE, positions that restart per document and
  # positions that do not give the same attention within a document.
  mcfg = ModelConfig(arch="decoder_only", d_model=32, num_layers=1, num_heads=2, d_ff=64,
                     pos="sinusoidal")
  dcfg = DataConfig(task="lm", paths=(str(tmp_path / "*.py"),), seq_len=32, batch_size=4,
                    validation_percent=0)
  sources, _ = pipeline.build_sources(dcfg, mcfg)
  lm_batch = next(pipeline.train_iterator(sources, dcfg))
  assert (lm_batch["segment_ids_BT"].max(axis=1) > 1).any()  # packed: a row holds 2+ documents
  tcfg = TrainConfig(**SGD)
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  params = _host(state["params"])

  @functools.partial(jax.jit, static_argnums=1)
  def hand(params, packed):
    model = nnx.merge(setup.graphdef, params, setup.rest)
    kw = (dict(positions_BT=jnp.asarray(lm_batch["positions_BT"]),
               segment_ids_BT=jnp.asarray(lm_batch["segment_ids_BT"])) if packed else {})
    logp_BTV = jax.nn.log_softmax(model(jnp.asarray(lm_batch["tokens_BT"]), **kw), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, jnp.asarray(lm_batch["targets_BT"])[..., None],
                                  axis=-1)[..., 0]
    mask_BT = jnp.asarray(lm_batch["loss_mask_BT"])
    return jnp.sum(nll_BT * mask_BT) / jnp.sum(mask_BT)

  want = float(hand(params, True))
  assert abs(want - float(hand(params, False))) > 1e-3  # the packing matters to the loss
  eval_step, train_step = steps.make_eval_step(setup), steps.make_train_step(setup, tcfg)
  nll_sum, weight = eval_step(state["params"], steps.put_batch(lm_batch, setup))
  np.testing.assert_allclose(float(nll_sum) / float(weight), want, rtol=1e-5)
  state, m = train_step(state, steps.put_batch(lm_batch, setup))
  np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)
  # A batch that counts one token: the step's loss is that token's NLL (the eval step's,
  # checked above), not divided by more; only a count of 0 is raised (to 1), and a batch
  # counting none takes a finite step of loss 0.
  one_BT = np.zeros_like(lm_batch["loss_mask_BT"])
  one_BT.flat[np.flatnonzero(lm_batch["loss_mask_BT"])[0]] = 1.0
  one_batch = dict(lm_batch, loss_mask_BT=one_BT)
  nll_sum, weight = eval_step(state["params"], steps.put_batch(one_batch, setup))
  assert float(weight) == 1.0
  state, m = train_step(state, steps.put_batch(one_batch, setup))
  np.testing.assert_allclose(float(m["loss"]), float(nll_sum), rtol=1e-5)
  none_batch = dict(lm_batch, loss_mask_BT=np.zeros_like(one_BT))
  _, m = train_step(state, steps.put_batch(none_batch, setup))
  assert bool(m["finite"]) and float(m["loss"]) == 0.0 and float(m["tokens"]) == 0.0


def test_every_dropout_stream_gets_its_own_key():
  """``with_dropout_key`` keys every RNG stream of the model differently (fold_in(key, i)):
  two streams with one key would draw the same masks in different layers."""
  mcfg = MCFG.replace(dropout_rate=0.3, num_layers=2)
  setup, _ = steps.init_train(mcfg, TrainConfig(**SGD), sharding.make_mesh((1, 1, 1)))

  def stream_keys(key):
    rest = steps.with_dropout_key(setup.rest, key)
    is_key = lambda x: isinstance(x, nnx.RngKey)
    return [np.asarray(jax.random.key_data(v.get_value())).tobytes()
            for v in jax.tree.leaves(rest, is_leaf=is_key) if is_key(v)]

  keys = stream_keys(jax.random.key(3))
  assert len(keys) >= 4 and len(set(keys)) == len(keys)
  assert stream_keys(jax.random.key(3)) == keys  # the same key, the same streams


def test_model_rngs_take_every_seed_and_keep_seeds_apart():
  """The dropout stream is folded out of the seed's own key: the largest seed builds (the
  int seed + 1 overflowed), seed s's dropout key is not seed s + 1's parameter key, and
  every bit of a seed counts (2**32 + 5 was seed 5)."""
  from attnlab.config import MAX_SEED, seed_key
  from attnlab.training.steps import model_rngs

  data = lambda stream: np.asarray(jax.random.key_data(stream.key[...]))  # its base key
  seeds = (0, 1, 5, 2**32 + 5, MAX_SEED)
  for seed in seeds:
    rngs = model_rngs(seed)
    np.testing.assert_array_equal(data(rngs.params), jax.random.key_data(seed_key(seed)))
    np.testing.assert_array_equal(data(rngs.dropout),
                                  jax.random.key_data(jax.random.fold_in(seed_key(seed), 1)))
  streams = [data(getattr(model_rngs(s), name)).tobytes() for s in seeds
             for name in ("params", "dropout")]
  assert len(set(streams)) == len(streams)
  # A seed below 2**32 keeps the key it had: jax.random.key(seed).
  np.testing.assert_array_equal(data(model_rngs(5).params),
                                jax.random.key_data(jax.random.key(5)))


def test_the_schedule_is_built_for_the_models_width():
  """``init_train`` builds the optimizer for the model's ``d_model``, which the paper's
  inverse_sqrt schedule reads: lr * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5) at s =
  count + 1, by hand for d_model 32 (the other schedules do not read it)."""
  tcfg = TrainConfig(schedule="inverse_sqrt", learning_rate=2.0, warmup_steps=3, steps=5)
  setup, _ = steps.init_train(MCFG, tcfg, sharding.make_mesh((1, 1, 1)))
  for count in range(6):
    s = count + 1
    want = 2.0 * MCFG.d_model ** -0.5 * min(s ** -0.5, s * 3 ** -1.5)
    np.testing.assert_allclose(float(setup.schedule(count)), want, rtol=1e-6)


def test_each_accumulated_micro_batch_draws_its_own_dropout_masks(batch):
  """Gradient accumulation keys micro-batch i's dropout with ``fold_in(key, i)``: with A
  identical micro-batches the step's loss is the mean of A differently dropped-out losses
  (built here by hand), not A copies of one. Catches one key reused for every micro-batch
  (the step's loss would then be a single micro-batch's)."""
  from attnlab.config import seed_key

  accum, tcfg_kw = 4, dict(SGD, seed=7)
  mcfg = MCFG.replace(dropout_rate=0.3)
  tcfg = TrainConfig(grad_accum=accum, **tcfg_kw)
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  params = _host(state["params"])
  # Micro-batch i takes rows i, i + A: rows 0..A-1 all row 0, rows A..2A-1 all row 1 make
  # every micro-batch rows (0, 1).
  rows = np.repeat(np.arange(2), accum)
  same = {k: v[rows] for k, v in batch.items()}
  micro = {k: v[:2] for k, v in batch.items()}
  key = jax.random.fold_in(seed_key(tcfg.seed), 0)  # the step's key at step 0

  @jax.jit
  def micro_loss(params, key):
    return hand_loss(setup.graphdef, steps.with_dropout_key(setup.rest, key), params, micro, 0.0)

  per_micro = [float(micro_loss(params, jax.random.fold_in(key, i))) for i in range(accum)]
  assert len(set(per_micro)) == accum  # dropout is on: every key draws other masks
  _, m = steps.make_train_step(setup, tcfg)(state, steps.put_batch(same, setup))
  # Equal micro-batches count equal tokens: the step's loss is the mean of theirs.
  np.testing.assert_allclose(float(m["loss"]), np.mean(per_micro), rtol=1e-5)
  assert abs(float(m["loss"]) - float(micro_loss(params, key))) > 1e-4


def test_bfloat16_parameters_accumulate_micro_batch_gradients_in_float32(batch):
  """With bfloat16 parameters each micro-batch's gradient is bfloat16; their sum, the
  division by the token count and the logged norm are float32 (until 2026-12-04 they were
  summed in bfloat16, 8 bits of mantissa: the norm and the update off by ~1e-3). Reference:
  the per-micro-batch (per-row) gradients summed in float64."""
  mcfg = MCFG.replace(param_dtype="bfloat16")
  accum = 8  # one row per micro-batch
  tcfg = TrainConfig(grad_accum=accum, **SGD)
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  before = _host(state["params"])
  assert {x.dtype.name for x in jax.tree.leaves(before)} == {"bfloat16"}

  def row_loss_sum(params, rows):
    return hand_loss(setup.graphdef, setup.rest, params, rows, 0.0) * jnp.sum(
        rows["loss_mask_BT"])

  # The row is an argument (one compiled gradient for every row, not one per row).
  grad_fn = jax.jit(jax.grad(row_loss_sum))
  total = None
  for row in range(accum):
    rows = {k: v[row:row + 1] for k, v in batch.items()}
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), _host(grad_fn(before, rows)))
    total = g if total is None else jax.tree.map(np.add, total, g)
  want = jax.tree.map(lambda x: x / np.sum(batch["loss_mask_BT"]), total)
  want_norm = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(want)))
  state, m = steps.make_train_step(setup, tcfg)(state, steps.put_batch(batch, setup))
  np.testing.assert_allclose(float(m["grad_norm"]), want_norm, rtol=1e-4)
  # SGD, lr 1: after = bfloat16(before - gradient), the difference in float32 (the optimizer
  # updates bfloat16 parameters in float32: until 2026-12-07 the gradient was rounded to
  # bfloat16 first), element for element but for the few whose float32 sum rounds the
  # other way from the float64 one.
  after = _host(state["params"])
  mismatched = total_size = 0
  for a, b, g in zip(jax.tree.leaves(after), jax.tree.leaves(before), jax.tree.leaves(want)):
    # NumPy's bfloat16 (ml_dtypes) rounds to nearest even, as XLA does.
    expect = (b.astype(np.float32) - np.asarray(g, np.float32)).astype(jnp.bfloat16)
    mismatched += int(np.sum(a != expect))
    total_size += a.size
  assert mismatched <= 0.002 * total_size, (mismatched, total_size)


def test_bfloat16_parameters_without_accumulation_divide_and_measure_in_float32(batch):
  """grad_accum=1: the bfloat16 gradient of the batch's loss sum is divided by the token
  count and measured for grad_norm in float32, before the optimizer gets it back in
  bfloat16 (measured after that cast, the norm is ~5e-3 off). Reference: the same gradient
  divided in float64."""
  mcfg = MCFG.replace(param_dtype="bfloat16")
  tcfg = TrainConfig(grad_accum=1, **SGD)
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  before = _host(state["params"])
  weight = float(np.sum(batch["loss_mask_BT"]))
  loss_sum = lambda p: hand_loss(setup.graphdef, setup.rest, p, batch, 0.0) * weight
  grads = _host(jax.jit(jax.grad(loss_sum))(before))
  assert {g.dtype.name for g in jax.tree.leaves(grads)} == {"bfloat16"}
  want_norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64) / weight))
                          for g in jax.tree.leaves(grads)))
  _, m = steps.make_train_step(setup, tcfg)(state, steps.put_batch(batch, setup))
  np.testing.assert_allclose(float(m["grad_norm"]), want_norm, rtol=1e-4)


def test_float16_parameters_take_adamw_steps_with_float32_state(batch):
  """float16 cannot hold Adam's state (eps=1e-9 rounds to 0, small gradients square to 0,
  a parameter with no gradient divides 0 by 0): until 2026-12-05 every AdamW update of
  float16 parameters was non-finite and a run stopped at step 1. The state is float32 now.
  Reference: AdamW's first step (weight decay 0) moves each parameter by -lr * g / (|g| +
  eps) (-lr * sign(g) where |g| >> eps) and leaves one with g = 0 where it was; float16
  rounds the result to within an ulp."""
  mcfg = MCFG.replace(param_dtype="float16")
  tcfg = TrainConfig(optimizer="adamw", learning_rate=1e-2, schedule="constant",
                     warmup_steps=0, weight_decay=0.0, grad_clip=0.0, steps=5)
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  before = _host(state["params"])
  assert {x.dtype.name for x in jax.tree.leaves(before)} == {"float16"}
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0]
  assert moments and {x.dtype.name for x in moments} == {"float32"}
  grads = _host(jax.jit(jax.grad(functools.partial(hand_loss, setup.graphdef, setup.rest)),
                        static_argnums=(1, 2))(
      jax.tree.map(lambda x: x.astype(jnp.float32), state["params"]),
      _Frozen(batch), 0.0))
  step = steps.make_train_step(setup, tcfg)
  state, m = step(state, steps.put_batch(batch, setup))
  assert bool(m["finite"])
  after = _host(state["params"])
  checked = 0
  for a, b, g in zip(jax.tree.leaves(after), jax.tree.leaves(before), jax.tree.leaves(grads)):
    assert np.isfinite(a).all()
    big = np.abs(g) > 1e-3 * np.abs(g).max()  # float16 rounding cannot flip their sign
    expect = (b.astype(np.float32) - 1e-2 * g / (np.abs(g) + 1e-9)).astype(np.float16)
    ulps = np.abs(a[big].astype(np.float32) - expect[big]) / np.spacing(expect[big])
    assert ulps.max() <= 1, ulps.max()
    assert (a[g == 0] == b[g == 0]).all()
    checked += int(big.sum())
  assert checked > 1000
  for _ in range(3):
    state, m = step(state, steps.put_batch(batch, setup))
    assert bool(m["finite"])
  # A finite float32 update that overflows float16 when added: not applied (the float16
  # update was inf before in_float32; a review found the overflow applied in between).
  tcfg = TrainConfig(optimizer="sgd", b1=0.0, learning_rate=1e7, schedule="constant",
                     warmup_steps=0, grad_clip=0.0, steps=5)
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  before = _host(state["params"])
  state, m = steps.make_train_step(setup, tcfg)(state, steps.put_batch(batch, setup))
  assert not bool(m["finite"])
  for a, b in zip(jax.tree.leaves(_host(state["params"])), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)


def test_gradient_scale_keeps_a_micro_batch_sum_under_4096_tokens():
  scales = {n: steps.gradient_scale(n) for n in (1, 4096, 4097, 8192, 8193, 2**19)}
  assert scales == {1: 1.0, 4096: 1.0, 4097: 0.5, 8192: 0.5, 8193: 0.25, 2**19: 2.0**-7}


@pytest.mark.parametrize("param_dtype, dtype", [("float16", "float32"), ("float32", "float16")])
def test_float16_gradients_of_a_large_batch_stay_finite(param_dtype, dtype, monkeypatch):
  """A micro-batch's float16 weight gradients summed the loss's gradient over all its tokens:
  past float16's 65504 with enough tokens, and every step non-finite (until 2026-12-07
  at ~260K tokens a micro-batch for a small model). Here 16K tokens of one repeated
  sequence, with a final norm's scale of 16, sum ~1e5 in the output projection's gradient.
  Reference: the float32 model's step on the same batch (the gradient norm, which a
  power-of-two scale leaves unchanged there)."""
  mcfg = ModelConfig(arch="decoder_only", vocab_size=16, d_model=16, num_layers=1,
                     num_heads=2, d_ff=32, max_len=128)
  B, T = 128, 128
  tokens = np.tile(np.arange(T + 1, dtype=np.int32) % 16, (B, 1))
  batch = {"tokens_BT": tokens[:, :-1], "targets_BT": tokens[:, 1:],
           "positions_BT": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
           "segment_ids_BT": np.ones((B, T), np.int32),
           "loss_mask_BT": np.ones((B, T), np.float32)}
  tcfg = TrainConfig(**SGD)

  def final_norm_times_16(path, x):
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return x * 16 if keys[-2:] == ["norm", "scale"] else x

  def step(pd, cd, check=False):
    setup, state = steps.init_train(mcfg.replace(param_dtype=pd, dtype=cd), tcfg,
                                    sharding.make_mesh((1, 1, 1)))
    state["params"] = jax.tree_util.tree_map_with_path(final_norm_times_16, state["params"])
    if check:  # the float32 step's gradient (scaled by 1/4 and back) against the plain mean's
      def mean_loss(params):
        logits_BTV = steps.model_logits(nnx.merge(setup.graphdef, params, setup.rest), batch)
        logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp_BTV, batch["targets_BT"][..., None], -1))

      want_norm = float(global_norm(jax.jit(jax.grad(mean_loss))(state["params"])))
    m = steps.make_train_step(setup, tcfg)(state, steps.put_batch(batch, setup))[1]
    if check:
      assert steps.gradient_scale(B * T) == 0.25
      np.testing.assert_allclose(float(m["grad_norm"]), want_norm, rtol=1e-5)
    return m

  want, got = step("float32", "float32", check=True), step(param_dtype, dtype)
  assert bool(want["finite"]) and bool(got["finite"])
  np.testing.assert_allclose(float(got["grad_norm"]), float(want["grad_norm"]), rtol=2e-2)
  # The whole sum, as differentiated before: non-finite.
  monkeypatch.setattr(steps, "gradient_scale", lambda num_tokens: 1.0)
  assert not bool(step(param_dtype, dtype)["finite"])


class _Frozen(dict):
  """A batch as a hashable static argument (its identity)."""
  __hash__ = object.__hash__


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_abstract_state_initializes_lazily_as_the_eager_one(optimizer):
  """A resume makes the state abstract (``init_train(abstract=True)``) and initializes only
  what its checkpoint lacks: ``init_params`` gives the parameters the eager initialization
  does, and ``fresh_rest`` (a weights-only checkpoint's optimizer state and step) what the
  eager one gives, placed as the setup says, for bfloat16 parameters (float32 moments) too;
  the RNG variables of both setups agree."""
  mcfg = MCFG.replace(param_dtype="bfloat16", dropout_rate=0.1)
  tcfg = TrainConfig(optimizer=optimizer, b1=0.9, seed=3)
  mesh = sharding.make_mesh((1, 1, 1))
  eager_setup, eager = steps.init_train(mcfg, tcfg, mesh)
  setup, abstract = steps.init_train(mcfg, tcfg, mesh, abstract=True)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
  params = steps.init_params(mcfg, tcfg, setup)
  lazy = {"params": params, **setup.fresh_rest(params)}
  assert jax.tree.structure(lazy) == jax.tree.structure(eager)
  for a, b, want in zip(jax.tree.leaves(lazy), jax.tree.leaves(eager),
                        jax.tree.leaves(abstract), strict=True):
    assert a.dtype == b.dtype == want.dtype and a.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(np.asarray(x).any() for x in jax.tree.leaves(params))
  # A fresh optimizer state: every moment and count zero (adamw's mu, nu, sgd's trace), step 0.
  assert int(lazy["step"]) == 0 and lazy["step"].dtype == np.int32
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(lazy["opt_state"]))
  assert jax.tree.structure(lazy["opt_state"]) == jax.tree.structure(setup.tx.init(params))
  keys = lambda rest: [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(rest)]
  assert len(keys(setup.rest)) > 0
  for a, b in zip(keys(setup.rest), keys(eager_setup.rest), strict=True):
    np.testing.assert_array_equal(a, b)
