"""What the benchmarks share: the model, its transformers twin, the torch worker, timing.

The model (``MODEL``) is a small Llama: 4 layers, d_model 256, 8 query heads
sharing 2 KV heads of dim 32, SwiGLU 688, the byte vocabulary (259), float32.
``attnlab_config`` builds it as a ``ModelConfig``; ``llama_config`` as
transformers' ``LlamaConfig`` (the same shapes, tied embeddings).

The torch side runs in a worker process: the benchmark script itself, started
as ``PYTHON SCRIPT --torch_worker`` under ``--torch_python`` (a venv with torch
and transformers) or, if this interpreter has both, under this one. The worker
calls ``serve_torch(run)``: it prints one ready line, then for every integer
read from stdin prints the seconds ``run(n)`` took. ``TorchWorker`` is the other
end. Only the standard library is imported at the top: the worker's Python
need not have jax or attnlab. Importing this module puts the checkout on
``sys.path``, so the benchmarks run from a bare clone.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import time

# Run from a bare checkout too: the benchmarks import attnlab from this repository.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

MODEL = dict(layers=4, d_model=256, heads=8, kv_heads=2, head_dim=32, d_ff=688, vocab=259)


def positive_int(text: str) -> int:
  """An argparse type for counts (iterations, rounds, files...): a positive int; 0 or less
  is the usage's one error line (until 2026-12-05 a traceback or a nonsense result)."""
  import argparse

  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
  return value


def header() -> str:
  """A benchmark's first line: the CPU (``cpu_name``) and the UTC time it ran (until
  2026-12-05 most tools printed neither, and two printed local time without a zone)."""
  return f"# {cpu_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"


def cpu_name() -> str:
  """The CPU as ``lscpu`` describes it: model name, family / model, and whether it has
  AVX-512 ("AMD EPYC (family 23 model 1, avx2, no avx512)"). The model name alone is not
  enough: two boxes both called "AMD EPYC" ran these benchmarks 4-6x apart."""
  import platform

  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return platform.processor() or "unknown"
  fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
  fields = {k.strip(): v.strip() for k, v in fields.items()}
  flags = set(fields.get("Flags", "").split())
  simd = ", ".join(["avx2" if "avx2" in flags else "no avx2",
                    "avx512" if "avx512f" in flags else "no avx512"])
  return (f"{fields.get('Model name', 'unknown')} (family {fields.get('CPU family', '?')} "
          f"model {fields.get('Model', '?')}, {simd})")


def attnlab_config(**overrides):
  """``MODEL`` as an ``attnlab.ModelConfig`` (float32, SwiGLU)."""
  from attnlab.config import ModelConfig

  kwargs = dict(vocab_size=MODEL["vocab"], d_model=MODEL["d_model"],
                num_layers=MODEL["layers"], num_heads=MODEL["heads"],
                num_kv_heads=MODEL["kv_heads"], head_dim=MODEL["head_dim"],
                d_ff=MODEL["d_ff"], mlp="swiglu", dtype="float32")
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def serve_workload(requests: int, seed: int = 0):
  """The model and requests of tools/bench_serve.py: (model, prompts, budgets).

  The demo-sized model (4 layers, d_model 128, 4 heads, SwiGLU 352, RoPE, vocab
  259; random weights, float32); prompt lengths uniform in 8..200, token
  budgets in 16..256, drawn with ``seed``.
  """
  import numpy as np
  from flax import nnx

  import attnlab

  cfg = attnlab.ModelConfig(arch="decoder_only", vocab_size=259, d_model=128, num_layers=4,
                            num_heads=4, d_ff=352, pos="rope", norm="rmsnorm", mlp="swiglu",
                            tie_embeddings=True, max_len=1024)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  rs = np.random.RandomState(seed)
  lengths = rs.randint(8, 201, requests)
  budgets = rs.randint(16, 257, requests).tolist()
  prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in lengths]
  return model, prompts, budgets


