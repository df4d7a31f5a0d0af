"""Peak memory and time of a resume's restore, in fresh processes.

A resume reads its checkpoint into a state of shapes (``Run(abstract_state=True)``, what
``attnlab train`` does in a workdir with checkpoints since 2026-12-07) against
initializing the whole train state first and reading the checkpoint beside it (``Run()``,
what it did before). Each way runs in its own fresh Python process, ``--rounds`` times,
alternating; each prints how far its peak resident memory (VmHWM) rose above the memory
it held before the ``Run`` was made, the seconds from there to the restored state, and a
checksum of the restored parameters (both ways must restore the same ones).

    PYTHONPATH=$PWD python tools/bench_resume.py --workdir runs/x [--rounds 2]

Without ``--workdir`` it first trains a run of its own for one step in a temporary folder
(seq2seq_reverse.gin at ``--d_model`` / ``--layers``: the default's train state is ~0.3 GB,
so that the state, not the interpreter, decides the peak), and deletes it after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import _bench  # noqa: E402 - tools/ is on sys.path (run as a script)

WAYS = ("shapes", "initialized")


def _status_bytes(field: str) -> int:
  """A field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"/proc/self/status has no {field}")


def _child(workdir: str, way: str) -> None:
  import jax
  import numpy as np

  from attnlab import config_gin
  from attnlab.training.checkpoint import CONFIG_FILE, Checkpointer
  from attnlab.training.trainer import Run

  jax.devices()
  mcfg, dcfg, tcfg = config_gin.read_workdir_config(os.path.join(workdir, CONFIG_FILE))
  before = _status_bytes("VmRSS")
  hwm_before = _status_bytes("VmHWM")
  t0 = time.perf_counter()
  run = Run(mcfg, tcfg, dcfg, abstract_state=way == "shapes")
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    step = run.restore(ckpt)
  finally:
    ckpt.close()
  jax.block_until_ready(run.state)
  seconds = time.perf_counter() - t0
  leaves = jax.tree.leaves(run.state)
  print(json.dumps({
      "step": step, "seconds": seconds,
      "peak_rise": max(_status_bytes("VmHWM"), hwm_before) - before,
      "state_bytes": sum(x.nbytes for x in leaves),
      "param_sum": sum(float(np.asarray(x, np.float64).sum())
                       for x in jax.tree.leaves(run.state["params"]))}))


def _train(workdir: str, d_model: int, layers: int) -> None:
  from attnlab.cli import main

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rc = main(["train", "--gin_file", os.path.join(repo, "configs", "seq2seq_reverse.gin"),
             "--workdir", workdir, f"--gin.ModelConfig.d_model={d_model}",
             f"--gin.ModelConfig.d_ff={4 * d_model}", f"--gin.ModelConfig.num_layers={layers}",
             "--gin.TrainConfig.steps=1", "--gin.TrainConfig.progress=False",
             "--gin.DataConfig.batch_size=8"])
  if rc:
    sys.exit(f"training the run to resume failed (exit {rc})")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", help="a training workdir with checkpoints (default: one of its "
                                   "own, trained for one step)")
  p.add_argument("--rounds", type=_bench.positive_int, default=2)
  p.add_argument("--d_model", type=_bench.positive_int, default=512)
  p.add_argument("--layers", type=_bench.positive_int, default=6)
  p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
  p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    _child(args.workdir, args.child)
    return
  if args.train:
    _train(args.workdir, args.d_model, args.layers)
    return
  own = args.workdir is None
  workdir = tempfile.mkdtemp(prefix="bench_resume_") if own else args.workdir
  try:
    if own:  # in a process of its own: this one holds no JAX state
      res = subprocess.run([sys.executable, __file__, "--train", "--workdir", workdir,
                            "--d_model", str(args.d_model), "--layers", str(args.layers)],
                           capture_output=True, text=True)
      if res.returncode:
        sys.exit(f"training the run to resume failed (exit {res.returncode}):\n"
                 f"{res.stderr[-3000:]}")
    elif not os.path.isfile(os.path.join(workdir, "config.gin")):
      p.error(f"{os.path.join(workdir, 'config.gin')} does not exist: not a training workdir")
    print(_bench.header(), flush=True)
    rows = {way: [] for way in WAYS}
    for _ in range(args.rounds):
      for way in WAYS:
        res = subprocess.run([sys.executable, __file__, "--workdir", workdir, "--child", way],
                             capture_output=True, text=True)
        if res.returncode:
          sys.exit(f"the {way} resume failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
        rows[way].append(json.loads(res.stdout.strip().splitlines()[-1]))
  finally:
    if own:
      shutil.rmtree(workdir, ignore_errors=True)
  state = rows["shapes"][0]["state_bytes"]
  print(f"train state {state / 2**20:.1f} MiB (parameters and optimizer state), step "
        f"{rows['shapes'][0]['step']}")
  for way in WAYS:
    rise = [round(r["peak_rise"] / 2**20, 1) for r in rows[way]]
    seconds = [round(r["seconds"], 2) for r in rows[way]]
    print(f"{way:12s} peak memory rise MiB {rise}  seconds {seconds}")
  best = {way: min(r["peak_rise"] for r in rows[way]) for way in WAYS}
  print(f"peak rise, initialized / shapes: {best['initialized'] / max(best['shapes'], 1):.2f}x; "
        f"in states: {best['initialized'] / state:.2f} / {best['shapes'] / state:.2f}")
  print("same parameters:", len({r["param_sum"] for way in WAYS for r in rows[way]}) == 1)


if __name__ == "__main__":
  main()
