"""A batch-1 decode step on one device against the same step with the parameters
sharded over ``--tensor`` host devices (tensor parallelism across CPU cores).

XLA:CPU runs each op of a program on one core, so a B=1 decode step streams
its weights through one core's memory bandwidth. With the host platform split
into several devices (``--xla_force_host_platform_device_count``) and the
parameters sharded over a (1, 1, T) mesh (``attnlab.load_checkpoint(...,
mesh=)`` and ``attnlab decode --mesh_shape 1,1,T`` do the same for a
checkpoint), each device reads its share of every matrix on its own core,
and the partial results meet in an all-reduce per attention and MLP block.

The model of tools/bench_decode.py (``_bench.MODEL``: 4 layers, d_model 256,
8 / 2 heads, head dim 32, SwiGLU 688, vocab 259, float32), prompt 16, greedy,
contiguous cache; the step is (time of 240 new tokens - time of 16) / 224,
so the prefill and the call's fixed costs cancel. Each setting runs in its
own process (the device count is fixed when jax starts), started once per
round, the settings alternating; every process checks that its tokens equal
the one-device tokens. Prints each round's step times and the median ratio.

    PYTHONPATH=$PWD python tools/bench_decode_mesh.py [--tensor 2] [--rounds 3] [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import _bench

PROMPT, LONG, SHORT = 16, 240, 16


def worker(tensor: int, iters: int):
  """Runs in the subprocess: prints {"step_us": ..., "tokens": [...]} as JSON."""
  import time

  import jax
  import numpy as np
  from flax import nnx

  import attnlab
  from attnlab.training import sharding

  assert jax.device_count() == tensor, jax.devices()
  model = attnlab.build_model(_bench.attnlab_config(max_len=512), rngs=nnx.Rngs(0))
  if tensor > 1:
    mesh = sharding.make_mesh((1, 1, tensor))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    model = nnx.merge(graphdef, jax.device_put(params, sharding.param_shardings(params, mesh)),
                      rest)
  prompt = np.random.RandomState(0).randint(3, _bench.MODEL["vocab"], (1, PROMPT)).astype(np.int32)

  def run(n):
    start = time.perf_counter()
    tokens = np.asarray(attnlab.generate(model, prompt, max_new_tokens=n, eos_id=None))
    return time.perf_counter() - start, tokens

  run(LONG), run(SHORT)  # compile both
  # (best long - best short) / the steps between, as profile_decode_step.py: until
  # 2026-12-06 the best of the pairs' differences, which a slow short call biased low.
  best_long = best_short = float("inf")
  for _ in range(iters):
    long_s, tokens = run(LONG)
    best_long, best_short = min(best_long, long_s), min(best_short, run(SHORT)[0])
  step = (best_long - best_short) / (LONG - SHORT)
  print(json.dumps(dict(step_us=step * 1e6, tokens=tokens[0].tolist())))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tensor", type=_bench.positive_int, default=2,
                 help="host devices the parameters span")
  p.add_argument("--rounds", type=_bench.positive_int, default=3)
  p.add_argument("--iters", type=_bench.positive_int, default=5,
                 help="timed generate pairs per process")
  p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker is not None:
    return worker(args.worker, args.iters)
  import numpy as np

  def measure(devices):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
    res = subprocess.run([sys.executable, __file__, "--worker", str(devices), "--iters",
                          str(args.iters)], env=env, capture_output=True, text=True, check=False)
    if res.returncode:
      sys.exit(f"the {devices}-device worker failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])

  print(f"model {_bench.MODEL}, float32, B=1, prompt {PROMPT}, contiguous cache; "
        f"1 device against (1, 1, {args.tensor}); {_bench.cpu_name()}, {os.cpu_count()} cores",
        flush=True)
  ratios = []
  for r in range(args.rounds):
    order = (1, args.tensor) if r % 2 == 0 else (args.tensor, 1)
    got = {d: measure(d) for d in order}
    if got[1]["tokens"] != got[args.tensor]["tokens"]:
      sys.exit(f"round {r}: the tokens differ on {args.tensor} devices")
    ratios.append(got[1]["step_us"] / got[args.tensor]["step_us"])
    load = os.getloadavg()[0]
    print(f"round {r}: step {got[1]['step_us']:.1f} us on 1 device, "
          f"{got[args.tensor]['step_us']:.1f} us on {args.tensor} ({ratios[-1]:.2f}x; "
          f"{1e6 / got[args.tensor]['step_us']:.0f} tok/s; load average {load:.2f})", flush=True)
  print(json.dumps(dict(cpu=_bench.cpu_name(), tensor=args.tensor, rounds=args.rounds,
                        speedup_median=round(float(np.median(ratios)), 2),
                        speedup_per_round=[round(x, 2) for x in ratios])))


if __name__ == "__main__":
  main()
