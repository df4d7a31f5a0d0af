"""What one ``attnlab.generate`` call costs beyond its decode steps.

The tools/bench_decode.py model (``_bench.MODEL``, float32), B=1, prompt 16,
greedy, contiguous cache: the best wall time of ``--iters`` calls for 1 and
240 new tokens (each compiled by a first call that is not timed). The 1-token
call is the per-call floor: argument handling, dispatch, the prefill and one
sampled token.

    PYTHONPATH=$PWD python tools/bench_generate_call.py [--iters 15]
"""

from __future__ import annotations

import argparse
import json

import _bench


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--iters", type=_bench.positive_int, default=15)
  args = p.parse_args()

  import numpy as np
  from flax import nnx

  import attnlab

  model = attnlab.build_model(_bench.attnlab_config(), rngs=nnx.Rngs(0))
  prompt = np.arange(3, 19, dtype=np.int32)[None]
  out = {"cpu": _bench.cpu_name()}
  for n in (1, 240):
    call = lambda n=n: np.asarray(attnlab.generate(model, prompt, max_new_tokens=n, eos_id=None))
    call()  # compile
    out[f"ms_{n}_tokens"] = round(_bench.best_of(call, args.iters) * 1e3, 2)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
