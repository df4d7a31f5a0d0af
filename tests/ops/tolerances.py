"""Tolerances shared by the kernel parity tests."""

import numpy as np

# A bfloat16 kernel may be off the float32 definition by at most this many
# times the reference op's own bfloat16 error (measured: up to 1.7x on dV).
BF16_ERROR_FACTOR = 3.0


def assert_bf16_close(actual, ref_bf16, ref_f32, what):
  """The kernel's bfloat16 error is at most a few times the reference's own.

  ``ref_f32`` is the reference in float32 on the same bfloat16-rounded inputs,
  ``ref_bf16`` the reference in bfloat16: ``max |actual - ref_f32|`` must stay
  within ``BF16_ERROR_FACTOR * max |ref_bf16 - ref_f32|`` (a fixed fraction of
  the tensor's scale would accept errors far above bfloat16 rounding).
  """
  actual, ref_bf16, ref_f32 = (np.asarray(x, np.float32) for x in (actual, ref_bf16, ref_f32))
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  err = float(np.max(np.abs(actual - ref_f32)))
  ref_err = float(np.max(np.abs(ref_bf16 - ref_f32)))
  tiny = 1e-6 * max(1.0, float(np.max(np.abs(ref_f32))))
  assert err <= BF16_ERROR_FACTOR * ref_err + tiny, (
      f"{what}: bfloat16 error {err:.3g} > {BF16_ERROR_FACTOR} x the reference's {ref_err:.3g}")
