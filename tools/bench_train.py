"""Train-step throughput: attnlab (JAX, XLA:CPU) vs transformers' Llama (torch).

Config: ``_bench.MODEL`` (4 layers, d_model 256, 8 heads / 2 KV heads, head
dim 32, SwiGLU 688), seq 256, batch 8, float32, AdamW. Rounds alternate
between the two so both see the same machine load; prints tokens/s, the ratio
and attnlab's compile time (the first train step).

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

import _bench

SEQ, BATCH = 256, 8


def torch_worker():
  """Runs n AdamW train steps per stdin line (``_bench.serve_torch``)."""
  import torch

  model = _bench.llama_model(max_positions=SEQ)
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
  x = torch.randint(3, _bench.MODEL["vocab"], (BATCH, SEQ))

  def steps(n):
    for _ in range(n):
      loss = model(input_ids=x, labels=x).loss
      loss.backward()
      opt.step()
      opt.zero_grad(set_to_none=True)

  steps(1)
  _bench.serve_torch(steps, {"threads": torch.get_num_threads()})


def attnlab_setup(attention_impl: str = "auto", cache_dir: str | None = None):
  """(run(n) -> seconds of n train steps, the first step's compile stages)."""
  import jax
  import numpy as np

  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)

  from attnlab.config import TrainConfig
  from attnlab.training import sharding, steps

  mcfg = _bench.attnlab_config(attention_impl=attention_impl)
  tcfg = TrainConfig(steps=1000, warmup_steps=0, schedule="constant", learning_rate=1e-4,
                     grad_clip=0.0, mesh_shape=(1, 1, 1))
  setup, state = steps.init_train(mcfg, tcfg, sharding.make_mesh((1, 1, 1)))
  step_fn = steps.make_train_step(setup, tcfg)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, mcfg.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
  batch = steps.put_batch(dict(
      tokens_BT=tokens[:, :-1], targets_BT=tokens[:, 1:],
      segment_ids_BT=np.ones((BATCH, SEQ), np.int32),
      positions_BT=np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
      loss_mask_BT=np.ones((BATCH, SEQ), np.float32)), setup)
  holder = {"state": state}

  def run(n):
    def steps_n():
      for _ in range(n):
        holder["state"], m = step_fn(holder["state"], batch)
      return m
    return _bench.wall(steps_n)

  with _bench.compile_stages() as first:
    run(1)
  return run, first


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=_bench.positive_int, default=5)
  p.add_argument("--steps", type=_bench.positive_int, default=5, help="train steps per round")
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
  first_line = "attnlab first train step (attention_impl={!r}): {}"
  if args.compile_only:
    _, first = attnlab_setup(args.attention_impl, args.compilation_cache)
    print(first_line.format(args.attention_impl, _bench.stages_line(first)))
    return None
  print(_bench.header(), flush=True)
  worker = _bench.start_torch_worker(__file__, args.torch_python)
  run, first = attnlab_setup(args.attention_impl, args.compilation_cache)
  ours, theirs = [], []
  for _ in range(args.rounds):
    ours.append(run(args.steps))
    if worker:
      theirs.append(worker.seconds(args.steps))
  if worker:
    worker.close()
  best = lambda ts: BATCH * SEQ * args.steps / min(ts)
  print(f"config: {_bench.MODEL}, seq {SEQ}, batch {BATCH}, float32, AdamW; "
        f"{args.rounds} rounds x {args.steps} steps, best round")
  print(f"attnlab  train step: {best(ours):10.0f} tokens/s")
  print(first_line.format(args.attention_impl, _bench.stages_line(first)))
  if theirs:
    print(f"torch HF train step: {best(theirs):10.0f} tokens/s")
    print(f"ratio attnlab / torch: {best(ours) / best(theirs):.2f}x")


if __name__ == "__main__":
  main()
