"""Sharding: the rules table, and 1 device vs a (2, 2, 2) mesh of 8 forced
host devices (in a subprocess: the device count is fixed at jax import)."""

import json
import os
import re
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



class _Mesh:
  def __init__(self, data, fsdp, tensor):
    self.shape = {"data": data, "fsdp": fsdp, "tensor": tensor}


@pytest.mark.parametrize("mesh, axes, shape, want", [
    # The batch goes over data x fsdp, or over whichever of them is larger than 1.
    ((2, 2, 2), ("batch", "length", "embed"), (8, 5, 4), P(("data", "fsdp"), None, None)),
    ((1, 4, 2), ("batch", "length", "embed"), (8, 5, 4), P("fsdp", None, None)),
    ((4, 1, 2), ("batch", "length", "vocab"), (8, 5, 6), P("data", None, "tensor")),
    # data x fsdp = 4 must divide the batch; otherwise it is replicated.
    ((2, 2, 1), ("batch",), (6,), P(None)),
    # A mesh axis is used once per array: embed takes fsdp after the batch did not.
    ((2, 2, 2), ("embed", "mlp"), (32, 64), P("fsdp", "tensor")),
    ((1, 2, 4), ("heads", "kv_heads", "head_dim"), (8, 8, 4), P("tensor", None, None)),
    ((2, 2, 2), ("batch", "embed"), (4, 4), P(("data", "fsdp"), None)),
    # Axes of size 1 shard nothing; unknown names and None replicate.
    ((8, 1, 1), ("embed", "heads", "mlp", "vocab"), (8, 8, 8, 8), P(None, None, None, None)),
    ((2, 2, 2), ("nope", None, "length", "head_dim"), (8, 8, 8, 8), P(None, None, None, None)),
    ((1, 1, 8), ("vocab", "embed"), (259, 32), P(None, None)),
    ((1, 1, 8), ("embed", "vocab"), (32, 264), P(None, "tensor")),
])
def test_logical_to_spec_table(mesh, axes, shape, want):
  assert sharding.logical_to_spec(axes, shape, _Mesh(*mesh)) == want


@pytest.mark.parametrize("shape, n, message", [
    ((-1, 3, 1), 8, "mesh_shape=(-1, 3, 1) does not divide 8 devices"),
    ((2, 2, 4), 8, "mesh_shape=(2, 2, 4) needs 16 devices, only 8 exist"),
    ((2, -1, 1), 1, "mesh_shape=(2, -1, 1) does not divide 1 devices"),
])
def test_mesh_shape_errors_name_the_shape_and_the_devices(shape, n, message):
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    sharding.resolve_mesh_shape(shape, n)


def test_mesh_shape_fills_the_one_unknown_axis_and_may_use_fewer_devices():
  filled = sharding.resolve_mesh_shape((1, 1, -1), 8)
  assert filled == (1, 1, 8) and all(type(n) is int for n in filled)
  assert sharding.resolve_mesh_shape([2, 1, 2], 8) == (2, 1, 2)  # 4 of the 8
  assert sharding.resolve_mesh_shape((1, 1, 1), 1) == (1, 1, 1)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert list(mesh.devices.flat) == jax.devices()[:1]


class _Dev(str):
  """A stand-in device: its name, and the process it belongs to."""

  def __new__(cls, name, process_index=0):
    dev = super().__new__(cls, name)
    dev.process_index = process_index
    return dev


@pytest.mark.parametrize("shape", [(0, 1, 1), (-1, -1, 1), (-2, 1, 1), (-1, 0, 1), "2,2,2",
                                   (2, 2), {2, 1, 4}])
def test_make_mesh_refuses_what_mesh_shape_refuses(shape):
  """``make_mesh`` (which the README's decode example calls) checks the shape as
  ``TrainConfig.mesh_shape`` does (until 2026-12-07: (0, 1, 1) an empty mesh, (-2, 1, 1)
  one of 6 devices, (-1, 0, 1) a ZeroDivisionError, "2,2,2" a TypeError)."""
  with pytest.raises(sharding.MeshShapeError, match="^" + re.escape(
      f"mesh_shape={shape!r} must be 3 positive ints (data, fsdp, tensor), at most one -1")):
    sharding.make_mesh(shape, devices=[_Dev(f"dev{i}") for i in range(8)])


