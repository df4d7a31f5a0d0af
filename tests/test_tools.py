"""The measurement tools under tools/ (README numbers come from them): every one prints its
usage, and every name it imports from attnlab, at the top or inside a function, exists, so
an API that moved or a broken argument parser shows here, not when someone reruns a
benchmark; run_timed.py passes its command's exit code through and prints its summary line.
(What the benchmarks measure is not checked here: they need minutes and, some, torch.)"""

import ast
import glob
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Not command-line tools with --help: the shared helpers of the benchmarks, a pytest
# plugin, and run_timed.py (tested below).
NOT_CLI = {"_bench.py", "pytest_compile_profile.py", "run_timed.py"}
TOOLS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "tools", "*.py"))
               if os.path.basename(p) not in NOT_CLI)


def _run(args, **kw):
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300, **kw)


def test_the_tool_list_is_what_the_folder_holds():
  assert len(TOOLS) >= 14 and "bench_decode.py" in TOOLS and "profile_decode_step.py" in TOOLS


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_imports_and_prints_its_usage(tool):
  res = _run([os.path.join("tools", tool), "--help"])
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.startswith("usage: ") and tool in res.stdout.split("\n", 1)[0], res.stdout


def _attnlab_imports(path):
  """(module, name or None) of every attnlab import in a file, at any depth."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from ((a.name, None) for a in node.names if a.name.split(".")[0] == "attnlab")
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "attnlab":
      yield from ((node.module, a.name) for a in node.names)


def test_every_name_a_tool_imports_from_attnlab_exists():
  """Most tools import attnlab inside ``main`` (after parsing their flags), which --help
  never reaches: every such import is resolved here."""
  seen = 0
  for path in sorted(glob.glob(os.path.join(REPO, "tools", "*.py"))):
    for module, name in _attnlab_imports(path):
      mod = importlib.import_module(module)
      if name is not None and not hasattr(mod, name):
        importlib.import_module(f"{module}.{name}")  # a submodule: raises if it is not one
      seen += 1
  assert seen > 30  # the tools do import from attnlab


def test_run_timed_passes_the_exit_code_through_and_prints_a_summary():
  res = _run(["tools/run_timed.py", "--", sys.executable, "-c", "import sys; sys.exit(3)"])
  assert res.returncode == 3
  assert re.match(r"\[run_timed\] exit 3; wall 0 min \d+ s; CPU of the command \d+ min \d+ s "
                  r"on \d+ CPUs", res.stderr), res.stderr
  res = _run(["tools/run_timed.py"])
  assert res.returncode == 1 and "usage: python tools/run_timed.py -- COMMAND" in res.stderr
  # A command that does not exist: 127 and the summary, as a shell gives (a traceback until
  # 2026-12-04).
  res = _run(["tools/run_timed.py", "--", "/nonexistent/command"])
  assert res.returncode == 127 and "Traceback" not in res.stderr, res.stderr
  assert "[run_timed] exit 127; wall" in res.stderr, res.stderr
  # --help is the usage, not a command to run (127 "No such file" until 2026-12-04).
  res = _run(["tools/run_timed.py", "--help"])
  assert res.returncode == 0 and "python tools/run_timed.py -- make test" in res.stdout
  # A command killed by a signal: the shell's 128 + N (247 for SIGKILL until 2026-12-05).
  res = _run(["tools/run_timed.py", "--", sys.executable, "-c",
              "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
  assert res.returncode == 137 and "[run_timed] exit 137; wall" in res.stderr, res.stderr


def test_run_timed_says_when_no_cpu_tick_passed():
  """Not "busy 100%" (until 2026-12-05), as a division by 1 tick made it."""
  sys.path.insert(0, os.path.join(REPO, "tools"))
  try:
    import run_timed
  finally:
    sys.path.pop(0)
  ticks = dict.fromkeys(run_timed.FIELDS, 5)
  assert run_timed.shares(ticks, ticks) is None
  later = dict(ticks, user=8, idle=6, steal=6)
  assert run_timed.shares(ticks, later) == dict(busy=0.6, idle=0.2, steal=0.2)


@pytest.mark.parametrize("tool", ["bench_load_checkpoint.py", "eval_cache_dtype.py",
                                  "prompt_bos_loss.py", "bench_resume.py"])
def test_a_tool_given_a_folder_that_is_no_workdir_says_so_in_one_line(tool, tmp_path):
  """Exit 2 and the usage's one error line (a FileNotFoundError traceback until
  2026-12-04)."""
  res = _run([os.path.join("tools", tool), "--workdir", str(tmp_path)])
  assert res.returncode == 2, res.stderr[-2000:]
  assert res.stderr.strip().splitlines()[-1] == (
      f"{tool}: error: {tmp_path / 'config.gin'} does not exist: not a training workdir")
  assert "Traceback" not in res.stderr


COUNT_FLAGS = ("iters", "rounds", "repeats", "batches", "files", "tokens", "requests", "slots",
               "steps", "new_tokens", "batch", "top", "prompts", "gpu_batch", "tpu_batch",
               "decode_batch", "recompute_tokens", "decode_chunk", "widths", "steady_width",
               # sizes (until 2026-12-06 plain ints: `bench_decode_mesh.py --tensor 0` was a
               # worker's traceback)
               "lengths", "skip_len", "window", "heads", "kv_heads", "head_dim", "gpu_lengths",
               "gpu_heads", "decode_lengths", "tensor", "page_size", "block", "transpose_len",
               "tpu_lengths", "tpu_heads")


def test_count_flags_take_positive_integers_only():
  """A count of 0 or less was a traceback (``min()`` of nothing, a KeyError, a division by
  zero) or a nonsense result (``--files 0`` read every file) until 2026-12-05: every count
  flag of every tool parses with ``_bench.positive_int``, and one of them is run."""
  plain = []
  for path in sorted(glob.glob(os.path.join(REPO, "tools", "*.py"))):
    if os.path.basename(path) == "import_time.py":  # checks --repeats itself, without _bench
      continue
    with open(path, encoding="utf-8") as f:
      text = f.read()
    plain += [f"{os.path.basename(path)}: --{name}" for name in COUNT_FLAGS
              if re.search(rf'add_argument\("--{name}", type=int\b', text)]
  assert plain == []
  res = _run(["tools/bench_generate_call.py", "--iters", "0"])
  assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
      "bench_generate_call.py: error: argument --iters: 0 is not a positive integer")
  # A cache it does not know: the usage's line (a traceback from the first request until
  # 2026-12-05).
  res = _run(["tools/bench_prefill_buckets.py", "--cache", "paged,bogus"])
  assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
      "bench_prefill_buckets.py: error: --cache: 'bogus' is not paged or contiguous")


def test_fuzz_parity_runs_a_trial_and_refuses_a_bad_budget_or_seed():
  """One attention trial (the budget is checked between trials): every CPU implementation
  against the float64 oracle, one JSON summary line, exit 0; a budget of no time or a
  negative seed is the usage's one line."""
  import json

  res = _run(["tools/fuzz_parity.py", "--check", "attention", "--seconds", "0.001"])
  assert res.returncode == 0, res.stderr[-2000:]
  summary = json.loads(res.stdout.strip().splitlines()[-1])
  assert (summary["check"], summary["seed"], summary["trials"], summary["mismatches"]) == (
      "attention", 0, 1, 0)
  for flag, value, why in (("--seconds", "0", "0 is not a positive number of seconds"),
                           ("--seconds", "nan", "nan is not a positive number of seconds"),
                           ("--seed", "-1", "-1 is not an integer >= 0")):
    res = _run(["tools/fuzz_parity.py", "--check", "gradients", flag, value])
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        f"fuzz_parity.py: error: argument {flag}: {why}"), res.stderr


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_profile_decode_step_counts_the_loop_body_and_the_weights_made_float32_before_it(
    param_dtype, monkeypatch):
  """profile_decode_step.py reads XLA's optimized HLO of ``generate``'s program: the loop
  body's instructions (none weight-sized: no weight copied in a step), and the weights
  converted to float32 outside the loop, which is where XLA:CPU puts a bfloat16 weight's
  conversion (so its loop reads float32 copies): one per weight matrix at least, and none
  for float32 parameters."""
  from flax import nnx

  import attnlab

  monkeypatch.syspath_prepend(os.path.join(REPO, "tools"))
  import _bench
  import profile_decode_step as tool

  # The benchmarks' model itself: at tiny dims activations would share the weights' sizes.
  cfg = _bench.attnlab_config(max_len=512, param_dtype=param_dtype)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  kinds, converted = tool.loop_body_ops(model, cfg)
  assert "weight-sized" not in kinds and kinds.get("fusion(kLoop)", 0) > 0, kinds
  matrices = 7 * cfg.num_layers + 1  # q, k, v, o, gate, up, down per layer; the embedding
  if param_dtype == "float32":
    assert converted == 0
  else:
    assert converted >= matrices, converted


