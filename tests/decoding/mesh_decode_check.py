"""Run by test_mesh_decode.py in a subprocess with 4 forced host devices: decodes
with the parameters sharded over (data, fsdp, tensor) meshes and prints JSON
for the test to compare with one device.

    python tests/decoding/mesh_decode_check.py WORKDIR

WORKDIR: a trained decoder-only run (``attnlab train``) for ``load_checkpoint``
and ``attnlab decode --mesh_shape``.
"""

import contextlib
import io
import json
import os
import sys

# Appended: the test session's flags (tests/conftest.py) are kept.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import attnlab  # noqa: E402
from attnlab.cli import main as cli_main  # noqa: E402
from attnlab.commands import decode as decode_command  # noqa: E402
from attnlab.decoding import batching  # noqa: E402
from attnlab.training import sharding  # noqa: E402
from tests.decoding.tiny_models import decoder_model, encdec_model, random_tokens  # noqa: E402


def on_mesh(model, shape):
  """The model with its parameters sharded over a ``shape`` mesh (the training rules)."""
  mesh = sharding.make_mesh(shape)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = jax.device_put(params, sharding.param_shardings(params, mesh))
  return nnx.merge(graphdef, params, jax.device_put(rest, sharding.replicated(mesh)))


KINDS = [("contiguous", None), ("ring", None), ("paged", None), ("contiguous", "int8")]


def generated(model, kinds=KINDS):
  """Greedy tokens of each (cache kind, cache dtype): {"kind/dtype": list}."""
  prompt_BT = random_tokens(0, (3, 7))
  lengths_B = np.array([7, 4, 6], np.int32)
  out = {}
  for kind, dtype in kinds:
    tokens = attnlab.generate(model, prompt_BT, prompt_lengths_B=lengths_B, max_new_tokens=9,
                              cache=kind, cache_dtype=dtype, eos_id=None, page_size=4)
    out[f"{kind}/{dtype}"] = np.asarray(tokens).tolist()
  return out


REQUESTS = [random_tokens(10 + i, (n,)).tolist() for i, n in enumerate([5, 12, 3, 9, 7])]
BUDGETS = [6, 3, 9, 4, 7]


def served(model, cache):
  """``generate_requests`` twice (2 slots for 5 requests): the tokens, the per-device shape
  and spec of the first layer's K buffer that every decode call received, and the
  programs compiled during the second run (none: the first compiled them all)."""
  seen = set()
  decode = batching._decode

  def spy(graphdef, state, kv_cache, *args, **kwargs):
    k = jax.tree.leaves(kv_cache[0].self_attn)[0]
    seen.add((str(getattr(k.sharding, "spec", "one device")),
              tuple(k.addressable_shards[0].data.shape)))
    return decode(graphdef, state, kv_cache, *args, **kwargs)

  compiles = []
  listener = lambda name, *_, **__: compiles.append(name) if "backend_compile" in name else None
  batching._decode = spy
  try:
    run = lambda: batching.generate_requests(model, REQUESTS, BUDGETS, slots=2, cache=cache,
                                             page_size=4, eos_id=None)
    first = run()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
      second = run()
    finally:
      jax.monitoring.unregister_event_duration_listener(listener)
  finally:
    batching._decode = decode
  assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
  return dict(tokens=[r.tolist() for r in first], k_buffers=sorted(seen),
              compiled_again=len(compiles))


def decode_cli(workdir, *flags):
  """(exit code, stdout, the mesh shape the checkpoint was restored onto)."""
  meshes = []
  load = decode_command.load_checkpoint

  def spy(*args, mesh=None, **kwargs):
    meshes.append(None if mesh is None else dict(mesh.shape))
    return load(*args, mesh=mesh, **kwargs)

  out = io.StringIO()
  decode_command.load_checkpoint = spy
  try:
    with contextlib.redirect_stdout(out):
      rc = cli_main(["decode", "--workdir", workdir, "--prompt", "def f(", "--max_new_tokens",
                     "6", *flags])
  finally:
    decode_command.load_checkpoint = load
  return rc, out.getvalue(), meshes


def main(workdir):
  out = {"devices": jax.device_count()}
  model = decoder_model("gqa_rope_window10", varied=True)  # 2 KV heads, window 10
  src_BS = random_tokens(3, (2, 9))
  encdec = encdec_model("paper_gqa", varied=True)
  beam = lambda m: np.asarray(attnlab.generate(m, src_BS, max_new_tokens=8, beam_size=3,
                                               eos_id=None)).tolist()
  out["one device"] = dict(generate=generated(model), beam=beam(encdec),
                           serve={c: served(model, c) for c in ("paged", "contiguous", "ring")})
  m = on_mesh(model, (1, 1, 2))  # the 2 KV heads split in two
  out["(1, 1, 2)"] = dict(generate=generated(m), beam=beam(on_mesh(encdec, (1, 1, 2))),
                          serve={c: served(m, c) for c in ("paged", "contiguous", "ring")})
  # Two replicas over data, heads over tensor: the cache made inside generate's program.
  out["(2, 1, 2)"] = dict(generate=generated(on_mesh(model, (2, 1, 2)), KINDS[:1]))
  # 4 does not divide 2 KV heads: the projections and the cache stay whole on every device.
  out["(1, 1, 4)"] = dict(serve={"paged": served(on_mesh(model, (1, 1, 4)), "paged")})
  # A checkpoint restored onto a mesh: the training layout, the same values, the same text.
  mesh = sharding.make_mesh((1, 1, 2))
  ref, _ = attnlab.load_checkpoint(workdir)
  got, _ = attnlab.load_checkpoint(workdir, mesh=mesh)
  ref_p, got_p = nnx.state(ref, nnx.Param), nnx.state(got, nnx.Param)
  out["restored_equal"] = all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(ref_p), jax.tree.leaves(got_p), strict=True))
  want = sharding.param_shardings(got_p, mesh)
  out["restored_layout"] = all(
      x.sharding == s for x, s in zip(jax.tree.leaves(got_p), jax.tree.leaves(want), strict=True))
  out["restored_q_spec"] = str(got.decoder.layers[0].self_attn.q_proj.w.get_value().sharding.spec)
  out["cli"] = {"one device": decode_cli(workdir),
                "1,1,2": decode_cli(workdir, "--mesh_shape", "1,1,2"),
                "served, one device": decode_cli(workdir, "--slots", "2"),
                "served, 1,1,2": decode_cli(workdir, "--mesh_shape", "1,1,2", "--slots", "2")}
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
