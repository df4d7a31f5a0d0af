"""The training loop: data, steps, metrics, evaluation, checkpoints, signals.

``train(...)`` resumes from the newest readable checkpoint in the workdir,
runs to ``TrainConfig.steps`` and checkpoints every ``checkpoint_every``
steps, at the end, and when SIGTERM / SIGINT arrive during the steps (then it
returns normally with ``step`` < ``TrainConfig.steps``, and ``attnlab train`` exits
75, ``commands.EXIT_STOPPED``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import signal
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from attnlab import config_gin as gin_config
from attnlab import extras
from attnlab.config import DataConfig, DecodeConfig, ModelConfig, TrainConfig
from attnlab.data import pipeline
from attnlab.decoding.generate import length_penalty_for
from attnlab.nn.transformer import count_params
from attnlab.training import evaluate as eval_lib
from attnlab.training import optim
from attnlab.training import sharding as shd
from attnlab.training import steps as steps_lib
from attnlab.training.checkpoint import (
  Checkpointer,
  UnreadableCheckpointError,
  abstract_model,
  cause_in_chain,
  has_saved_steps,
  workdir_config,
)
from attnlab.training.metrics import (  # write_text_atomically: trainer's name too
  WINDOW_HOLDS_COMPILE,
  MetricsWriter,
  perplexity,
  write_text_atomically,
)

log = logging.getLogger(__name__)

# Fault-injection hook for tests: sleep this long after every step, so a
# signal can arrive mid-run.
STEP_SLEEP_ENV = "ATTNLAB_TEST_STEP_SLEEP"


def predictions_path(workdir: str, step: int, beam_size: int | None = None,
                     length_penalty: float = DecodeConfig.length_penalty) -> str:
  """Where the decoded validation examples of a seq2seq eval at ``step`` go (greedy, or
  beam search of ``beam_size`` with that length penalty)."""
  beam = "" if beam_size is None else f"_beam{beam_size}_lp{length_penalty:g}"
  return os.path.join(workdir, "eval", f"predictions_{step}{beam}.jsonl")


def _log_line(step: int, total: int, m: dict) -> str:
  """The plain progress line (stderr without a TTY): step, loss, throughput."""
  return (f"train step {step}/{total}: loss {m['loss']:.4f}, perplexity {m['perplexity']:.2f}, "
          f"lr {m['learning_rate']:.3g}, {m['tokens_per_s']:.0f} tokens/s")


class NonFiniteError(RuntimeError):
  """The loss or gradient became NaN / Inf and on_nonfinite='stop'."""


class SaveError(RuntimeError):
  """A checkpoint could not be saved (a full disk, say): the run stops, and the message
  names the checkpoint the same command resumes from."""


class WriteError(SaveError):
  """Another file of the run could not be written (its config.gin, metrics.jsonl or
  TensorBoard events: a full disk, a directory in a file's place): the run stops (after
  saving the step it reached, where it can), and the message names the checkpoint the same
  command resumes from."""


class ResumeError(ValueError):
  """The workdir's checkpoints do not fit the model of the run resuming in it."""


class SetupError(ValueError):
  """The run cannot start with its config and data (found before anything is written)."""


def _too_large(mcfg: ModelConfig, tcfg: TrainConfig, error: str) -> str:
  """Why the training state did not fit (a traceback from inside JAX until 2026-12-06):
  the parameter count and bytes, with the optimizer's moments, and the sizes that make them."""
  from flax import nnx

  model = abstract_model(mcfg)
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  count = count_params(model)
  moments = 1 if tcfg.optimizer == "sgd" else 2  # momentum; Adam's m and v
  # The moments in the dtype the optimizer updates in (float32 for float16 / bfloat16
  # parameters: counted at the parameters' itemsize until 2026-12-07).
  nbytes = sum(x.size * (x.dtype.itemsize
                         + moments * np.dtype(optim.update_dtype(x.dtype)).itemsize)
               for x in params)
  first = error.strip().splitlines()[0][:200]
  return (f"the training state does not fit in memory ({first}): {count:,} parameters, "
          f"{nbytes / 2**30:.1f} GiB with the optimizer's moments (ModelConfig vocab_size="
          f"{mcfg.vocab_size}, d_model={mcfg.d_model}, d_ff={mcfg.d_ff}, num_layers="
          f"{mcfg.num_layers}, max_len={mcfg.max_len}); make the model smaller or shard it "
          "over more devices (TrainConfig.mesh_shape)")


def _saved_configs(workdir: str):
  """(ModelConfig, DataConfig, TrainConfig) of the workdir's config.gin, the run that wrote
  its checkpoints; None when there is none to read (nothing to compare with)."""
  try:
    return gin_config.read_workdir_config(os.path.join(workdir, "config.gin"))
  except Exception:  # noqa: BLE001 - no or unreadable config.gin
    return None


# ModelConfig fields a resume may change: how the same function of the same parameters is
# computed (the attention implementation, rematerialization, the compute dtype, the
# parameters' dtype: a restore casts them), the training-only dropout, and max_len (a
# learned position table's shape is checked with the other shapes). Any other field
# changes the model the checkpoints were trained as.
RESUMABLE_MODEL_FIELDS = ("attention_impl", "remat", "dtype", "param_dtype", "dropout_rate",
                          "attention_dropout_rate", "max_len")


