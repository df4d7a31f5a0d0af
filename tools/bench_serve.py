"""Serving: continuous vs static batching on a mixed workload.

The demo-sized model (configs/models/decoder_tiny.gin: 4 layers, d_model 128,
4 heads, SwiGLU 352, RoPE, vocab 259; random weights, float32) serves
``--requests`` requests with prompt lengths drawn uniformly from 8..200 and
token budgets from 16..256 (fixed seed; ``eos_id=None``, so every request
runs to its budget and both policies generate exactly the same tokens).
Both policies use the same ``attnlab.generate_requests`` programs and the
same ``--slots``; "static" admits a new batch only when every request of the
previous one has finished. Each policy runs once to compile, then
``--rounds`` times in alternation (static, continuous, static, ...); the
fastest run of each is reported: tokens/s, slot occupancy (mean fraction of
the slots decoding per decode step), decode steps, and the seconds spent in
prefill and decode calls (``ServeStats``; the rest is the host loop). Both policies run the
same prefills and generate the same tokens, so the speedup is at most the
ratio of their decode steps (also printed).

    PYTHONPATH=$PWD python tools/bench_serve.py [--requests 64] [--slots 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess


def cpu_name() -> str:
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
      if line.startswith("Model name:"):
        return line.split(":", 1)[1].strip()
  except (OSError, subprocess.CalledProcessError):
    pass
  return platform.processor() or "unknown"


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--rounds", type=int, default=3, help="timed runs of each policy, alternating")
  args = p.parse_args()

  import numpy as np
  from flax import nnx

  import attnlab
  from attnlab.decoding import batching
  from attnlab.decoding.batching import POLICIES

  cfg = attnlab.ModelConfig(arch="decoder_only", vocab_size=259, d_model=128, num_layers=4,
                            num_heads=4, d_ff=352, pos="rope", norm="rmsnorm", mlp="swiglu",
                            tie_embeddings=True, max_len=1024)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  rs = np.random.RandomState(args.seed)
  lengths = rs.randint(8, 201, args.requests)
  budgets = rs.randint(16, 257, args.requests).tolist()
  prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in lengths]
  report = dict(cpu=cpu_name(), requests=args.requests, slots=args.slots,
                tokens=int(sum(budgets)))
  for policy in POLICIES:  # the first run of each compiles
    batching.serve_requests(model, prompts, budgets, slots=args.slots, page_size=args.page_size,
                            eos_id=None, policy=policy)
  best = {}
  for r in range(args.rounds):  # alternating, so machine noise hits both policies alike
    for policy in POLICIES:
      load = os.getloadavg()[0]
      _, stats = batching.serve_requests(model, prompts, budgets, slots=args.slots,
                                         page_size=args.page_size, eos_id=None, policy=policy)
      print(f"round {r}: {policy} {stats.seconds:.2f} s (load average {load:.2f})", flush=True)
      if policy not in best or stats.seconds < best[policy][0].seconds:
        best[policy] = (stats, load)
  for policy, (stats, load) in best.items():
    report[policy] = dict(tokens_per_s=round(stats.tokens_per_second, 1),
                          seconds=round(stats.seconds, 2), occupancy=round(stats.occupancy, 3),
                          decode_steps=stats.decode_steps,
                          prefill_s=round(stats.prefill_seconds, 2),
                          decode_s=round(stats.decode_seconds, 2),
                          ms_per_decode_step=round(stats.decode_seconds / stats.decode_steps * 1e3,
                                                   2),
                          load_avg_1min=round(load, 2))
    print(policy, report[policy], flush=True)
  report["speedup"] = round(report["continuous"]["tokens_per_s"]
                            / report["static"]["tokens_per_s"], 2)
  report["decode_step_ratio"] = round(report["static"]["decode_steps"]
                                      / report["continuous"]["decode_steps"], 2)
  print(json.dumps(report))


if __name__ == "__main__":
  main()
