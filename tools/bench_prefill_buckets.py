"""Prefill seconds under the library's length buckets against powers of two alone.

Serves tools/bench_serve.py's 256 prompts (lengths 8..200, seed 0) with a budget
of one token each, so a run is its prefills alone (``ServeStats.prefill_seconds``),
once with ``attnlab.decoding.batching.bucket_length`` (16, 24, 32, 48, ...) and
once with powers of two from 16, per cache, after a run of each that compiles.
The two alternate, in reverse order every other round; the tool prints each
run, the padded prompt tokens of each scheme, and the per-round ratio
(power-of-two seconds / library seconds) with its median.

    PYTHONPATH=$PWD python tools/bench_prefill_buckets.py [--rounds 4] [--cache paged,contiguous]
"""

from __future__ import annotations

import argparse
import json

import _bench


def power_of_two_bucket(n: int, max_len: int) -> int:
  """The buckets before 2026-12-01: the least power of two >= max(n, 16), capped at max_len."""
  return min(max(16, 1 << (n - 1).bit_length()), max(max_len, n))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--requests", type=_bench.positive_int, default=256)
  p.add_argument("--rounds", type=_bench.positive_int, default=4)
  p.add_argument("--cache", default="paged,contiguous", help="comma-separated caches")
  args = p.parse_args()
  for c in args.cache.split(","):  # a traceback from the first request until 2026-12-05
    if c not in ("paged", "contiguous"):
      p.error(f"--cache: {c!r} is not paged or contiguous")

  import numpy as np

  from attnlab.decoding import batching

  model, prompts, _ = _bench.serve_workload(args.requests)
  schemes = {"library": batching.bucket_length, "power_of_two": power_of_two_bucket}
  max_len = model.cfg.max_len
  report = dict(cpu=_bench.cpu_name(), requests=args.requests, prompt_tokens=sum(map(len, prompts)))
  for name, fn in schemes.items():
    report[f"{name}_padded_tokens"] = sum(fn(len(x), max_len) for x in prompts)

  def prefill_seconds(scheme, cache):
    batching.bucket_length = schemes[scheme]
    try:
      # bucket=False: the cache sized exactly under either scheme; only the prefills differ
      stats = batching.serve_requests(model, prompts, 1, cache=cache, eos_id=None,
                                      bucket=False)[1]
    finally:
      batching.bucket_length = schemes["library"]
    return stats.prefill_seconds

  caches = args.cache.split(",")
  for cache in caches:
    for scheme in schemes:
      prefill_seconds(scheme, cache)  # compiles its buckets
  ratios = {cache: [] for cache in caches}
  for r in range(args.rounds):
    for cache in caches:
      order = list(schemes) if r % 2 == 0 else list(schemes)[::-1]
      secs = {scheme: prefill_seconds(scheme, cache) for scheme in order}
      print(f"round {r}: {cache} " + ", ".join(f"{k} {v:.2f} s" for k, v in secs.items()),
            flush=True)
      ratios[cache].append(secs["power_of_two"] / secs["library"])
  for cache in caches:
    report[f"{cache}/power_of_two_over_library"] = dict(
        median=round(float(np.median(ratios[cache])), 2),
        per_round=[round(x, 2) for x in ratios[cache]])
  print(json.dumps(report))


if __name__ == "__main__":
  main()
