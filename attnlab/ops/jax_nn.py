"""The ``jax.nn.dot_product_attention`` passthroughs: "xla" and "cudnn"."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops import masks


def check_backend(implementation: str, name: str = "implementation") -> None:
  """ValueError if ``implementation`` cannot run on JAX's default backend ('cudnn' needs a
  CUDA GPU), naming it as ``name``; commands call it before they write anything."""
  if implementation == "cudnn" and jax.default_backend() != "gpu":
    raise ValueError(
        f"{name}='cudnn' needs a CUDA GPU; the default backend is "
        f"{jax.default_backend()!r}. Use 'xla', 'chunked' or 'reference'."
    )


def jax_nn_attention(
    q_BTNH, k_BSKH, v_BSKH, *, implementation, causal, window, q_segment_ids, kv_segment_ids,
    q_offset, scale,
):
  """``jax.nn.dot_product_attention`` with attnlab's mask semantics.

  "xla" receives the explicit boolean mask built from the same predicate as
  the reference op; "cudnn" receives only what cuDNN's fused kernel supports
  (aligned causal, a causal sliding window, no segments, no offset) and
  raises ``ValueError`` for anything else.
  """
  B, T, _, _ = q_BTNH.shape
  S = k_BSKH.shape[1]
  dtypes = (q_BTNH.dtype, k_BSKH.dtype, v_BSKH.dtype)
  if len(set(dtypes)) > 1:  # jax.nn's own message names neither argument nor the way out
    raise ValueError(
        f"implementation={implementation!r} (jax.nn.dot_product_attention) needs q_BTNH, "
        f"k_BSKH and v_BSKH of one dtype, got {', '.join(str(d) for d in dtypes)}: cast them, "
        "or use 'reference', 'chunked' or 'pallas', which take mixed dtypes"
    )
  if implementation == "cudnn":
    check_backend(implementation)
    unsupported = []
    if q_segment_ids is not None:
      unsupported.append("segment ids")
    if not (isinstance(q_offset, int) and q_offset == 0):
      unsupported.append("q_offset")
    if window is not None and not causal:
      unsupported.append("a non-causal window")
    if causal and T != S:
      unsupported.append(f"causal with T={T} != S={S}")
    if unsupported:
      raise ValueError(
          f"implementation='cudnn' does not support {', '.join(unsupported)}; "
          "use 'pallas', 'xla' or 'chunked'"
      )
    return jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, scale=scale, is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )
  if q_BTNH.dtype == jnp.float16 and jax.default_backend() == "cpu":
    # XLA:CPU has no float16 x float16 -> float32 dot under jit ("The precision
    # 'F16_F16_F32' is not supported by dot_general on CPU"): float32 inside, float16 out.
    f32 = lambda x: x.astype(jnp.float32)
    return jax_nn_attention(f32(q_BTNH), f32(k_BSKH), f32(v_BSKH), causal=causal,
                            window=window, q_segment_ids=q_segment_ids,
                            kv_segment_ids=kv_segment_ids, q_offset=q_offset, scale=scale,
                            implementation=implementation).astype(jnp.float16)
  needs_mask = causal or window is not None or q_segment_ids is not None
  if not needs_mask:
    return jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, scale=scale, implementation="xla"
    )
  mask_BTS = masks.make_attention_mask(
      B, T, S, causal=causal, window=window, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, q_offset=q_offset,
  )
  out_BTNH = jax.nn.dot_product_attention(
      q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None], scale=scale, implementation="xla"
  )
  # jax.nn averages the values of a row that sees no key; attnlab returns zeros.
  seen_BT = jnp.any(mask_BTS, axis=-1)
  return jnp.where(seen_BT[:, :, None, None], out_BTNH, 0).astype(q_BTNH.dtype)
