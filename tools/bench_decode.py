"""Decoding speed: cached decode vs recompute-everything, and vs transformers.

Config: 4 layers, d_model 256, 8 heads / 2 KV heads, head dim 32, SwiGLU 688,
vocab 259, float32; prompt 16, 240 new tokens, greedy. Measured in one run:

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
import json
import subprocess
import sys
import time

CFG = dict(layers=4, d_model=256, heads=8, kv_heads=2, head_dim=32, d_ff=688, vocab=259,
           prompt=16, new=240)


def torch_worker():
  """Reads a batch size per line; prints the seconds its greedy generate took."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=CFG["vocab"], hidden_size=CFG["d_model"],
                    intermediate_size=CFG["d_ff"], num_hidden_layers=CFG["layers"],
                    num_attention_heads=CFG["heads"], num_key_value_heads=CFG["kv_heads"],
                    head_dim=CFG["head_dim"], max_position_embeddings=512,
                    tie_word_embeddings=True)
  model = LlamaForCausalLM(cfg).float().eval()

  def run(batch):
    x = torch.randint(3, CFG["vocab"], (batch, CFG["prompt"]))
    with torch.no_grad():
      t0 = time.perf_counter()
      model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=CFG["new"],
                     min_new_tokens=CFG["new"], do_sample=False, pad_token_id=0)
      return time.perf_counter() - t0

  run(1)
  print(json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    print(json.dumps({"seconds": run(int(line))}), flush=True)


def _compile_listener():
  """Seconds per JAX compile stage (trace / lower / XLA compile), summed."""
  import collections

  import jax

  seconds = collections.defaultdict(float)
  names = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
           "backend_compile_duration": "compile"}

  def listen(event, secs, **_):
    name = names.get(event.rsplit("/", 1)[-1])
    if name:
      seconds[name] += secs

  jax.monitoring.register_event_duration_secs_listener(listen)
  return seconds


def attnlab_setup(recompute_tokens):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import attnlab

  cfg = attnlab.ModelConfig(vocab_size=CFG["vocab"], d_model=CFG["d_model"],
                            num_layers=CFG["layers"], num_heads=CFG["heads"],
                            num_kv_heads=CFG["kv_heads"], head_dim=CFG["head_dim"],
                            d_ff=CFG["d_ff"], mlp="swiglu", max_len=512)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  P, N = CFG["prompt"], CFG["new"]
  R = min(recompute_tokens or N, N)  # recompute steps timed; the buffer stays P + N wide

  @jax.jit
  def recompute(prompt_BT):
    # The same forward pass over the whole (fixed-size) buffer for every token.
    B = prompt_BT.shape[0]
    m = nnx.merge(graphdef, state)
    buf = jnp.concatenate([prompt_BT, jnp.zeros((B, N), jnp.int32)], axis=1)

    def body(i, buf):
      logits = m(buf)
      nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, P + i - 1, 1, False), -1)
      return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(jnp.int32), P + i, 1)

    return jax.lax.fori_loop(0, R, body, buf)[:, P:P + R]

  prompts = {b: np.asarray(jax.random.randint(jax.random.key(b), (b, P), 3, CFG["vocab"]))
             for b in (1, 8)}
  stages = _compile_listener()
  t0 = time.perf_counter()
  attnlab.generate(model, prompts[1], max_new_tokens=N, eos_id=None).block_until_ready()
  first_s = time.perf_counter() - t0
  first = dict(stages, total=first_s)
  t0 = time.perf_counter()
  attnlab.generate(model, prompts[1], max_new_tokens=N, eos_id=None).block_until_ready()
  first["run"] = time.perf_counter() - t0

  def timed(fn):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0

  def cached(b):
    return timed(lambda: attnlab.generate(model, prompts[b], max_new_tokens=N, eos_id=None))

  def full(b):
    return timed(lambda: recompute(jnp.asarray(prompts[b])))

  for b in (1, 8):  # compile everything outside the timed rounds
    cached(b), full(b)
  check = np.asarray(attnlab.generate(model, prompts[8], max_new_tokens=N, eos_id=None))[:, :R]
  agree = float((check == np.asarray(recompute(jnp.asarray(prompts[8])))).mean())
  return cfg, cached, full, first, agree, R


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--torch_python", default=None)
  parser.add_argument("--recompute_tokens", type=int, default=None,
                      help="new tokens of the recompute-everything baseline (default 240)")
  parser.add_argument("--torch_worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.torch_worker:
    return torch_worker()
  worker = None
  python = args.torch_python
  if python is None:
    try:
      import torch  # noqa: F401
      import transformers  # noqa: F401
      python = sys.executable
    except ImportError:
      print("torch / transformers not found: attnlab only (--torch_python PATH to compare)")
  if python:
    worker = subprocess.Popen([python, __file__, "--torch_worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    worker.stdout.readline()
  cfg, cached, full, first, agree, R = attnlab_setup(args.recompute_tokens)
  times = {(kind, b): [] for kind in ("cached", "full", "torch") for b in (1, 8)}
  for _ in range(args.rounds):
    for b in (1, 8):
      times["cached", b].append(cached(b))
      times["full", b].append(full(b))
      if worker:
        worker.stdin.write(f"{b}\n")
        worker.stdin.flush()
        times["torch", b].append(json.loads(worker.stdout.readline())["seconds"])
  if worker:
    worker.stdin.close()
    worker.wait()
  best = {k: min(v) for k, v in times.items() if v}
  n = CFG["new"]
  print(f"config: {CFG}, float32, greedy; best of {args.rounds} rounds; "
        f"recompute baseline timed on {R} tokens")
  print(f"first generate call (B=1): {first['total']:.2f} s = trace {first.get('trace', 0):.2f}"
        f" + lower {first.get('lower', 0):.2f} + XLA compile {first.get('compile', 0):.2f} + "
        f"run and Python (the compiled call alone: {first['run']:.2f} s)")
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
