"""Time to load a checkpoint for decoding, in fresh processes.

``attnlab.load_checkpoint`` (the parameters restored into their shapes, never
initialized) against building the model eagerly and restoring over it (what it
did before). Each way runs in its own fresh Python process (the first load in
a process pays XLA's compilation of every op it runs), ``--rounds`` times,
alternating; prints the seconds of each load and checks that both give the
same parameters.

    PYTHONPATH=$PWD python tools/bench_load_checkpoint.py --workdir runs/demo [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _bench  # noqa: E402 - tools/ is on sys.path (run as a script)


def _child(workdir: str, way: str) -> None:
  import jax
  import numpy as np
  from flax import nnx

  import attnlab
  from attnlab import config_gin
  from attnlab.training.checkpoint import CONFIG_FILE, Checkpointer

  t0 = time.perf_counter()
  if way == "load_checkpoint":
    model, _ = attnlab.load_checkpoint(workdir)
  else:
    mcfg, _, _ = config_gin.read_workdir_config(f"{workdir}/{CONFIG_FILE}")
    model = attnlab.build_model(mcfg, rngs=nnx.Rngs(params=0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ckpt = Checkpointer(workdir, read_only=True)
    try:
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
      # the step load_checkpoint takes: the newest that reads
      _, params = ckpt.read_step(None, lambda s: ckpt.restore_params(s, abstract))
    finally:
      ckpt.close()
    model = nnx.merge(graphdef, params, rest)
  seconds = time.perf_counter() - t0
  total = sum(float(np.asarray(x, np.float64).sum())
              for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(json.dumps({"seconds": seconds, "param_sum": total}))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--rounds", type=_bench.positive_int, default=2)
  p.add_argument("--child", choices=("load_checkpoint", "eager"), help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    _child(args.workdir, args.child)
    return
  config = os.path.join(args.workdir, "config.gin")  # without importing JAX here
  if not os.path.isfile(config):  # a traceback until 2026-12-04
    p.error(f"{config} does not exist: not a training workdir")
  print(_bench.header(), flush=True)
  results = {"load_checkpoint": [], "eager": []}
  sums = set()
  for _ in range(args.rounds):
    for way in results:
      res = subprocess.run([sys.executable, __file__, "--workdir", args.workdir, "--child", way],
                           capture_output=True, text=True)
      if res.returncode:  # the child's own error, not a bare CalledProcessError
        sys.exit(f"the {way} load failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
      row = json.loads(res.stdout.strip().splitlines()[-1])
      results[way].append(round(row["seconds"], 2))
      sums.add(row["param_sum"])
  for way, seconds in results.items():
    print(f"{way:16s} seconds per first load: {seconds}")
  print("same parameters:", len(sums) == 1)


if __name__ == "__main__":
  main()
