"""Where a decode step's time goes, op by op: XLA:CPU's own per-op trace.

Runs ``attnlab.generate`` on the tools/bench_decode.py model (``_bench.MODEL``,
float32, prompt 16, greedy, contiguous cache) under ``jax.profiler.trace``
with XLA:CPU's per-thunk trace events on
(``--xla_cpu_enable_xprof_traceme=true``), reads the events back with
jax's profile-data reader, and prints the ops of the compiled program by
time per decode step: fusions, library calls (``ynn_fusion``), dots, copies.
Tracing adds a few microseconds to every op, so the totals run above an
untraced step (tools/profile_decode_step.py times that); the ranking and the
op names (which match XLA's optimized HLO, ``--xla_dump_to``) are the point.
This is how the per-step transpose of the output projection's weight
(``copy_bitcast_fusion``, fixed by ``attnlab.nn.layers.weight_einsum``) was found.

    PYTHONPATH=$PWD python tools/trace_decode_ops.py [--batch 1] [--new_tokens 240] [--top 30]

With ``--serve paged|contiguous`` it traces one run of tools/bench_serve.py's
workload instead (``--requests``, ``--policy``; 8 slots) and prints the ops of
the decode program alone, per batched decode step.

    PYTHONPATH=$PWD python tools/trace_decode_ops.py --serve paged [--requests 64]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile

_FLAG = "--xla_cpu_enable_xprof_traceme=true"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import _bench  # noqa: E402


def _trace(run, module: str | None):
  """{op name: [events, total ns]} of XLA's ops while ``run()`` runs (traced), only those
  of programs whose name contains ``module`` if given."""
  import jax
  from jax._src.lib import _profile_data

  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      out = run()
    (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
    data = _profile_data.ProfileData.from_file(path)
  times = collections.defaultdict(lambda: [0, 0])
  for plane in data.planes:
    for line in plane.lines:
      if "python" in line.name:  # the host's Python events, not XLA's ops
        continue
      for ev in line.events:
        if module is not None and module not in str(dict(ev.stats).get("hlo_module", "")):
          continue
        t = times[ev.name]
        t[0] += 1
        t[1] += ev.duration_ns
  return times, out


def op_times(batch: int, new_tokens: int, calls: int = 3):
  """{op name: (events, total ns)} over ``calls`` traced generate calls, XLA threads only."""
  import numpy as np
  from flax import nnx

  import attnlab

  cfg = _bench.attnlab_config()
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  prompt = np.tile(np.arange(3, 19, dtype=np.int32)[None] % cfg.vocab_size, (batch, 1))
  run = lambda: np.asarray(attnlab.generate(model, prompt, max_new_tokens=new_tokens,
                                            eos_id=None))
  run()  # compile outside the trace
  times, _ = _trace(lambda: [run() for _ in range(calls)], None)
  return times


def serve_op_times(cache: str, policy: str, requests: int):
  """({op name: (events, total ns)} of the decode program, ServeStats) of one traced
  ``serve_requests`` run of tools/bench_serve.py's workload."""
  from attnlab.decoding import batching

  model, prompts, budgets = _bench.serve_workload(requests)
  run = lambda: batching.serve_requests(model, prompts, budgets, slots=8, cache=cache,
                                        eos_id=None, policy=policy, bucket=False)[1]
  run()  # compile outside the trace
  return _trace(run, "_decode")


def _print_ops(times, steps, top):
  ops = {n: t for n, t in times.items()
         # (SlinkyThreadPool events are waits inside a library call's own event: counted
         # twice until 2026-12-06)
         if not n.startswith(("ThunkExecutor", "ThreadpoolListener", "SlinkyThreadPool", "end:",
                              "while"))}
  total = sum(ns for _, ns in ops.values())
  print(f"all ops: {total / steps / 1e3:.1f} us a step over {len(ops)} distinct ops "
        "(traced: each op pays the trace's own overhead)")
  kinds = collections.Counter()
  for name, (_, ns) in ops.items():
    kinds[name.split(".")[0]] += ns
  print("by kind: " + ", ".join(f"{k} {ns / steps / 1e3:.1f} us"
                                for k, ns in kinds.most_common(8)))
  for name, (n, ns) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]:
    print(f"{ns / steps / 1e3:9.2f} us/step {n / steps:6.2f}/step  {name}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=_bench.positive_int, default=1)
  parser.add_argument("--new_tokens", type=_bench.positive_int, default=240)
  parser.add_argument("--top", type=_bench.positive_int, default=30)
  parser.add_argument("--serve", choices=("paged", "contiguous"), default=None,
                      help="trace the decode program of tools/bench_serve.py's workload with "
                           "this cache instead (8 slots)")
  parser.add_argument("--policy", choices=("continuous", "static"), default="continuous")
  parser.add_argument("--requests", type=_bench.positive_int, default=64)
  args = parser.parse_args()
  print(_bench.header(), flush=True)
  if args.serve:
    times, stats = serve_op_times(args.serve, args.policy, args.requests)
    print(f"bench_serve workload, {args.requests} requests, cache={args.serve}, "
          f"policy={args.policy}: {stats.decode_steps} decode steps of 8 slots, occupancy "
          f"{stats.occupancy:.3f}; the decode program's ops per step")
    _print_ops(times, stats.decode_steps, args.top)
    return
  calls = 3
  times = op_times(args.batch, args.new_tokens, calls)
  print(f"model {_bench.MODEL}, float32, B={args.batch}, prompt 16, {args.new_tokens} new "
        f"tokens; {calls} traced calls; per decode step (prefill included, spread over steps)")
  _print_ops(times, calls * args.new_tokens, args.top)


if __name__ == "__main__":
  main()