def test_profile_decode_step_credits_its_stream_with_the_bytes_it_reads(monkeypatch):
  """The stream pass reads a bfloat16 array through the float32 copy XLA makes of it
  before the loop: its GB/s count float32 bytes (until 2026-12-06 the bfloat16 bytes, half
  of what was read); integer arrays as they are. The weights are the pass's arguments."""
  import jax.numpy as jnp

  monkeypatch.syspath_prepend(os.path.join(REPO, "tools"))
  import profile_decode_step as tool

  arrays = [jnp.ones((3, 5), jnp.bfloat16), jnp.ones((2,), jnp.float32),
            jnp.ones((7,), jnp.int32), jnp.ones((4,), jnp.int8)]
  assert tool.float32_bytes(arrays) == 15 * 4 + 2 * 4 + 7 * 4 + 4
  assert tool.stream_seconds(arrays, iters=1, steps=2) > 0


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_profile_decode_step_reads_narrow_weights_in_the_loop(fmt, monkeypatch):
  """The narrow-weight probe's products are the float32 products within the format's
  rounding, and its loop reads the narrow weights themselves: the compiled while loop
  carries every weight in its format (without the probe's barrier XLA converts them once
  before the loop and carries float32 / int32 copies, as it does for the model's bfloat16
  parameters)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import attnlab

  monkeypatch.syspath_prepend(os.path.join(REPO, "tools"))
  import _bench
  import profile_decode_step as tool

  w = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32)
  x = jax.random.normal(jax.random.key(1), (64,), jnp.float32)
  [(wq, scale)] = tool.narrow_weights([w], fmt)
  assert wq.dtype == jnp.dtype(fmt)
  exact = np.asarray(x @ w)
  got = np.asarray(tool.narrow_product(x, wq, scale))
  ax, aw = np.abs(np.asarray(x)), np.abs(np.asarray(w))
  if fmt == "bfloat16":  # both factors rounded to 8 significant bits
    bound = 2 ** -7 * (ax @ aw)
  else:  # each factor off by at most half its scale (its max |.| / 127), and their product
    bound = (ax.max() * aw.sum(0) + ax.sum() * aw.max(0)) / 254 + (
        64 * ax.max() * aw.max(0) / 254**2)
  assert np.all(np.abs(got - exact) <= 1.001 * bound), np.abs(got - exact).max()
  assert np.abs(got - exact).max() > 0  # computed in the narrow format, not in float32

  cfg = _bench.attnlab_config(max_len=64)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  run, carry, nbytes = tool.narrow_matvec_program(cfg, model, fmt, steps=2)
  matrices = tool._weight_matrices(cfg, model)
  assert len(matrices) == 7 * cfg.num_layers + 1
  assert nbytes == sum(m.size for m in matrices) * jnp.dtype(fmt).itemsize
  text = run.lower(carry).compile().as_text()
  [loop] = [line for line in text.splitlines() if " while(" in line]
  carried = re.findall(r"(\w+)\[([\d,]+)\]", loop.split(" while(")[0])
  shapes = {tuple(m.shape) for m in matrices}
  weights = [dtype for dtype, dims in carried if tuple(map(int, dims.split(","))) in shapes]
  short = {"bfloat16": "bf16", "int8": "s8"}[fmt]
  assert len(weights) >= 7 * cfg.num_layers + 1 and set(weights) == {short}, weights
  jax.block_until_ready(run(carry))


def test_bench_serve_reports_the_slots_that_ran(monkeypatch, capsys):
  """serve_requests takes no more slots than requests; the report's ``slots`` (which the
  occupancy counts) is those that ran, not --slots (until 2026-12-07: 8 named, 2 ran)."""
  from flax import nnx

  import attnlab

  monkeypatch.syspath_prepend(os.path.join(REPO, "tools"))
  import _bench
  import bench_serve as tool

  cfg = attnlab.ModelConfig(arch="decoder_only", vocab_size=40, d_model=16, num_layers=1,
                            num_heads=2, d_ff=32, max_len=32)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  monkeypatch.setattr(_bench, "serve_workload",
                      lambda requests, seed: (model, [[3, 4, 5], [6, 7]], [4, 6]))
  from attnlab.decoding import batching

  buckets = []  # one set of requests: sized exactly, as the README's numbers were measured
  real = batching.serve_requests

  def spy(*args, **kwargs):
    buckets.append(kwargs.get("bucket", True))
    return real(*args, **kwargs)

  monkeypatch.setattr(batching, "serve_requests", spy)
  monkeypatch.setattr(sys, "argv", ["bench_serve.py", "--requests", "2", "--slots", "8",
                                    "--rounds", "1", "--cache", "paged", "--page_size", "4",
                                    "--decode_chunk", "4"])
  tool.main()
  assert buckets and not any(buckets)
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["slots"] == 2 and report["requests"] == 2
  # 10 tokens in 6 decode steps: budgets 4 and 6 less the prefill's first tokens (3 and 5
  # steps, the longer one alone for its last 2).
  assert report["paged/continuous"]["decode_steps"] == 5
  assert report["paged/continuous"]["occupancy"] == round(8 / (5 * 2), 3)