def test_a_mesh_that_leaves_out_a_process_is_refused(monkeypatch):
  """With several processes every one must hold a device of the mesh: a process without
  one failed at its first step while the others waited in a checkpoint save forever (until
  2026-12-07). One device of a process is enough."""
  monkeypatch.setattr(sharding, "Mesh", lambda grid, axes: (grid, axes))
  devices = [_Dev(f"dev{i}", i // 2) for i in range(6)]  # 3 processes of 2 devices
  with pytest.raises(sharding.MeshShapeError) as e:
    sharding.make_mesh((3, 1, 1), devices=devices)
  assert str(e.value) == (
      "mesh_shape=(3, 1, 1) uses 3 of the 6 devices of 3 processes and none of process 2's: "
      "with several processes the mesh must hold devices of every one (give a shape of all "
      "the devices, e.g. one -1)")
  with pytest.raises(sharding.MeshShapeError, match="none of process 1, 2's"):
    sharding.make_mesh((1, 2, 1), devices=devices)
  grid, _ = sharding.make_mesh((5, 1, 1), devices=devices)
  assert [d.process_index for d in grid.flat] == [0, 0, 1, 1, 2]
  # A caller's own mesh is checked alike (train's and load_checkpoint's ``mesh``).
  monkeypatch.undo()
  monkeypatch.setattr(jax, "devices", lambda: devices)
  mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1, 1),
                           sharding.MESH_AXES)
  with pytest.raises(sharding.MeshShapeError, match=re.escape(
      "the mesh {'data': 1, 'fsdp': 1, 'tensor': 1} uses 1 of the 6 devices of 3 processes "
      "and none of process 1, 2's")):
    sharding.check_mesh(mesh)


def test_check_mesh_takes_what_make_mesh_makes_and_names_anything_else():
  """A caller's mesh (train's, load_checkpoint's): a Mesh, the three axes, Auto axis types."""
  from jax.sharding import AxisType

  sharding.check_mesh(sharding.make_mesh((1, 1, 1)))
  grid = np.array(jax.devices()[:1]).reshape(1, 1, 1)
  for mesh, what in (((1, 1, 1), "tuple (1, 1, 1)"),
                     (jax.sharding.Mesh(grid, ("data", "fsdp", "model")),
                      "a Mesh with axes ('data', 'fsdp', 'model')")):
    with pytest.raises(ValueError) as e:
      sharding.check_mesh(mesh)
    assert str(e.value) == ("mesh must be a jax.sharding.Mesh with axes ('data', 'fsdp', "
                            "'tensor') (make one with attnlab.training.sharding.make_mesh(shape)), "
                            f"got {what}")
  mixed = jax.sharding.Mesh(grid, sharding.MESH_AXES,
                            axis_types=(AxisType.Auto, AxisType.Manual, AxisType.Explicit))
  with pytest.raises(ValueError) as e:
    sharding.check_mesh(mixed)
  assert str(e.value) == (
      "mesh has Manual axes (Auto, Manual, Explicit; jax.make_mesh makes Explicit ones by "
      "default): give one with Auto axes, attnlab.training.sharding.make_mesh(shape) or "
      "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 3)")
  sharding.check_mesh(jax.sharding.Mesh(grid, sharding.MESH_AXES,
                                        axis_types=(AxisType.Auto,) * 3))


def test_make_mesh_lays_out_the_devices_it_is_given(monkeypatch):
  """The devices given (here 6 stand-ins; JAX's own when none are), the first of them
  filling the shape in order: what train passes is what the mesh holds."""
  monkeypatch.setattr(sharding, "Mesh", lambda grid, axes: (grid, axes))
  devices = [_Dev(f"dev{i}") for i in range(6)]
  grid, axes = sharding.make_mesh((-1, 1, 2), devices=iter(devices))
  assert axes == ("data", "fsdp", "tensor")
  assert grid.tolist() == [[["dev0", "dev1"]], [["dev2", "dev3"]], [["dev4", "dev5"]]]
  grid, _ = sharding.make_mesh((2, 1, 1), devices=devices)  # the first 2 of 6
  assert grid.tolist() == [[["dev0"]], [["dev1"]]]
  with pytest.raises(sharding.MeshShapeError, match=r"needs 8 devices, only 6 exist"):
    sharding.make_mesh((2, 2, 2), devices=devices)
  grid, _ = sharding.make_mesh()
  assert grid.reshape(-1).tolist() == jax.devices()