def _model_field_changes(saved: ModelConfig, mcfg: ModelConfig, skip=()) -> list[str]:
  """['ModelConfig.x: a -> b', ...] for the fields (but ``skip``) that differ, each spelled
  one way: the three bias switches as the biases they give (``qkv_bias=None`` under
  ``use_bias=False`` is ``qkv_bias=False``), ``use_bias`` itself left out."""
  def fields(cfg):
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
           if f.name not in skip and f.name != "use_bias"}
    out.update(qkv_bias=cfg.has_bias("qkv"), o_bias=cfg.has_bias("o"),
               mlp_bias=cfg.has_bias("mlp"))
    return out

  was, now = fields(saved), fields(mcfg)
  return [f"ModelConfig.{name}: {was[name]!r} -> {now[name]!r}" for name in was
          if was[name] != now[name]]


def _model_changes(workdir: str, mcfg: ModelConfig, tcfg: TrainConfig) -> str:
  """' (ModelConfig.x: a -> b, ..., TrainConfig.optimizer: a -> b)' against the
  workdir's config.gin: the fields that shape the saved state; or ''."""
  saved = _saved_configs(workdir)
  if saved is None:
    return ""
  changed = _model_field_changes(saved[0], mcfg)
  saved_t = saved[2]
  if saved_t.optimizer != tcfg.optimizer:
    changed.append(f"TrainConfig.optimizer: {saved_t.optimizer!r} -> {tcfg.optimizer!r}")
  if (saved_t.grad_clip > 0) != (tcfg.grad_clip > 0):  # clipping is a step of the chain
    changed.append(f"TrainConfig.grad_clip: {saved_t.grad_clip!r} -> {tcfg.grad_clip!r}")
  return f" ({', '.join(changed)})" if changed else ""


def _other_model(workdir: str, mcfg: ModelConfig) -> list[str]:
  """The fields outside RESUMABLE_MODEL_FIELDS in which ``mcfg`` differs from the
  workdir's config.gin (``_model_field_changes``; none when there is none to read)."""
  saved = _saved_configs(workdir)
  return [] if saved is None else _model_field_changes(saved[0], mcfg, RESUMABLE_MODEL_FIELDS)


def _saved_data_config(workdir: str) -> DataConfig | None:
  """The DataConfig of the workdir's config.gin (the run that wrote its checkpoints),
  or None when there is none to read (old data states then stay unchecked)."""
  saved = _saved_configs(workdir)
  return None if saved is None else saved[1]


SCHEDULE_FIELDS = ("schedule", "learning_rate", "warmup_steps", "steps", "min_lr_ratio")


def _checkpoint_train_config(workdir: str, tcfg: TrainConfig, meta: dict) -> TrainConfig | None:
  """The TrainConfig's seed and schedule that checkpoint ``meta`` was trained under (the rest
  ``tcfg``'s): its meta's ``seed`` and ``schedule`` (kept since 2026-12-06), else the
  workdir's config.gin (None without one). A launch writes config.gin before it trains, so
  one that died before its first save left a config.gin no checkpoint was trained under: the
  resume warnings compared against it until 2026-12-06 (a false warning, or none)."""
  schedule = meta.get("schedule")
  if isinstance(schedule, dict) and set(schedule) == set(SCHEDULE_FIELDS) and "seed" in meta:
    return tcfg.replace(seed=meta["seed"], **schedule)
  configs = _saved_configs(workdir)
  return None if configs is None else configs[2]


def _warn_schedule_change(saved: TrainConfig | None, tcfg: TrainConfig, d_model: int,
                          opt_state) -> None:
  """Warn when a resumed run's learning rate is not the one its checkpoint was headed for
  (``saved``: ``_checkpoint_train_config``): the schedule's fields changed (a cosine decays
  over ``TrainConfig.steps``, so training a run further moves its rate), which a run of the
  new config from step 0 would not see."""
  if saved is None:
    return
  changed = [f"TrainConfig.{f}: {getattr(saved, f)!r} -> {getattr(tcfg, f)!r}"
             for f in SCHEDULE_FIELDS if getattr(saved, f) != getattr(tcfg, f)]
  if not changed:
    return
  count = _replicated_int(optim.schedule_count(opt_state))
  before = float(optim.make_schedule(saved, d_model)(count))
  after = float(optim.make_schedule(tcfg, d_model)(count))
  if not math.isclose(before, after, rel_tol=1e-6, abs_tol=0.0):
    log.warning("the learning rate at update %d is now %.4g, not %.4g (%s): the resumed run "
                "follows the new schedule from here, unlike a run of this config from step 0",
                count, after, before, ", ".join(changed))


def _warn_seed_change(saved: TrainConfig | None, tcfg: TrainConfig) -> None:
  """Warn when a run resumes under another ``TrainConfig.seed`` than its checkpoint's
  (``saved``: ``_checkpoint_train_config``): its parameters came from the saved seed, its
  dropout draws follow the new one from here, and the config.gin it writes names the new
  seed, so a run of that file from step 0 is another run (resumed without a word until
  2026-12-06)."""
  if saved is not None and saved.seed != tcfg.seed:
    log.warning("TrainConfig.seed: %d -> %d: the resumed run keeps the parameters that seed %d "
                "began and draws its dropout from seed %d from here, unlike a run of this "
                "config from step 0", saved.seed, tcfg.seed, saved.seed, tcfg.seed)


