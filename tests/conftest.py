"""Shared pytest hooks.

One persistent XLA compilation cache per test session: the programs that
several tests compile alike (the tiny training configs' train step, compiled
again by every resume, every ``attnlab train`` subprocess and every sweep arm)
compile once and are loaded from the cache afterwards. The directory is new
for each session (shared by its xdist workers and the subprocesses they start,
which inherit the environment), so a run never reads programs compiled by an
older checkout. A directory set by the caller in $JAX_COMPILATION_CACHE_DIR is
used as it is. Tests that read what XLA prints while compiling turn the cache
off in their own process (tests/training/remat_check.py).

XLA:CPU compiles for speed of compilation, not of the code: the suite's
programs are small and run once or a few times, so most of a test's time was
LLVM optimizing code that then runs for microseconds. Backend (LLVM)
optimization level 0, and fusions through XLA's older loop emitters instead of
the MLIR fusion emitters (``--xla_cpu_use_fusion_emitters=false``, about half
the compile time of a flash-attention forward + backward):
tests/ops/test_attention.py takes 3 min 24 s with XLA's defaults, 1 min 20 s at
level 0, 49 s with both. And one LLVM module per program
(``--xla_cpu_parallel_codegen_split_count=1``): XLA splits a module to compile
the parts on idle cores, but the suite's two workers leave none idle, so the
split is overhead (3-4% less CPU time over test_attention + test_kv_cache +
test_batching with ``-n 2``, two rounds each, 2026-12-03, Intel box). None of
these changes what a program computes (XLA's CPU fast-math is off either way).
Flags the caller put in $XLA_FLAGS come first and are kept; a caller who sets
``--xla_backend_optimization_level`` there gets XLA's defaults for all, and so
does a machine with a GPU or TPU plugin installed (the flags are for XLA:CPU).
A flag the installed XLA does not know is left out: XLA aborts the process on one
(jax 0.12 has no ``--xla_cpu_use_fusion_emitters``: every test process died at
its first compile until 2026-12-07). One subprocess asks XLA, in the session's
first process only (xdist's workers inherit the flags it settled on).
Subprocesses inherit the flags; the scripts that force a device count append
to them.
"""

import gc
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  # xdist gives the controller and every worker the same run id.
  _run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
  _OWN_CACHE = os.path.join(tempfile.gettempdir(), f"attnlab-test-xla-cache-{_run}")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  # Programs that compile in under 0.1 s are not written: writing one costs ~17 ms.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "libtpu")


def known_xla_flags(given: str, flags: str) -> str:
  """``flags`` less those the installed XLA does not know, after the caller's ``given``:
  XLA aborts a process whose $XLA_FLAGS holds unknown flags, naming them ("Unknown flag in
  XLA_FLAGS: --a", "Unknown flags in XLA_FLAGS: --a --b")."""
  wanted = flags.split()
  while wanted:
    env = dict(os.environ, XLA_FLAGS=" ".join([given, *wanted]).strip(), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, text=True, timeout=300)
    if run.returncode == 0:
      break
    named = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", run.stderr)
    unknown = named[1].split() if named else []
    if not unknown or not set(unknown) <= set(wanted):  # not (only) ours: XLA's defaults
      return ""
    wanted = [f for f in wanted if f not in unknown]
  return " ".join(wanted)


if ("xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
    and not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)):
  _given = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{_given} {known_xla_flags(_given, TEST_XLA_FLAGS)}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  """Modules with a test marked ``slow`` run first, so that with ``-n 2`` no worker starts
  a minute-long test while the other has nothing left (pytest-xdist hands out tests in
  this order); a module stays in one piece, so its module-scoped fixtures are built once.
  Tests marked ``gpu`` / ``tpu`` are skipped unless JAX's default backend is one."""
  slow = {item.path for item in items if "slow" in item.keywords}
  items.sort(key=lambda item: item.path not in slow)  # stable: file order otherwise
  backend = jax.default_backend()
  for marker in ("gpu", "tpu"):
    if backend == marker:
      continue
    skip = pytest.mark.skip(reason=f"needs a {marker.upper()}; the default backend is {backend!r}")
    for item in items:
      if marker in item.keywords:
        item.add_marker(skip)


