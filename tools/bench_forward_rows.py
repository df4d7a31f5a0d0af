"""What one token costs in the model's forward, by how many tokens go through together.

tools/bench_serve.py's model (4 layers, d_model 128, float32) runs its forward
pass with no cache over token batches of different sizes: [8, 1] (one token of
each of 8 sequences: the token-wise work of a decode step at 8 slots, without
its attention over the cache) and [1, T] for prompt lengths T. Each shape runs
``--iters`` forwards in one jitted ``fori_loop`` (so dispatch does not count),
once to compile, then once per round, in alternation (reverse order every
other round); the tool prints the best microseconds per forward and per token.

What it answers: whether tokens are cheaper to compute in a larger batch. Were
they, folding prompt chunks into the decode steps (chunked prefill) would make
the prefills cheaper for continuous batching; where the cost per token is flat
from 8 tokens up, the prefills cost what they cost, whichever program runs them.

    PYTHONPATH=$PWD python tools/bench_forward_rows.py [--rounds 5] [--iters 200]
"""

from __future__ import annotations

import argparse
import json
import time

import _bench

SHAPES = ((8, 1), (1, 8), (1, 16), (1, 32), (1, 64), (1, 128))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=_bench.positive_int, default=5)
  p.add_argument("--iters", type=_bench.positive_int, default=200)
  args = p.parse_args()

  import jax
  import jax.numpy as jnp
  from flax import nnx

  model, _, _ = _bench.serve_workload(8)
  graphdef, state = nnx.split(model)

  @jax.jit
  def forwards(state, tokens_BT):
    def body(_, acc):
      # The token ids depend on the carry, so the forwards cannot be hoisted out of the loop.
      logits_BTV = nnx.merge(graphdef, state)(tokens_BT + (acc > 1e30).astype(jnp.int32))
      return acc + logits_BTV[0, 0, 0]
    return jax.lax.fori_loop(0, args.iters, body, jnp.float32(0))

  inputs = {shape: jnp.full(shape, 5, jnp.int32) for shape in SHAPES}
  for shape in SHAPES:
    jax.block_until_ready(forwards(state, inputs[shape]))  # compiles
  best = dict.fromkeys(SHAPES, float("inf"))
  for r in range(args.rounds):
    for shape in (SHAPES if r % 2 == 0 else SHAPES[::-1]):
      t0 = time.perf_counter()
      jax.block_until_ready(forwards(state, inputs[shape]))
      best[shape] = min(best[shape], (time.perf_counter() - t0) / args.iters)
  report = dict(cpu=_bench.cpu_name(), rounds=args.rounds, iters=args.iters)
  for (B, T), seconds in best.items():
    report[f"[{B}, {T}]"] = dict(us_per_forward=round(seconds * 1e6, 1),
                                 us_per_token=round(seconds * 1e6 / (B * T), 2))
  print(json.dumps(report))


if __name__ == "__main__":
  main()
