"""Random differential checks of attnlab against independent oracles, for a time budget.

Each trial draws a fresh case from ``--seed``; a mismatch prints the case on one line.

  attention  ``attnlab.attention`` of every implementation that runs on the CPU
             (reference, blocked, chunked, xla, pallas in interpret mode) against a float64
             NumPy loop over (batch, query, head): random B, T, S, GQA groups, head dims,
             causal, windows, segment ids, q_offset (one, or one per row; a quarter of the
             cases at the ends of int32 positions), scale. Max error
             2e-5. An implementation that refuses the case with a documented ValueError
             (blocked before 2026-12-06: a per-row offset) is counted, not failed.
  gradients  the gradients of blocked, chunked, xla and pallas against those of reference
             (jax.grad of a random projection of the output), relative error 1e-5.
  generate   greedy ``attnlab.generate`` (contiguous, paged with a random page size, ring
             with a window) of a random tiny model (decoder-only or encoder-decoder, every
             position kind, MHA / GQA / MQA, every attention implementation) for prompts of
             random lengths in one batch, against argmax decoding that runs the whole model
             again for every token. A token that differs where the oracle's logits of its
             token and of attnlab's are within 1e-4 is a tie, not a mismatch.
  requests   ``attnlab.generate_requests`` (random slots, cache, page size, num_pages,
             eos, decode_chunk; more requests than slots) against ``generate`` of each
             prompt alone.

Programs are compiled for every case; the program caches are cleared between trials
(XLA:CPU maps each executable's code, and a process that keeps thousands of them runs out
of memory maps). Prints one JSON line at the end; exits 1 on a mismatch.

    PYTHONPATH=$PWD python tools/fuzz_parity.py --check attention [--seconds 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time

import _bench

CHECKS = ("attention", "gradients", "generate", "requests")


def _positive_seconds(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = float("nan")
  if not value > 0:
    raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
  return value


def _seed(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = -1
  if value < 0:
    raise argparse.ArgumentTypeError(f"{text} is not an integer >= 0")
  return value


def _mask_np(np, B, T, S, causal, window, q_seg, kv_seg, offset_B):
  """bool [B, T, S]: what each query sees, written from the README's definitions."""
  q_pos = offset_B[:, None, None] + np.arange(T)[None, :, None]
  k_pos = np.arange(S)[None, None, :]
  ok = np.ones((B, T, S), bool)
  if causal:
    ok &= k_pos <= q_pos
  if window is not None:
    ok &= q_pos - k_pos < window
    if not causal:
      ok &= k_pos - q_pos < window
  if q_seg is not None:
    ok &= q_seg[:, :, None] == kv_seg[:, None, :]
  return ok


