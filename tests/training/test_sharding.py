"""Sharding: the rules table, and 1 device vs a (2, 2, 2) mesh of 8 forced
host devices (in a subprocess: the device count is fixed at jax import)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from attnlab.training import sharding


class _FakeMesh:
  shape = {"data": 2, "fsdp": 2, "tensor": 2}


def test_rules_shard_and_fall_back_to_replication():
  mesh = _FakeMesh()
  assert sharding.logical_to_spec(("embed", "heads", "head_dim"), (32, 4, 8), mesh) == P(
      "fsdp", "tensor", None)
  # 259 is not divisible by 2: the vocab dimension is replicated.
  assert sharding.logical_to_spec(("vocab", "embed"), (259, 32), mesh) == P(None, "fsdp")
  assert sharding.logical_to_spec(("embed", "mlp"), (32, 64), mesh) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("embed",), (33,), mesh) == P(None)


def test_mesh_shape_resolution():
  assert sharding.resolve_mesh_shape((-1, 1, 1), 8) == (8, 1, 1)
  assert sharding.resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.resolve_mesh_shape((2, 2, 4), 8)
  assert dict(sharding.make_mesh((1, 1, 1)).shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  assert jax.device_count() >= 1


def test_one_device_and_8_device_mesh_agree(tmp_path):
  script = os.path.join(os.path.dirname(__file__), "mesh_check.py")
  env = dict(os.environ)  # the script forces 8 host devices itself
  res = subprocess.run([sys.executable, script, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  assert out["devices"] == 8
  np.testing.assert_allclose(out["(1, 1, 1)"], out["(2, 2, 2)"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out["grad_norm (1, 1, 1)"], out["grad_norm (2, 2, 2)"], rtol=1e-4)
  assert out["(1, 1, 1)"][-1] < out["(1, 1, 1)"][0]
  specs = out["specs"]
  assert "P('fsdp', 'tensor', None)" in specs  # q/k/v [embed, heads, head_dim]
  assert "P('tensor', None, 'fsdp')" in specs  # o_proj [heads, head_dim, embed]
  assert "P(None, 'fsdp')" in specs  # embedding: vocab 259 not divisible
  assert out["num_devices_of_q"] == 8
  assert "P('fsdp', 'tensor', None)" in out["opt_specs"]  # Adam moments too
  assert out["restore_step"] == 6 and out["restore_equal"]
  assert out["restore_mesh"] == {"data": 1, "fsdp": 2, "tensor": 4}


@pytest.mark.slow
def test_train_step_compiles_without_involuntary_rematerialization():
  """The layers declare their activations' logical sharding: on (2,2,2), (1,1,8) and
  (1,8,1) meshes the SPMD partitioner never replicates a tensor to reshard it."""
  script = os.path.join(os.path.dirname(__file__), "remat_check.py")
  res = subprocess.run([sys.executable, script, "configs/models/llama_tiny.gin:lm",
                        "2,2,2", "1,1,8", "1,8,1"], capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  assert out.pop("devices") == 8
  assert len(out) == 3
  assert out == {k: [] for k in out}, out
