"""``attnlab train`` (dispatched from attnlab/cli.py).

    attnlab train --gin_file configs/lm_stdlib_tiny.gin [--gin_file more.gin]
    attnlab train --workdir runs/x     # no --gin_file: runs/x/config.gin
                  [--gin.TrainConfig.steps=200 ...] --workdir runs/x

Bindings given with ``--gin.NAME=VALUE`` are applied after all files, so
they win. Every config is validated before anything is written: a bad
binding, a missing file or include, or a wrong value is one error line and
exit code 2. A signal (SIGTERM / SIGINT) saves the current step and exits 75
(``EXIT_STOPPED``; the same command resumes); a non-finite loss stops with exit 1.
"""

from __future__ import annotations

import json
import os
import sys

import jax

from attnlab import config_gin, extras
from attnlab.commands import EXIT_STOPPED, print_result
from attnlab.commands._common import (
  CommandError,
  CommandParser,
  add_cache_flag,
  check_can_make,
  gin_flags_help,
  log_attnlab_info,
  parse_gin,
  split_gin_flags,
  use_compilation_cache,
)
from attnlab.data import pipeline, text
from attnlab.ops import jax_nn
from attnlab.training import sharding, trainer


def _add_distributed_flags(p):
  p.add_argument("--coordinator_address", default=None,
                 help="multi-host: host:port of process 0 (or $JAX_COORDINATOR_ADDRESS)")
  p.add_argument("--num_processes", type=int, default=None,
                 help="multi-host: number of processes (or $JAX_NUM_PROCESSES)")
  p.add_argument("--process_id", type=int, default=None,
                 help="multi-host: this process's index (or $JAX_PROCESS_ID)")


def main(argv: list[str]) -> int:
  bindings, rest = split_gin_flags(argv)
  p = CommandParser(prog="attnlab train", description="Train a model from gin config files.",
                    epilog=gin_flags_help("ModelConfig, DataConfig and TrainConfig"))
  p.add_argument("--gin_file", action="append", default=[],
                 help="a gin file (repeatable); a name that is no file, e.g. lm_stdlib_tiny.gin "
                      "or models/llama_tiny.gin, is attnlab's built-in config of that name")
  p.add_argument("--workdir", required=True, help="checkpoints, config.gin, metrics")
  _add_distributed_flags(p)
  add_cache_flag(p)
  args = p.parse_args(rest)
  if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
    raise CommandError(f"--workdir {args.workdir} is a file, not a directory")
  if not args.gin_file:
    # A prepared workdir (e.g. `attnlab convert-heads --to`) trains from its config.gin.
    if not os.path.isfile(os.path.join(args.workdir, "config.gin")):
      raise CommandError("at least one --gin_file is needed (or a --workdir with a config.gin)")
    args.gin_file = [os.path.join(args.workdir, "config.gin")]
  own = os.path.join(args.workdir, "config.gin")
  if len(args.gin_file) == 1 and os.path.isfile(own) and os.path.isfile(args.gin_file[0]) \
      and os.path.samefile(args.gin_file[0], own):
    # The run's own config.gin (a resume, or a prepared workdir): read as a saved one, a
    # DataConfig field its task does not read (written before 2026-12-06) as the default.
    try:
      mcfg, dcfg, tcfg = config_gin.parse_saved(own, bindings)
    except config_gin.GinConfigError as e:
      raise CommandError(str(e)) from None
  else:
    mcfg, dcfg, tcfg = parse_gin(args.gin_file, bindings)

  try:
    sharding.initialize_distributed(args.coordinator_address, args.num_processes,
                                    args.process_id)
  except ValueError as e:
    raise CommandError(str(e)) from None
  log_attnlab_info()
  config_text = config_gin.operative_config(mcfg, dcfg, tcfg, workdir=args.workdir)
  try:
    # Data and mesh are checked before the workdir is created.
    check_can_make("--workdir", args.workdir)
    sources, tokenizer = trainer_run_check(mcfg, tcfg, dcfg)
  except (ValueError, FileNotFoundError, ImportError) as e:
    raise CommandError(str(e)) from None
  use_compilation_cache(args.compilation_cache)  # after the checks: nothing made before
  try:
    last = trainer.train(mcfg, tcfg, dcfg, args.workdir, config_text=config_text,
                         sources=sources, tokenizer=tokenizer)
  except (trainer.NonFiniteError, trainer.SaveError) as e:
    print(f"attnlab train: {e}", file=sys.stderr)
    return 1
  except (trainer.ResumeError, trainer.SetupError, trainer.WorkdirBusyError) as e:
    raise CommandError(str(e)) from None
  # Short of TrainConfig.steps only when a signal stopped it (its step saved).
  return print_result(json.dumps({"workdir": os.path.abspath(args.workdir), **last}),
                      EXIT_STOPPED if last["step"] < tcfg.steps else 0)