def _warn_schedule_surprises(tcfg: TrainConfig, d_model: int) -> None:
  """Warn about a schedule that does not do what its numbers suggest (silent until
  2026-12-04): a warmup longer than the run (the rate rises to its last update), and an
  inverse_sqrt ``learning_rate`` below 0.01 (it multiplies the paper's formula: the default
  1e-3 gives a peak 1000x below the paper's)."""
  schedule = optim.make_schedule(tcfg, d_model)
  # The update count at which the rate peaks: warmup_steps for the linear warmups (read
  # from count 0), warmup_steps - 1 for inverse_sqrt (read at count + 1).
  peak_count = tcfg.warmup_steps - (tcfg.schedule == "inverse_sqrt")
  if peak_count > tcfg.steps - 1:
    log.warning("TrainConfig.warmup_steps=%d with steps=%d: the learning rate rises for the "
                "whole run and never reaches its peak (the last update's is %.4g)",
                tcfg.warmup_steps, tcfg.steps, float(schedule(tcfg.steps - 1)))
  if tcfg.schedule == "inverse_sqrt" and tcfg.learning_rate < 0.01:
    peak = float(schedule(peak_count))  # inverse_sqrt has warmup_steps >= 1
    log.warning("schedule='inverse_sqrt' peaks at %.3g: TrainConfig.learning_rate=%g "
                "multiplies the paper's d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) "
                "(1.0 is the paper's schedule, a peak of %.3g here)", peak, tcfg.learning_rate,
                peak / tcfg.learning_rate)


class StopFlag:
  """Turns SIGTERM / SIGINT into "checkpoint and stop" at the next step.

  Flags nest (a sweep's around each run's training): a signal sets the inner flag and
  every flag around it, and an inner flag entered after a signal starts set, so a signal
  that arrives while a sweep sets up or measures a run stops the training too.
  """

  def __init__(self):
    self.signum = None
    self._old = {}
    self._outer = None
    self._off_main = False

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      # Python delivers signals to the main thread alone, and only it may set handlers: the
      # work runs on, and is not stopped at a step (said since 2026-12-07's review), once
      # for the outermost flag of the thread (a sweep's, not each run's again).
      if not getattr(_OFF_MAIN, "depth", 0):
        log.warning("training in a thread other than the main one: SIGTERM and Ctrl-C do not "
                    "stop it at a step with a checkpoint (exit 75) as they do in the main "
                    "thread; it saves its checkpoints as TrainConfig.checkpoint_every says")
      _OFF_MAIN.depth = getattr(_OFF_MAIN, "depth", 0) + 1
      self._off_main = True
      return self
    for sig in (signal.SIGTERM, signal.SIGINT):
      with contextlib.suppress(ValueError):  # (a subinterpreter: no handlers there either)
        self._old[sig] = old = signal.signal(sig, self._handle)
        outer = getattr(old, "__self__", None)
        if isinstance(outer, StopFlag):
          self._outer = outer
          self.signum = self.signum or outer.signum
    return self

  def _handle(self, signum, frame):
    self.signum = signum
    if self._outer is not None:
      self._outer._handle(signum, frame)

  def __exit__(self, *exc):
    if self._off_main:
      _OFF_MAIN.depth -= 1
    for sig, old in self._old.items():
      signal.signal(sig, old)


_OFF_MAIN = threading.local()  # ``depth``: StopFlags entered in this thread, not the main one


