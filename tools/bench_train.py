"""Train-step throughput: attnlab (JAX, XLA:CPU) vs transformers' Llama (torch).

Config: 4 layers, d_model 256, 8 heads / 2 KV heads, head dim 32, SwiGLU 688,
seq 256, batch 8, float32, AdamW. Rounds alternate between the two so both
see the same machine load; prints tokens/s, the ratio and attnlab's compile
time (the first train step).

    python tools/bench_train.py [--rounds 5] [--steps 5]
        [--torch_python /tmp/hfvenv/bin/python]   # a venv with torch + transformers
    python tools/bench_train.py --compile_only [--attention_impl reference]
        [--compilation_cache /tmp/xla_cache]      # run twice: cold, then a cache hit

The torch side runs in a worker process (this same file, ``--torch_worker``)
under ``--torch_python`` when given, else under this interpreter if it has
transformers; otherwise only attnlab is measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CFG = dict(layers=4, d_model=256, heads=8, kv_heads=2, head_dim=32, d_ff=688, seq=256,
           batch=8, vocab=259)


def torch_worker():
  """Reads a step count per line from stdin; prints the seconds they took."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=CFG["vocab"], hidden_size=CFG["d_model"],
                    intermediate_size=CFG["d_ff"], num_hidden_layers=CFG["layers"],
                    num_attention_heads=CFG["heads"], num_key_value_heads=CFG["kv_heads"],
                    head_dim=CFG["head_dim"], max_position_embeddings=CFG["seq"],
                    tie_word_embeddings=True)
  model = LlamaForCausalLM(cfg).float()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
  x = torch.randint(3, CFG["vocab"], (CFG["batch"], CFG["seq"]))

  def step():
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

  step()
  print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
  for line in sys.stdin:
    n = int(line)
    t0 = time.perf_counter()
    for _ in range(n):
      step()
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


def attnlab_setup(attention_impl: str = "auto", cache_dir: str | None = None):
  import jax

  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
  import numpy as np

  from attnlab.config import ModelConfig, TrainConfig
  from attnlab.training import sharding, steps

  mcfg = ModelConfig(vocab_size=CFG["vocab"], d_model=CFG["d_model"], num_layers=CFG["layers"],
                     num_heads=CFG["heads"], num_kv_heads=CFG["kv_heads"],
                     head_dim=CFG["head_dim"], d_ff=CFG["d_ff"], mlp="swiglu",
                     dtype="float32", attention_impl=attention_impl)
  tcfg = TrainConfig(steps=1000, warmup_steps=0, schedule="constant", learning_rate=1e-4,
                     grad_clip=0.0, mesh_shape=(1, 1, 1))
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  step_fn = steps.make_train_step(setup, tcfg)
  rng = np.random.default_rng(0)
  B, T = CFG["batch"], CFG["seq"]
  tokens = rng.integers(3, CFG["vocab"], (B, T + 1)).astype(np.int32)
  batch = steps.put_batch(dict(
      tokens_BT=tokens[:, :-1], targets_BT=tokens[:, 1:],
      segment_ids_BT=np.ones((B, T), np.int32),
      positions_BT=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
      loss_mask_BT=np.ones((B, T), np.float32)), setup)
  # The first step, phase by phase: trace (Python -> jaxpr), lower (-> HLO),
  # XLA compile (or a persistent-cache hit), the first execution.
  times = {}
  t0 = time.perf_counter()
  traced = step_fn.trace(state, batch)
  times["trace"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  lowered = traced.lower()
  times["lower"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = lowered.compile()
  times["compile"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  state, m = compiled(state, batch)
  jax.block_until_ready(m)
  times["first_run"] = time.perf_counter() - t0
  holder = {"state": state}

  def run(n):
    t0 = time.perf_counter()
    for _ in range(n):
      holder["state"], m = compiled(holder["state"], batch)
    jax.block_until_ready(m)
    return time.perf_counter() - t0

  return run, times


def _first_step_line(times: dict, impl: str) -> str:
  parts = ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
  total = sum(times.values())
  return f"attnlab first train step (attention_impl={impl!r}): {total:.2f} s = {parts}"


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=5, help="train steps per round")
  p.add_argument("--torch_python", default=None)
  p.add_argument("--attention_impl", default="auto", help="ModelConfig.attention_impl")
  p.add_argument("--compilation_cache", default=None, metavar="DIR",
                 help="persistent compilation cache (a second run measures a cache hit)")
  p.add_argument("--compile_only", action="store_true",
                 help="measure the first step only (no throughput rounds, no torch)")
  p.add_argument("--torch_worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.torch_worker:
    return torch_worker()
  tokens_per_step = CFG["batch"] * CFG["seq"]
  worker = None
  python = args.torch_python
  if args.compile_only:
    run, times = attnlab_setup(args.attention_impl, args.compilation_cache)
    print(_first_step_line(times, args.attention_impl))
    return None
  if python is None:
    try:
      import torch  # noqa: F401
      import transformers  # noqa: F401
      python = sys.executable
    except ImportError:
      print("torch / transformers not found: measuring attnlab only "
            "(--torch_python PATH to compare)")
  if python:
    worker = subprocess.Popen([python, __file__, "--torch_worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    worker.stdout.readline()  # its first (warm-up) step is done
  run, times = attnlab_setup(args.attention_impl, args.compilation_cache)
  run(1)
  ours, theirs = [], []
  for _ in range(args.rounds):
    ours.append(run(args.steps))
    if worker:
      worker.stdin.write(f"{args.steps}\n")
      worker.stdin.flush()
      theirs.append(json.loads(worker.stdout.readline())["seconds"])
  if worker:
    worker.stdin.close()
    worker.wait()
  best = lambda ts: tokens_per_step * args.steps / min(ts)
  print(f"config: {CFG}, float32, AdamW; {args.rounds} rounds x {args.steps} steps, best round")
  print(f"attnlab  train step: {best(ours):10.0f} tokens/s")
  print(_first_step_line(times, args.attention_impl))
  if theirs:
    print(f"torch HF train step: {best(theirs):10.0f} tokens/s")
    print(f"ratio attnlab / torch: {best(ours) / best(theirs):.2f}x")


if __name__ == "__main__":
  main()