def test_a_model_axis_that_shards_no_parameter_is_named():
  """A mesh whose tensor (or fsdp) axis divides no dimension it could split replicates every
  parameter along it (correct, but its devices compute the same thing): named in a warning
  by init_train; it ran without a word until 2026-12-05."""
  model = [(("vocab", "embed"), (259, 36)), (("embed", "heads", "head_dim"), (36, 6, 6)),
           (("embed", "kv_heads", "head_dim"), (36, 3, 6)), (("embed", "mlp"), (36, 36))]

  def warnings(*shape):
    mesh = _Mesh(*shape)
    return sharding.idle_axes([sharding.logical_to_spec(a, s, mesh) for a, s in model], mesh)

  assert warnings(1, 1, 8) == [
      "mesh axis 'tensor' of 8 devices shards no parameter (no heads/kv_heads/mlp/vocab "
      "dimension is a multiple of 8): its devices hold every parameter whole and compute the "
      "same thing"]
  assert warnings(1, 8, 1) == [
      "mesh axis 'fsdp' of 8 devices shards no parameter (no embed dimension is a multiple of "
      "8): it splits the batch only, as data does"]
  assert warnings(1, 4, 2) == [] and warnings(2, 2, 2) == [] and warnings(8, 1, 1) == []
  assert len(warnings(1, 8, 8)) == 2  # (a fake mesh: shapes only)
  # An axis of 2 devices is a model axis too: dimensions that 2 divides none of.
  model[:] = [(("vocab", "embed"), (259, 35)), (("embed", "heads", "head_dim"), (35, 3, 6)),
              (("embed", "kv_heads", "head_dim"), (35, 1, 6)), (("embed", "mlp"), (35, 35))]
  assert [w.split(" shards")[0] for w in warnings(1, 2, 2)] == [
      "mesh axis 'fsdp' of 2 devices", "mesh axis 'tensor' of 2 devices"]
  # An entry naming several mesh axes (the batch's) uses each of them.
  mesh = _Mesh(2, 2, 2)
  assert sharding.idle_axes([P(("data", "fsdp"), None), P(None, "tensor")], mesh) == []
  assert sharding.idle_axes([P(("data", "tensor"))], mesh) == [warnings(1, 2, 2)[0]]
  # init_train logs them: mesh_check.py (8 devices) checks it.


def test_param_shardings_read_each_variables_axes():
  """From each Variable's ``axes`` (none: replicated), in the parameters' tree structure;
  optimizer state: copies of the parameters sharded alike, every other leaf (counts)
  replicated."""
  from flax import nnx

  mesh = sharding.make_mesh((1, 1, 1))
  params = {"w": nnx.Param(np.ones((4, 8)), axes=("embed", "mlp")),
            "b": nnx.Param(np.ones((8,))), "n": np.int32(3)}
  out = sharding.param_shardings(params, mesh)
  assert isinstance(out["w"], nnx.Param) and isinstance(out["b"], nnx.Param)
  assert out["w"].get_value() == jax.sharding.NamedSharding(mesh, P(None, None))
  assert out["b"].get_value() == sharding.replicated(mesh)
  assert out["n"] == sharding.replicated(mesh)
  fake = _Mesh(1, 2, 4)
  assert sharding.logical_to_spec(("embed", "mlp"), (4, 8), fake) == P("fsdp", "tensor")
  state = {"mu": {"a": 1, "b": 2}, "nu": {"a": 3, "b": 4}, "count": 5}
  like = sharding.tree_shardings_like(state, {"a": 0, "b": 0}, "PARAMS", mesh)
  assert like == {"mu": "PARAMS", "nu": "PARAMS", "count": sharding.replicated(mesh)}
  assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"))
  assert sharding.replicated(mesh).spec == P()
  resolve = sharding.activation_resolver(mesh)
  assert resolve(("batch", "embed"), (2, 4)) == jax.sharding.NamedSharding(mesh, P(None, None))


