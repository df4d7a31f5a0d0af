"""``weight_einsum``: the einsum of every projection, contracting in the weight's order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.nn.layers import weight_einsum

CASES = [
    ("BTNH,NHD->BTD", (2, 3, 4, 8), (4, 8, 16)),  # two contracted dims
    ("BTD,DNH->BTNH", (2, 3, 16), (16, 4, 8)),
    ("RD,DF->RF", (5, 7), (7, 9)),
    ("BTD,VD->BTV", (2, 3, 7), (11, 7)),  # contracted dim last in the weight
    ("BKGH,BKSH->BKGS", (2, 3, 4, 5), (2, 3, 6, 5)),  # batch dims
    ("BTD,DNH->BNTH", (2, 3, 16), (16, 4, 8)),  # an output order that needs a transpose
    ("BTHN,NHD->BTD", (2, 3, 8, 4), (4, 8, 16)),  # the input's order differs from the weight's
]


@pytest.mark.parametrize("equation,x_shape,w_shape", CASES)
def test_weight_einsum_equals_einsum(equation, x_shape, w_shape):
  rng = np.random.default_rng(0)
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = rng.standard_normal(w_shape).astype(np.float32)
  want = np.einsum(equation, x.astype(np.float64), w.astype(np.float64))
  got = weight_einsum(equation, jnp.asarray(x), jnp.asarray(w))
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation,x_contract", [("BTNH,NHD->BTD", (2, 3)),
                                                 ("BTHN,NHD->BTD", (3, 2))])
def test_weight_einsum_contracts_in_the_weights_order(equation, x_contract):
  """The dot's contracting dims follow the weight's storage order (jnp.einsum lists
  "BTNH,NHD->BTD" as (H, N), and XLA transposes the weight to match)."""
  jaxpr = jax.make_jaxpr(lambda x, w: weight_einsum(equation, x, w))(
      jnp.ones((1, 1, 4, 4)), jnp.ones((4, 4, 16)))
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  (x_dims, w_dims), _ = eqn.params["dimension_numbers"]
  assert tuple(w_dims) == (0, 1) and tuple(x_dims) == x_contract


def test_weight_einsum_keeps_a_bfloat16_dtype():
  x = jnp.ones((2, 3), jnp.bfloat16)
  w = jnp.ones((3, 4), jnp.bfloat16)
  assert weight_einsum("RD,DF->RF", x, w).dtype == jnp.bfloat16


@pytest.mark.parametrize("equation", ["BD,DF", "BDD,DF->BF", "BD,DF->BFX", "BXD,DF->BF"])
def test_weight_einsum_refuses_what_it_does_not_do(equation):
  with pytest.raises(ValueError, match="weight_einsum"):
    weight_einsum(equation, jnp.ones((2, 3, 3)), jnp.ones((3, 4)))
