"""Multi-host training as two processes on 127.0.0.1 (XLA:CPU, gloo collectives).

Two ``attnlab train`` processes with 2 CPU devices each form one 4-device
mesh; they must give the loss curve and the final parameters of one process
with 4 devices, also when the run stops at a checkpoint and both processes
resume from it (orbax saves and restores with every process taking part).
The flag / environment parsing of ``initialize_distributed`` is checked
without processes.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import attnlab
from attnlab.training import sharding
from attnlab.training.checkpoint import Checkpointer
from attnlab.training.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "seq2seq_reverse.gin")
TINY = ["ModelConfig.d_model=32", "ModelConfig.d_ff=64", "ModelConfig.num_layers=1",
        "ModelConfig.num_encoder_layers=1", "DataConfig.batch_size=8", "DataConfig.max_len=6",
        "DataConfig.seq_len=8", "TrainConfig.log_every=1", "TrainConfig.eval_every=6",
        "TrainConfig.eval_batches=1", "TrainConfig.checkpoint_every=3",
        "TrainConfig.progress=False", "TrainConfig.warmup_steps=2",
        "TrainConfig.learning_rate=3e-3"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(workdir, steps, devices, dist_args=(), extra=()):
  argv = [sys.executable, "-m", "attnlab.cli", "train", "--gin_file", CONFIG,
          *[f"--gin.{b}" for b in TINY + list(extra)], f"--gin.TrainConfig.steps={steps}",
          "--workdir", str(workdir), *dist_args]
  # JAX_NUM_CPU_DEVICES: local CPU devices per process (read at backend start).
  env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
  # No forced host device count (JAX_NUM_CPU_DEVICES sets it); other flags are kept.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _finish(procs, timeout=300):
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      assert p.returncode == 0, err[-3000:]
      outs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:  # a hung peer (one process failed) must not outlive the test
      if p.poll() is None:
        p.kill()
        p.wait()
  return outs


def _two_processes(workdir, steps, extra=()):
  addr = f"127.0.0.1:{_free_port()}"
  return [_spawn(workdir, steps, 2, ["--coordinator_address", addr, "--num_processes", "2",
                                     "--process_id", str(i)], extra) for i in range(2)]


def _both_refused(workdir, extra=()):
  """Two processes of a 2-step run in ``workdir``; both must exit 2: their stderr."""
  procs = _two_processes(workdir, 2, extra)
  try:
    errs = [p.communicate(timeout=120)[1] for p in procs]
  finally:
    for p in procs:  # a hung peer must not outlive the test
      if p.poll() is None:
        p.kill()
        p.wait()
  assert [p.returncode for p in procs] == [2, 2], errs
  return errs


def test_a_mesh_that_leaves_a_process_without_a_device_is_refused_by_every_process(tmp_path):
  """mesh_shape=(2, 1, 1) over two processes of 2 devices: "the first devices" are all of
  process 0's. Both exit 2 naming process 1, before anything is written (until 2026-12-07
  process 1 failed at its first step and process 0 waited in a checkpoint save forever)."""
  for err in _both_refused(tmp_path / "run", ["TrainConfig.mesh_shape=(2,1,1)"]):
    assert ("error: mesh_shape=(2, 1, 1) uses 2 of the 4 devices of 2 processes and none of "
            "process 1's: with several processes the mesh must hold devices of every one") in err
  assert not (tmp_path / "run").exists()


def test_a_workdir_being_trained_is_refused_by_every_process(tmp_path):
  """Another run holds the workdir's lock: process 0 finds it, and every process exits 2
  with its message (process 1 would otherwise wait for process 0 in its first collective)."""
  import fcntl

  workdir = tmp_path / "run"
  workdir.mkdir()
  held = os.open(workdir, os.O_RDONLY)
  fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    errs = _both_refused(workdir)
  finally:
    os.close(held)
  for err in errs:
    assert f"error: another attnlab train is running in {workdir}" in err
  assert os.listdir(workdir) == []


def _train_losses(workdir):
  return [r["loss"] for r in read_metrics(str(workdir)) if r["split"] == "train"]


def _params(workdir):
  from flax import nnx

  model, _ = attnlab.load_checkpoint(str(workdir))
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  # One process, 4 devices, 6 steps; and two processes x 2 devices that stop
  # at the step-3 checkpoint, then resume from it (both restore) to step 6.
  # The reference skips evaluation (it changes no parameter; the two-process run's
  # evaluation is checked below): one compilation of the eval and decode steps less.
  ref = _spawn(one, 6, 4, extra=["TrainConfig.eval_every=0"])
  first = _finish(_two_processes(two, 3) + [ref])
  assert [o["step"] for o in first] == [3, 3, 6]
  assert Checkpointer(str(two), read_only=True).steps() == [3]
  second = _finish(_two_processes(two, 6))
  assert [o["step"] for o in second] == [6, 6]
  assert second[0]["loss"] == second[1]["loss"]  # the processes agree

  assert Checkpointer(str(two), read_only=True).steps() == [3, 6]
  losses_one, losses_two = _train_losses(one), _train_losses(two)
  assert len(losses_one) == len(losses_two) == 6
  np.testing.assert_allclose(losses_two, losses_one, rtol=1e-5, atol=1e-5)
  evals = [r for r in read_metrics(str(two)) if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [6] and all("exact_match" in r for r in evals)
  for a, b in zip(_params(one), _params(two)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_initialize_distributed_flags_and_environment(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert not sharding.initialize_distributed()  # single process: nothing to do
  assert not sharding.initialize_distributed("127.0.0.1:1234", 1, 0)
  assert sharding.initialize_distributed("127.0.0.1:1234", 2, 1)
  assert calls[-1] == dict(coordinator_address="127.0.0.1:1234", num_processes=2,
                           process_id=1)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:999")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert sharding.initialize_distributed()
  assert calls[-1] == dict(coordinator_address="127.0.0.1:999", num_processes=4, process_id=3)
  # Flags win over the environment.
  assert sharding.initialize_distributed(process_id=0)
  assert calls[-1]["process_id"] == 0 and len(calls) == 3


@pytest.mark.slow
def test_a_batch_axis_replicated_across_processes_gets_the_whole_batch(tmp_path):
  """Mesh (1, 1, 4) over two processes of two devices: the batch is replicated across the
  processes (tensor parallelism only), and each device takes all of it. Until 2026-12-04
  each process passed "its" half of the rows, which the mesh read as a global batch of
  B / 2 rows filled differently by each process: their losses differed from the first
  step and the parameters drifted apart."""
  one, two = tmp_path / "one", tmp_path / "two"
  mesh = ["TrainConfig.mesh_shape=(1,1,4)", "TrainConfig.eval_every=0"]
  addr = f"127.0.0.1:{_free_port()}"
  procs = [_spawn(two, 2, 2, ["--coordinator_address", addr, "--num_processes", "2",
                              "--process_id", str(i)], extra=mesh) for i in range(2)]
  outs = _finish(procs + [_spawn(one, 2, 4, extra=mesh)])
  assert [o["step"] for o in outs] == [2, 2, 2]
  assert outs[0]["loss"] == outs[1]["loss"]  # the processes agree
  np.testing.assert_allclose(_train_losses(two), _train_losses(one), rtol=1e-5, atol=1e-5)
  for a, b in zip(_params(one), _params(two)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