def check_batch_fits_memory(dcfg, memory: int | None = None) -> None:
  """ValueError naming batch_size and seq_len when one host batch's token ids and targets
  alone (int32 [B, T + 1] twice: a lower bound of what the pipeline makes) pass this
  machine's memory: until 2026-12-06 ``batch_size=2**30`` was a NumPy MemoryError traceback
  (or the kernel's kill) while the first batches were made."""
  memory = pipeline.physical_memory_bytes() if memory is None else memory
  need = pipeline.batch_token_bytes(dcfg)
  if memory is not None and need > memory:
    raise ValueError(f"a batch of batch_size={dcfg.batch_size} rows of seq_len={dcfg.seq_len} "
                     f"takes at least {need / 2**30:.1f} GiB on the host (int32 token ids and "
                     f"targets), more than this machine's memory ({memory / 2**30:.1f} GiB): "
                     "give a smaller DataConfig.batch_size")


def trainer_run_check(mcfg, tcfg, dcfg):
  """Fail fast (before writing anything) on a mesh, data or package the run cannot use.

  Returns ``(sources, tokenizer)`` for ``trainer.train`` to reuse, so nothing is
  built twice: the sources of a TSV or synthetic task (None for an LM corpus,
  which only the run reads) and the tokenizer.
  """
  extras.check_data_config(dcfg)
  check_batch_fits_memory(dcfg)
  # 'cudnn' off a GPU: refused before the workdir exists, not by the first step's trace
  jax_nn.check_backend(mcfg.attention_impl, "ModelConfig.attention_impl")
  # A moved or unreadable tokenizer model file: one line, not a traceback from inside Run.
  tokenizer = pipeline.make_tokenizer(dcfg.tokenizer, dcfg.tokenizer_model,
                                      bos_id=dcfg.bos_id, eos_id=dcfg.eos_id)
  mesh = sharding.make_mesh(tcfg.mesh_shape, jax.devices())
  trainer.check_batch_layout(tcfg, dcfg, mesh)
  # the model against the data (vocabulary, positions, special ids), every task: an LM run's
  # were found only by Run, which convert-heads does not build (until 2026-12-06 it wrote a
  # run that train then refused)
  pipeline.check_data_fits_model(dcfg, mcfg, tokenizer)
  if dcfg.task == "lm":  # the corpus files exist (Run reads them)
    text.lm_files(dcfg.paths, validation_percent=dcfg.validation_percent,
                  max_files=dcfg.max_files)
    return None, tokenizer
  # a TSV's pairs, or a synthetic task's split
  sources, _ = pipeline.build_sources(dcfg, mcfg, tokenizer)
  # A synthetic task's validation set has no end. Checked whatever eval_every says: `attnlab
  # eval` reads the same eval_batches from config.gin (with eval_every=0 a run trained to
  # its end, then could not be evaluated, until 2026-12-06).
  if sources["validation"].size is None:
    pipeline.check_validation_fits_memory(dcfg, tcfg.eval_batches)
  return sources, tokenizer
