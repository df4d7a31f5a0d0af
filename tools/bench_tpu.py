"""Benchmarks of the TPU flash kernel (attnlab/ops/pallas/flash_tpu.py).

CPU (default; TPU interpret mode, so times measure grid steps and DMAs as the
interpreter emulates them, not TPU speed):
  1. Block skipping: a sliding window (--window) against full causal at
     --skip_len, forward and forward+backward; the window/causal ratio.
  2. The boundary transposes ([B, T, N, H] <-> heads-major [B, N, T, H]):
     their share of the interpret-mode time, and the transposes XLA keeps
     when the same call is lowered for TPU.

TPU (--tpu): TFLOP/s of pallas-tpu (compiled) against
jax.nn.dot_product_attention (XLA), bfloat16, T in --tpu_lengths, H in
{64, 128}, causal or not, forward and forward+backward (forward FLOPs
4 B N T S H, halved when causal; backward 2.5x the forward).

  python tools/bench_tpu.py                      # CPU, several minutes
  python tools/bench_tpu.py --tpu --iters 3      # on a TPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout

import _bench  # noqa: E402 - tools/ is on sys.path (run as a script)

from attnlab.ops.pallas import flash_tpu  # noqa: E402


def _qkv(B, T, N, K, H, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32).astype(dtype)
  return q, k, v


def _fwd_bwd(fn):
  def run(q, k, v):
    out, pullback = jax.vjp(fn, q, k, v)
    return pullback(jnp.ones_like(out))

  return run


def _time(fn, *args, iters):
  """Best wall time of a compiled call over ``iters``, after one warm-up."""
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def _row(*cells, width=14):
  print("".join(str(c).rjust(width) for c in cells), flush=True)


def cpu_skipping(args):
  B, N, K, H, T, w = 1, args.heads, args.kv_heads, args.head_dim, args.skip_len, args.window
  bs = dict(block_q=args.block, block_k=args.block)
  q, k, v = _qkv(B, T, N, K, H, jnp.float32)
  print(f"# TPU interpret mode: sliding window {w} vs full causal, T={T}, B={B} N={N} K={K} "
        f"H={H} float32, blocks {args.block} (best of {args.iters}, seconds)")
  _row("pass", "causal s", f"window={w} s", "window/causal")
  for mode in args.modes:
    t = {}
    for name, window in (("causal", None), ("window", w)):
      fn = lambda q, k, v, window=window: flash_tpu.flash_attention_tpu(
          q, k, v, causal=True, window=window, **bs)
      t[name] = _time(fn if mode == "fwd" else _fwd_bwd(fn), q, k, v, iters=args.iters)
    _row(mode, f"{t['causal']:.2f}", f"{t['window']:.2f}", f"{t['window'] / t['causal']:.2f}")
  print()


def cpu_transposes(args):
  B, N, K, H, T = 1, args.heads, args.kv_heads, args.head_dim, args.transpose_len
  bs = dict(block_q=args.block, block_k=args.block)
  q, k, v = _qkv(B, T, N, K, H, jnp.float32)
  kernel = lambda q, k, v: flash_tpu.flash_attention_tpu(q, k, v, causal=True, **bs)

  def transposes_only(q, k, v):
    # What the wrapper does around the kernels in the forward: three in, one out. Each is
    # an output, so XLA materializes it (until 2026-12-05 it cancelled the two of q and
    # dropped those of k and v under a sum: the time was of two sums and an add).
    q2, k2, v2 = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    return q2, k2, v2, jnp.swapaxes(q2 * 2.0, 1, 2)

  t_all = _time(kernel, q, k, v, iters=args.iters)
  t_tr = _time(transposes_only, q, k, v, iters=args.iters)
  print(f"# boundary transposes, T={T} B={B} N={N} K={K} H={H} float32 causal, "
        f"TPU interpret mode (best of {args.iters})")
  print(f"forward {t_all:.3f} s; the transposes alone {t_tr * 1e3:.2f} ms "
        f"({100 * t_tr / t_all:.2f}% of it)")
  qs = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  ks = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
  for mode in ("fwd", "fwd+bwd"):
    fn = lambda q, k, v: flash_tpu.flash_attention_tpu(q, k, v, causal=True, interpret=False)
    fn = fn if mode == "fwd" else _fwd_bwd(fn)
    text = jax.jit(fn).trace(qs, ks, ks).lower(lowering_platforms=("tpu",)).as_text()
    n_tr = text.count("stablehlo.transpose")
    print(f"lowered for TPU, {mode}: {n_tr} stablehlo.transpose ops around "
          f"{text.count('tpu_custom_call')} kernels")
  print()


def _flops(B, N, T, H, causal, mode):
  fwd = 4 * B * N * T * T * H / (2 if causal else 1)
  return fwd if mode == "fwd" else 3.5 * fwd


def tpu_throughput(args):
  B, N = args.tpu_batch, args.tpu_heads
  print(f"# TFLOP/s, bfloat16, B={B} N=K={N} (best of {args.iters})")
  _row("T", "H", "causal", "pass", "pallas-tpu", "xla", width=11)
  for T in args.tpu_lengths:
    for H in (64, 128):
      q, k, v = _qkv(B, T, N, N, H, jnp.bfloat16)
      for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
          row = [T, H, causal, mode]
          for name in ("pallas-tpu", "xla"):
            if name == "xla":
              fn = lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                  q, k, v, is_causal=c, implementation="xla")
            else:
              fn = lambda q, k, v, c=causal: flash_tpu.flash_attention_tpu(q, k, v, causal=c)
            try:
              t = _time(fn if mode == "fwd" else _fwd_bwd(fn), q, k, v, iters=args.iters)
              row.append(f"{_flops(B, N, T, H, causal, mode) / t / 1e12:.1f}")
            except Exception as e:  # one failing implementation must not hide the other
              print(f"{name} T={T} H={H}: {e!r}"[:400], file=sys.stderr)
              row.append("error")
          _row(*row, width=11)
  print()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--tpu", action="store_true", help="the TFLOP/s table (needs a TPU)")
  p.add_argument("--skip", nargs="*", default=[], choices=["skipping", "transposes"])
  p.add_argument("--skip_len", type=_bench.positive_int, default=4096)
  p.add_argument("--window", type=_bench.positive_int, default=256)
  p.add_argument("--block", type=_bench.positive_int, default=128)
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  p.add_argument("--transpose_len", type=_bench.positive_int, default=1024)
  p.add_argument("--heads", type=_bench.positive_int, default=1)
  p.add_argument("--kv_heads", type=_bench.positive_int, default=1)
  p.add_argument("--head_dim", type=_bench.positive_int, default=64)
  p.add_argument("--iters", type=_bench.positive_int, default=2)
  p.add_argument("--tpu_lengths", type=_bench.positive_int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--tpu_batch", type=_bench.positive_int, default=1)
  p.add_argument("--tpu_heads", type=_bench.positive_int, default=16)
  args = p.parse_args(argv)
  print(f"# jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.devices()[0].device_kind}\n{_bench.header()}\n")
  if args.tpu:
    if jax.default_backend() != "tpu":
      sys.exit(f"--tpu needs a TPU; the default backend is {jax.default_backend()!r}")
    tpu_throughput(args)
    return
  if "skipping" not in args.skip:
    cpu_skipping(args)
  if "transposes" not in args.skip:
    cpu_transposes(args)


if __name__ == "__main__":
  main()