def check_batch_layout(tcfg: TrainConfig, dcfg: DataConfig, mesh) -> None:
  """A MeshShapeError (the mesh is what a caller can change: ``attnlab eval --mesh_shape``)
  unless the batch splits into grad_accum micro-batches over the mesh's batch shards."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if dcfg.batch_size % (tcfg.grad_accum * shards):
    accum = f"grad_accum={tcfg.grad_accum} x " if tcfg.grad_accum > 1 else ""
    raise shd.MeshShapeError(
        f"batch_size={dcfg.batch_size} must be a multiple of {accum}data*fsdp={shards}, the "
        "mesh's batch shards")


class Run:
  """A model, its data and its train state on a mesh (shared by train and eval)."""

  def __init__(self, mcfg: ModelConfig, tcfg: TrainConfig, dcfg: DataConfig, mesh=None,
               sources=None, tokenizer=None, *, abstract_state: bool = False):
    """``sources`` / ``tokenizer``: what ``pipeline.build_sources(dcfg, mcfg)`` and
    ``pipeline.make_tokenizer`` give for ``dcfg``, when the caller has them already
    (``attnlab train`` builds them in its checks); built here otherwise.
    ``abstract_state``: the train state as shapes only (``steps.init_train``), for an
    evaluation, which then reads a checkpoint's parameters (``restore_params``), and for a
    resume, whose ``restore`` initializes only what the checkpoint does not hold."""
    self.mcfg, self.tcfg, self.dcfg = mcfg, tcfg, dcfg
    extras.check_data_config(dcfg)  # a missing package stops the run here, not at an eval
    if mesh is not None:
      shd.check_mesh(mesh)
    self.mesh = mesh if mesh is not None else shd.make_mesh(tcfg.mesh_shape)
    check_batch_layout(tcfg, dcfg, self.mesh)
    if tokenizer is None:
      tokenizer = pipeline.make_tokenizer(dcfg.tokenizer, dcfg.tokenizer_model,
                                          bos_id=dcfg.bos_id, eos_id=dcfg.eos_id)
    if sources is None:
      sources, _ = pipeline.build_sources(dcfg, mcfg, tokenizer)
    self.sources = sources
    self.tokenizer = tokenizer
    self.data = pipeline.train_iterator(sources, dcfg)
    self._val_batches = None
    if tcfg.eval_every:  # a validation set the mesh cannot split stops the run here
      self.validation_batches()
    # The data is checked before the model is built (and compiled).
    with self._out_of_memory_refused():
      self.setup, self.state = steps_lib.init_train(mcfg, tcfg, self.mesh,
                                                    abstract=abstract_state)
    self.abstract = abstract_state
    self.eval_step = steps_lib.make_eval_step(self.setup)

  @contextlib.contextmanager
  def _out_of_memory_refused(self):
    """XLA's RESOURCE_EXHAUSTED while the train state is made (initialized, or restored:
    orbax may raise it as the cause of its own error) as a ``SetupError`` naming the
    state's size (a traceback from inside JAX until 2026-12-06)."""
    try:
      yield
    except Exception as e:
      cause = cause_in_chain(e, lambda c: isinstance(c, jax.errors.JaxRuntimeError)
                             and "RESOURCE_EXHAUSTED" in str(c))
      if cause is None:
        raise
      raise SetupError(_too_large(self.mcfg, self.tcfg, str(cause))) from None

  def initialize(self) -> None:
    """Initialize the train state of a Run made with ``abstract_state`` (a resume that
    found no checkpoint it could read); nothing for one initialized already."""
    if self.abstract:
      with self._out_of_memory_refused():
        self.state = {"params": steps_lib.init_params(self.mcfg, self.tcfg, self.setup)}
        self.state.update(self.setup.fresh_rest(self.state["params"]))
      self.abstract = False

  def put(self, batch):
    # Every process reads the same global batch; each device takes its own rows.
    return steps_lib.put_batch(batch, self.setup)

  def restore(self, ckpt: Checkpointer, step: int | None = None, *,
              saved_data: DataConfig | None = None) -> int | None:
    """Restore the newest readable (or the given) checkpoint, and continue the training
    data where it stopped (``pipeline.DataStateError`` when it was saved under another
    training stream); its step, or None when there is none (or none of them could be
    read). (An evaluation reads the parameters alone: ``restore_params``.) ``saved_data``: the
    DataConfig the checkpoints were written under (the workdir's config.gin), which
    completes a data state saved before the position was kept
    (``pipeline.complete_state``).

    A Run made with ``abstract_state`` reads the checkpoint into shapes alone (until
    2026-12-07 a resume initialized the whole train state first, then read the checkpoint
    beside it: twice the state's memory at the peak, and the initialization's time): a
    weights-only checkpoint gets a fresh optimizer state for its parameters, and where
    none can be read the state is initialized (``initialize``).
    """
    abstract = self.setup.abstract_state(self.state)
    fresh = self.setup.fresh_rest if self.abstract else self.state
    with self._out_of_memory_refused():
      if step is None:
        found = ckpt.restore_latest(abstract, init_state=fresh)
        if found is None:
          self.initialize()
          return None
        step, state, data_state = found
      else:
        state, data_state = ckpt.restore(step, abstract, init_state=fresh)
    if data_state is not None:  # None: a converted (weights-only) checkpoint
      if saved_data is not None:
        data_state = pipeline.complete_state(data_state, saved_data)
      self.data.set_state(data_state)
      saved_bs = data_state.get("batch_size", self.dcfg.batch_size)
      if saved_bs != self.dcfg.batch_size:
        log.info("batch_size %d -> %d: the data continues at example %d", saved_bs,
                 self.dcfg.batch_size, self.data.example)
    self.state = state
    self.abstract = False
    return step

  def restore_params(self, ckpt: Checkpointer, step: int | None = None) -> int | None:
    """Restore the parameters alone (an evaluation reads nothing else: no optimizer state,
    no data position) of the newest readable (or the given) checkpoint; its step, or None
    when none could be read."""
    abstract = self.setup.abstract_state(self.state)["params"]
    read = lambda s: ckpt.restore_params(s, abstract)
    if step is None:
      found = ckpt.restore_newest(read)
      if found is None:
        return None
      step, params = found
    else:
      params = read(step)
    self.state = dict(self.state, params=params)
    return step

  def validation_batches(self):
    if self._val_batches is None:
      shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
      self._val_batches = pipeline.validation_batches(self.sources, self.dcfg,
                                                      self.tcfg.eval_batches, shards)
    return self._val_batches

  def evaluate(self, predictions_path: str | None = None, *, beam_size: int | None = None,
               length_penalty: float = DecodeConfig.length_penalty) -> dict:
    """Validation loss / perplexity; for seq2seq tasks also exact match of the
    greedy outputs, and corpus BLEU for translation (task 'tsv').

    Args:
      predictions_path: seq2seq: where process 0 writes the decoded examples
        (JSON lines of source, reference, prediction text and the reference /
        prediction token ids).
      beam_size, length_penalty: decode by beam search of that width and GNMT
        alpha instead (a seq2seq task); None = greedy.
    """
    out = eval_lib.validation_loss(self.eval_step, self.state["params"],
                                   self.validation_batches(), self.put)
    if self.dcfg.task != "lm":
      from flax import nnx

      # Every process decodes the whole validation set on its own host copy
      # (a few batches): no cross-process traffic inside generation.
      params = eval_lib.host_params(self.state["params"])
      model = nnx.merge(self.setup.graphdef, params, self.setup.rest)
      examples = eval_lib.decode_batches(model, self.validation_batches(),
                                         eos_id=self.tokenizer.eos_id,
                                         bos_id=self.tokenizer.bos_id, beam_size=beam_size,
                                         length_penalty=length_penalty)
      if jax.process_index() != 0:
        predictions_path = None
      out.update(eval_lib.seq2seq_metrics(examples, self.tokenizer,
                                          bleu=self.dcfg.task == "tsv",
                                          predictions_path=predictions_path))
    return out