def _attention_np(np, q, k, v, mask, scale):
  """float64 attention, one query head at a time; a query that sees no key gives zeros."""
  B, T, N, H = q.shape
  G = N // k.shape[2]
  out = np.zeros((B, T, N, H))
  for b in range(B):
    for t in range(T):
      seen = mask[b, t]
      if not seen.any():
        continue
      for n in range(N):
        logits = k[b, :, n // G].astype(np.float64) @ q[b, t, n].astype(np.float64) * scale
        logits = np.where(seen, logits, -np.inf)
        w = np.exp(logits - logits.max())
        out[b, t, n] = (w / w.sum()) @ v[b, :, n // G].astype(np.float64)
  return out


def _attention_case(np, rng):
  B, T, S = int(rng.integers(1, 3)), int(rng.integers(1, 40)), int(rng.integers(1, 50))
  K, G = int(rng.choice([1, 2])), int(rng.choice([1, 2, 3]))
  H = int(rng.choice([4, 8, 16, 32]))
  causal = bool(rng.integers(2))
  window = None if rng.integers(2) else int(rng.integers(1, 20))
  offset_B = rng.integers(0, 30, B) if rng.integers(2) else np.zeros(B, np.int64)
  if rng.integers(4) == 0:  # rows at the ends of int32 positions (the kernels' last query
    # block there saw no key, and a key 2**31 from its query was seen, until 2026-12-06)
    top, bottom = 2**31 - T - rng.integers(0, 4, B), -2**31 + rng.integers(0, 4, B)
    offset_B = np.where(rng.integers(2, size=B) == 1, top, bottom).astype(np.int64)
    if window is not None and rng.integers(2):
      window = 2**31 - 1 - int(rng.integers(0, 4))
  q_offset = int(offset_B[0]) if (offset_B == offset_B[0]).all() and rng.integers(2) \
      else offset_B.astype(np.int32)
  segments = bool(rng.integers(2))
  q_seg = np.sort(rng.integers(0, 3, (B, T)), 1) if segments else None
  kv_seg = np.sort(rng.integers(0, 3, (B, S)), 1) if segments else None
  scale = None if rng.integers(2) else float(rng.uniform(0.05, 1.0))
  q = rng.standard_normal((B, T, K * G, H)).astype(np.float32)
  k, v = (rng.standard_normal((B, S, K, H)).astype(np.float32) for _ in range(2))
  case = dict(B=B, T=T, S=S, N=K * G, K=K, H=H, causal=causal, window=window,
              q_offset=np.asarray(q_offset).tolist(), segments=segments, scale=scale)
  kwargs = dict(causal=causal, window=window, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                q_offset=q_offset, scale=scale)
  mask = _mask_np(np, B, T, S, causal, window, q_seg, kv_seg, offset_B)
  return case, (q, k, v), kwargs, mask


def _trial_attention(np, rng, report):
  import jax

  import attnlab

  case, (q, k, v), kwargs, mask = _attention_case(np, rng)
  want = _attention_np(np, q, k, v, mask, kwargs["scale"] or 1 / np.sqrt(q.shape[-1]))
  for impl in ("reference", "blocked", "chunked", "xla", "pallas"):
    run = jax.jit(lambda q, k, v, impl=impl: attnlab.attention(q, k, v, implementation=impl,
                                                               **kwargs))
    try:
      got = np.asarray(run(q, k, v))
    except ValueError as e:
      if impl == "blocked" and "needs an int q_offset" in str(e):
        report("refused", impl, case)
        continue
      raise
    err = float(np.abs(got - want).max()) if want.size else 0.0
    if not err < 2e-5:
      report("mismatch", impl, dict(case, max_error=err))


def _trial_gradients(np, rng, report):
  import jax
  import jax.numpy as jnp

  import attnlab

  case, (q, k, v), kwargs, _ = _attention_case(np, rng)
  if not isinstance(kwargs["q_offset"], int):  # blocked takes one offset: give every impl one
    kwargs["q_offset"] = case["q_offset"] = int(np.asarray(kwargs["q_offset"]).flat[0])
  g = rng.standard_normal(q.shape).astype(np.float32)

  def grads(impl):
    loss = lambda q, k, v: jnp.sum(attnlab.attention(q, k, v, implementation=impl,
                                                     **kwargs) * g)
    return [np.asarray(x, np.float64) for x in jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)]

  want = grads("reference")
  for impl in ("blocked", "chunked", "xla", "pallas"):
    for name, got, ref in zip(("dq", "dk", "dv"), grads(impl), want):
      err = float(np.abs(got - ref).max() / (1 + np.abs(ref).max())) if ref.size else 0.0
      if not err < 1e-5:
        report("mismatch", impl, dict(case, grad=name, relative_error=err))


def _tiny_model(np, rng, arch=None):
  from flax import nnx

  import attnlab

  K, G = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
  H = int(rng.choice([8, 16]))
  arch = arch or str(rng.choice(["decoder_only", "decoder_only", "encoder_decoder"]))
  kw = dict(arch=arch, vocab_size=40, d_model=K * G * H, num_layers=int(rng.integers(1, 3)),
            num_heads=K * G, num_kv_heads=K, head_dim=H, d_ff=32,
            pos=str(rng.choice(["rope", "sinusoidal", "learned", "none"])),
            window=None if rng.integers(2) else int(rng.integers(1, 7)),
            norm=str(rng.choice(["rmsnorm", "layernorm"])),
            norm_position=str(rng.choice(["pre", "post"])),
            mlp=str(rng.choice(["relu", "gelu", "swiglu"])),
            attention_impl=str(rng.choice(["auto", "reference", "blocked", "chunked", "xla",
                                           "pallas"])), max_len=64)
  if arch == "encoder_decoder":
    kw["num_encoder_layers"] = int(rng.integers(1, 3))
  return attnlab.build_model(attnlab.ModelConfig(**kw), rngs=nnx.Rngs(int(rng.integers(1000)))), kw


def _greedy_oracle(np, model, prompt, new_tokens, got, bos_id=1):
  """The first step where ``got`` is not the argmax of the model run on everything before
  it, and by how much the oracle's choice beats ``got``'s token there; None if none."""
  import jax.numpy as jnp

  decoder_only = model.cfg.arch == "decoder_only"
  seq = list(prompt) if decoder_only else [bos_id]
  for i in range(new_tokens):
    tokens = jnp.asarray([seq], jnp.int32)
    logits = model(tokens) if decoder_only else model(jnp.asarray([prompt], jnp.int32), tokens)
    logits = np.asarray(logits)[0, -1]
    best = int(logits.argmax())
    if best != got[i]:
      return i, float(logits[best] - logits[got[i]])
    seq.append(best)
  return None


def _trial_generate(np, rng, report):
  import attnlab

  model, kw = _tiny_model(np, rng)
  B = int(rng.integers(1, 4))
  lengths = rng.integers(1, 11, B)
  prompt = np.zeros((B, int(lengths.max())), np.int32)
  for b in range(B):
    prompt[b, :lengths[b]] = rng.integers(3, 40, lengths[b])
  new_tokens = int(rng.integers(1, 9))
  cache = str(rng.choice(["contiguous", "paged"] + (["ring"] if kw["window"] else [])))
  page_size = int(rng.choice([1, 2, 4, 16]))
  case = dict(kw, B=B, lengths=lengths.tolist(), new_tokens=new_tokens, cache=cache,
              page_size=page_size)
  got = np.asarray(attnlab.generate(model, prompt, max_new_tokens=new_tokens, cache=cache,
                                    eos_id=None, prompt_lengths_B=lengths, page_size=page_size))
  for b in range(B):
    differs = _greedy_oracle(np, model, prompt[b, :lengths[b]].tolist(), new_tokens, got[b])
    if differs is not None:
      step, margin = differs
      report("tie" if margin <= 1e-4 else "mismatch", "generate",
             dict(case, row=b, step=step, margin=margin))


def _trial_requests(np, rng, report):
  import attnlab

  model, kw = _tiny_model(np, rng, arch="decoder_only")
  R, slots = int(rng.integers(1, 9)), int(rng.integers(1, 5))
  prompts = [rng.integers(3, 40, int(rng.integers(1, 15))).tolist() for _ in range(R)]
  budgets = [int(rng.integers(1, 12)) for _ in range(R)]
  cache = str(rng.choice(["paged", "contiguous"] + (["ring"] if kw["window"] else [])))
  page_size = int(rng.choice([1, 2, 4, 8, 16]))
  eos = int(rng.integers(3, 40)) if rng.integers(2) else None
  num_pages = None
  if cache == "paged" and rng.integers(2):  # tight: requests wait for freed pages
    num_pages = max(-(-(len(p) + b) // page_size) for p, b in zip(prompts, budgets)) \
        + int(rng.integers(0, 4))
  chunk = int(rng.choice([1, 3, 16]))
  case = dict(kw, slots=slots, cache=cache, page_size=page_size, eos=eos, num_pages=num_pages,
              decode_chunk=chunk, lengths=[len(p) for p in prompts], budgets=budgets)
  got = attnlab.generate_requests(model, prompts, budgets, slots=slots, cache=cache,
                                  page_size=page_size, num_pages=num_pages, eos_id=eos,
                                  decode_chunk=chunk)
  for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
    alone = np.asarray(attnlab.generate(model, np.asarray([prompt], np.int32),
                                        max_new_tokens=budget, eos_id=eos))[0]
    if eos is not None and (alone == eos).any():
      alone = alone[:int(np.argmax(alone == eos)) + 1]
    if not np.array_equal(np.asarray(got[i]), alone):
      report("mismatch", "generate_requests",
             dict(case, request=i, got=np.asarray(got[i]).tolist(), alone=alone.tolist()))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--check", choices=CHECKS, required=True)
  p.add_argument("--seconds", type=_positive_seconds, default=300.0,
                 help="time budget (a trial under way finishes)")
  p.add_argument("--seed", type=_seed, default=0)
  args = p.parse_args()

  import jax
  import numpy as np

  trial = {"attention": _trial_attention, "gradients": _trial_gradients,
           "generate": _trial_generate, "requests": _trial_requests}[args.check]
  rng = np.random.default_rng(args.seed)
  counts = {"mismatch": 0, "tie": 0, "refused": 0}

  def report(kind, what, case):
    counts[kind] += 1
    if kind != "refused":
      print(json.dumps({kind: what, **case}, default=str), flush=True)

  start, trials = time.perf_counter(), 0
  while time.perf_counter() - start < args.seconds:
    trial(np, rng, report)
    trials += 1
    jax.clear_caches()
  print(json.dumps({"cpu": _bench.cpu_name(), "check": args.check, "seed": args.seed,
                    "seconds": round(time.perf_counter() - start, 1), "trials": trials,
                    "mismatches": counts["mismatch"], "ties": counts["tie"],
                    "refused": counts["refused"]}))
  raise SystemExit(1 if counts["mismatch"] else 0)


if __name__ == "__main__":
  main()