def llama_config(max_positions: int):
  """``MODEL`` as transformers' ``LlamaConfig`` (tied embeddings, like attnlab's default)."""
  from transformers import LlamaConfig

  return LlamaConfig(vocab_size=MODEL["vocab"], hidden_size=MODEL["d_model"],
                     intermediate_size=MODEL["d_ff"], num_hidden_layers=MODEL["layers"],
                     num_attention_heads=MODEL["heads"], num_key_value_heads=MODEL["kv_heads"],
                     head_dim=MODEL["head_dim"], max_position_embeddings=max_positions,
                     tie_word_embeddings=True)


def llama_model(max_positions: int):
  """A float32 ``LlamaForCausalLM`` of ``MODEL``, seeded (torch.manual_seed(0))."""
  import torch
  from transformers import LlamaForCausalLM

  torch.manual_seed(0)
  return LlamaForCausalLM(llama_config(max_positions)).float()


def serve_torch(run, ready: dict | None = None) -> None:
  """The worker's loop: a ready line, then the seconds of ``run(n)`` per stdin line."""
  print(json.dumps({"ready": True, **(ready or {})}), flush=True)
  for line in sys.stdin:
    t0 = time.perf_counter()
    run(int(line))
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


class TorchWorker:
  """The parent's end of ``serve_torch``: ``seconds(n)`` asks the worker to run ``n``."""

  def __init__(self, script: str, python: str):
    self._proc = subprocess.Popen([python, script, "--torch_worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    self.ready = json.loads(self._proc.stdout.readline())  # its warm-up is done

  def seconds(self, n: int) -> float:
    self._proc.stdin.write(f"{n}\n")
    self._proc.stdin.flush()
    return json.loads(self._proc.stdout.readline())["seconds"]

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait()


def start_torch_worker(script: str, torch_python: str | None) -> TorchWorker | None:
  """A worker under ``torch_python``, else this Python if it has torch + transformers."""
  if torch_python is None:
    try:
      import torch  # noqa: F401
      import transformers  # noqa: F401
    except ImportError:
      print("torch / transformers not found: measuring attnlab only "
            "(--torch_python PATH to compare)")
      return None
    torch_python = sys.executable
  return TorchWorker(script, torch_python)


def wall(fn) -> float:
  """Seconds of one call of ``fn``, until its (JAX) result is ready."""
  import jax

  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def best_of(fn, iters: int) -> float:
  """Best wall time of ``fn()`` over ``iters`` calls, after one warm-up call.

  The minimum, not the median: on a shared machine the noise is one-sided.
  """
  wall(fn)
  return min(wall(fn) for _ in range(iters))


_STAGE_EVENTS = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
                 "backend_compile_duration": "compile"}
_stage_seconds = None


@contextlib.contextmanager
def compile_stages():
  """Seconds per JAX compile stage of the calls inside the block, summed.

  Yields a dict that holds, after the block, ``trace`` (Python -> jaxpr),
  ``lower`` (-> StableHLO), ``compile`` (XLA, or a persistent-cache hit),
  ``total`` (the block's wall time) and ``run`` (the rest: execution and Python).
  """
  global _stage_seconds
  import jax

  if _stage_seconds is None:  # a listener cannot be removed: register one, once
    _stage_seconds = collections.defaultdict(float)

    def listen(event, secs, **_):
      name = _STAGE_EVENTS.get(event.rsplit("/", 1)[-1])
      if name:
        _stage_seconds[name] += secs

    jax.monitoring.register_event_duration_secs_listener(listen)
  _stage_seconds.clear()
  out = {}
  t0 = time.perf_counter()
  yield out
  out["total"] = time.perf_counter() - t0
  out.update({name: _stage_seconds[name] for name in ("trace", "lower", "compile")})
  out["run"] = out["total"] - out["trace"] - out["lower"] - out["compile"]


def stages_line(stages: dict) -> str:
  """"2.10 s = trace 0.40 + lower 0.10 + XLA compile 1.20 + run and Python 0.40"."""
  return (f"{stages['total']:.2f} s = trace {stages['trace']:.2f} + lower {stages['lower']:.2f}"
          f" + XLA compile {stages['compile']:.2f} + run and Python {stages['run']:.2f}")