def _nonfinite_what(m) -> str:
  """What was not finite in a step's metrics ``m``: the loss or the gradient norm, or else
  the update itself (until 2026-12-05 that case, too, named the loss and the gradient norm,
  both finite)."""
  loss, norm = float(m["loss"]), float(m["grad_norm"])
  if math.isfinite(loss) and math.isfinite(norm):
    return (f"non-finite parameter update (the loss {loss:.6g} and gradient norm {norm:.6g} "
            f"are finite; learning rate {float(m['learning_rate']):.3g})")
  return f"non-finite loss ({loss}) or gradient norm ({norm})"


def train(mcfg: ModelConfig, tcfg: TrainConfig, dcfg: DataConfig, workdir: str, *,
          mesh=None, config_text: str | None = None, sources=None, tokenizer=None) -> dict:
  """Train (or resume) in ``workdir``; returns the last logged metrics, with
  ``metrics_step`` (the step they were logged at, None if none was), ``step`` (the step
  it stopped at: a run stopped by a signal between two logged steps stops later than its
  metrics, which until 2026-12-04 nothing said) and ``start_step`` (the checkpoint it
  resumed from: the newest readable one, 0 for a fresh run).

  ``sources`` / ``tokenizer``: the data already built for ``dcfg`` (see ``Run``).

  Raises:
    NonFiniteError: a NaN / Inf loss or gradient with on_nonfinite='stop';
      the last good checkpoint stays the newest in the workdir.
    SetupError: the data, mesh or model checks failed (nothing was written).
    attnlab.extras.MissingDependencyError: an optional package the data needs is not
      installed (an ImportError, raised as early: nothing was written).
    ResumeError: the workdir's checkpoints do not fit the model, were saved by a run
      reading other training data, cannot be read for a reason of the system (permission
      denied, an I/O error), or the newest is past ``tcfg.steps`` (its config.gin and
      checkpoints are left as they were).
    SaveError: a checkpoint could not be saved (a full disk): the message names the one
      the same call resumes from.
    WorkdirBusyError: another process trains in ``workdir`` (nothing was changed).
  """
  main_process = jax.process_index() == 0
  # A workdir holding checkpoints is a resume: its state is read into shapes alone (``Run
  # .restore``), not initialized first. Decided by process 0 for all: the initialization's
  # programs span the mesh.
  resume = has_saved_steps(workdir)
  if jax.process_count() > 1:
    resume = bool(multihost_utils.broadcast_one_to_all(np.int32(resume)))
  try:
    run = Run(mcfg, tcfg, dcfg, mesh, sources=sources, tokenizer=tokenizer,
              abstract_state=resume)
  except ValueError as e:  # data, mesh and model checks: nothing is written yet
    raise SetupError(str(e)) from e
  os.makedirs(workdir, exist_ok=True)
  lock = busy = None
  if main_process:
    try:
      lock = _lock_workdir(workdir)
    except WorkdirBusyError as e:
      busy = e
  # Every process stops, not process 0 alone (the others would wait for it in a collective).
  if jax.process_count() > 1 and multihost_utils.broadcast_one_to_all(
      np.int32(busy is not None)):
    busy = busy or WorkdirBusyError(_BUSY.format(workdir=workdir))
  if busy is not None:
    raise busy
  try:
    return _train_in(run, mcfg, tcfg, dcfg, workdir, config_text, main_process)
  finally:
    if lock is not None:
      os.close(lock)  # the lock goes with its descriptor


class WorkdirBusyError(ValueError):
  """Another process holds the workdir's training lock (``_lock_workdir``)."""


_BUSY = ("another attnlab train is running in {workdir} (it holds the workdir's lock): "
         "nothing was changed; wait for it to end, or train in another workdir")


