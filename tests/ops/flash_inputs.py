"""Inputs, the value-and-gradients harness and the decode reference shared by the
kernel tests."""

import contextlib
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from attnlab.ops.reference import reference_attention
from tests import random_arrays


@contextlib.contextmanager
def cuda_target():
  """Lowering for CUDA on a host without a GPU: newer jax (0.12) asks which GPU the Triton
  kernels are for ("No supported GPU devices found, please specify an abstract GPU device"),
  through an abstract mesh's device: an H100, the kind the GPU machine lends. jax 0.10
  takes it too."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                       platform="gpu")
  with jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("cuda_target",), abstract_device=device)):
    yield


def flash_inputs(seed, B, T, S, N, K, H, dtype, segments):
  """(q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment-id kwargs) drawn from ``seed``.

  ``segments``: None; "packed" (several documents per row, sorted ids 1..3);
  "pad" (real tokens then padding at the tail; B <= 2, the second row keeps
  half its queries and a third of its keys).
  """
  rng = random_arrays.rng(seed)
  q = random_arrays.normal(rng, (B, T, N, H), dtype)
  k = random_arrays.normal(rng, (B, S, K, H), dtype)
  v = random_arrays.normal(rng, (B, S, K, H), dtype)
  do = random_arrays.normal(rng, (B, T, N, H), dtype)
  seg = {}
  if segments == "packed":
    seg = dict(q_segment_ids=jax.device_put(np.sort(rng.integers(1, 4, (B, T), np.int32), axis=1)),
               kv_segment_ids=jax.device_put(np.sort(rng.integers(1, 4, (B, S), np.int32), axis=1)))
  elif segments == "pad":
    seg = dict(
        q_segment_ids=jax.device_put(
            (np.arange(T)[None] < np.array([T, max(1, T // 2)])[:B, None]).astype(np.int32)),
        kv_segment_ids=jax.device_put(
            (np.arange(S)[None] < np.array([S, max(1, S // 3)])[:B, None]).astype(np.int32)),
    )
  elif segments is not None:
    raise ValueError(f"segments={segments!r} is not one of None, 'packed', 'pad'")
  return q, k, v, do, seg


def value_and_grads(fn):
  """jit(q, k, v, dout) -> (out, dq, dk, dv) of ``fn(q, k, v)`` through jax.vjp."""

  def run(q, k, v, do):
    out, pullback = jax.vjp(fn, q, k, v)
    return (out, *pullback(do))

  return jax.jit(run)


@functools.partial(jax.jit, static_argnames=("window",))
def decode_reference(q_BTNH, k_BSKH, v_BSKH, lengths_B, window=None, scale=None):
  """What a decode kernel must return, by the reference op (jitted: one compilation
  instead of one per op): the T queries of row b sit at positions lengths_B[b] - T ..
  lengths_B[b] - 1, causal (and ``window``), and cache slots at or past lengths_B[b]
  are empty; ``scale`` multiplies the scores (default 1 / sqrt(H))."""
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  pos_BS = jnp.broadcast_to(jnp.arange(S), (q_BTNH.shape[0], S))
  kv_positions = jnp.where(pos_BS < lengths_B[:, None], pos_BS, -1)
  return reference_attention(q_BTNH, k_BSKH, v_BSKH, causal=True, window=window,
                             q_offset=lengths_B - T, kv_positions=kv_positions, scale=scale)


def equations(jaxpr):
  """Every equation of a jaxpr (open or closed), those of nested jaxprs, branches and
  kernel bodies too, each after the equation that holds it."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from equations(sub)


def pallas_calls(jaxpr):
  """Every pallas_call equation of a jaxpr, in nested jaxprs and branches too."""
  return [eqn for eqn in equations(jaxpr) if eqn.primitive.name == "pallas_call"]


def kernel_blocks(jaxpr, arrays=False):
  """{kernel name: [(kernel block shape, dtype), ...]} of every pallas_call in a jaxpr;
  with ``arrays``, the shapes of the whole arrays the blocks are cut from instead."""
  return {str(eqn.params["name"]): [
      (tuple((bm.array_aval if arrays else bm.block_aval).shape), bm.array_aval.dtype)
      for bm in eqn.params["grid_mapping"].block_mappings] for eqn in pallas_calls(jaxpr)}


def kernel_dots(jaxpr):
  """{kernel name: [(lhs dtype, rhs dtype) of each dot_general in its body]} of every
  pallas_call in a jaxpr that has one."""
  found = {}
  for call in pallas_calls(jaxpr):
    dots = [tuple(str(x.aval.dtype) for x in eqn.invars)
            for eqn in equations(call.params["jaxpr"]) if eqn.primitive.name == "dot_general"]
    if dots:
      found.setdefault(str(call.params["name"]), []).extend(dots)
  return found


def far_apart_inputs(B, T, S, N, K, H):
  """(q, k, v, dout) float32 whose scores lie far from 0 and far apart by row: query (t, n)
  is +-300 / sqrt(H) * ones(H) (the sign alternating over t + n), key s is x_s * ones(H)
  with x_s in [0.5, 1], so at the default scale 1 / sqrt(H) the scores are +-300 x_s, in
  [150, 300] or [-300, -150]. A softmax that starts its running max at 0 instead of -inf
  underflows a negative row to 0 / 0 (every exp(s - 0) is 0 in float32), and one max for
  all rows does the same; values and dout are random."""
  x_S = np.linspace(0.5, 1.0, S)
  sign_TN = np.where((np.arange(T)[:, None] + np.arange(N)[None]) % 2 == 0, 1.0, -1.0)
  q = np.broadcast_to(300 / np.sqrt(H) * sign_TN[None, :, :, None], (B, T, N, H))
  k = np.broadcast_to(x_S[None, :, None, None], (B, S, K, H))
  rng = random_arrays.rng(29)
  v = random_arrays.normal(rng, (B, S, K, H), jnp.float32)
  do = random_arrays.normal(rng, (B, T, N, H), jnp.float32)
  return jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), v, do


def assert_far_apart_close(got, want):
  """(out, dq, dk, dv) of ``far_apart_inputs`` against the float64 ones. The backward
  recomputes P as exp(s - lse) with s and lse near +-300, where float32's spacing is
  2**-15: P carries a relative error of ~3e-5, and the gradients' O(1) terms an absolute
  one of ~1e-5 (the reference op, which subtracts the row max, is closer), so 1e-4."""
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5 if name == "out" else 1e-4,
                               atol=1e-5 if name == "out" else 1e-4, err_msg=name)
