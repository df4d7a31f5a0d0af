"""Run by test_sharding.py in a subprocess with 8 forced host devices:
trains the same tiny config (with gradient accumulation) on a 1-device mesh
and on a (2, 2, 2) mesh, recording losses and gradient norms and the validation loss of
5 rows (a batch filled up to the data shards on the larger mesh),
restores the (2, 2, 2) checkpoint onto a (1, 2, 4) mesh, evaluates it as ``attnlab eval``
does on (1, 1, 1) and (8, 1, 1) meshes, and prints JSON."""

import dataclasses
import json
import logging
import os
import sys

# Appended: the test session's flags (tests/conftest.py) are kept.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from attnlab import config_gin as gin_config  # noqa: E402
from attnlab.config import DataConfig, ModelConfig, TrainConfig  # noqa: E402
from attnlab.data import pipeline  # noqa: E402
from attnlab.training import sharding, steps  # noqa: E402
from attnlab.training.checkpoint import Checkpointer  # noqa: E402
from attnlab.training.evaluate import validation_loss  # noqa: E402
from attnlab.training.trainer import Run, evaluate_workdir  # noqa: E402


class FirstRows:
  """The first ``size`` rows of a source."""

  def __init__(self, source, size):
    self.source, self.size = source, size

  def batch(self, indices):
    return self.source.batch(indices)


def placement(state):
  """Where a train state lives: {"part spec on N devices": how many leaves}."""
  counts = {}
  for part in ("params", "opt_state", "step"):
    for leaf in jax.tree.leaves(state[part]):
      where = getattr(leaf.sharding, "spec", type(leaf.sharding).__name__)
      key = f"{part} {where} on {len(leaf.sharding.device_set)}"
      counts[key] = counts.get(key, 0) + 1
  return counts


def main(workdir):
  mcfg = ModelConfig(d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                     d_ff=64)
  dcfg = DataConfig(task="reverse", seq_len=32, batch_size=8)
  tcfg = TrainConfig(steps=6, warmup_steps=2, learning_rate=3e-3, grad_accum=2, progress=False)
  out = {"devices": jax.device_count()}
  sources, _ = pipeline.build_sources(dcfg, mcfg)
  # 5 validation rows: one batch of 5 on one device; on (2, 2, 2) (4 data shards) one of 8,
  # 3 of them filling rows that must add nothing to the loss.
  sources = dict(sources, validation=FirstRows(sources["validation"], 5))
  warnings = []  # init_train's warnings (an idle mesh axis)
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: warnings.append(record.getMessage())
  steps.log.addHandler(handler)
  for shape in [(1, 1, 1), (2, 2, 2)]:
    mesh = sharding.make_mesh(shape)
    run = Run(mcfg, tcfg, dcfg, mesh, sources)
    out[f"init warnings {shape}"] = list(warnings)
    warnings[:] = []
    out[f"placement at init {shape}"] = placement(run.state)
    step_fn = steps.make_train_step(run.setup, tcfg)
    losses, grad_norms = [], []
    for _ in range(tcfg.steps):
      run.state, m = step_fn(run.state, run.put(next(run.data)))
      losses.append(float(m["loss"]))
      grad_norms.append(float(m["grad_norm"]))
    out[str(shape)] = losses
    batches = run.validation_batches()
    out[f"validation rows {shape}"] = [len(b["targets_BT"]) for b in batches]
    out[f"validation {shape}"] = validation_loss(run.eval_step, run.state["params"], batches,
                                                 run.put)
    # AdamW (+ clipping) hides a constant gradient scale: compare gradients too.
    out[f"grad_norm {shape}"] = grad_norms
    out[f"placement after training {shape}"] = placement(run.state)
    if shape == (2, 2, 2):
      ckpt = Checkpointer(workdir)
      ckpt.save(tcfg.steps, run.state, run.data.get_state())
      saved = [np.asarray(x) for x in jax.tree.leaves(run.state["params"])]
  # Restore onto another mesh shape.
  run = Run(mcfg, tcfg, dcfg, sharding.make_mesh((1, 2, 4)), sources)
  fresh = placement(run.state)
  step = run.restore(Checkpointer(workdir))
  out["restore_placement"] = [fresh, placement(run.state)]
  restored = [np.asarray(x) for x in jax.tree.leaves(run.state["params"])]
  out["restore_step"] = step
  out["restore_equal"] = all(np.array_equal(a, b) for a, b in zip(saved, restored))
  out["restore_mesh"] = dict(run.mesh.shape)
  # attnlab eval on an (8, 1, 1) mesh: 8 rows on 8 data shards, whatever grad_accum the run
  # trained with (an evaluation accumulates nothing; it was refused before 2026-12-04).
  with open(os.path.join(workdir, "config.gin"), "w") as f:
    f.write(gin_config.operative_config(mcfg, dcfg, dataclasses.replace(tcfg, eval_batches=1)))
  for shape in [(1, 1, 1), (8, 1, 1)]:
    out[f"evaluate_workdir {shape}"] = evaluate_workdir(workdir, mesh_shape=shape)["loss"]
  # A batch the run's mesh (-1, 1, 1: 8 data shards here) cannot split: `attnlab eval`
  # names the way out as for a mesh of too many devices (it named grad_accum, not the mesh).
  from attnlab.commands import CommandError
  from attnlab.commands import eval as eval_command

  with open(os.path.join(workdir, "config.gin"), "w") as f:
    f.write(gin_config.operative_config(mcfg, dataclasses.replace(dcfg, batch_size=12),
                                        dataclasses.replace(tcfg, eval_batches=1)))
  try:
    eval_command.main(["--workdir", workdir])
  except CommandError as e:
    out["eval batch 12"] = str(e)
  # A tensor axis of 8 that divides no heads / kv_heads / mlp / vocab dimension: init_train
  # names it (every parameter replicated along it; no word until 2026-12-05).
  warnings[:] = []
  steps.init_train(ModelConfig(d_model=36, num_layers=1, num_heads=6, num_kv_heads=3,
                               d_ff=36), tcfg, sharding.make_mesh((1, 1, 8)))
  steps.log.removeHandler(handler)
  out["idle axis warnings"] = warnings
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
