"""Where a batch-1 decode step goes: step time against streaming and overhead.

The model of tools/bench_decode.py (``_bench.MODEL``: 4 layers, d_model 256,
8 / 2 heads, head dim 32, SwiGLU 688, vocab 259, float32), prompt 16, greedy,
contiguous cache. Measured in one run, each the best of ``--iters`` calls:

  * step: one decode step of ``attnlab.generate`` at B=1, as
    (time of 240 new tokens - time of 16) / 224, so the prefill and the
    call's fixed costs cancel; for ``attention_impl="auto"`` (decode steps
    through ``attnlab.ops.decode``: the buffer read, then written in place)
    and ``"chunked"`` (the token written first, then the chunked op over the
    buffer; what "auto" did before), compiled in this process and timed in
    alternating rounds, so machine noise hits both alike;
  * stream: one pass that reads every weight and the whole cache once
    (``sum(x + c)`` over each array, inside a loop so that it runs like a
    step);
  * matvecs: the 29 matrix-vector products of a step alone (q, k, v, o,
    gate, up, down of 4 layers and the logits), chained through the loop:
    the time to stream the weights through XLA's matrix-vector kernels;
  * tiny: the same generate on the same architecture shrunk to d_model 8,
    head dim 4, d_ff 8 (the same ops, almost no bytes): the per-step cost of
    the loop's ops themselves (dispatch, small fusions, cache update);
  * first call: of each config's 240-token generate (trace, compile, run);
  * ops: the instructions of each compiled decode loop's body (fusions,
    library calls, copies; "weight-sized": those that make an array of a
    weight's size, i.e. a weight copied into another layout in every step),
    from XLA's optimized HLO.

    python tools/profile_decode_step.py [--iters 7]
"""

from __future__ import annotations

import argparse
import re

import _bench

PROMPT, LONG, SHORT = 16, 240, 16


def _programs(cfg):
  """The model and its compiled ``generate`` programs for LONG and SHORT new tokens."""
  import numpy as np
  from flax import nnx

  import attnlab

  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  prompt = np.arange(3, 3 + PROMPT, dtype=np.int32)[None] % cfg.vocab_size
  calls = {n: (lambda n=n: attnlab.generate(model, prompt, max_new_tokens=n, eos_id=None))
           for n in (LONG, SHORT)}
  first = _bench.wall(calls[LONG])  # trace, compile and run
  _bench.wall(calls[SHORT])
  return model, calls, first


def step_seconds(cfgs, iters):
  """Seconds per decode step at B=1 of each config, timed in alternating rounds.

  Per config: (best time of LONG new tokens - best of SHORT) / (LONG - SHORT),
  so the prefill and the call's fixed costs cancel.
  """
  progs = {name: _programs(cfg) for name, cfg in cfgs.items()}
  best = {(name, n): float("inf") for name in cfgs for n in (LONG, SHORT)}
  for _ in range(iters):
    for name, (_, calls, _) in progs.items():
      for n, call in calls.items():
        best[name, n] = min(best[name, n], _bench.wall(call))
  return {name: ((best[name, LONG] - best[name, SHORT]) / (LONG - SHORT), model, first)
          for name, (model, _, first) in progs.items()}


def _looped(fn, steps):
  """``carry -> fn`` applied ``steps`` times in a fori_loop, jitted."""
  import jax

  run = jax.jit(lambda c: jax.lax.fori_loop(0, steps, lambda i, c: fn(c), c))
  return run


def stream_seconds(arrays, iters, steps=LONG):
  """Seconds to read every array once (the carry changes each pass: nothing is hoisted)."""
  import jax.numpy as jnp

  def one_pass(c):
    return sum(jnp.sum(x.astype(jnp.float32) + c) for x in arrays) * 1e-30

  run = _looped(one_pass, steps)
  return _bench.best_of(lambda: run(jnp.float32(0)), iters) / steps


