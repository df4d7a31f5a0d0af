"""Head-sharing ablation sweeps: the arms, running them, measuring each run.

A ``Sweep`` names the arms (one per number of KV heads, trained from scratch,
plus optional uptraining arms converted from the MHA arm's final checkpoint)
and the seeds. Every arm x seed is a normal training run (``trainer.train``)
in ``OUT/arms/NAME/seed_S/``; for seed S every arm gets ``TrainConfig.seed =
DataConfig.seed = S``, so arms of a seed see the same data order, steps and
batch and differ only in the architecture (the init differs where the shapes
do). A run that finished leaves ``result.json`` (its measurements, status
"ok"); one that raised leaves ``result.json`` with status "failed" and its
error (``error.txt`` has the traceback) and is retried by the next invocation,
which first moves that result to ``result.previous_failure.json`` (a retry that is
stopped reads as interrupted, not failed); one that was stopped resumes from its
newest checkpoint.

The report (tables, plots) is built by ``attnlab.training.report`` from the
``result.json`` files alone, so it can be (re)built from whatever finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab import config_gin
from attnlab.config import (
  DataConfig,
  ModelConfig,
  Sweep,
  TrainConfig,
  absolute_path,
  check_seed,
)
from attnlab.convert.heads import check_conversion, convert_heads
from attnlab.data import pipeline
from attnlab.data.tokenizer import (
  TOKENIZER_FILES,
  check_companion_files,
  check_regular_file,
  make_tokenizer,
  not_a_regular_file,
)
from attnlab.decoding.generate import generate
from attnlab.extras import MissingDependencyError
from attnlab.training import sharding as shd
from attnlab.training import steps as steps_lib
from attnlab.training import trainer
from attnlab.training.checkpoint import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    Checkpointer,
    UnreadableCheckpointError,
    abstract_model,
    load_checkpoint,
)
from attnlab.training.metrics import WINDOW_HOLDS_COMPILE, perplexity, read_metrics

ARMS_DIR = "arms"
RESULT_FILE = "result.json"
# A failed run's result.json, moved aside when a rerun retries the run: until the retry
# writes its own result, the run reads as interrupted or pending, not as failed.
PREVIOUS_FAILURE_FILE = "result.previous_failure.json"
CONVERSION_FILE = "conversion.json"
# ARM/.seed_S.converting: an uptraining conversion being made; ARM/.seed_S.replaced: the
# run's folder it replaces, until removed
CONVERTING_SUFFIX, REPLACED_SUFFIX = ".converting", ".replaced"
WALL_FILE = "wall_time_s"
ERROR_FILE = "error.txt"
# A run's own records of its attempts, kept when a conversion cut short is started again.
ATTEMPT_FILES = (PREVIOUS_FAILURE_FILE, WALL_FILE, ERROR_FILE)
PROMPTS_FILE = "prompts.json"
SWEEP_FILE = "sweep.gin"
DECODE_BATCHES = (1, 8)
# The Sweep fields that set how every run is measured: one OUT holds one setting of them.
MEASURE_FIELDS = ("decode_prompt_len", "decode_new_tokens", "decode_repeats")

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
  """One arm: K KV heads, trained from scratch or uptrained from the MHA arm."""

  name: str
  num_kv_heads: int
  kind: str = "scratch"  # "scratch" | "uptrain"
  method: str = ""  # uptrain: the conversion method
  d_ff: int = 0  # the FFN width of its model


def scratch_name(k: int, n: int) -> str:
  return "mha" if k == n else "mqa" if k == 1 else f"gqa{k}"


@functools.lru_cache(maxsize=256)
def param_counts(mcfg: ModelConfig) -> tuple[int, int]:
  """(all parameters, attention parameters) of the model ``mcfg`` describes.

  Counted once per config (a report counts every arm, a d_ff match several configs;
  each count traces a whole model build). A ModelConfig is frozen and its fields are
  checked scalars, so it is always a cache key."""
  total = attn = 0
  state = nnx.to_pure_dict(nnx.state(abstract_model(mcfg), nnx.Param))
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    size = math.prod(leaf.shape)
    total += size
    if any(str(getattr(k, "key", "")).endswith("attn") for k in path):
      attn += size
  return total, attn


def matched_d_ff(mcfg: ModelConfig, target: int) -> int:
  """The d_ff that brings ``mcfg``'s parameter count closest to ``target``.

  Raises:
    ValueError: no d_ff >= 1 gets within 1% of ``target``.
  """
  p0, _ = param_counts(mcfg)
  p1, _ = param_counts(mcfg.replace(d_ff=mcfg.d_ff + 1))
  slope = p1 - p0  # the count is linear in d_ff
  d_ff = max(1, round(mcfg.d_ff + (target - p0) / slope))
  got, _ = param_counts(mcfg.replace(d_ff=d_ff))
  if abs(got - target) > 0.01 * target:
    raise ValueError(f"match_params: num_kv_heads={mcfg.num_kv_heads} cannot match the MHA "
                     f"arm's {target} parameters within 1% by d_ff (best d_ff={d_ff}: {got})")
  return d_ff


def check_benchmark(sweep: Sweep, mcfg: ModelConfig, dcfg: DataConfig) -> None:
  """ValueError if the decode benchmark does not fit the model's positions: every run would
  train, then fail when measured (as it did until 2026-12-04)."""
  if mcfg.arch == "decoder_only":  # prompts of decode_prompt_len tokens, at most a row's
    prompt = min(sweep.decode_prompt_len, dcfg.seq_len)
    need = prompt + sweep.decode_new_tokens - 1
    what = (f"prompts of {prompt} tokens (Sweep.decode_prompt_len, at most DataConfig.seq_len) "
            f"and Sweep.decode_new_tokens={sweep.decode_new_tokens}")
  else:
    need, what = sweep.decode_new_tokens, "Sweep.decode_new_tokens"
  if need > mcfg.max_len:
    raise ValueError(f"the decode benchmark needs {need} positions ({what}), more than "
                     f"ModelConfig.max_len={mcfg.max_len}: lower Sweep.decode_new_tokens or "
                     "Sweep.decode_prompt_len")


def plan(sweep: Sweep, mcfg: ModelConfig) -> list[Arm]:
  """The arms of a sweep on the base model ``mcfg`` (from-scratch arms first).

  Raises:
    ValueError: an empty arm list, a K that does not divide N, uptraining
      arms without an MHA arm or with a K that does not divide N.
  """
  n = mcfg.num_heads
  ks = sweep.num_kv_heads
  if ks is None:
    ks, k = [], n
    while True:
      ks.append(k)
      if k == 1 or k % 2:
        break
      k //= 2
    if ks[-1] != 1:
      ks.append(1)
  for k in ks:
    if k > n or n % k:
      raise ValueError(f"num_kv_heads={k} must divide num_heads={n} of the base model")
  if sweep.uptrain_num_kv_heads and n not in ks:
    raise ValueError(f"uptrain_num_kv_heads={sweep.uptrain_num_kv_heads!r} needs the MHA arm "
                     f"(num_kv_heads={n}) in num_kv_heads={tuple(ks)!r}: it is the source")
  for k in sweep.uptrain_num_kv_heads:
    if k > n or n % k:
      raise ValueError(f"uptrain_num_kv_heads={k} must divide num_heads={n} of the base model")
  mha_params = param_counts(mcfg.replace(num_kv_heads=n))[0] if sweep.match_params else None
  arms = []
  for k in ks:
    d_ff = mcfg.d_ff
    if sweep.match_params and k != n:
      d_ff = matched_d_ff(mcfg.replace(num_kv_heads=k), mha_params)
    arms.append(Arm(scratch_name(k, n), k, d_ff=d_ff))
  for k in sweep.uptrain_num_kv_heads:
    for m in sweep.uptrain_methods:
      arms.append(Arm(f"uptrain-{m}-{scratch_name(k, n)}", k, "uptrain", m, mcfg.d_ff))
  return arms


def uptrain_steps(sweep: Sweep, tcfg: TrainConfig) -> int:
  return max(1, round(sweep.uptrain_fraction * tcfg.steps))


def run_configs(sweep: Sweep, arm: Arm, seed: int, mcfg: ModelConfig, dcfg: DataConfig,
                tcfg: TrainConfig) -> tuple[ModelConfig, DataConfig, TrainConfig]:
  """The configs of one run: the base, the arm's K and d_ff, the seed."""
  steps = tcfg.steps if arm.kind == "scratch" else uptrain_steps(sweep, tcfg)
  warmup = tcfg.warmup_steps
  if arm.kind == "uptrain":
    warmup = min(round(sweep.uptrain_fraction * warmup), steps - 1)
    if tcfg.schedule == "inverse_sqrt":
      warmup = max(1, warmup)
  eval_every = tcfg.eval_every or max(1, steps // sweep.curve_points)
  log_every = tcfg.log_every
  lr = tcfg.learning_rate
  if arm.kind == "uptrain":
    if log_every:
      log_every = min(log_every, max(1, steps // 4))  # a few windows for the throughput
    if sweep.uptrain_learning_rate is not None:
      lr = float(sweep.uptrain_learning_rate)
  return (mcfg.replace(num_kv_heads=arm.num_kv_heads, d_ff=arm.d_ff),
          dataclasses.replace(dcfg, seed=seed),
          tcfg.replace(seed=seed, steps=steps, warmup_steps=max(0, warmup),
                       eval_every=eval_every, log_every=log_every, learning_rate=lr,
                       progress=False))


def run_dir(out: str, arm: Arm | str, seed: int) -> str:
  name = arm if isinstance(arm, str) else arm.name
  return os.path.join(out, ARMS_DIR, name, f"seed_{seed}")


def check_run_dirs(out: str, sweep: Sweep, arms: list[Arm], *, only: str | None = None) -> None:
  """ValueError naming the first run folder of the selected runs (or its arm's folder, or
  OUT/arms) that is there but no folder, before anything trains: the run could neither
  train nor record its failure (until 2026-12-06 the sweep stopped there with a
  NotADirectoryError traceback, the runs after it not run)."""
  for arm, seed in _selected(sweep, arms, only):
    run = run_dir(out, arm, seed)
    for path in (os.path.dirname(os.path.dirname(run)), os.path.dirname(run), run):
      if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file, not a folder: the sweep's run of arm "
                         f"{arm.name!r} seed {seed} goes there; move it away")


def _is_number(v, kinds=(int, float)) -> bool:
  """A JSON number of ``kinds`` (not a bool, which Python counts as an int)."""
  return isinstance(v, kinds) and not isinstance(v, bool)


def read_result(out: str, arm, seed: int) -> dict | None:
  """The run's result.json, or None when it has none (not finished).

  Raises:
    ValueError: the file is not JSON, or lacks what the report reads (``status``; for
      a finished run ``val_loss`` and ``curve``, a list of [step, val_loss]), or something
      other than a file is there (a folder, a FIFO); names the path (attnlab writes the
      file atomically: a damaged one was edited or copied). Until 2026-12-07 a folder there
      read as no result: the report counted the run unfinished, and the rerun trained it
      and then failed to write its result (IsADirectoryError).
  """
  path = os.path.join(run_dir(out, arm, seed), RESULT_FILE)
  fix = "delete it to run that arm and seed again"
  kind = not_a_regular_file(path)
  if kind is not None:
    raise ValueError(f"{path} is {kind}, not a run result (attnlab writes a file there); "
                     f"{fix}")
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      r = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not a JSON run result ({e}); {fix}") from None
  problem = None
  if not isinstance(r, dict) or not isinstance(r.get("status"), str):
    problem = "no status"
  elif r["status"] == "ok" and not _is_number(r.get("val_loss")):
    problem = f"val_loss={r.get('val_loss')!r}, not a number"
  elif r["status"] == "ok" and not (isinstance(r.get("curve"), list) and all(
      isinstance(p, list) and len(p) == 2 and all(map(_is_number, p)) for p in r["curve"])):
    problem = "no curve of [step, val_loss] pairs"
  if problem:
    raise ValueError(f"{path} is not a run result attnlab wrote ({problem}); {fix}")
  return r


def _write_json(path: str, obj) -> None:
  trainer.write_text_atomically(path, json.dumps(obj, indent=1, sort_keys=True))


# --------------------------------------------------------------------------- conversion


def write_converted_run(src: str, dst: str, num_kv_heads: int, method: str, *,
                        step: int | None = None, seed: int = 0, bindings: dict | None = None,
                        check_only: bool = False) -> dict:
  """Convert a training run's checkpoint to K KV heads as a new run ``dst``.

  ``dst`` gets a checkpoint at step 0 (the converted parameters, a fresh
  optimizer state, the source's data position, so uptraining reads data the
  source had not) and a ``config.gin`` (the source's, with the new
  ``num_kv_heads`` and ``bindings``: ``{"TrainConfig": {...}, "DataConfig":
  {...}}`` field overrides), so ``attnlab train --workdir dst`` uptrains it. A
  tokenizer file inside ``src`` (an HF-converted run's tokenizer.json) is
  copied into ``dst`` and named relative to it, and so is an HF import's
  ``generation_config.json`` (its eos ids: decode stops at them, the export
  gives them back).

  Everything is checked before anything is written; ``check_only`` stops
  there and returns ``{"configs": (ModelConfig, DataConfig, TrainConfig)}``, the new run's.

  Returns:
    {"source": ..., "source_step": ..., "method": ..., "num_kv_heads": ...}.

  ``step`` None: the newest checkpoint that reads (a damaged newer one is skipped with a
  warning, as ``load_checkpoint`` skips it).

  Raises:
    FileNotFoundError: ``src`` is not a run, or holds no (readable) checkpoint.
    UnreadableCheckpointError: the given ``step`` is damaged.
    ValueError: a missing step, K that does not divide the source's KV heads
      or exceeds them, an unknown method, a seed outside [0, 2**63 - 1], a ``dst``
      that already holds a run, a tokenizer file inside ``src`` that the new run would get
      a copy of but could not read (``_check_own_tokenizer``).
    trainer.SaveError: a write into ``dst`` failed (a full disk), naming what and why;
      what was written stays (``attnlab convert-heads`` removes it). Until 2026-12-07
      orbax's or the OS's own error came through.
  """
  config_path = os.path.join(src, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path} does not exist: --from is not a training run")
  mcfg, dcfg, tcfg = config_gin.read_workdir_config(config_path)
  check_conversion(mcfg.num_kv_heads, num_kv_heads, method)
  check_seed("seed", seed)
  ckpt_dir = os.path.join(src, CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f"{ckpt_dir} does not exist: the source run saved no checkpoint")
  bindings = bindings or {}
  new_mcfg = mcfg.replace(num_kv_heads=num_kv_heads)
  source_dcfg = dcfg
  dcfg = dataclasses.replace(dcfg, **bindings.get("DataConfig", {}))
  tcfg = tcfg.replace(**bindings.get("TrainConfig", {}))
  if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
    what = "is not empty" if os.path.isdir(dst) else "is a file"
    raise ValueError(f"--to {dst} already exists and {what}: give a new directory")
  _check_own_tokenizer(dcfg, src)
  src_ckpt = Checkpointer(src, read_only=True)
  try:
    src_ckpt.resolve_step(step)  # nothing saved, or a step that was not: named
    if check_only:
      try:
        shd.make_mesh(tcfg.mesh_shape)  # the mesh the new run's state is laid out on
      except ValueError as e:  # named without the way out until 2026-12-04
        raise ValueError(f"{e} (the new run's TrainConfig.mesh_shape, the source's unless "
                         "bound: give --gin.TrainConfig.mesh_shape=(D, F, T) for this "
                         "machine's devices)") from None
      return {"configs": (new_mcfg, dcfg, tcfg)}

    def read(s):  # a weights-only source (convert --from-hf) read no data yet: batch 0
      # As one read of step s: a source still training may delete s meanwhile (then the
      # newest is read again; load_checkpoint's "no such step" came through until 2026-12-07).
      return src_ckpt.read_as_step(s, lambda: (src_ckpt.restore_data(s) or {"index": 0},
                                               load_checkpoint(src, s)[0]))

    step, (data_state, model) = src_ckpt.read_step(step, read)
  finally:
    src_ckpt.close()
  # The new run continues the source's training stream when its DataConfig reads the same
  # one (the bindings may change the batch size), else starts its own.
  data_state = pipeline.continue_state(pipeline.complete_state(data_state, source_dcfg), dcfg)
  new = convert_heads(model, num_kv_heads, method, rngs=steps_lib.model_rngs(seed))
  mesh = shd.make_mesh(tcfg.mesh_shape)
  setup, state = steps_lib.init_train(new_mcfg, tcfg, mesh)
  params = jax.device_put(nnx.state(new, nnx.Param), setup.state_shardings["params"])
  opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings["opt_state"])(params)
  state = {"params": params, "opt_state": opt_state,
           "step": jax.device_put(jnp.zeros((), jnp.int32), setup.state_shardings["step"])}
  info = {"source": os.path.abspath(src), "source_step": int(step), "method": method,
          "num_kv_heads": int(num_kv_heads), "source_num_kv_heads": mcfg.num_kv_heads}
  os.makedirs(dst, exist_ok=True)
  ckpt = Checkpointer(dst, tcfg.keep_checkpoints)
  try:
    ckpt.save(0, state, data_state, {"seed": tcfg.seed, "converted": info})
  except Exception as e:  # what orbax raises of a failed write: ValueError, OSError, ...
    with contextlib.suppress(Exception):  # a close on the same full disk: the save says it
      ckpt.close()
    raise trainer.SaveError(f"saving checkpoint 0 in {ckpt.directory} failed "
                            f"({trainer.failure_cause(e)})") from e
  ckpt.close()
  try:
    dcfg = _copy_own_tokenizer(dcfg, src, dst)
    config_gin.copy_generation_config(src, dst)  # an HF import's eos ids
    text = config_gin.operative_config(new_mcfg, dcfg, tcfg, workdir=dst)
    header = (f"# Converted by `attnlab convert-heads` from {info['source']} step {step} "
              f"({info['source_num_kv_heads']} -> {num_kv_heads} KV heads, method {method}).\n")
    with open(os.path.join(dst, CONFIG_FILE), "w", encoding="utf-8") as f:
      f.write(header + text)
  except OSError as e:
    raise trainer.SaveError(f"copying the source's tokenizer and generation config into, or "
                            f"writing config.gin in, {dst} failed ({trainer.failure_cause(e)})"
                            ) from e
  return info


def _check_own_tokenizer(dcfg: DataConfig, src: str) -> None:
  """ValueError naming a tokenizer file inside the run ``src`` that ``_copy_own_tokenizer``
  copies into the new run but that would not serve it: the tokenizer file missing, not a
  regular file (a folder, a FIFO) or not read by its tokenizer (an empty or cut-off
  tokenizer.json), or a transformers file beside an hf_json one that is no regular file.
  Until 2026-12-07 an empty or cut-off tokenizer.json was copied without a word (the new
  run's decode then failed on it), and a folder or a FIFO left the new config.gin naming
  the source's path."""
  path = dcfg.tokenizer_model
  if dcfg.tokenizer == "byte" or not path or config_gin.relative_inside(path, src) is None:
    return  # no file, or one outside the run (the user's): the new run names it as it is
  why = f"the tokenizer of --from {src}, which the new run gets a copy of"
  try:
    make_tokenizer(dcfg.tokenizer, path, bos_id=dcfg.bos_id, eos_id=dcfg.eos_id)
  except MissingDependencyError:  # no package to read it with (the conversion needs none):
    _check_tokenizer_bytes(dcfg.tokenizer, path, why)  # what can be checked without it
  except ValueError as e:
    raise ValueError(f"{e} ({why})") from None
  if dcfg.tokenizer == "hf_json":
    check_companion_files(os.path.dirname(path), f"{why}, this file with it")


def _check_tokenizer_bytes(kind: str, path: str, why: str) -> None:
  """``_check_own_tokenizer``'s checks where the tokenizer's package is not installed: a
  regular file there, not empty, and for a tokenizer.json a JSON object (the copy of a
  cut-off one would not read)."""
  try:
    check_regular_file(path, "tokenizer.json" if kind == "hf_json" else "sentencepiece .model")
    with open(path, "rb") as f:
      data = f.read()
  except (OSError, ValueError) as e:
    raise ValueError(f"{e} ({why})") from None
  if not data:
    raise ValueError(f"tokenizer_model={path!r} is empty ({why})")
  if kind == "hf_json":
    try:
      ok = isinstance(json.loads(data.decode("utf-8")), dict)
    except (UnicodeDecodeError, ValueError):
      ok = False
    if not ok:
      raise ValueError(f"tokenizer_model={path!r} is not a readable tokenizer.json: not a "
                       f"JSON object ({why})")


def _copy_own_tokenizer(dcfg: DataConfig, src: str, dst: str) -> DataConfig:
  """``dcfg`` naming a copy in ``dst`` of a tokenizer file that lives inside the run ``src``
  (a workdir made by ``attnlab convert --from-hf`` holds its tokenizer.json; with
  tokenizer="hf_json" the transformers files beside it are copied too), so ``dst`` does not
  depend on ``src``. A tokenizer elsewhere (the user's data) stays where it is."""
  path = dcfg.tokenizer_model
  if not path or not os.path.isfile(path):
    return dcfg
  rel = config_gin.relative_inside(path, src)
  if rel is None:
    return dcfg
  root = os.path.realpath(src)
  names = [rel]
  if dcfg.tokenizer == "hf_json":
    folder = os.path.dirname(rel)
    names += [os.path.join(folder, n) for n in TOKENIZER_FILES
              if os.path.join(folder, n) != rel and os.path.isfile(os.path.join(root, folder, n))]
  for name in names:
    os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
    shutil.copyfile(os.path.join(root, name), os.path.join(dst, name))
  return dataclasses.replace(dcfg, tokenizer_model=os.path.join(dst, rel))


# --------------------------------------------------------------------------- measuring


def prompt_set(sweep: Sweep, mcfg: ModelConfig, dcfg: DataConfig) -> list[list[int]]:
  """The benchmark prompts: the first ``decode_prompt_len`` tokens of the first
  validation rows (DataConfig.seed 0), cycled to 8 rows."""
  dcfg = dataclasses.replace(dcfg, seed=0)
  sources, _ = pipeline.build_sources(dcfg, mcfg)
  key = "tokens_BT" if mcfg.arch == "decoder_only" else "src_BS"
  rows = []
  # the batches that hold the rows (until 2026-12-06 eight batches were made for eight rows)
  batches = -(-max(DECODE_BATCHES) // dcfg.batch_size)
  for batch in pipeline.validation_batches(sources, dcfg, batches):
    # The rows that only fill up the last batch are not examples.
    for row in np.asarray(batch[key])[batch[pipeline.EXAMPLE_MASK]]:
      row = row[row != mcfg.pad_id] if mcfg.arch == "encoder_decoder" else row
      rows.append([int(t) for t in row[:sweep.decode_prompt_len]])
    if len(rows) >= max(DECODE_BATCHES):
      break
  rows = [r for r in rows if r] or [[mcfg.pad_id + 3]]
  return [rows[i % len(rows)] for i in range(max(DECODE_BATCHES))]


def decode_tokens_per_s(model, prompts: list[list[int]], batch: int, new_tokens: int,
                        repeats: int) -> float:
  """Cached greedy decode throughput (generated tokens / s, best of ``repeats``
  after a compile run) on the first ``batch`` prompts, no early stop."""
  rows = prompts[:batch]
  cfg = model.cfg
  width = max(len(r) for r in rows)
  prompt_BT = np.full((batch, width), cfg.pad_id, np.int32)
  for b, r in enumerate(rows):
    prompt_BT[b, :len(r)] = r
  kwargs = dict(max_new_tokens=new_tokens, eos_id=None, bucket=False)  # one width
  if cfg.arch == "decoder_only":
    kwargs["prompt_lengths_B"] = np.array([len(r) for r in rows], np.int32)
  jax.block_until_ready(generate(model, prompt_BT, **kwargs))
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(generate(model, prompt_BT, **kwargs))
    best = min(best, time.perf_counter() - t0)
  return batch * new_tokens / best


def _run_records(workdir: str) -> list[dict]:
  """workdir/metrics.jsonl's records ([] without one), read once per measurement (twice
  until 2026-12-06, which warned twice of a cut-short line)."""
  return read_metrics(workdir) if os.path.isfile(os.path.join(workdir, "metrics.jsonl")) else []


def _eval_records(records: list[dict]) -> dict[int, dict]:
  """The last eval record of every step (a resumed run may have logged a step twice)."""
  return {r["step"]: r for r in records if r["split"] == "eval"}


def train_rate(records: list[dict]) -> float | None:
  """The median tokens/s of a run's logged training windows, leaving out those that hold
  a compilation (the first window of every process, flagged by the trainer: a resume
  compiles again). The last record of a step counts (a resume logs again what it redoes).
  Records written before the flag (2026-12-03) leave out the first window only. None when
  no window is left."""
  train = {r["step"]: r for r in records if r["split"] == "train"}
  ordered = [train[s] for s in sorted(train)]
  if not any(WINDOW_HOLDS_COMPILE in r for r in records):
    ordered = ordered[1:]
  rates = [r["tokens_per_s"] for r in ordered if not r.get(WINDOW_HOLDS_COMPILE)]
  return statistics.median(rates) if rates else None


def best_eval_step(evals: dict) -> int:
  """The step of the lowest validation loss among ``{step: record}``; a nan loss (no counted
  token) is never the best, nor does it hide one (a nan that came first was picked until
  2026-12-04: nan compares False)."""
  return min(evals, key=lambda s: (math.isnan(float(evals[s]["loss"])), float(evals[s]["loss"]),
                                   s))


def measure(workdir: str, mcfg: ModelConfig, dcfg: DataConfig, tcfg: TrainConfig,
            sweep: Sweep, prompts) -> dict:
  """The measurements of a finished run (see the module docstring of report)."""
  records = _run_records(workdir)
  evals = _eval_records(records)
  if tcfg.steps not in evals:
    final = trainer.evaluate_workdir(workdir, tcfg.steps)
    evals[tcfg.steps] = {"step": tcfg.steps, **final}
  curve = [[s, float(evals[s]["loss"])] for s in sorted(evals)]
  best_step = best_eval_step(evals)
  rate = train_rate(records)
  total, attn = param_counts(mcfg)
  out = {
      "params": total, "attention_params": attn, "d_ff": mcfg.d_ff,
      "num_kv_heads": mcfg.num_kv_heads, "kv_bytes_per_token": mcfg.kv_cache_bytes_per_token(),
      "steps": tcfg.steps, "tokens_per_step": dcfg.batch_size * dcfg.seq_len,
      "val_loss": float(evals[tcfg.steps]["loss"]),
      "val_ppl": perplexity(float(evals[tcfg.steps]["loss"])),
      "best_val_loss": float(evals[best_step]["loss"]),
      "best_val_ppl": perplexity(float(evals[best_step]["loss"])),
      "train_tokens_per_s": rate, "curve": curve,
  }
  for key in ("exact_match", "bleu"):
    if key in evals[tcfg.steps]:
      out[key] = float(evals[tcfg.steps][key])
  model, _ = load_checkpoint(workdir, tcfg.steps)
  for b in DECODE_BATCHES:
    out[f"decode_tokens_per_s_b{b}"] = decode_tokens_per_s(
        model, prompts, b, sweep.decode_new_tokens, sweep.decode_repeats)
  return out


# --------------------------------------------------------------------------- running


class SweepInterrupted(Exception):
  """A sweep was stopped by SIGTERM / SIGINT (what its runs trained is saved)."""


def _add_wall(workdir: str, seconds: float) -> float:
  """The run's wall time so far, ``seconds`` added (kept in ``wall_time_s``, written
  atomically). A file that does not hold a number (a write cut off by a kill before
  2026-12-04 left it empty, and every rerun then failed on it) counts from 0, with a
  warning naming it."""
  path = os.path.join(workdir, WALL_FILE)
  before = 0.0
  if os.path.isfile(path):
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
    try:
      before = float(text)
    except ValueError:
      before = math.nan
    if not (math.isfinite(before) and before >= 0):
      log.warning("%s holds %r, not a number of seconds: the run's wall time counts from "
                  "this invocation", path, text[:40])
      before = 0.0
  os.makedirs(workdir, exist_ok=True)
  trainer.write_text_atomically(path, f"{before + seconds:.3f}")
  return before + seconds


def _read_conversion(path: str) -> dict:
  """An uptraining run's conversion.json (``_prepare_uptrain`` writes it atomically).

  Raises:
    ValueError: not JSON, or without a numeric ``val_loss_converted`` and an integer
      ``source_step``; names the file (the run is then recorded as failed with it).
  """
  fix = f"delete {os.path.dirname(path)} to convert and uptrain that run again"
  try:
    with open(path, encoding="utf-8") as f:
      info = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not JSON ({e}); {fix}") from None
  if not (isinstance(info, dict) and _is_number(info.get("val_loss_converted"))
          and _is_number(info.get("source_step"), int)):
    raise ValueError(f"{path} is not a conversion record attnlab wrote (it needs a numeric "
                     f"val_loss_converted and an integer source_step); {fix}")
  return info


def _prepare_uptrain(out, arm, seed, source, configs) -> dict:
  """Convert the MHA run of ``seed`` into the uptraining run (once) and record
  the validation loss right after conversion."""
  workdir = run_dir(out, arm, seed)
  conv_path = os.path.join(workdir, CONVERSION_FILE)
  if os.path.isfile(conv_path):
    return _read_conversion(conv_path)
  src_result = read_result(out, source, seed)
  if src_result is None or src_result.get("status") != "ok":
    raise RuntimeError(f"arm {arm.name!r} converts the finished {source.name!r} run of seed "
                       f"{seed}, which has not finished (run --arm {source.name} first)")
  # The MHA run's final checkpoint, as the report compares against its final loss (until
  # 2026-12-06 a damaged one was skipped for the one before, named only in a warning).
  src = run_dir(out, source, seed)
  final = config_gin.read_workdir_config(os.path.join(src, CONFIG_FILE))[2].steps
  # A conversion cut short (or an attempt that failed before it: its source unfinished) is
  # made again in a folder of its own beside the run's (ARM/.seed_S.converting: the same
  # filesystem, so renames move it), while the run's folder keeps its records of the
  # attempts (the earlier failure, the wall time); the finished conversion takes them along
  # and replaces the run's folder by two renames. Until 2026-12-06 the folder was emptied
  # first, and a kill during the conversion lost them.
  arm_dir = os.path.dirname(workdir)
  tmp = os.path.join(arm_dir, f".seed_{seed}{CONVERTING_SUFFIX}")
  replaced = os.path.join(arm_dir, f".seed_{seed}{REPLACED_SUFFIX}")
  if not os.path.isdir(workdir) and os.path.isdir(tmp):  # a kill between the two renames:
    os.replace(tmp, workdir)  # the second, now (the records are in the new run only)
  kept = {}
  for name in ATTEMPT_FILES:
    path = os.path.join(workdir, name)
    if os.path.isfile(path):
      with open(path, "rb") as f:
        kept[name] = f.read()
  for leftover in (tmp, replaced):
    if os.path.isdir(leftover):
      shutil.rmtree(leftover)
  mcfg, dcfg, tcfg = configs
  train_fields = {f.name: getattr(tcfg, f.name) for f in dataclasses.fields(tcfg)}
  try:
    info = write_converted_run(src, tmp, arm.num_kv_heads, arm.method, step=final, seed=seed,
                               bindings={"TrainConfig": train_fields,
                                         "DataConfig": {"seed": dcfg.seed}})
  except UnreadableCheckpointError as e:
    raise RuntimeError(
        f"arm {arm.name!r} converts the final checkpoint (step {final}) of the {source.name!r} "
        f"run of seed {seed}, which does not read ({e}); to train that step again, delete "
        f"{os.path.join(src, RESULT_FILE)} and {os.path.join(src, CHECKPOINT_DIR, str(final))} "
        "and rerun") from None
  for name, data in kept.items():
    with open(os.path.join(tmp, name), "wb") as f:
      f.write(data)
  if os.path.isdir(workdir):
    os.replace(workdir, replaced)
  os.replace(tmp, workdir)
  shutil.rmtree(replaced, ignore_errors=True)
  info["val_loss_converted"] = float(trainer.evaluate_workdir(workdir, 0)["loss"])
  _write_json(conv_path, info)
  return info


def mha_arm(arms: list[Arm], mcfg: ModelConfig) -> Arm | None:
  """The from-scratch arm with K = N (the uptraining arms' source)."""
  return next((a for a in arms if a.kind == "scratch" and a.num_kv_heads == mcfg.num_heads),
              None)


def _retire_failure(workdir: str) -> None:
  """Move a failed attempt's result.json aside (``PREVIOUS_FAILURE_FILE``) as the run is
  retried: a retry stopped before it writes its own result (a signal, a kill) leaves the
  run interrupted (its checkpoints) or pending, as it is. Until 2026-12-04 the stale
  "failed" stayed, and the report showed a resumable run as failed."""
  path = os.path.join(workdir, RESULT_FILE)
  if os.path.isfile(path):
    os.replace(path, os.path.join(workdir, PREVIOUS_FAILURE_FILE))


def run_one(out: str, sweep: Sweep, arm: Arm, seed: int, base, prompts, source=None,
            stop: trainer.StopFlag | None = None) -> dict:
  """Train (or resume) and measure one run; its result (also in result.json).

  A result.json already there is a failed attempt's (``run_sweep`` retries only runs
  without an "ok" one): it is moved aside first (``_retire_failure``).

  Args:
    source: the uptraining arms' source arm (the MHA arm).
    stop: the sweep's signal flag (``run_sweep``'s), set by SIGTERM / SIGINT.

  Raises:
    SweepInterrupted: a signal stopped the trainer before the last step, or came while
      the run was set up or trained (its checkpoint saved; the run is measured by the
      rerun, not now: a preempted job's grace period is short).
  """
  configs = run_configs(sweep, arm, seed, *base)
  mcfg, dcfg, tcfg = configs
  workdir = run_dir(out, arm, seed)
  _retire_failure(workdir)
  t0 = time.perf_counter()
  try:
    extra = {}
    if arm.kind == "uptrain":
      extra = _prepare_uptrain(out, arm, seed, source, configs)
    last = trainer.train(mcfg, tcfg, dcfg, workdir,
                         config_text=config_gin.operative_config(*configs, workdir=workdir))
    signum = None if stop is None else stop.signum
    # The step the trainer resumed from, not the newest on disk: a corrupted newest
    # checkpoint is skipped (it restores the one before).
    start = last["start_step"]
    if last["step"] < tcfg.steps or signum is not None:
      _add_wall(workdir, time.perf_counter() - t0)
      why = f" (signal {signum})" if signum is not None else ""
      if last["step"] > start:
        raise SweepInterrupted(f"arm {arm.name} seed {seed} stopped at step {last['step']}"
                               f"{why}; checkpoint saved")
      raise SweepInterrupted(f"arm {arm.name} seed {seed} stopped before training{why}, at "
                             f"step {start}")
    result = measure(workdir, mcfg, dcfg, tcfg, sweep, prompts)
    if extra:
      result.update(val_loss_converted=extra["val_loss_converted"],
                    source_step=extra["source_step"])
      converted = extra["val_loss_converted"]
      result["curve"] = [[0, converted]] + [p for p in result["curve"] if p[0] != 0]
      # The converted checkpoint is the run's step 0, and uptraining can make the loss
      # worse: the best is over the whole curve (until 2026-12-05 the trained steps only).
      if not math.isnan(converted) and not converted >= result["best_val_loss"]:
        result.update(best_val_loss=converted, best_val_ppl=perplexity(converted))
    result["status"] = "ok"
  except (SweepInterrupted, trainer.WorkdirBusyError):  # another process trains this run:
    raise  # not a failure of it (nothing recorded)
  except Exception as e:  # noqa: BLE001 - a failing run is recorded, the sweep goes on
    os.makedirs(workdir, exist_ok=True)
    trainer.write_text_atomically(os.path.join(workdir, ERROR_FILE), traceback.format_exc())
    msg = " ".join(str(e).split()) or type(e).__name__
    result = {"status": "failed", "error": f"{type(e).__name__}: {msg}"[:500]}
  result["wall_time_s"] = _add_wall(workdir, time.perf_counter() - t0)
  result.update(arm=arm.name, kind=arm.kind, method=arm.method, seed=seed,
                num_kv_heads=arm.num_kv_heads)
  _write_json(os.path.join(workdir, RESULT_FILE), result)
  return result


def _fmt_s(s: float) -> str:
  s = int(round(s))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _selected(sweep: Sweep, arms: list[Arm], only: str | None):
  """(arm, seed) of every run of the sweep, or of arm ``only``, seed by seed."""
  return [(arm, seed) for seed in sweep.seeds for arm in arms
          if only is None or arm.name == only]


def _latest_step(workdir: str) -> int:
  """The run's latest checkpoint step; 0 without one."""
  if not os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):
    return 0
  c = Checkpointer(workdir, read_only=True)
  try:
    return max(c.steps() or [0])
  finally:
    c.close()


def stale_runs(out: str, sweep: Sweep, arms: list[Arm], base, *,
               only: str | None = None) -> list[str]:
  """Runs in ``out`` that a rerun would reuse but that were trained with another
  config than this sweep gives them (e.g. ``Sweep.match_params``,
  ``uptrain_fraction`` or ``uptrain_learning_rate`` changed since): one line
  each, naming the run and the first line of its ``config.gin`` that differs.

  A run counts once it trained a step: finished, or a checkpoint past step 0
  (an uptraining run's step-0 checkpoint is its conversion, whose config.gin
  the trainer replaces when it starts).

  The configs are compared, not only their text: a config.gin written by an
  older attnlab, without a field added since, is not stale if that field's
  default is what this sweep gives (the run trained as this sweep would).
  """
  stale = []
  for arm, seed in _selected(sweep, arms, only):
    workdir = run_dir(out, arm, seed)
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(path):
      continue
    result = read_result(out, arm, seed)
    finished = result is not None and result.get("status") == "ok"
    if not (finished or _latest_step(workdir) > 0):
      continue
    diff = _config_difference(path, run_configs(sweep, arm, seed, *base))
    if diff is not None:
      stale.append(f"{os.path.relpath(workdir, out)} has {diff[0]!r} where this sweep "
                   f"gives {diff[1]!r}")
  return stale


def _config_difference(path: str, want_configs) -> tuple[str, str] | None:
  """None if the config.gin at ``path`` describes ``want_configs``, else its first
  difference as (that file's line, the line ``want_configs`` give)."""
  with open(path, encoding="utf-8", errors="replace") as f:
    have = f.read().splitlines()
  want = config_gin.operative_config(*want_configs,
                                     workdir=os.path.dirname(path)).splitlines()
  if have == want:
    return None
  try:  # Another attnlab's text (fields added since take their defaults) or a moved file.
    parsed = config_gin.read_workdir_config(path)
  except config_gin.GinConfigError:
    parsed = None  # a field this attnlab lacks: compare the text
  if parsed is not None:
    return configs_difference(parsed, want_configs)
  return next(((h, w) for h, w in zip(have, want, strict=False) if h != w),
              (f"{len(have)} lines", f"{len(want)} lines"))


def configs_difference(have_configs, want_configs) -> tuple[str, str] | None:
  """None if the configs are equal, else their first differing field as two gin lines
  (``have_configs``' binding, ``want_configs``')."""
  for got, cfg in zip(have_configs, want_configs, strict=True):
    for field in dataclasses.fields(cfg):
      a, b = getattr(got, field.name), getattr(cfg, field.name)
      if field.name == "tokenizer_model" and a and b:  # config.gin writes it absolute
        a, b = (os.path.realpath(x) for x in (a, b))
      if field.name == "paths" and a and b:  # and these (``operative_config``)
        a, b = (tuple(absolute_path(p) for p in x) for x in (a, b))
      if a != b:
        name = f"{type(cfg).__name__}.{field.name}"
        return f"{name} = {config_gin.gin_value(a)}", f"{name} = {config_gin.gin_value(b)}"
  return None


def check_not_stale(out: str, sweep: Sweep, arms: list[Arm], base, *,
                    only: str | None = None) -> None:
  """Raises ValueError naming the runs of ``stale_runs``, if any."""
  stale = stale_runs(out, sweep, arms, base, only=only)
  if stale:
    raise ValueError(f"{out} holds {len(stale)} run(s) trained with another config than this "
                     f"sweep's ({'; '.join(stale)}); use a new --out, or delete those runs to "
                     "train them again")


def run_sweep(out: str, sweep: Sweep, arms: list[Arm], base, *, only: str | None = None,
              stream=None) -> dict[str, int]:
  """Run every unfinished (arm, seed) of ``arms`` (or of arm ``only``).

  Prints a progress line before and after each run (arm, seed, step, ETA).

  Returns:
    {"ok": n, "failed": n, "skipped": n} of this invocation.

  Raises:
    ValueError: a run that would be skipped or resumed was trained with
      another config than this sweep gives it (``stale_runs``); nothing runs.
    SweepInterrupted: a run was stopped by a signal (rerun to resume).
  """
  check_not_stale(out, sweep, arms, base, only=only)
  stream = stream or sys.stderr
  _, _, tcfg = base
  todo, counts = [], {"ok": 0, "failed": 0, "skipped": 0}
  for arm, seed in _selected(sweep, arms, only):
    r = read_result(out, arm, seed)
    if r is not None and r.get("status") == "ok":
      counts["skipped"] += 1
      continue
    todo.append((arm, seed))
  prompts = None
  if todo:  # the benchmark prompts: made once per OUT; every run is measured on them
    prompts = prompt_set(sweep, base[0], base[1])
    prompts_path = os.path.join(out, PROMPTS_FILE)
    if not os.path.isfile(prompts_path):
      _write_json(prompts_path, prompts)
    else:
      with open(prompts_path, encoding="utf-8") as f:
        try:
          saved = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError):  # named below, as any other
          saved = None
      if saved != prompts:
        raise ValueError(f"{prompts_path} holds other benchmark prompts than this sweep "
                         "makes (another Sweep.decode_prompt_len or data, or an edited file): "
                         "its runs were measured on them; use a new --out, or delete it if "
                         "no run has finished")
  steps_of = lambda arm: tcfg.steps if arm.kind == "scratch" else uptrain_steps(sweep, tcfg)
  remaining = sum(steps_of(a) for a, _ in todo)
  done_steps, t_start = 0, time.perf_counter()
  # One flag for the whole sweep: a signal while a run is set up, converted or measured
  # stops the sweep too (the trainer's own flag only covers its steps).
  with trainer.StopFlag() as stop:
    for i, (arm, seed) in enumerate(todo):
      if stop.signum is not None:  # it came while the run before was measured
        raise SweepInterrupted(f"signal {stop.signum} before arm {arm.name} seed {seed}")
      start = _latest_step(run_dir(out, arm, seed))
      elapsed = time.perf_counter() - t_start
      eta = f"ETA {_fmt_s(elapsed / done_steps * remaining)}" if done_steps else "ETA ?"
      print(f"ablate [{i + 1}/{len(todo)}] arm={arm.name} seed={seed} step={start}/"
            f"{steps_of(arm)} {'resuming' if start else 'starting'}; sweep {eta}",
            file=stream, flush=True)
      r = run_one(out, sweep, arm, seed, base, prompts, source=mha_arm(arms, base[0]),
                  stop=stop)
      counts[r["status"]] += 1
      done_steps += steps_of(arm)
      remaining -= steps_of(arm)
      elapsed = time.perf_counter() - t_start
      ok = r["status"] == "ok"
      what = f"val_loss={r['val_loss']:.4f}" if ok else f"FAILED: {r['error']}"
      # A failed run got as far as its last checkpoint (0: it never saved one).
      reached = steps_of(arm) if ok else _latest_step(run_dir(out, arm, seed))
      eta = _fmt_s(elapsed / done_steps * remaining)  # done_steps >= 1: every run has a step
      print(f"ablate [{i + 1}/{len(todo)}] arm={arm.name} seed={seed} step={reached}/"
            f"{steps_of(arm)} {what} ({r['wall_time_s']:.0f} s); sweep ETA {eta}",
            file=stream, flush=True)
  return counts


def operative_sweep_config(sweep: Sweep, mcfg: ModelConfig, dcfg: DataConfig,
                           tcfg: TrainConfig) -> str:
  """gin text of a sweep with every field explicit (``Sweep.base`` emptied: the
  base files are folded into the three configs), so it reruns on its own."""
  text = config_gin.operative_config(dataclasses.replace(sweep, base=()), mcfg, dcfg, tcfg)
  body = text.split("\n", 2)[2]
  return ("# The operative sweep config, written by `attnlab ablate`.\n"
          "# `attnlab ablate --gin_file THIS_FILE --out ...` reruns it. The seed of each run\n"
          "# replaces TrainConfig.seed and DataConfig.seed.\n" + body)
