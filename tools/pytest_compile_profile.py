"""A pytest plugin: where the suite's time goes, per test file -- the test's wall time and,
of it, JAX tracing + lowering and XLA compiling (from ``jax.monitoring``'s duration
events), and how many programs were compiled. Works with xdist (each worker writes its
rows; the controller adds them up).

    PYTHONPATH=tools pytest -p pytest_compile_profile -n 2 --dist worksteal tests

Subprocesses a test starts (``attnlab train`` and the like) are not seen: their time counts
as the test's wall time only. ``ATTNLAB_COMPILE_PROFILE_NAMES=N`` adds the N programs (by the
name JAX gives them: ``jit(f)``'s ``f``, an eager op's primitive) that took the most trace +
lower + compile time, summed over the suite; tracing time counts again in every enclosing
traced function, so that column adds up to more than the suite's total.
``ATTNLAB_COMPILE_PROFILE_TESTS=N`` adds the N test functions (all their parameters
together) that took the longest. The ``gc`` column is the time Python's cycle collector ran
during the tests (``gc.callbacks``; tests/conftest.py's collections every 100 tests
included), the summary adds how many of its collections were full ones (generation 2).
"""

from __future__ import annotations

import collections
import gc
import glob
import json
import os
import shutil
import tempfile
import time

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
_current = collections.Counter()
_rows = []
_names = collections.defaultdict(collections.Counter)


def _name(fun_name):
  """``f`` (tracing), ``jit_f`` (lowering), ``jit(f)`` (compiling): ``f``."""
  name = str(fun_name)
  if name.startswith("jit(") and name.endswith(")"):
    return name[4:-1]
  return name.removeprefix("jit_")


def _listen(event, seconds, fun_name=None, **_):
  if event in EVENTS:
    _current[EVENTS[event]] += seconds
    _names[_name(fun_name)][EVENTS[event]] += seconds
    if EVENTS[event] == "compile":
      _current["programs"] += 1
      _names[_name(fun_name)]["programs"] += 1


def _listen_hits(event, **_):
  if event == "/jax/compilation_cache/cache_hits":
    _current["cache hits"] += 1


_gc_start = [0.0]


def _gc_callback(phase, info):
  if phase == "start":
    _gc_start[0] = time.perf_counter()
    return
  _current["gc"] += time.perf_counter() - _gc_start[0]
  if info["generation"] == 2:
    _current["full collections"] += 1


def pytest_configure(config):
  import jax

  gc.callbacks.append(_gc_callback)
  jax.monitoring.register_event_duration_secs_listener(_listen)
  jax.monitoring.register_event_listener(_listen_hits)
  if not hasattr(config, "workerinput"):  # the controller (or the only process)
    config._compile_profile_dir = tempfile.mkdtemp(prefix="attnlab-compile-profile-")
    os.environ["ATTNLAB_COMPILE_PROFILE_DIR"] = config._compile_profile_dir


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  _current.clear()
  start = time.perf_counter()
  yield
  _rows.append(dict(test=item.nodeid.split("[")[0], wall=time.perf_counter() - start,
                    **_current))


def pytest_sessionfinish(session):
  folder = os.environ.get("ATTNLAB_COMPILE_PROFILE_DIR")
  if folder:
    with open(os.path.join(folder, f"rows.{os.getpid()}.json"), "w") as f:
      json.dump(_rows, f)
    with open(os.path.join(folder, f"names.{os.getpid()}.json"), "w") as f:
      json.dump(_names, f)


def pytest_terminal_summary(terminalreporter, config):
  folder = getattr(config, "_compile_profile_dir", None)
  if folder is None:
    return
  per_file = collections.defaultdict(collections.Counter)
  per_test = collections.defaultdict(collections.Counter)
  for path in glob.glob(os.path.join(folder, "rows.*.json")):
    with open(path) as f:
      for row in json.load(f):
        test = row.pop("test")
        per_file[test.split("::")[0]].update(row)
        per_test[test].update(row, cases=1)
  names = collections.defaultdict(collections.Counter)
  for path in glob.glob(os.path.join(folder, "names.*.json")):
    with open(path) as f:
      for name, c in json.load(f).items():
        names[name].update(c)
  shutil.rmtree(folder, ignore_errors=True)
  total = sum(per_file.values(), collections.Counter())
  write = terminalreporter.write_line
  write(f"\ncompile profile (seconds summed over workers): test time {total['wall']:.0f}, "
        f"trace {total['trace']:.0f}, lower {total['lower']:.0f}, XLA compile "
        f"{total['compile']:.0f}, {total['programs']} programs compiled "
        f"({total['cache hits']} of them read from the persistent cache); Python's cycle "
        f"collector {total['gc']:.0f}, {total['full collections']} full collections")
  write(f"{'wall':>7} {'trace':>6} {'lower':>6} {'compile':>7} {'gc':>5} {'programs':>8}  file")
  for name, c in sorted(per_file.items(), key=lambda item: -item[1]["wall"]):
    write(f"{c['wall']:7.1f} {c['trace']:6.1f} {c['lower']:6.1f} {c['compile']:7.1f} "
          f"{c['gc']:5.1f} {c['programs']:8d}  {name}")
  top = int(os.environ.get("ATTNLAB_COMPILE_PROFILE_TESTS") or 0)
  if top:
    write(f"\nthe {top} test functions (all their parameters together) that took the longest:")
    write(f"{'wall':>7} {'trace':>6} {'lower':>6} {'compile':>7} {'programs':>8} "
          f"{'cases':>5}  test")
    for name, c in sorted(per_test.items(), key=lambda item: -item[1]["wall"])[:top]:
      write(f"{c['wall']:7.1f} {c['trace']:6.1f} {c['lower']:6.1f} {c['compile']:7.1f} "
            f"{c['programs']:8d} {c['cases']:5d}  {name}")
  top = int(os.environ.get("ATTNLAB_COMPILE_PROFILE_NAMES") or 0)
  if top:
    write(f"\nthe {top} programs that took the most trace + lower + compile time:")
    write(f"{'trace':>7} {'lower':>6} {'compile':>7} {'programs':>8}  name")
    cost = lambda c: c["trace"] + c["lower"] + c["compile"]
    for name, c in sorted(names.items(), key=lambda item: -cost(item[1]))[:top]:
      write(f"{c['trace']:7.1f} {c['lower']:6.1f} {c['compile']:7.1f} {c['programs']:8d}  {name}")