def _lock_workdir(workdir: str) -> int | None:
  """A descriptor of ``workdir`` holding an exclusive ``flock`` on it for the run: a second
  ``train`` in the same workdir while one runs is refused before it touches anything (until
  2026-12-07 it ran beside the first: its Checkpointer deleted the first's half-saved
  checkpoint as its own leftover, and both saved steps and wrote metrics.jsonl). The kernel
  releases the lock when the process ends, a crash or a kill included: no stale lock.
  None where the folder cannot be opened for it (a workdir one may write but not list) or
  the file system has no such locks: then nothing is checked."""
  fd = None
  try:
    fd = os.open(workdir, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd
  except BlockingIOError:
    os.close(fd)
    raise WorkdirBusyError(_BUSY.format(workdir=workdir)) from None
  except OSError as e:  # not opened (mode 0300), or a file system without flock
    if fd is not None:
      os.close(fd)
    log.info("%s cannot be locked (%s): a second run in it would not be refused", workdir, e)
    return None


def _train_in(run: Run, mcfg: ModelConfig, tcfg: TrainConfig, dcfg: DataConfig, workdir: str,
              config_text: str | None, main_process: bool) -> dict:
  """``train`` in its workdir, the workdir locked."""
  ckpt = Checkpointer(workdir, tcfg.keep_checkpoints)
  try:
    restored = run.restore(ckpt, saved_data=_saved_data_config(workdir))  # None: fresh
    start = restored or 0
  except SetupError:  # the state does not fit in memory
    ckpt.close()
    raise
  except pipeline.DataStateError as e:
    ckpt.close()
    # The same config matching other files (a corpus folder that grew): the config.gin
    # cannot bring the stream back, the files can.
    way = ("put back the corpus files the checkpoints read (or give DataConfig.paths that "
           "match those alone)" if e.fields == ("files",) else
           "resume with the workdir's own DataConfig")
    raise ResumeError(
        f"the checkpoints in {ckpt.directory} were saved by a run reading other training data: "
        f"{e}. Nothing was changed in {workdir}; {way}, or train in a new workdir") from e
  except BaseException as e:
    ckpt.close()
    if isinstance(e, OSError):  # permission denied, an I/O error: nothing about the model
      raise ResumeError(
          f"reading the checkpoints in {ckpt.directory} failed: {type(e).__name__}: {e}. "
          f"Nothing was changed in {workdir}; rerun once they can be read") from e
    if not isinstance(e, (ValueError, KeyError, TypeError)):  # orbax: shapes or tree differ
      raise
    text = str(e).strip()
    first = text.splitlines()[0][:500].rstrip(".: ") if text else type(e).__name__
    raise ResumeError(
        f"the checkpoints in {ckpt.directory} do not fit this run's model and optimizer"
        f"{_model_changes(workdir, mcfg, tcfg)}: {first}. Nothing was changed in {workdir}; "
        "resume with the workdir's own config.gin, or train in a new workdir") from e
  # From here to the step loop's own try, anything raised (a refusal below, an interrupt,
  # an error of a library import) closes the checkpointer (until 2026-12-07 a Ctrl-C
  # there left it open for the process).
  try:
    changed = _other_model(workdir, mcfg) if restored is not None else []
    if changed:  # the arrays fit, but not the model: an activation, a norm, the positions...
      raise ResumeError(
          f"the checkpoints in {ckpt.directory} were trained as another model "
          f"({', '.join(changed)}; a resume may change only "
          f"{', '.join('ModelConfig.' + f for f in RESUMABLE_MODEL_FIELDS)}). Nothing was "
          f"changed in {workdir}; resume with the workdir's own config.gin, or train in a new "
          "workdir")
    if start > tcfg.steps:
      raise ResumeError(
          f"the newest checkpoint in {ckpt.directory} is step {start}, past TrainConfig.steps="
          f"{tcfg.steps}: nothing to train. Nothing was changed in {workdir}; train to at least "
          f"{start} steps, or in a new workdir")
    finished = start == tcfg.steps  # a rerun of a finished run: nothing to train
    if start and not finished:
      log.info("resumed from step %d", start)
      try:
        saved_meta = ckpt.read_meta(start)
      except (UnreadableCheckpointError, OSError):  # changed since the restore: config.gin's
        saved_meta = {}
      saved = _checkpoint_train_config(workdir, tcfg, saved_meta)
      _warn_schedule_change(saved, tcfg, mcfg.d_model, run.state["opt_state"])
      _warn_seed_change(saved, tcfg)
    if not finished:
      _warn_schedule_surprises(tcfg, mcfg.d_model)
      betas = tcfg.betas_at_1_in_float32()  # a new config refuses it: a saved one's, resumed
      if betas is not None and main_process:
        log.warning("TrainConfig.%s: this run's config.gin holds it (taken before 2026-12-07), "
                    "and the resumed run goes on so (until 2026-12-07 without a word); resume "
                    "with --gin.TrainConfig.%s=0.999 (or less) to train", betas,
                    betas.split("=", 1)[0])
    # Written once the checkpoints are known to fit this config: a resume under a
    # model the checkpoints do not fit stops above and leaves the workdir's config.gin
    # describing them, as does a rerun of a finished run (it trains nothing under the
    # new config).
    config_path = os.path.join(workdir, "config.gin")
    try:  # a traceback until 2026-12-07
      if config_text is not None and main_process and not (
          finished and os.path.isfile(config_path)):
        write_text_atomically(config_path, config_text)
      writer = MetricsWriter(workdir, enabled=main_process)
    except OSError as e:
      raise _write_failed("writing the run's files", e, restored, None) from e
  except BaseException:
    ckpt.close()
    raise
  bar = None
  # Everything from here on closes the writer (its event file) and the checkpointer on
  # the way out, an interrupt while the step compiles too (until 2026-12-07 the setup
  # below ran before the try: a Ctrl-C there left both open for the process).
  try:
    step_fn = steps_lib.make_train_step(run.setup, tcfg)
    # the seed and schedule a resume compares with (_checkpoint_train_config)
    meta = {"seed": tcfg.seed, "rng": "fold_in(seed_key(seed), step)",
            "schedule": {f: getattr(tcfg, f) for f in SCHEDULE_FIELDS}}
    sleep_s = float(os.environ.get(STEP_SLEEP_ENV) or 0)
    # A bar on a terminal; in a log file (no TTY) one plain line per logged step,
    # not a bar rewriting itself with carriage returns.
    plain_log = tcfg.progress and main_process and not sys.stderr.isatty()
    if tcfg.progress and main_process and not plain_log:
      bar = tqdm(total=tcfg.steps, initial=start, desc="train", unit="step", file=sys.stderr,
                 dynamic_ncols=True)
    # Steps whose update was skipped (non-finite): state["step"] counts them, the optimizer's
    # schedule count does not, so a resumed run goes on counting from the checkpoint's (a
    # fresh or weights-only start has none).
    skipped = _replicated_int(run.state["step"]) - _replicated_int(
        optim.schedule_count(run.state["opt_state"]))
    last, window_tokens, window_t0 = {}, 0.0, time.perf_counter()
    metrics_step = None
    first_window = True
    step = start
    # The newest checkpoint known to be good: the one resumed from (a converted run's step 0
    # too; None for a fresh run), then each save. Not ckpt.steps()[-1], which may be a
    # corrupted checkpoint the restore skipped.
    last_good = restored
    with StopFlag() as stop:
      while step < tcfg.steps:
        if step == start and stop.signum is not None:  # before any step (a sweep's flag)
          print(f"attnlab train: received signal {stop.signum} before training; stopped at "
                f"step {step}, nothing new to save", file=sys.stderr)
          break
        t0 = time.perf_counter()
        batch = run.put(next(run.data))
        run.state, m = step_fn(run.state, batch)
        m = jax.device_get(m)
        step += 1
        if not bool(m["finite"]):
          what = _nonfinite_what(m)
          if tcfg.on_nonfinite == "stop":
            raise NonFiniteError(
                f"{what} at step {step}; stopped. Last good checkpoint: "
                f"{'none' if last_good is None else last_good} in {ckpt.directory}")
          skipped += 1
          log.warning("step %d: %s, update skipped", step, what)
        try:
          window_tokens += float(m["tokens"])
          if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(m['loss']):.3f}")
          if step == tcfg.steps or (tcfg.log_every and step % tcfg.log_every == 0):
            elapsed = time.perf_counter() - window_t0
            # "loss" is what the step minimizes (label-smoothed); "nll" the plain negative
            # log-likelihood, the eval loss's measure (logged since 2026-12-04).
            last = {"loss": float(m["loss"]), "nll": float(m["nll"]),
                    "perplexity": perplexity(float(m["nll"])),
                    "learning_rate": float(m["learning_rate"]),
                    "grad_norm": float(m["grad_norm"]),
                    "tokens_per_s": window_tokens / max(elapsed, 1e-9),
                    "step_time_s": time.perf_counter() - t0, "skipped_steps": skipped}
            # The first window of a process holds the compilation (and a resume's restore):
            # flagged, so a throughput summary can leave it out (sweep.train_rate).
            writer.write(step, "train", last,
                         {WINDOW_HOLDS_COMPILE: True} if first_window else None)
            metrics_step = step
            first_window = False
            if plain_log:
              print(_log_line(step, tcfg.steps, last), file=sys.stderr, flush=True)
            window_tokens, window_t0 = 0.0, time.perf_counter()
          if tcfg.eval_every and step % tcfg.eval_every == 0:
            t_eval = time.perf_counter()
            writer.write(step, "eval", run.evaluate(predictions_path(workdir, step)))
            window_t0 += time.perf_counter() - t_eval  # tokens/s counts training steps only
          if sleep_s:
            time.sleep(sleep_s)
        except Exception as crash:
          # A crash outside the step (logging, metrics, eval) keeps the training
          # done so far, as SIGTERM does: save this step, then let the error show.
          saved = None
          try:
            _save(ckpt, step, run, meta, last_good)
            saved = step
          except SaveError as e:  # the crash comes first; this says what was kept
            print(f"attnlab train: {e}", file=sys.stderr)
          if isinstance(crash, OSError):  # a full disk under metrics.jsonl: one line (a
            # traceback until 2026-12-07)
            raise _write_failed(f"logging or evaluating step {step}", crash, last_good,
                                saved) from crash
          if saved is not None:
            print(f"attnlab train: checkpoint saved at step {step} in {ckpt.directory} "
                  "before the error below", file=sys.stderr)
          raise
        if stop.signum is not None or step == tcfg.steps or (
            tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0):
          t_save = time.perf_counter()
          _save(ckpt, step, run, meta, last_good)
          last_good = step
          window_t0 += time.perf_counter() - t_save
        if stop.signum is not None:
          print(f"attnlab train: received signal {stop.signum}; checkpoint saved at step "
                f"{step} in {ckpt.directory}", file=sys.stderr)
          break
  except BaseException:
    failing = True
    raise
  else:
    failing = False
  finally:
    _close_all(([bar.close] if bar is not None else []) + [writer.close, ckpt.close],
               failing=failing)
  last["metrics_step"] = metrics_step
  last["step"] = step
  last["start_step"] = start
  return last