def _recorded_initialize(monkeypatch, env: dict) -> list:
  """jax.distributed.initialize's calls, recorded (none made), under exactly ``env``'s
  JAX_* multi-host variables."""
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  return calls


@pytest.mark.parametrize("args, env, want", [
    ((), {}, None),
    (("host:1234", 1, 0), {}, None),  # one process needs nothing
    (("host:1234", 2, 1), {}, dict(coordinator_address="host:1234", num_processes=2,
                                   process_id=1)),
    ((), {"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"},
     dict(coordinator_address="h:9", num_processes=4, process_id=3)),
    ((None, 2, None), {"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "4",
                       "JAX_PROCESS_ID": "1"},
     dict(coordinator_address="h:9", num_processes=2, process_id=1)),
    (("host:1234", 2, None), {}, dict(coordinator_address="host:1234", num_processes=2,
                                      process_id=None)),  # left to JAX's cluster detection
    (("[::1]:1234", 2, 1), {}, dict(coordinator_address="[::1]:1234", num_processes=2,
                                    process_id=1)),  # an IPv6 host: the port after the last ":"
    # A coordinator or process id left in the environment without a process count: one
    # process, as before the checks (flags saying as much are refused below).
    ((), {"JAX_PROCESS_ID": "0"}, None),
    ((), {"JAX_COORDINATOR_ADDRESS": "h:9"}, None),
])
def test_initialize_distributed_takes_arguments_over_the_environment(monkeypatch, args, env,
                                                                     want):
  calls = _recorded_initialize(monkeypatch, env)
  assert sharding.initialize_distributed(*args) is (want is not None)
  assert calls == ([] if want is None else [want])


@pytest.mark.parametrize("args, env, message", [
    # Trained alone without a word until 2026-12-04:
    ((), {"JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"},
     "--num_processes 4 needs --coordinator_address HOST:PORT (or $JAX_COORDINATOR_ADDRESS): "
     "where process 0 listens"),
    ((None, 2, None), {}, "--num_processes 2 needs --coordinator_address HOST:PORT"),
    ((None, None, 1), {}, "--coordinator_address and --process_id need --num_processes N (or "
                          "$JAX_NUM_PROCESSES)"),
    (("host:1234", None, None), {}, "--coordinator_address and --process_id need"),
    # Tracebacks from JAX until then:
    (("host:1234", 2, 5), {}, "--process_id 5 must be in [0, 2) for --num_processes 2"),
    (("host:1234", 2, -1), {}, "--process_id -1 must be in [0, 2)"),
    (("host", 2, 0), {}, "--coordinator_address 'host' must be HOST:PORT (process 0's address "
                         "and a free port, 1 to 65535)"),
    (("host:x", 2, 0), {}, "--coordinator_address 'host:x' must be HOST:PORT"),
    # A port no coordinator can listen on: a wait without end (until 2026-12-06).
    (("host:99999999", 2, 0), {}, "--coordinator_address 'host:99999999' must be HOST:PORT "
                                  "(process 0's address and a free port, 1 to 65535)"),
    (("host:0", 2, 0), {}, "--coordinator_address 'host:0' must be HOST:PORT"),
    ((None, 0, None), {}, "--num_processes 0 must be at least 1"),
    ((None, 1, 1), {}, "--process_id 1 must be in [0, 1)"),
    ((), {"JAX_NUM_PROCESSES": "two"}, "$JAX_NUM_PROCESSES='two' must be an integer "
                                       "(--num_processes)"),
    ((), {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "x"},
     "$JAX_PROCESS_ID='x' must be an integer (--process_id)"),
])
def test_an_incomplete_or_impossible_distributed_setting_is_named(monkeypatch, args, env,
                                                                  message):
  calls = _recorded_initialize(monkeypatch, env)
  with pytest.raises(ValueError) as e:
    sharding.initialize_distributed(*args)
  assert str(e.value).startswith(message), str(e.value)
  assert calls == []


