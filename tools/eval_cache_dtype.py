"""What an int8 KV cache costs: validation loss and greedy agreement against a float cache.

    PYTHONPATH=$PWD python tools/eval_cache_dtype.py --workdir runs/demo [--batches 4]

Teacher-forced loss through a cache: each validation row goes through the
model in one pass WITH a cache, so every query attends over keys / values as
the cache stores them (written, then read back: quantized and dequantized
for int8), exactly what token-by-token decoding of the same row would see.
Rows are taken as single sequences (positions 0..T-1; the document
boundaries of the packed rows are ignored, identically for every cache
dtype). Reported: the mean NLL over the loss tokens with no cache (the model
alone), a float32 cache and an int8 cache, the relative delta int8 vs float,
and for greedy decoding (16-token prompts cut from the rows, 64 new tokens)
the fraction of tokens equal between the float and the int8 cache and the
mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import _bench  # noqa: E402 - tools/ is on sys.path (run as a script)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--batches", type=_bench.positive_int, default=4)
  p.add_argument("--prompts", type=_bench.positive_int, default=8)
  args = p.parse_args()

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import attnlab
  from attnlab import config_gin as gin_config
  from attnlab.data.pipeline import build_sources, validation_batches
  from attnlab.nn import kv_cache as cache_lib

  try:  # one line, not a traceback (until 2026-12-04)
    model, cfg = attnlab.load_checkpoint(args.workdir)
  except (FileNotFoundError, ValueError) as e:
    p.error(str(e))
  if cfg.arch != "decoder_only":  # a KeyError from the batches until 2026-12-04
    sys.exit(f"{args.workdir} holds an encoder-decoder; this measures a decoder-only model's "
             "self-attention cache")
  _, dcfg, _ = gin_config.read_workdir_config(os.path.join(args.workdir, "config.gin"))
  sources, _ = build_sources(dcfg, cfg)
  batches = validation_batches(sources, dcfg, args.batches)
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, static_argnames=("dtype_code",))
  def nll(tokens_BT, targets_BT, mask_BT, *, dtype_code):
    m = nnx.merge(graphdef, state)
    m.eval()
    B, T = tokens_BT.shape
    if dtype_code == "none":
      logits = m(tokens_BT)
    else:
      cache = cache_lib.init_cache(cfg, "contiguous", B, T, dtype=dtype_code)
      logits, _ = m(tokens_BT, segment_ids_BT=jnp.ones((B, T), jnp.int32), cache=cache)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
    return -jnp.sum(tok * mask_BT), jnp.sum(mask_BT)

  report = dict(workdir=args.workdir, batches=len(batches))
  for code in ("none", "float32", "int8"):
    tot = cnt = 0.0
    for b in batches:
      s, c = nll(jnp.asarray(b["tokens_BT"]), jnp.asarray(b["targets_BT"]),
                 jnp.asarray(b["loss_mask_BT"], jnp.float32), dtype_code=code)
      tot, cnt = tot + float(s), cnt + float(c)
    report[f"loss_{code}"] = tot / cnt
  report["int8_rel_delta"] = (report["loss_int8"] - report["loss_float32"]) / report[
      "loss_float32"]
  prompts = np.asarray(batches[0]["tokens_BT"])[:args.prompts, :16]
  outs = {d: np.asarray(attnlab.generate(model, prompts, max_new_tokens=64, eos_id=None,
                                         cache_dtype=d)) for d in ("float32", "int8")}
  same = outs["float32"] == outs["int8"]
  prefix = [int(np.argmin(r)) if not r.all() else r.size for r in same]
  report["greedy_token_agreement"] = float(same.mean())
  report["greedy_mean_common_prefix"] = float(np.mean(prefix))
  report["bytes_per_token"] = {d: cfg.kv_cache_bytes_per_token(d)
                               for d in ("float32", "bfloat16", "int8")}
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
