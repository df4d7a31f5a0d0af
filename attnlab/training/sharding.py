"""The device mesh, the logical-axis rules table, and shardings derived from it.

Layers tag every parameter with logical axes (``("embed", "heads",
"head_dim")``); ``RULES`` maps each logical axis to a mesh axis. The mesh has
three axes: ``data`` (batch only), ``fsdp`` (batch, and parameters over their
``embed`` dimension) and ``tensor`` (heads / kv_heads / mlp / vocab). A
dimension that the mesh axis does not divide is replicated instead, so one
config runs on 1 device and on 8.

Multi-host: call ``initialize_distributed`` (training/commands.py does, from
``--coordinator_address`` / ``--num_processes`` / ``--process_id`` or the
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
environment) before anything touches a device; the mesh then spans the
devices of all processes.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attnlab.config import check_mesh_shape

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes); anything not listed is replicated.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "head_dim": None,
    "length": None,
}


class MeshShapeError(ValueError):
  """A mesh_shape that the devices of this process cannot make."""


def resolve_mesh_shape(shape, num_devices: int) -> tuple[int, int, int]:
  """Fill a -1 entry with the devices the others leave; check the product. A shape that is
  not 3 positive ints with at most one -1 is refused as ``TrainConfig.mesh_shape`` refuses
  it (until 2026-12-07 ``make_mesh((0, 1, 1))`` made an empty mesh, ``(-2, 1, 1)`` one of
  6 devices of 8)."""
  try:
    shape = list(check_mesh_shape(shape))
  except ValueError as e:
    raise MeshShapeError(str(e)) from None
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if num_devices % known:
      raise MeshShapeError(f"mesh_shape={tuple(shape)} does not divide {num_devices} devices")
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) > num_devices:
    raise MeshShapeError(f"mesh_shape={tuple(shape)} needs {math.prod(shape)} devices, "
                         f"only {num_devices} exist")
  return tuple(shape)


def make_mesh(shape=(-1, 1, 1), devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh; a shape smaller than the device count uses
  the first devices (with several processes, only a shape that leaves none of them out).
  Axes are classic GSPMD ("auto") axes."""
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_mesh_shape(shape, len(devices))
  used = devices[:math.prod(shape)]
  _check_processes(used, devices, f"mesh_shape={shape}")
  return Mesh(np.asarray(used, dtype=object).reshape(shape), MESH_AXES)


def _check_processes(used, devices, what: str) -> None:
  """A MeshShapeError when ``used`` (a mesh's devices) leaves out a process that ``devices``
  has: its arrays would have no shard there, and the other processes wait for it (until
  2026-12-07 one process failed at its first step and the others hung in a checkpoint)."""
  have = {d.process_index for d in devices}
  left = sorted(have - {d.process_index for d in used})
  if left:
    raise MeshShapeError(
        f"{what} uses {len(used)} of the {len(devices)} devices of {len(have)} processes and "
        f"none of process {', '.join(map(str, left))}'s: with several processes the mesh must "
        "hold devices of every one (give a shape of all the devices, e.g. one -1)")


def check_mesh(mesh) -> None:
  """A ValueError unless ``mesh`` is a (data, fsdp, tensor) ``Mesh`` with auto axes holding
  devices of every process: what ``make_mesh`` gives. A mesh with explicit axes
  (``jax.make_mesh``'s default) is refused: the parameters' shardings are GSPMD ones (it
  passed, and failed inside a reshape, until 2026-12-07)."""
  if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != MESH_AXES:
    # a mesh shape, say, was an AttributeError inside the shardings until 2026-12-06
    what = (f"a Mesh with axes {tuple(mesh.axis_names)}" if isinstance(mesh, Mesh)
            else f"{type(mesh).__name__} {mesh!r}")
    raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {MESH_AXES} (make one with "
                     f"attnlab.training.sharding.make_mesh(shape)), got {what}")
  kinds = [t for t in mesh.axis_types if t != jax.sharding.AxisType.Auto]
  if kinds:
    raise ValueError(
        f"mesh has {kinds[0].name} axes ({', '.join(t.name for t in mesh.axis_types)}; "
        "jax.make_mesh makes Explicit ones by default): give one with Auto axes, "
        "attnlab.training.sharding.make_mesh(shape) or jax.make_mesh(shape, names, "
        "axis_types=(jax.sharding.AxisType.Auto,) * 3)")
  _check_processes(list(mesh.devices.flat), jax.devices(), f"the mesh {dict(mesh.shape)}")


def _mesh_axes(logical: str) -> tuple[str, ...]:
  """The mesh axes ``RULES`` maps a logical axis to (none for an unlisted one)."""
  target = RULES.get(logical)
  return (target,) if isinstance(target, str) else tuple(target or ())


