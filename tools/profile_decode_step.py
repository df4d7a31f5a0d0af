"""Where a batch-1 decode step goes: step time against streaming and overhead.

The model of tools/bench_decode.py (``_bench.MODEL``: 4 layers, d_model 256,
8 / 2 heads, head dim 32, SwiGLU 688, vocab 259; float32, or ``--param_dtype``
/ ``--dtype bfloat16``), prompt 16, greedy, contiguous cache. Measured in one
run, each the best of ``--iters`` calls:

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
  * split matvecs: the same products with every weight cut into 4, 8, 9 and 16
    column blocks (separate arrays, independent products, concatenated): XLA:CPU's
    thunk executor can run ops that are ready together on another core, so this
    shows what cutting every projection into independent pieces would give a step
    (the pieces cost overhead of their own);
  * narrow matvecs: the same products with the weights in bfloat16 or in int8
    (per-column scales, int32 accumulation), read as such in every step (an
    optimization barrier keeps XLA from making float32 copies before the loop):
    whether a weight format of fewer bytes would make the step faster here;
  * cores busy: the process's CPU time over the wall time while a program
    ran (XLA:CPU runs most ops of a step on one core); and one [m, n]
    matrix-vector product in a loop for three sizes (the model's largest
    weight, [512, 2048], [1024, 2048]): from what size XLA:CPU puts more
    than one core on such a product;
  * tiny: the same generate on the same architecture shrunk to d_model 8,
    head dim 4, d_ff 8 (the same ops, almost no bytes): the per-step cost of
    the loop's ops themselves (dispatch, small fusions, cache update);
  * first call: of each config's 240-token generate (trace, compile, run);
  * ops: the instructions of each compiled decode loop's body (fusions,
    library calls, copies; "weight-sized": those that make an array of a
    weight's size, i.e. a weight copied into another layout in every step),
    from XLA's optimized HLO; and the conversions of a weight to float32 outside
    the loop (``--param_dtype bfloat16``: XLA:CPU computes a bfloat16 matrix-vector
    product in float32 and hoists the weight's conversion out of the loop, so the
    loop reads float32 copies, not the bfloat16 bytes);
  * with ``--torch_python`` (a venv with torch + transformers; by default this
    Python, when it has both): transformers'
    decode step the same way (its greedy ``generate``, 240 new tokens against 16),
    and torch's matrix-vector product of one vector with every weight of the
    model at once (one ``F.linear`` over 10.8 MiB, on 1 and on 2 threads): the
    floor of any float32 step that reads the weights once, as another library
    streams them, and the ratio to transformers a step at that floor would give;
    the same with the weights in bfloat16 (5.4 MiB: whether another library reads
    fewer bytes faster here); timed in the same rounds as the steps.

    python tools/profile_decode_step.py [--iters 7] [--torch_python /work/venv/bin/python]
                                        [--param_dtype bfloat16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import math
import re
import time

import _bench

PROMPT, LONG, SHORT = 16, 240, 16
SPLITS = (4, 8, 9, 16)  # column blocks per weight in the split matvec probes
MODEL_D = _bench.MODEL["d_model"]


def _programs(cfg):
  """The model and its compiled ``generate`` programs for LONG and SHORT new tokens."""
  import numpy as np
  from flax import nnx

  import attnlab

  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  prompt = np.arange(3, 3 + PROMPT, dtype=np.int32)[None] % cfg.vocab_size
  # bucket=False: the cache the output names (prompt + n - 1 slots), not the budget's bucket
  calls = {n: (lambda n=n: attnlab.generate(model, prompt, max_new_tokens=n, eos_id=None,
                                            bucket=False))
           for n in (LONG, SHORT)}
  first = _bench.wall(calls[LONG])  # trace, compile and run
  _bench.wall(calls[SHORT])
  return model, calls, first


def step_seconds(cfgs, iters, also=None):
  """Seconds per decode step at B=1 of each config, timed in alternating rounds.

  Per config: (best time of LONG new tokens - best of SHORT) / (LONG - SHORT),
  so the prefill and the call's fixed costs cancel. ``also``: more timings to
  take in the same rounds, name -> a function returning seconds.

  Returns ({config name: (seconds, model, first call seconds, cores busy)},
  {``also`` name: best seconds}); cores busy: the process's CPU seconds over
  the wall seconds of the config's timed calls.
  """
  progs = {name: _programs(cfg) for name, cfg in cfgs.items()}
  best = {(name, n): float("inf") for name in cfgs for n in (LONG, SHORT)}
  spent = {name: [0.0, 0.0] for name in cfgs}  # CPU seconds, wall seconds
  also_best = dict.fromkeys(also or (), float("inf"))
  for _ in range(iters):
    for name, (_, calls, _) in progs.items():
      for n, call in calls.items():
        cpu0 = _cpu_seconds()
        wall = _bench.wall(call)
        spent[name][0] += _cpu_seconds() - cpu0
        spent[name][1] += wall
        best[name, n] = min(best[name, n], wall)
    for name in also_best:
      also_best[name] = min(also_best[name], also[name]())
  steps = {name: ((best[name, LONG] - best[name, SHORT]) / (LONG - SHORT), model, first,
                  spent[name][0] / spent[name][1])
           for name, (model, _, first) in progs.items()}
  return steps, also_best


def _cpu_seconds():
  """User + system CPU seconds of this process so far (all its threads)."""
  import resource

  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _looped(fn, steps):
  """``carry -> fn`` applied ``steps`` times in a fori_loop, jitted."""
  import jax

  run = jax.jit(lambda c: jax.lax.fori_loop(0, steps, lambda i, c: fn(c), c))
  return run


def stream_seconds(arrays, iters, steps=LONG):
  """Seconds to read every array once as float32 (the carry changes each pass). The
  arrays are arguments, as the step's weights are (until 2026-12-06 they were constants of
  the program); a bfloat16 one is read through a float32 copy that XLA makes before the
  loop, as the step reads its weights: ``float32_bytes`` is what such a pass reads."""
  import jax.numpy as jnp

  def one_pass(carry):
    c, xs = carry
    return sum(jnp.sum(x.astype(jnp.float32) + c) for x in xs) * 1e-30, xs

  run = _looped(one_pass, steps)
  return _bench.best_of(lambda: run((jnp.float32(0), list(arrays))), iters) / steps


def float32_bytes(arrays):
  """Bytes of ``arrays`` with every floating one counted as float32: what
  ``stream_seconds`` reads."""
  import jax.numpy as jnp

  return sum(x.size * (4 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype.itemsize)
             for x in arrays)


def cores_busy(fn, iters):
  """(best seconds of ``fn()``, process CPU seconds / wall seconds over the ``iters`` calls):
  how many of the machine's cores the program kept busy while it ran."""
  _bench.wall(fn)
  cpu0, t0 = _cpu_seconds(), time.perf_counter()
  best = min(_bench.wall(fn) for _ in range(iters))
  return best, (_cpu_seconds() - cpu0) / (time.perf_counter() - t0)


