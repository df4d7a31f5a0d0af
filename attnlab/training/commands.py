"""``attnlab train`` and ``attnlab eval`` (dispatched from attnlab/cli.py).

    attnlab train --gin_file configs/lm_stdlib_tiny.gin [--gin_file more.gin]
                  [--gin.TrainConfig.steps=200 ...] --workdir runs/x
    attnlab train --workdir runs/x     # no --gin_file: runs/x/config.gin
    attnlab eval  --workdir runs/x [--step N]

Bindings given with ``--gin.NAME=VALUE`` are applied after all files, so
they win. Every config is validated before anything is written: a bad
binding, a missing file or include, or a wrong value is one error line and
exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from attnlab.cli import CommandError


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise CommandError(message)


def _split_gin_flags(argv: list[str]) -> tuple[list[str], list[str]]:
  """(``--gin.NAME=VALUE`` bindings as "NAME=VALUE", the other args)."""
  bindings, rest = [], []
  it = iter(argv)
  for arg in it:
    if arg.startswith("--gin."):
      body = arg[len("--gin."):]
      if "=" not in body:
        value = next(it, None)
        if value is None:
          raise CommandError(f"{arg} needs a value: --gin.NAME=VALUE")
        body = f"{body}={value}"
      name, value = body.split("=", 1)
      bindings.append(f"{name} = {value}")
    else:
      rest.append(arg)
  return bindings, rest


def _add_distributed_flags(p):
  p.add_argument("--coordinator_address", default=None,
                 help="multi-host: host:port of process 0 (or $JAX_COORDINATOR_ADDRESS)")
  p.add_argument("--num_processes", type=int, default=None,
                 help="multi-host: number of processes (or $JAX_NUM_PROCESSES)")
  p.add_argument("--process_id", type=int, default=None,
                 help="multi-host: this process's index (or $JAX_PROCESS_ID)")


def _add_cache_flag(p):
  p.add_argument("--compilation_cache", default=None, metavar="DIR",
                 help="persistent XLA compilation cache (e.g. WORKDIR/xla_cache): a rerun or "
                      "resume of the same config skips compiling (or $JAX_COMPILATION_CACHE_DIR)")


def use_compilation_cache(path: str | None) -> None:
  """Point JAX's persistent compilation cache at ``path`` (None: leave as is).

  Must run before the first compilation. Only programs that took at least
  ``jax_persistent_cache_min_compile_time_secs`` (default 1 s) to compile are
  stored: the train / eval steps and generation, not the small eager ops.
  """
  if not path:
    return
  import jax

  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))


def train_main(argv: list[str]) -> int:
  bindings, rest = _split_gin_flags(argv)
  p = _Parser(prog="attnlab train", description="Train a model from gin config files.")
  p.add_argument("--gin_file", action="append", default=[], help="a gin file (repeatable)")
  p.add_argument("--workdir", required=True, help="checkpoints, config.gin, metrics")
  _add_distributed_flags(p)
  _add_cache_flag(p)
  args = p.parse_args(rest)
  if not args.gin_file:
    # A prepared workdir (e.g. `attnlab convert-heads --to`) trains from its config.gin.
    if not os.path.isfile(os.path.join(args.workdir, "config.gin")):
      raise CommandError("at least one --gin_file is needed (or a --workdir with a config.gin)")
    args.gin_file = [os.path.join(args.workdir, "config.gin")]

  from attnlab.training import gin_config

  try:
    mcfg, dcfg, tcfg = gin_config.parse(args.gin_file, bindings)
  except gin_config.GinConfigError as e:
    raise CommandError(str(e)) from None

  from attnlab.training import sharding, trainer

  use_compilation_cache(args.compilation_cache)
  sharding.initialize_distributed(args.coordinator_address, args.num_processes,
                                  args.process_id)
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  config_text = gin_config.operative_config(mcfg, dcfg, tcfg)
  try:
    # Data and mesh are checked before the workdir is created.
    trainer_run_check(mcfg, tcfg, dcfg)
  except (ValueError, FileNotFoundError, ImportError) as e:
    raise CommandError(str(e)) from None
  try:
    last = trainer.train(mcfg, tcfg, dcfg, args.workdir, config_text=config_text)
  except trainer.NonFiniteError as e:
    print(f"attnlab train: {e}", file=sys.stderr)
    return 1
  print(json.dumps({"workdir": os.path.abspath(args.workdir), **last}))
  return 0


def trainer_run_check(mcfg, tcfg, dcfg) -> None:
  """Fail fast (before writing anything) on a mesh or data the run cannot use."""
  import jax

  from attnlab.data import pipeline
  from attnlab.training import sharding, trainer

  mesh = sharding.make_mesh(tcfg.mesh_shape, jax.devices())
  trainer.check_batch_layout(tcfg, dcfg, mesh)
  if dcfg.task == "tsv":
    pipeline.build_sources(dcfg, mcfg)
  elif dcfg.task == "lm":
    from attnlab.data import text

    text.lm_files(dcfg.paths, validation_percent=dcfg.validation_percent,
                  max_files=dcfg.max_files)
  else:
    pipeline.build_sources(dcfg, mcfg)


def eval_main(argv: list[str]) -> int:
  p = _Parser(prog="attnlab eval", description="Validation metrics of a checkpoint.")
  p.add_argument("--workdir", required=True)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  _add_cache_flag(p)
  args = p.parse_args(argv)
  use_compilation_cache(args.compilation_cache)

  from attnlab.training import trainer

  try:
    out = trainer.evaluate_workdir(args.workdir, args.step)
  except (FileNotFoundError, ValueError) as e:
    raise CommandError(str(e)) from None
  print(json.dumps(out))
  return 0