def logical_to_spec(axes, shape, mesh: Mesh) -> PartitionSpec:
  """PartitionSpec of an array with logical ``axes`` and ``shape`` on ``mesh``.

  A mesh axis is used at most once per array, and only where it divides the
  dimension; otherwise that dimension is replicated.
  """
  used, spec = set(), []
  for name, dim in zip(axes, shape):
    targets = tuple(t for t in _mesh_axes(name) if t not in used and mesh.shape[t] > 1)
    size = math.prod(mesh.shape[t] for t in targets)
    if not targets or dim % size:
      spec.append(None)
      continue
    used.update(targets)
    spec.append(targets[0] if len(targets) == 1 else targets)
  return PartitionSpec(*spec)


def idle_axes(specs, mesh: Mesh) -> list[str]:
  """Warnings, one per model axis (fsdp, tensor) of more than one device that splits none of
  ``specs`` (the parameters' PartitionSpecs): every dimension it could split is replicated,
  because the axis does not divide it (``logical_to_spec``), so the axis saves no memory
  and, for tensor, its devices compute the same thing. Until 2026-12-05 such a mesh ran
  without a word."""
  used = set()
  for spec in specs:
    for entry in spec:
      used.update((entry,) if isinstance(entry, str) else tuple(entry or ()))
  out = []
  for axis, effect in (("fsdp", "it splits the batch only, as data does"),
                       ("tensor", "its devices hold every parameter whole and compute the "
                                  "same thing")):
    n = mesh.shape[axis]
    if n > 1 and axis not in used:
      dims = "/".join(name for name in RULES if name != "batch" and axis in _mesh_axes(name))
      out.append(f"mesh axis {axis!r} of {n} devices shards no parameter (no {dims} "
                 f"dimension is a multiple of {n}): {effect}")
  return out


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def param_shardings(params, mesh: Mesh):
  """A tree of NamedShardings matching an ``nnx.State`` of parameters, from
  each Variable's ``axes`` metadata (no metadata: replicated)."""
  from flax import nnx

  def one(v):
    if not isinstance(v, nnx.Variable):
      return replicated(mesh)
    axes = v.get_metadata().get("axes")
    spec = PartitionSpec() if axes is None else logical_to_spec(axes, v.shape, mesh)
    # Keep the Variable node so the tree matches the parameters' structure.
    return v.replace(NamedSharding(mesh, spec))

  return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def tree_shardings_like(tree, params, params_shardings, mesh: Mesh):
  """Shardings for a tree that embeds copies of ``params`` (optax state:
  mu, nu, ...): those copies are sharded like the parameters, every other
  leaf (step counts) is replicated."""
  p_struct = jax.tree.structure(params)
  return jax.tree.map(
      lambda x: params_shardings if jax.tree.structure(x) == p_struct else replicated(mesh),
      tree, is_leaf=lambda x: jax.tree.structure(x) == p_struct,
  )


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
  """``jax.distributed.initialize`` from arguments or the environment.

  Returns True when a multi-process run was initialized; a single process
  needs nothing.

  Raises:
    ValueError: an incomplete or impossible setting, named with the flag (until
      2026-12-04 ``--num_processes 2`` without a coordinator trained alone without a word,
      and a process id out of range or an address without a port were tracebacks from
      JAX). ``process_id`` may be left to JAX's cluster detection (SLURM, Open MPI, TPU).
  """
  partial_flags = num_processes is None and (coordinator_address or process_id is not None)
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num_processes = _int_setting("--num_processes", num_processes, "JAX_NUM_PROCESSES")
  process_id = _int_setting("--process_id", process_id, "JAX_PROCESS_ID")
  if num_processes is None:
    if partial_flags:
      raise ValueError("--coordinator_address and --process_id need --num_processes N (or "
                       "$JAX_NUM_PROCESSES)")
    return False  # a coordinator or process id left in the environment alone: one process
  if num_processes < 1:
    raise ValueError(f"--num_processes {num_processes} must be at least 1")
  if process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id {process_id} must be in [0, {num_processes}) for "
                     f"--num_processes {num_processes}")
  if num_processes == 1:
    return False
  if not coordinator_address:
    raise ValueError(f"--num_processes {num_processes} needs --coordinator_address HOST:PORT "
                     "(or $JAX_COORDINATOR_ADDRESS): where process 0 listens")
  host, _, port = coordinator_address.rpartition(":")
  # a port past 65535 waited for a coordinator that could never listen (until 2026-12-06)
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"--coordinator_address {coordinator_address!r} must be HOST:PORT "
                     "(process 0's address and a free port, 1 to 65535)")
  try:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
  except ValueError as e:  # e.g. no process id given and none detected
    raise ValueError(f"jax.distributed.initialize: {e} (give --process_id I, 0 to "
                     f"{num_processes - 1}, or $JAX_PROCESS_ID)") from None
  return True


def _int_setting(flag: str, value, env: str) -> int | None:
  """A flag's int, else the environment variable's (named if it is not an int), else None."""
  if value is not None:
    return int(value)
  text = os.environ.get(env)
  if not text:
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"${env}={text!r} must be an integer ({flag})") from None


def activation_resolver(mesh: Mesh):
  """``(logical axes, shape) -> NamedSharding`` on ``mesh`` by ``RULES``, for
  ``nn.partitioning.activation_sharding``."""
  return lambda axes, shape: NamedSharding(mesh, logical_to_spec(axes, shape, mesh))