def matvec_seconds(cfg, model, iters, steps=LONG):
  """Seconds of one step's matrix-vector products alone, chained through the loop."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  # Every weight as a matrix [in, out]: [D, ...] projections take a D-vector,
  # the output projection [N, H, D] an N*H-vector, the embedding [V, D] a V-vector.
  mats = [w.reshape(cfg.d_model, -1) if w.shape[0] == cfg.d_model
          else w.reshape(-1, w.shape[-1]) for w in jax.tree.leaves(nnx.state(model, nnx.Param))
          if w.ndim >= 2]
  sizes = sorted({n for w in mats for n in w.shape})

  def one_pass(vecs):
    vecs = dict(vecs)
    for w in mats:
      vecs[w.shape[1]] = vecs[w.shape[1]] + 1e-6 * (vecs[w.shape[0]] @ w)
    return vecs

  vecs = {n: jnp.ones((n,), jnp.float32) for n in sizes}
  run = _looped(one_pass, steps)
  return _bench.best_of(lambda: run(vecs), iters) / steps, len(mats)


def loop_body_ops(model, cfg):
  """Counts of the top-level instructions of the decode while-loop body, by kind,
  in the optimized HLO of the program ``generate`` runs (greedy, contiguous)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from attnlab.decoding import generate as gen

  prompt = np.arange(3, 3 + PROMPT, dtype=np.int32)[None] % cfg.vocab_size
  state = nnx.state(model)
  text = gen._sample_decoder_only.trace(
      model, jnp.asarray(prompt), jnp.asarray([PROMPT], jnp.int32), jax.random.key(0),
      jnp.int32(-1), sampling=gen.GREEDY, cache_len=PROMPT + LONG - 1, num_pages=None,
      max_new_tokens=LONG, kind="contiguous", page_size=16, cache_dtype=None,
  ).lower().compile().as_text()
  bodies = _while_bodies(text)
  body = max(bodies, key=len) if bodies else []
  weight_sizes = {int(np.prod(x.shape)) for x in jax.tree.leaves(state) if x.ndim >= 2}
  kinds: dict[str, int] = {}
  for line in body:
    m = re.match(r"\s*(?:ROOT )?\S+ = \S+ (\w[\w-]*)\(", line)
    if not m:
      continue
    op = m.group(1)
    if op in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
      continue
    shape = re.match(r"\s*(?:ROOT )?\S+ = f32\[([\d,]+)\]", line)
    if shape and int(np.prod([int(d) for d in shape.group(1).split(",")])) in weight_sizes:
      # A weight-sized array made in the loop: a weight copied into another layout.
      kinds["weight-sized"] = kinds.get("weight-sized", 0) + 1
    if op == "fusion":
      kind = re.search(r"kind=(\w+)", line)
      op = f"fusion({kind.group(1) if kind else '?'})"
    kinds[op] = kinds.get(op, 0) + 1
  return kinds


def _while_bodies(text):
  """The computations named as a while loop's body, as lists of lines."""
  names = set(re.findall(r"body=%?([\w.\-]+)", text))
  comps, cur, name = {}, None, None
  for line in text.splitlines():
    m = re.match(r"^%?([\w.\-]+) .*\{$", line) or re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
    if line and not line.startswith(" ") and m:
      name, cur = m.group(1), []
      comps[name] = cur
    elif cur is not None and line.startswith(" "):
      cur.append(line)
  return [comps[n] for n in names if n in comps]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=7)
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from attnlab.nn import kv_cache as cache_lib

  cfg = _bench.attnlab_config(max_len=512)
  steps = step_seconds({impl: cfg.replace(attention_impl=impl) for impl in ("auto", "chunked")},
                       args.iters)
  step, model, _ = steps["auto"]
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  cache = jax.tree.leaves(cache_lib.init_cache(cfg, "contiguous", 1, PROMPT + LONG - 1))
  weight_bytes = sum(x.size * x.dtype.itemsize for x in params)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in cache)
  stream = stream_seconds(params + [jnp.asarray(x) for x in cache], args.iters)
  matvec, n_mats = matvec_seconds(cfg, model, args.iters)
  tiny_cfg = cfg.replace(d_model=8, head_dim=4, d_ff=8)
  tiny, _, _ = step_seconds({"tiny": tiny_cfg}, args.iters)["tiny"]

  us = lambda s: f"{s * 1e6:7.1f} us"
  print(f"model: {_bench.MODEL}, float32; B=1, prompt {PROMPT}, contiguous cache of "
        f"{PROMPT + LONG - 1}; best of {args.iters}")
  print(f"weights {weight_bytes / 2**20:.1f} MiB, cache {cache_bytes / 2**20:.2f} MiB")
  for impl, (seconds, m, first) in steps.items():
    ops = loop_body_ops(m, cfg.replace(attention_impl=impl))
    total = sum(v for k, v in ops.items() if k != "weight-sized")
    print(f"decode step, {impl + ':':8s}      {us(seconds)}  ({1 / seconds:.0f} tok/s); first "
          f"call {first:.2f} s (trace + compile + run); loop body {total} instructions: "
          + ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
  print(f"auto vs chunked: {steps['chunked'][0] / step:.2f}x faster")
  print(f"stream weights + cache once: {us(stream)}  "
        f"({(weight_bytes + cache_bytes) / stream / 1e9:.1f} GB/s)")
  print(f"the step's {n_mats} matvecs alone: {us(matvec)}  "
        f"({weight_bytes / matvec / 1e9:.1f} GB/s of weights)")
  print(f"same ops, tiny dims:         {us(tiny)}  (per-step cost of the ops themselves)")
  print(f"auto step / matvecs: {step / matvec:.2f}x; step / stream: {step / stream:.2f}x; "
        f"step - tiny: {us(step - tiny)}")


if __name__ == "__main__":
  main()