def one_matvec(shape, iters, bytes_per_call=64 << 20):
  """(seconds, cores busy) of one [1, m] x [m, n] product, repeated in a loop that
  streams ``bytes_per_call``: when XLA:CPU runs a matrix-vector product on more
  than one core."""
  import jax
  import jax.numpy as jnp

  m, n = shape
  reps = max(1, bytes_per_call // (4 * m * n))
  # The weight is an argument (a constant could be folded into the program).
  w = jax.random.normal(jax.random.key(0), (m, n), jnp.float32)
  run = jax.jit(lambda x, w: jax.lax.fori_loop(
      0, reps, lambda i, x: x + 1e-9 * jnp.tile(x @ w, -(-m // n))[:m], x))
  seconds, busy = cores_busy(lambda: run(jnp.ones((m,), jnp.float32), w), iters)
  return seconds / reps, busy


def matvec_seconds(cfg, model, iters, steps=LONG, split=1):
  """(seconds, count, cores busy) of one step's matrix-vector products alone,
  chained through the loop.

  ``split``: each weight cut into that many column blocks (separate arrays), whose
  products are independent of each other and concatenated: whether XLA:CPU's thunk
  executor, which can hand ops that are ready together to another core, makes the
  products faster that way."""
  import jax.numpy as jnp

  mats = _weight_matrices(cfg, model)
  sizes = sorted({n for w in mats for n in w.shape})

  # Pre-split (outside the program), so that no step slices a weight.
  blocks = [[jnp.asarray(b) for b in jnp.array_split(w, split, axis=1)] for w in mats]

  def one_pass(carry):
    vecs, blocks = carry
    vecs = dict(vecs)
    for parts in blocks:
      m, n = parts[0].shape[0], sum(b.shape[1] for b in parts)
      x = vecs[m]
      # in the weights' dtype, as the model
      product = jnp.concatenate([x.astype(b.dtype) @ b for b in parts])
      vecs[n] = vecs[n] + 1e-6 * product.astype(jnp.float32)
    return vecs, blocks

  vecs = {n: jnp.ones((n,), jnp.float32) for n in sizes}
  run = _looped(one_pass, steps)
  seconds, busy = cores_busy(lambda: run((vecs, blocks)), iters)
  return seconds / steps, len(mats), busy


def _weight_matrices(cfg, model):
  """Every weight of ``model`` as a matrix [in, out] in its own dtype: [D, ...] projections
  take a D-vector, the output projection [N, H, D] an N*H-vector, the embedding [V, D] a
  V-vector."""
  import jax
  from flax import nnx

  return [w.reshape(cfg.d_model, -1) if w.shape[0] == cfg.d_model
          else w.reshape(-1, w.shape[-1]) for w in jax.tree.leaves(nnx.state(model, nnx.Param))
          if w.ndim >= 2]


NARROW = ("bfloat16", "int8")  # the weight formats of ``narrow_matvec_program``


def narrow_weights(mats, fmt):
  """(weight, per-column scale) pairs of float32 matrices [in, out] stored in ``fmt``:
  "bfloat16" (scales of 1) or "int8" (symmetric, per output column: max |w| / 127)."""
  import jax.numpy as jnp

  if fmt not in NARROW:
    raise ValueError(f"fmt must be one of {NARROW}, got {fmt!r}")
  pairs = []
  for w in mats:
    if fmt == "bfloat16":
      pairs.append((w.astype(jnp.bfloat16), jnp.ones((w.shape[1],), jnp.float32)))
    else:
      scale = jnp.maximum(jnp.max(jnp.abs(w), axis=0), 1e-30) / 127
      pairs.append((jnp.round(w / scale).astype(jnp.int8), scale))
  return pairs


def narrow_product(x, w, scale):
  """The float32 product x [in] @ w [in, out] of a ``narrow_weights`` pair, computed in the
  weight's format: bfloat16 with float32 accumulation, or int8 (the vector quantized per
  call, symmetric) with int32 accumulation, both scales applied after."""
  import jax
  import jax.numpy as jnp

  if w.dtype == jnp.bfloat16:
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
  x_scale = jnp.maximum(jnp.max(jnp.abs(x)), 1e-30) / 127
  acc = jax.lax.dot(jnp.round(x / x_scale).astype(jnp.int8), w,
                    preferred_element_type=jnp.int32)
  return acc.astype(jnp.float32) * x_scale * scale


def narrow_matvec_program(cfg, model, fmt, steps=LONG):
  """(jitted loop, its argument, weight bytes): the step's matrix-vector products, chained
  as in ``matvec_seconds``, with every weight in ``fmt`` (``narrow_weights``) and read as
  such in every step: the weights pass through ``lax.optimization_barrier`` in each
  iteration, so XLA cannot make float32 copies of them once before the loop (what it does
  with the model's bfloat16 weights, which its CPU matrix-vector products read in float32)."""
  import jax
  import jax.numpy as jnp

  pairs = narrow_weights([w.astype(jnp.float32) for w in _weight_matrices(cfg, model)], fmt)
  sizes = sorted({n for w, _ in pairs for n in w.shape})

  def one_pass(carry):
    vecs, pairs = carry
    pairs, vecs = jax.lax.optimization_barrier((pairs, dict(vecs)))
    for w, scale in pairs:
      m, n = w.shape
      vecs[n] = vecs[n] + 1e-6 * narrow_product(vecs[m], w, scale)
    return vecs, pairs

  vecs = {n: jnp.ones((n,), jnp.float32) for n in sizes}
  return (_looped(one_pass, steps), (vecs, pairs),
          sum(w.size * w.dtype.itemsize for w, _ in pairs))


def narrow_matvec_seconds(cfg, model, iters, fmt, steps=LONG):
  """(seconds, weight bytes) of one pass of ``narrow_matvec_program``: whether a weight
  format of fewer bytes would make a B=1 step faster on this machine."""
  run, carry, nbytes = narrow_matvec_program(cfg, model, fmt, steps)
  return _bench.best_of(lambda: run(carry), iters) / steps, nbytes


# What the torch worker runs for a code on its stdin (``_bench.serve_torch``):
# transformers' greedy generate at B=1 with LONG or SHORT new tokens (torch's
# default threads, as tools/bench_decode.py runs it), or MATVEC_REPS products of
# a vector with every weight of the model at once, on 1 or 2 threads, in float32
# or with the weights (and the vector) in bfloat16.
TORCH_LONG, TORCH_SHORT, TORCH_MATVEC_1, TORCH_MATVEC_2 = 0, 1, 2, 3
TORCH_MATVEC_BF16_1, TORCH_MATVEC_BF16_2 = 4, 5
TORCH_MATVECS = {TORCH_MATVEC_1: ("float32", 1), TORCH_MATVEC_2: ("float32", 2),
                 TORCH_MATVEC_BF16_1: ("bfloat16", 1), TORCH_MATVEC_BF16_2: ("bfloat16", 2)}
MATVEC_REPS = 100


def torch_worker():
  """The transformers side: seconds of each code above, one per stdin line."""
  import torch

  threads = torch.get_num_threads()
  model = _bench.llama_model(max_positions=PROMPT + LONG).eval()
  # Every 2-D weight (the 28 projections and the tied embedding, 10.8 MiB) as
  # rows of 256 in one matrix: one F.linear streams all of them through torch's
  # matrix-vector kernel, with one call's overhead. The floor of a float32 step
  # that reads every weight once, measured by another library.
  rows = torch.cat([p.detach().reshape(-1, MODEL_D) for p in model.parameters() if p.ndim == 2])
  x = torch.ones(1, MODEL_D)
  narrow = {"float32": (x, rows), "bfloat16": (x.bfloat16(), rows.bfloat16())}
  prompt = torch.arange(3, 3 + PROMPT)[None] % _bench.MODEL["vocab"]

  def run(code):
    if code in (TORCH_LONG, TORCH_SHORT):
      torch.set_num_threads(threads)
      new = LONG if code == TORCH_LONG else SHORT
      with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)
    else:
      dtype, n_threads = TORCH_MATVECS[code]
      vector, weights = narrow[dtype]
      torch.set_num_threads(n_threads)
      with torch.no_grad():
        for _ in range(MATVEC_REPS):
          torch.nn.functional.linear(vector, weights)

  for code in (TORCH_LONG, *TORCH_MATVECS):
    run(code)
  _bench.serve_torch(run, {"threads": threads, "weight_bytes": rows.numel() * 4})


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
  weight_sizes = {int(np.prod(x.shape)) for x in jax.tree.leaves(state) if x.ndim >= 2}
  return op_counts(text, weight_sizes)


def _f32_size(line):
  """The element count of a line's float32 result, or None."""
  shape = re.match(r"\s*(?:ROOT )?\S+ = f32\[([\d,]+)\]", line)
  return None if shape is None else math.prod(int(d) for d in shape.group(1).split(","))


def op_counts(text, weight_sizes):
  """(kinds, converted) of a compiled program's HLO text: ``kinds`` counts the top-level
  instructions of its largest while-loop body by kind ("weight-sized": those that make a
  float32 array of a weight's size, i.e. a weight copied in every step); ``converted``
  counts the conversions to a weight-sized float32 array outside every loop body (a
  weight stored in another dtype made float32 before the loop, so that the loop reads
  float32 copies: what XLA:CPU does with bfloat16 parameters)."""
  bodies = _while_bodies(text)
  body = max(bodies, key=len) if bodies else []
  in_loops = {line for b in bodies for line in b}
  kinds: dict[str, int] = {}
  for line in body:
    m = re.match(r"\s*(?:ROOT )?\S+ = \S+ (\w[\w-]*)\(", line)
    if not m:
      continue
    op = m.group(1)
    if op in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
      continue
    if _f32_size(line) in weight_sizes:
      # A weight-sized array made in the loop: a weight copied into another layout.
      kinds["weight-sized"] = kinds.get("weight-sized", 0) + 1
    if op == "fusion":
      kind = re.search(r"kind=(\w+)", line)
      op = f"fusion({kind.group(1) if kind else '?'})"
    kinds[op] = kinds.get(op, 0) + 1
  converted = sum(1 for line in text.splitlines()
                  if line not in in_loops and re.search(r"= f32\[[\d,]*\]\S* convert\(", line)
                  and _f32_size(line) in weight_sizes)
  return kinds, converted


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
  parser.add_argument("--iters", type=_bench.positive_int, default=7)
  parser.add_argument("--torch_python", default=None,
                      help="a Python with torch + transformers: time transformers' step and "
                           "torch's matrix-vector floor in the same rounds")
  parser.add_argument("--param_dtype", default="float32", choices=("float32", "bfloat16"),
                      help="the parameters' storage dtype (ModelConfig.param_dtype)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="the compute dtype (ModelConfig.dtype)")
  parser.add_argument("--torch_worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.torch_worker:
    return torch_worker()
  print(_bench.header(), flush=True)
  worker = _bench.start_torch_worker(__file__, args.torch_python)
  also = {} if worker is None else {code: (lambda code=code: worker.seconds(code))
                                    for code in (TORCH_LONG, TORCH_SHORT, *TORCH_MATVECS)}

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from attnlab.nn import kv_cache as cache_lib

  cfg = _bench.attnlab_config(max_len=512, param_dtype=args.param_dtype, dtype=args.dtype)
  steps, torch_best = step_seconds(
      {impl: cfg.replace(attention_impl=impl) for impl in ("auto", "chunked")}, args.iters, also)
  if worker is not None:
    worker.close()
  step, model, _, _ = steps["auto"]
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  cache = jax.tree.leaves(cache_lib.init_cache(cfg, "contiguous", 1, PROMPT + LONG - 1))
  weight_bytes = sum(x.size * x.dtype.itemsize for x in params)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in cache)
  streamed = params + [jnp.asarray(x) for x in cache]
  stream = stream_seconds(streamed, args.iters)
  matvec, n_mats, matvec_busy = matvec_seconds(cfg, model, args.iters)
  split = {g: matvec_seconds(cfg, model, args.iters, split=g) for g in SPLITS}
  narrow = {fmt: narrow_matvec_seconds(cfg, model, args.iters, fmt) for fmt in NARROW}
  probes = {shape: one_matvec(shape, args.iters)
            for shape in ((cfg.d_model, cfg.d_ff), (512, 2048), (1024, 2048))}
  tiny_cfg = cfg.replace(d_model=8, head_dim=4, d_ff=8)
  tiny = step_seconds({"tiny": tiny_cfg}, args.iters)[0]["tiny"][0]

  us = lambda s: f"{s * 1e6:7.1f} us"
  print(f"model: {_bench.MODEL}, parameters {cfg.param_dtype}, compute {cfg.dtype}; B=1, "
        f"prompt {PROMPT}, contiguous cache of {PROMPT + LONG - 1}; best of {args.iters}")
  print(f"weights {weight_bytes / 2**20:.1f} MiB, cache {cache_bytes / 2**20:.2f} MiB")
  for impl, (seconds, m, first, busy) in steps.items():
    ops, converted = loop_body_ops(m, cfg.replace(attention_impl=impl))
    total = sum(v for k, v in ops.items() if k != "weight-sized")
    print(f"decode step, {impl + ':':8s}      {us(seconds)}  ({1 / seconds:.0f} tok/s); first "
          f"call {first:.2f} s (trace + compile + run); {busy:.2f} cores busy; loop body {total} "
          "instructions: "
          + ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))
          + f"; weight-sized conversions to float32 outside the loop: {converted}")
  print(f"auto vs chunked: {steps['chunked'][0] / step:.2f}x faster")
  # GB/s of the bytes the pass reads: float32 copies of bfloat16 arrays (until 2026-12-06
  # the bfloat16 bytes were credited, half of what was read).
  copies = " (as float32 copies)" if args.param_dtype != "float32" else ""
  print(f"stream weights + cache once{copies}: {us(stream)}  "
        f"({float32_bytes(streamed) / stream / 1e9:.1f} GB/s)")
  # The loop reads the float32 copies too (until 2026-12-07 these lines credited the
  # bfloat16 bytes, half of what was read).
  read_bytes = float32_bytes(params)
  print(f"the step's {n_mats} matvecs alone: {us(matvec)}  "
        f"({read_bytes / matvec / 1e9:.1f} GB/s of weights{copies}; {matvec_busy:.2f} cores "
        "busy)")
  for g, (seconds, _, busy) in split.items():
    print(f"  each cut into {g:2d} independent column blocks: {us(seconds)}  "
          f"({read_bytes / seconds / 1e9:.1f} GB/s; {busy:.2f} cores busy; "
          f"{matvec / seconds:.2f}x the uncut matvecs)")
  for fmt, (seconds, nbytes) in narrow.items():
    print(f"  with {fmt} weights read in the loop: {us(seconds)}  ({nbytes / 2**20:.1f} MiB "
          f"at {nbytes / seconds / 1e9:.1f} GB/s; {matvec / seconds:.2f}x the float32 "
          "matvecs)")
  for (m, n), (seconds, busy) in probes.items():
    print(f"one [{m}, {n}] matvec in a loop: {us(seconds)}  ({4 * m * n / seconds / 1e9:.1f} "
          f"GB/s; {busy:.2f} cores busy; {m * n // 1000}K multiply-adds)")
  print(f"same ops, tiny dims:         {us(tiny)}  (per-step cost of the ops themselves)")
  print(f"auto step / matvecs: {step / matvec:.2f}x; step / stream: {step / stream:.2f}x; "
        f"step - tiny: {us(step - tiny)}")
  if worker is None:
    return
  hf = (torch_best[TORCH_LONG] - torch_best[TORCH_SHORT]) / (LONG - SHORT)
  # The torch side is float32 whatever --param_dtype / --dtype say (named since 2026-12-07).
  print(f"transformers' step (float32, {worker.ready['threads']} torch threads): {us(hf)}  "
        f"({1 / hf:.0f} tok/s); attnlab / transformers: {hf / step:.2f}x; "
        f"10x would need a step of {us(hf / 10)}")
  for code, (dtype, n) in TORCH_MATVECS.items():
    floor = torch_best[code] / MATVEC_REPS
    nbytes = worker.ready["weight_bytes"] // (1 if dtype == "float32" else 2)
    print(f"torch, every weight in one matvec, {dtype:8s}, {n} thread{'s' if n > 1 else ' '}: "
          f"{us(floor)}  ({nbytes / floor / 1e9:.1f} GB/s); a step at this floor: "
          f"{hf / floor:.2f}x transformers")


if __name__ == "__main__":
  main()
