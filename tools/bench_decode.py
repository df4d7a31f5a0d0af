"""Decoding speed: cached decode vs recompute-everything, and vs transformers.

Config: ``_bench.MODEL`` (4 layers, d_model 256, 8 heads / 2 KV heads, head
dim 32, SwiGLU 688, vocab 259), float32; prompt 16, 240 new tokens, greedy. Measured in one run:

  * cached ``attnlab.generate`` vs a loop that recomputes the full forward
    pass (the same model call) for every token, at B=1 and B=8;
  * cache bytes per token for MHA / GQA / MQA (``ModelConfig``);
  * the first ``generate`` call at B=1, split into tracing, lowering to
    StableHLO, XLA compilation and running the 240 tokens (the same call
    again, compiled);
  * with ``--torch_python`` (a venv with torch + transformers), transformers'
    Llama ``generate`` (greedy, its KV cache) in rounds alternating with ours.

    python tools/bench_decode.py [--rounds 3] [--torch_python /tmp/hfvenv/bin/python]
                                 [--recompute_tokens 24]

``--recompute_tokens N`` times the recompute-everything baseline on N new
tokens instead of 240: every one of its steps runs the model over the same
fixed [B, 16 + 240] buffer, so its tokens/s does not depend on N, and a
small N cuts the benchmark from ~8 minutes to ~1 on two cores.
"""

from __future__ import annotations

import argparse

import _bench

PROMPT, NEW = 16, 240
MAX_LEN = 512


def torch_worker():
  """Greedy ``generate`` of a batch of n prompts per stdin line (``_bench.serve_torch``)."""
  import torch

  model = _bench.llama_model(max_positions=MAX_LEN).eval()

  def run(batch):
    x = torch.randint(3, _bench.MODEL["vocab"], (batch, PROMPT))
    with torch.no_grad():
      model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                     min_new_tokens=NEW, do_sample=False, pad_token_id=0)

  for batch in (1, 8):  # warm both batch sizes the rounds time, as attnlab_setup does
    run(batch)
  _bench.serve_torch(run)


def attnlab_setup(recompute_tokens):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import attnlab

  cfg = _bench.attnlab_config(max_len=MAX_LEN)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  P, N = PROMPT, NEW
  R = min(recompute_tokens or N, N)  # recompute steps timed; the buffer stays P + N wide

  @jax.jit
  def recompute(state, prompt_BT):
    # The same forward pass over the whole (fixed-size) buffer for every token. The weights
    # are an argument, as generate's are (closed over, XLA made them constants: ~1% in the
    # baseline's favour until 2026-12-06).
    B = prompt_BT.shape[0]
    m = nnx.merge(graphdef, state)
    buf = jnp.concatenate([prompt_BT, jnp.zeros((B, N), jnp.int32)], axis=1)

    def body(i, buf):
      logits = m(buf)
      nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, P + i - 1, 1, False), -1)
      return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(jnp.int32), P + i, 1)

    return jax.lax.fori_loop(0, R, body, buf)[:, P:P + R]

  prompts = {b: np.asarray(jax.random.randint(jax.random.key(b), (b, P), 3, cfg.vocab_size))
             for b in (1, 8)}

  def cached(b):
    return _bench.wall(lambda: attnlab.generate(model, prompts[b], max_new_tokens=N,
                                                eos_id=None))

  def full(b):
    return _bench.wall(lambda: recompute(state, jnp.asarray(prompts[b])))

  with _bench.compile_stages() as first:
    cached(1)
  first["compiled_run"] = cached(1)
  for b in (1, 8):  # compile everything outside the timed rounds
    cached(b), full(b)
  check = np.asarray(attnlab.generate(model, prompts[8], max_new_tokens=N, eos_id=None))[:, :R]
  agree = float((check == np.asarray(recompute(state, jnp.asarray(prompts[8])))).mean())
  return cfg, cached, full, first, agree, R


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=_bench.positive_int, default=3)
  parser.add_argument("--torch_python", default=None)
  parser.add_argument("--recompute_tokens", type=_bench.positive_int, default=None,
                      help="new tokens of the recompute-everything baseline (default 240)")
  parser.add_argument("--torch_worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.torch_worker:
    return torch_worker()
  print(_bench.header(), flush=True)
  worker = _bench.start_torch_worker(__file__, args.torch_python)
  cfg, cached, full, first, agree, R = attnlab_setup(args.recompute_tokens)
  times = {(kind, b): [] for kind in ("cached", "full", "torch") for b in (1, 8)}
  for _ in range(args.rounds):
    for b in (1, 8):
      times["cached", b].append(cached(b))
      times["full", b].append(full(b))
      if worker:
        times["torch", b].append(worker.seconds(b))
  if worker:
    worker.close()
  best = {k: min(v) for k, v in times.items() if v}
  n = NEW
  print(f"config: {_bench.MODEL}, prompt {PROMPT}, {NEW} new tokens, float32, greedy; "
        f"best of {args.rounds} rounds; recompute baseline timed on {R} tokens")
  print(f"first generate call (B=1): {_bench.stages_line(first)} "
        f"(the compiled call alone: {first['compiled_run']:.2f} s)")
  print(f"cached == recompute tokens (B=8, first {R}): {agree:.1%}")
  print(f"{'B':>3} {'cached tok/s':>13} {'recompute tok/s':>16} {'ratio':>7}"
        + (f" {'torch HF tok/s':>15} {'vs HF':>7}" if worker else ""))
  for b in (1, 8):
    cached_tps, full_tps = b * n / best["cached", b], b * R / best["full", b]
    row = f"{b:>3} {cached_tps:>13.0f} {full_tps:>16.0f} {cached_tps / full_tps:>6.1f}x"
    if worker:
      row += f" {b * n / best['torch', b]:>15.0f} {best['torch', b] / best['cached', b]:>6.1f}x"
    print(row)
  print("cache bytes per token (float32, 4 layers, head dim 32):")
  for name, k in (("MHA", 8), ("GQA", 2), ("MQA", 1)):
    print(f"  {name} (K={k}): {cfg.replace(num_kv_heads=k).kv_cache_bytes_per_token():>6} B")


if __name__ == "__main__":
  main()
