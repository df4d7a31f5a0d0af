"""Attention benchmarks: memory and block skipping on CPU, throughput on GPU.

CPU (default):
  1. Compile-time temporary memory (XLA's memory_analysis().temp_size_in_bytes)
     of "reference", "chunked" and "pallas" (interpret mode) at each --lengths,
     forward and forward+backward, as a ratio to the reference.
  2. Block skipping: time of a sliding window (--window) against full causal
     at --skip_len, for "pallas", "blocked" (query blocks against their key
     range; what "auto" runs on XLA:CPU) and "chunked" (whose lax.scan visits
     every block, so it is the control).

GPU (--gpu):
  3. TFLOP/s of "pallas" against jax.nn.dot_product_attention with cuDNN and
     with XLA, bfloat16, forward and forward+backward (forward FLOPs
     4 B N T S H, halved when causal; backward 2.5x the forward).
  4. Decode kernels: achieved GB/s reading the KV cache, against --peak_gbs.

  python tools/bench_attention.py                       # CPU, a few minutes
  python tools/bench_attention.py --lengths 1024 4096   # quicker
  python tools/bench_attention.py --gpu                 # on a GPU
"""

from __future__ import annotations

import argparse
import sys

import _bench  # first: puts the checkout on sys.path
import jax
import jax.numpy as jnp

import attnlab
from attnlab.ops.pallas import decode


def _qkv(B, T, N, K, H, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32).astype(dtype)
  return q, k, v


def _attend(impl, **kw):
  return lambda q, k, v: attnlab.attention(q, k, v, implementation=impl, **kw)


def _fwd_bwd(fn):
  """Forward + backward: gradients of sum(out * dout) w.r.t. q, k, v."""

  def run(q, k, v):
    out, pullback = jax.vjp(fn, q, k, v)
    return pullback(jnp.ones_like(out))

  return run


def _temp_bytes(fn, *args):
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  return None if stats is None else stats.temp_size_in_bytes


def _time(fn, *args, iters):
  """Best wall time of the jitted ``fn(*args)`` over ``iters`` calls, after a warm-up."""
  jitted = jax.jit(fn)
  return _bench.best_of(lambda: jitted(*args), iters)


class _Table:
  """Prints each row as soon as it is measured (a timed-out run keeps its rows)."""

  def __init__(self, *header, width=12):
    self.width = width
    self.row(*header)
    self.row(*["-" * (width - 1)] * len(header))

  def row(self, *cells):
    print("".join(str(c).rjust(self.width) for c in cells), flush=True)


def cpu_memory(args):
  B, N, K, H = 1, args.heads, args.kv_heads, args.head_dim
  print(f"# compile-time temp memory, B={B} N={N} K={K} H={H} float32 causal "
        "(MiB; ratio = reference / impl)")
  table = _Table("T", "pass", "reference", "chunked", "pallas", "ref/chunked", "ref/pallas")
  for T in args.lengths:
    # Shapes only: compiling the reference at 16k must not allocate its scores.
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    k = v = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)
    for mode in ("fwd", "fwd+bwd"):
      got = {}
      for impl in ("reference", "chunked", "pallas"):
        fn = _attend(impl, causal=True)
        got[impl] = _temp_bytes(fn if mode == "fwd" else _fwd_bwd(fn), q, k, v)
      ref = got["reference"]
      table.row(T, mode, *[f"{got[i] / 2**20:.1f}" for i in got],
                *[f"{ref / max(got[i], 1):.1f}x" for i in ("chunked", "pallas")])
  print()


def cpu_block_skipping(args):
  B, N, K, H, T, w = 1, args.heads, args.kv_heads, args.head_dim, args.skip_len, args.window
  q, k, v = _qkv(B, T, N, K, H, jnp.float32)
  print(f"# sliding window {w} vs full causal, T={T}, B={B} N={N} K={K} H={H} float32 "
        f"(best of {args.iters}, seconds)")
  table = _Table("impl", "pass", "causal s", f"window={w} s", "window/causal", width=14)
  for impl in ("pallas", "blocked", "chunked"):
    for mode in ("fwd", "fwd+bwd"):
      t = {}
      for name, window in (("causal", None), ("window", w)):
        fn = _attend(impl, causal=True, window=window)
        t[name] = _time(fn if mode == "fwd" else _fwd_bwd(fn), q, k, v, iters=args.iters)
      table.row(impl, mode, f"{t['causal']:.3f}", f"{t['window']:.3f}",
                f"{t['window'] / t['causal']:.2f}")
  print()


def _flops(B, N, T, S, H, causal, mode):
  fwd = 4 * B * N * T * S * H / (2 if causal else 1)
  return fwd if mode == "fwd" else 3.5 * fwd