def _save(ckpt: Checkpointer, step: int, run: Run, meta: dict, last_good: int | None) -> None:
  """Save ``step``; a save that fails (a full disk) is a ``SaveError`` naming the reason
  and the checkpoint a rerun starts from."""
  try:
    ckpt.save(step, run.state, run.data.get_state(), meta)
  except Exception as e:
    raise SaveError(
        f"saving checkpoint {step} in {ckpt.directory} failed ({failure_cause(e)}); "
        f"the run stopped. Last good checkpoint: {'none' if last_good is None else last_good}; "
        f"free the space (or mend the cause) and {_rerun(last_good)}") from e


def _write_failed(what: str, e: OSError, last_good: int | None,
                  saved: int | None) -> WriteError:
  """The ``WriteError`` of an operating-system error while doing ``what`` (writing the run's
  other files, or logging / evaluating a step: a full disk, or a validation file gone):
  ``saved`` the step just saved (None where it was not), ``last_good`` the newest good
  checkpoint before it."""
  kept = (f"Checkpoint {saved} saved" if saved is not None else
          f"Last good checkpoint: {'none' if last_good is None else last_good}")
  return WriteError(f"{what} failed ({failure_cause(e)}); the run stopped. {kept}; free the "
                    f"space (or mend the cause) and "
                    f"{_rerun(saved if saved is not None else last_good)}")