def test_jaxs_own_refusal_is_one_line_naming_the_process_id_flag(monkeypatch):
  def refuse(**kw):
    raise ValueError("The process id of the current process must be defined.")

  _recorded_initialize(monkeypatch, {})
  monkeypatch.setattr(jax.distributed, "initialize", refuse)
  with pytest.raises(ValueError) as e:
    sharding.initialize_distributed("host:1234", 2, None)
  assert str(e.value) == ("jax.distributed.initialize: The process id of the current process "
                          "must be defined. (give --process_id I, 0 to 1, or $JAX_PROCESS_ID)")


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
  # Validation: 5 rows; on 4 data shards a batch of 8 (3 filling rows that carry no loss).
  assert out["validation rows (1, 1, 1)"] == [5] and out["validation rows (2, 2, 2)"] == [8]
  one, eight = out["validation (1, 1, 1)"], out["validation (2, 2, 2)"]
  assert one["tokens"] == eight["tokens"] > 0
  np.testing.assert_allclose(one["loss"], eight["loss"], rtol=1e-5)
  assert out["(1, 1, 1)"][-1] < out["(1, 1, 1)"][0]
  trained = out["placement after training (2, 2, 2)"]  # {"part spec on N": leaves}
  on_8 = lambda part, *spec: trained.get(f"{part} {P(*spec)} on 8", 0)
  assert on_8("params", "fsdp", "tensor", None) == 3  # q/k/v [embed, heads, head_dim]
  assert on_8("params", "tensor", None, "fsdp") == 1  # o_proj [heads, head_dim, embed]
  assert on_8("params", None, "fsdp") == 1  # embedding: vocab 259 not divisible
  assert on_8("opt_state", "fsdp", "tensor", None) == 6  # Adam moments too (mu, nu)
  assert out["restore_step"] == 6 and out["restore_equal"]
  assert out["restore_mesh"] == {"data": 1, "fsdp": 2, "tensor": 4}
  # The restored state lies where a fresh state on that mesh does.
  fresh, restored = out["restore_placement"]
  assert restored == fresh and fresh[f"params {P('fsdp', 'tensor', None)} on 8"] > 0
  np.testing.assert_allclose(out["evaluate_workdir (8, 1, 1)"],
                             out["evaluate_workdir (1, 1, 1)"], rtol=1e-5)
  # init_train places the state where training keeps it (not on one device first, to be
  # moved by the first step), the step counter replicated over the mesh; and it warns of no
  # mesh axis on these two meshes (fsdp shards the embed axis, tensor the heads).
  for shape in ("(1, 1, 1)", "(2, 2, 2)"):
    assert out[f"placement at init {shape}"] == out[f"placement after training {shape}"], shape
    assert out[f"init warnings {shape}"] == [], shape
  at_init = out["placement at init (2, 2, 2)"]
  assert at_init[f"step {P()} on 8"] == 1
  assert at_init[f"params {P('fsdp', 'tensor', None)} on 8"] > 0
  assert out["idle axis warnings"] == [
      "mesh axis 'tensor' of 8 devices shards no parameter (no heads/kv_heads/mlp/vocab "
      "dimension is a multiple of 8): its devices hold every parameter whole and compute the "
      "same thing"]
  assert out["eval batch 12"] == (
      "batch_size=12 must be a multiple of data*fsdp=8, the mesh's batch shards (the run's "
      "TrainConfig.mesh_shape; evaluate on another mesh with --mesh_shape D,F,T, e.g. 1,1,1)")


@pytest.mark.slow
def test_train_step_compiles_without_involuntary_rematerialization():
  """The layers declare their activations' logical sharding: on (2,2,2), (1,1,8) and
  (1,8,1) meshes the SPMD partitioner never replicates a tensor to reshard it, with RoPE or
  learned positions (whose table's lookup did, on (2,2,2), until 2026-12-06)."""
  script = os.path.join(os.path.dirname(__file__), "remat_check.py")
  res = subprocess.run([sys.executable, script, "configs/models/llama_tiny.gin:lm",
                        'configs/models/llama_tiny.gin:lm:ModelConfig.pos="learned"',
                        "2,2,2", "1,1,8", "1,8,1"], capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  assert out.pop("devices") == 8
  assert len(out) == 6
  assert out == {k: [] for k in out}, out
