"""What prompt-width buckets save a loop of ``attnlab.generate`` calls.

The tools/bench_decode.py model (``_bench.MODEL``, float32), B=1, greedy, contiguous
cache, ``--new_tokens`` per call: one call for each prompt width 1..``--widths``, in a
fresh program cache, first with ``generate``'s buckets (every width padded to 16, one
program), then with each call at its own width (``bucket=False``: one program per
width). Prints the wall time of each loop (compiles included),
the programs compiled and the ratio. Then what the padding costs a compiled call: the best
of ``--iters`` calls with a ``--steady_width``-token prompt (default 200, bucket 256) each way.

    PYTHONPATH=$PWD python tools/bench_prompt_widths.py [--widths 16] [--new_tokens 16]
        [--steady_width 200] [--iters 7]
"""

from __future__ import annotations

import argparse
import json
import time

import _bench


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--widths", type=_bench.positive_int, default=16)
  p.add_argument("--new_tokens", type=_bench.positive_int, default=16)
  p.add_argument("--steady_width", type=_bench.positive_int, default=200)
  p.add_argument("--iters", type=_bench.positive_int, default=7)
  args = p.parse_args()

  import jax
  import numpy as np
  from flax import nnx

  import attnlab
  from attnlab.decoding import generate as generate_lib

  model = attnlab.build_model(_bench.attnlab_config(), rngs=nnx.Rngs(0))
  program = generate_lib._sample_decoder_only
  out = {"cpu": _bench.cpu_name(), "widths": args.widths, "new_tokens": args.new_tokens}
  steady = (np.arange(args.steady_width, dtype=np.int32) % 200 + 3)[None]
  for scheme, bucket in (("buckets", True), ("own_width", False)):
    jax.clear_caches()
    generate = lambda prompt, bucket=bucket: np.asarray(attnlab.generate(
        model, prompt, max_new_tokens=args.new_tokens, eos_id=None, bucket=bucket))
    start = time.perf_counter()
    for width in range(1, args.widths + 1):
      generate(np.arange(3, 3 + width, dtype=np.int32)[None])
    out[f"s_{scheme}"] = round(time.perf_counter() - start, 2)
    out[f"programs_{scheme}"] = program._cache_size()
    generate(steady)  # compile
    out[f"ms_width_{args.steady_width}_{scheme}"] = round(
        _bench.best_of(lambda generate=generate: generate(steady), args.iters) * 1e3, 2)
  out["own_width_over_buckets"] = round(out["s_own_width"] / out["s_buckets"], 2)
  w = args.steady_width
  out[f"width_{w}_buckets_over_own_width"] = round(
      out[f"ms_width_{w}_buckets"] / out[f"ms_width_{w}_own_width"], 3)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