def _rerun(good: int | None) -> str:
  """What the same command does again from the newest good checkpoint ``good``."""
  return ("rerun the same command to start over" if good is None else
          f"rerun the same command to resume from {good}")


def failure_cause(e: BaseException) -> str:
  """``TYPE: text`` of a failed write's error on one line, a long text (orbax's and
  tensorstore's name every file) cut in its middle: the reason is at the end ("No space left
  on device")."""
  cause = " ".join(str(e).split()) or type(e).__name__
  if len(cause) > 300:
    cause = f"{cause[:150]} ... {cause[-140:]}"
  return f"{type(e).__name__}: {cause}"


def _close_all(closes, *, failing: bool) -> None:
  """Call each of ``closes``. While an error propagates (``failing``), one that fails too
  is logged, not raised: it would replace that error (a full disk that failed the save
  fails the metrics flush too: until 2026-12-04 that OSError hid the SaveError). Otherwise
  the first failure is raised once every close ran."""
  first = None
  for close in closes:
    try:
      close()
    except Exception as e:  # noqa: BLE001 - reported below
      if failing:
        log.warning("while stopping after an error, closing the %s failed too: %s: %s",
                    type(getattr(close, "__self__", close)).__name__, type(e).__name__, e)
      elif first is None:
        first = e
  if first is not None:
    raise first


def _replicated_int(x) -> int:
  """A replicated scalar's value on any process (multi-host: not fully addressable)."""
  return int(np.asarray(x.addressable_data(0)))


def evaluate_workdir(workdir: str, step: int | None = None, *, beam_size: int | None = None,
                     length_penalty: float = DecodeConfig.length_penalty,
                     mesh_shape: tuple[int, int, int] | None = None) -> dict:
  """Validation metrics of a workdir's checkpoint (the config from config.gin).

  ``beam_size`` / ``length_penalty``: decode a seq2seq task's examples by beam
  search instead of greedily; the predictions go to their own file, and the
  result names both. ``mesh_shape``: evaluate on this mesh instead of the run's
  ``TrainConfig.mesh_shape`` (a checkpoint restores onto any mesh).
  """
  # A penalty without a beam refused before any work (until 2026-12-07 by generate, after the
  # loss; an LM's eval, which decodes nothing, ignored it); None is the default.
  length_penalty = length_penalty_for(beam_size, length_penalty)
  mcfg, dcfg, tcfg = gin_config.read_workdir_config(workdir_config(workdir))
  if mesh_shape is not None:
    tcfg = tcfg.replace(mesh_shape=mesh_shape)
  # An evaluation accumulates no gradients: the run's grad_accum does not bound its mesh.
  tcfg = tcfg.replace(grad_accum=1)
  if beam_size is not None:  # checked as `attnlab decode` checks them, before any work
    DecodeConfig(beam_size=beam_size, length_penalty=length_penalty)
    if dcfg.task == "lm":
      raise ValueError(f"beam search decodes the examples of a seq2seq task; {workdir} "
                       "holds a language model (task='lm'), whose eval is its loss")
  if dcfg.task != "lm":  # a seq2seq eval writes its predictions: checked before any work
    where = os.path.join(workdir, "eval")
    if os.path.lexists(where) and not os.path.isdir(where):  # a traceback after the whole
      # eval until 2026-12-07
      raise ValueError(f"{where} is not a folder: a seq2seq eval writes its decoded examples "
                       "there; move it away")
    if not os.access(where if os.path.isdir(where) else workdir, os.W_OK | os.X_OK):
      raise ValueError(f"{where} cannot be written (a read-only workdir?): a seq2seq eval "
                       "writes its decoded examples there; evaluate a writable copy")
  # Shapes only: the checkpoint's parameters replace them (an initialized state cost ~1.6-2.2
  # s of a 3.3-4.0 s demo-sized eval until 2026-12-07), and nothing else is read.
  run = Run(mcfg, tcfg, dcfg, abstract_state=True)
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    if not ckpt.steps():
      raise FileNotFoundError(f"{ckpt.directory} holds no checkpoint")
    if step is not None and step not in ckpt.steps():
      raise ValueError(f"step={step} has no checkpoint in {ckpt.directory}; "
                       f"saved steps: {ckpt.steps()}")
    restored = run.restore_params(ckpt, step)
    if restored is None:  # every checkpoint was unreadable (each one warned about)
      raise FileNotFoundError(f"no checkpoint in {ckpt.directory} could be read (saved "
                              f"steps: {ckpt.steps()}); an untrained model is not evaluated")
  finally:
    ckpt.close()
  step = restored
  out = run.evaluate(predictions_path(workdir, step, beam_size, length_penalty),
                     beam_size=beam_size, length_penalty=length_penalty)
  out["step"] = step
  if beam_size is not None:
    out.update(beam_size=beam_size, length_penalty=length_penalty)
  return out