def _memory_maps() -> tuple[int, int] | None:
  """(memory maps of this process, the kernel's limit per process), or None off Linux."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f), limit
  except (OSError, ValueError):
    return None


def pytest_runtest_teardown(item, nextitem):
  """Past three quarters of the kernel's limit of memory maps per process
  (``vm.max_map_count``, 65530 by default), JAX's caches are cleared: every program XLA:CPU
  compiled stays mapped while JAX caches it, and at the limit LLVM's JIT cannot map the next
  one ("Failed to materialize symbols", then the process aborts in a compile). jax 0.12.1
  maps about twice what 0.10.2 did for the same tests (tests/nn/test_models.py alone: 2909
  maps at its end against 1532); under 0.12.1 one process running the suite (``-n 1``)
  reached 65532 maps in tests/nn/test_models.py, about its 800th test, and aborted; under
  0.10.2 a worker of ``-n 2`` reached 26837 (2026-12-07), short of the line, where a
  clearing every 25 tests would cost the suite minutes of compiling. Cleared programs are
  compiled again (those that took 0.1 s or more, from the session's persistent cache).
  Counted every 25th test (reading /proc/self/maps costs ~1 ms per 5000 maps; a test adds
  under a hundred under jax 0.12)."""
  global _tests_since_maps
  _tests_since_maps += 1
  if _tests_since_maps % 25:
    return
  maps = _memory_maps()
  if maps is not None and maps[0] > maps[1] * 3 // 4:
    jax.clear_caches()
  if _tests_since_maps % FREEZE_EVERY == 0:
    _collect_and_freeze()


_tests_since_maps = 0
FREEZE_EVERY = 100


def _collect_and_freeze():
  """Every ``FREEZE_EVERY`` tests a worker collects all its garbage and moves what is left
  (JAX's caches of traced and compiled programs, the modules, the fixtures) out of the
  cycle collector's sight (``gc.freeze``) until the next time, which takes it back in
  (``gc.unfreeze``) first: a cycle through a frozen object waits at most that long to be
  freed. Python's full collections walk every object a process holds, and a worker holds
  2-3 million by the end (JAX's caches); in the suite's run on the Zen 4 box
  (2026-12-08 01:24-01:34 UTC, ``gc.callbacks`` timing each collection) the two workers
  spent 71 s of CPU collecting, 59 s of it in 98 full collections."""
  gc.unfreeze()
  gc.collect()
  gc.freeze()


def pytest_sessionfinish(session):
  """The controller (or the only process) removes the session's cache."""
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture
def warned(caplog):
  """A function giving the WARNING lines logged so far in the test (after any
  ``caplog.clear()``): attnlab reports a fallback or a skipped step in the log, once."""
  return lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture
def cache_dir_updates(monkeypatch):
  """The folders given to ``jax.config.update("jax_compilation_cache_dir", ...)``, recorded
  instead of set (the session keeps its own cache); other options go through (jax sets
  options of its own while it compiles)."""
  dirs = []
  update = jax.config.update

  def record(name, value):
    if name == "jax_compilation_cache_dir":
      dirs.append(value)
    else:
      update(name, value)

  monkeypatch.setattr(jax.config, "update", record)
  return dirs


@pytest.fixture(autouse=True)
def _retrace_for_mutmut_stats():
  """Under mutmut's first pass (``MUTANT_UNDER_TEST=stats``: which tests call which
  function), every test starts with JAX's caches cleared. mutmut runs a mutant only
  against the tests that called its function in that pass, and a function is called
  when a program is traced: without this, a jitted program that several tests share
  (a module-level ``jax.jit``, a cached decode program) counts for the first test that
  traced it only, and a mutant that only a later test kills shows as surviving
  (``test_sinusoidal_table_equals_paper_formula``'s first case, position 0, was the only
  test mapped to ``sinusoidal_positions``). A no-op outside that pass."""
  if os.environ.get("MUTANT_UNDER_TEST") == "stats":
    jax.clear_caches()