def gpu_throughput(args):
  print(f"# TFLOP/s, bfloat16, B={args.gpu_batch} N=K={args.gpu_heads} "
        f"(best of {args.iters})")
  table = _Table("T", "H", "causal", "pass", "pallas", "cudnn", "xla", width=10)
  B, N = args.gpu_batch, args.gpu_heads
  for T in args.gpu_lengths:
    for H in (64, 128):
      q, k, v = _qkv(B, T, N, N, H, jnp.bfloat16)
      for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
          row = [T, H, causal, mode]
          for impl in ("pallas", "cudnn", "xla"):
            fn = _attend(impl, causal=causal)
            try:
              t = _time(fn if mode == "fwd" else _fwd_bwd(fn), q, k, v, iters=args.iters)
              row.append(f"{_flops(B, N, T, T, H, causal, mode) / t / 1e12:.1f}")
            except Exception as e:  # one failing backend must not hide the others
              print(f"{impl} T={T} H={H}: {e!r}"[:400], file=sys.stderr)
              row.append("error")  # details on stderr
          table.row(*row)
  print()


def gpu_decode(args):
  B, N, K, H, C = args.decode_batch, 32, 8, 128, 64
  print(f"# decode, bfloat16, B={B} N={N} K={K} H={H} T=1, full caches; "
        f"GB/s of K/V read (peak {args.peak_gbs:.0f} GB/s)")
  table = _Table("S", "kernel", "us", "GB/s", "of peak", width=14)
  for S in args.decode_lengths:
    q = jax.random.normal(jax.random.key(0), (B, 1, N, H), jnp.bfloat16)
    _, k, v = _qkv(B, S, K, K, H, jnp.bfloat16, seed=1)
    lengths = jnp.full((B,), S, jnp.int32)
    cache_bytes = 2 * k.size * k.dtype.itemsize
    M = S // C
    page_table_BM = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
    k_pages = k.reshape(B * M, C, K, H)
    v_pages = v.reshape(B * M, C, K, H)
    cases = [
        ("decode", decode.decode_attention, (q, k, v, lengths)),
        ("paged decode", decode.paged_decode_attention,
         (q, k_pages, v_pages, page_table_BM, lengths)),
        ("xla", lambda q, k, v, l: attnlab.attention(
            q, k, v, causal=True, q_offset=l - 1, implementation="xla"), (q, k, v, lengths)),
    ]
    for name, fn, fargs in cases:
      try:
        t = _time(fn, *fargs, iters=args.iters)
        gbs = cache_bytes / t / 1e9
        table.row(S, name, f"{t * 1e6:.0f}", f"{gbs:.0f}", f"{100 * gbs / args.peak_gbs:.0f}%")
      except Exception as e:
        print(f"{name} S={S}: {e!r}"[:400], file=sys.stderr)
        table.row(S, name, "error", "", "")  # details on stderr
  print()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--gpu", action="store_true", help="run the GPU benchmarks instead")
  p.add_argument("--lengths", type=_bench.positive_int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--skip_len", type=_bench.positive_int, default=4096)
  p.add_argument("--window", type=_bench.positive_int, default=256)
  p.add_argument("--heads", type=_bench.positive_int, default=2)
  p.add_argument("--kv_heads", type=_bench.positive_int, default=1)
  p.add_argument("--head_dim", type=_bench.positive_int, default=64)
  p.add_argument("--iters", type=_bench.positive_int, default=5)
  p.add_argument("--skip", nargs="*", default=[], choices=["memory", "skipping", "throughput",
                                                           "decode"])
  p.add_argument("--gpu_lengths", type=_bench.positive_int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--gpu_batch", type=_bench.positive_int, default=1)
  p.add_argument("--gpu_heads", type=_bench.positive_int, default=16)
  p.add_argument("--decode_batch", type=_bench.positive_int, default=16)
  p.add_argument("--decode_lengths", type=_bench.positive_int, nargs="+", default=[4096, 32768])
  p.add_argument("--peak_gbs", type=float, default=4800.0, help="H200: 4.8 TB/s")
  args = p.parse_args(argv)
  print(f"# jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.devices()[0].device_kind}\n{_bench.header()}\n")
  if args.gpu:
    if jax.default_backend() != "gpu":
      sys.exit(f"--gpu needs a GPU; the default backend is {jax.default_backend()!r}")
    if "throughput" not in args.skip:
      gpu_throughput(args)
    if "decode" not in args.skip:
      gpu_decode(args)
    return
  if "memory" not in args.skip:
    cpu_memory(args)
  if "skipping" not in args.skip:
    cpu_block_skipping(args)


if __name__ == "__main__":
  main()
