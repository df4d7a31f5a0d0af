"""``weight_einsum`` (the einsum of every projection, contracting in the weight's order),
the fan-in init, ``param``, ``Einsum`` and ``as_dtype``."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab.config import DTYPES
from attnlab.nn.layers import Einsum, as_dtype, fan_in_init, param, weight_einsum
from tests import random_arrays

CASES = [
    ("BTNH,NHD->BTD", (2, 3, 4, 8), (4, 8, 16)),  # two contracted dims
    ("BTD,DNH->BTNH", (2, 3, 16), (16, 4, 8)),
    ("RD,DF->RF", (5, 7), (7, 9)),
    ("BTD,VD->BTV", (2, 3, 7), (11, 7)),  # contracted dim last in the weight
    ("BKGH,BKSH->BKGS", (2, 3, 4, 5), (2, 3, 6, 5)),  # batch dims
    ("BTD,DNH->BNTH", (2, 3, 16), (16, 4, 8)),  # an output order that needs a transpose
    ("BTHN,NHD->BTD", (2, 3, 8, 4), (4, 8, 16)),  # the input's order differs from the weight's
    ("BD,F->BDF", (2, 3), (4,)),  # nothing contracted: an outer product
    (" BTD , DNH -> BTNH ", (2, 3, 16), (16, 4, 8)),  # spaces, as jnp.einsum takes them
]


@pytest.mark.parametrize("equation,x_shape,w_shape", CASES)
def test_weight_einsum_equals_einsum(equation, x_shape, w_shape):
  rng = np.random.default_rng(0)
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = rng.standard_normal(w_shape).astype(np.float32)
  want = np.einsum(equation.replace(" ", ""), x.astype(np.float64), w.astype(np.float64))
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


GENERAL = ("weight_einsum takes an explicit two-operand einsum 'x,w->out' with each letter once "
           "per operand, got ")


@pytest.mark.parametrize("equation,message", [
    ("BD,DF", GENERAL),  # no output
    (",DF->F", GENERAL),  # no x
    ("BD,->BD", GENERAL),  # no weight
    ("BD,DE,FX->BX", GENERAL),  # three operands
    ("AB,CD,EF->ABCDEF", GENERAL),
    ("BDD,DF->BF", GENERAL),  # a letter twice in x
    ("BD,DFF->BF", GENERAL),  # ... in the weight
    ("BD,DF->BFF", GENERAL),  # ... in the output
    ("BD,DF->BFX", GENERAL),  # an output letter from neither operand
    ("BD,DX->F->BF", GENERAL),  # two arrows
    ("BXD,DF->BF", "weight_einsum: 'BXD,DF->BF' sums X over one operand only"),
    ("BXD,DFY->BF", "weight_einsum: 'BXD,DFY->BF' sums XY over one operand only"),
])
def test_weight_einsum_refuses_what_it_does_not_do(equation, message):
  if message == GENERAL:
    message += repr(equation)
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    weight_einsum(equation, jnp.ones((2, 3, 3)), jnp.ones((3, 4)))


@pytest.mark.parametrize("in_axes,scale", [((0,), 1.0), ((0, 1), 1.0), ((1,), 3.0)])
def test_fan_in_init_has_std_sqrt_scale_over_fan_in(in_axes, scale):
  """A normal truncated at +-2 of its own std, rescaled to std sqrt(scale / fan_in) (a unit
  normal cut at +-2 has std 0.8796): its values lie within +-2.27 of that std."""
  shape = (64, 8, 32)
  init = fan_in_init(in_axes) if scale == 1.0 else fan_in_init(in_axes, scale)
  w = np.asarray(init(jax.random.key(0), shape, jnp.float32), np.float64)
  std = math.sqrt(scale / math.prod(shape[a] for a in in_axes))
  assert abs(w.std() / std - 1) < 0.03, (w.std(), std)
  cut = 2 * std / 0.87962566103423978
  assert cut * 0.95 < abs(w).max() <= cut * 1.0001
  assert init(jax.random.key(0), (4, 4), jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("init_scale", [None, 4.0])
@pytest.mark.parametrize("dtype,param_dtype", [(jnp.float32, jnp.float32),
                                               (jnp.float32, jnp.bfloat16),
                                               (jnp.bfloat16, jnp.float32)])
def test_einsum_layer_projects_with_its_weight_init_dtypes_and_bias(init_scale, dtype,
                                                                   param_dtype):
  kw = {} if init_scale is None else dict(init_scale=init_scale)
  layer = Einsum("BTD,DNH->BTNH", (64, 4, 16), ("embed", "heads", "kv"), in_axes=(0,),
                 bias_dims=(1, 2), dtype=dtype, param_dtype=param_dtype,
                 rngs=nnx.Rngs(0), **kw)
  assert layer.w.dtype == layer.b.dtype == param_dtype
  assert layer.w.get_metadata()["axes"] == ("embed", "heads", "kv")
  assert layer.b.get_metadata()["axes"] == ("heads", "kv") and layer.b.shape == (4, 16)
  w = np.asarray(layer.w[...].astype(jnp.float32), np.float64)
  std = math.sqrt((init_scale or 1.0) / 64)
  assert abs(w.std() / std - 1) < 0.05, (w.std(), std)
  layer.b[...] = jnp.arange(64, dtype=jnp.float32).reshape(4, 16).astype(param_dtype)
  x = random_arrays.normal(1, (2, 3, 64))
  got = layer(x)
  assert got.dtype == dtype  # computed in dtype, whatever the parameters are stored in
  want = np.einsum("btd,dnh->btnh", np.asarray(x, np.float64), w) + np.asarray(
      layer.b[...].astype(jnp.float32), np.float64)
  tol = 1e-4 if dtype == jnp.float32 else 0.3  # bfloat16: 8 bits, |y| up to 64
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol)
  no_bias = Einsum("RD,DF->RF", (8, 4), ("embed", "mlp"), in_axes=(0,), rngs=nnx.Rngs(0))
  assert no_bias.b is None


def test_param_tags_its_logical_axes_and_refuses_axes_of_another_rank():
  p = param(nnx.Rngs(0), (2, 3), ("embed", "mlp"), lambda k, s, d: jnp.ones(s, d), jnp.bfloat16)
  assert p.dtype == jnp.bfloat16 and p.shape == (2, 3)
  assert p.get_metadata()["axes"] == ("embed", "mlp")
  with pytest.raises(ValueError, match=re.escape(
      "axes ('embed',) must name every dimension of shape (2, 3)")):
    param(nnx.Rngs(0), (2, 3), ("embed",), lambda k, s, d: jnp.ones(s, d), jnp.float32)


def test_as_dtype_takes_the_config_names_and_passes_dtypes_through():
  assert [as_dtype(n) for n in DTYPES] == [jnp.float32, jnp.bfloat16, jnp.float16]
  assert as_dtype(jnp.bfloat16) is jnp.bfloat16
  with pytest.raises(ValueError, match=re.escape(
      "dtype='float64' is not one of 'float32', 'bfloat16', 'float16'")):
    as_dtype("float64")


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float16"])
def test_one_seed_is_one_model_in_every_param_dtype(param_dtype):
  """Parameters are drawn in float32 and stored in param_dtype: a model built with bfloat16
  or float16 parameters is the float32 model rounded (until 2026-12-04 the draws were made
  in param_dtype, another random model: correlation ~0 with the float32 one), every leaf,
  learned positions and an untied head included."""
  import attnlab

  cfg = attnlab.ModelConfig(arch="decoder_only", vocab_size=37, d_model=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, d_ff=64, max_len=16, pos="learned",
                            tie_embeddings=False, use_bias=True)
  want = nnx.state(attnlab.build_model(cfg, rngs=nnx.Rngs(3)), nnx.Param)
  got = nnx.state(attnlab.build_model(cfg.replace(param_dtype=param_dtype), rngs=nnx.Rngs(3)),
                  nnx.Param)
  leaves_w, leaves_g = jax.tree.leaves(want), jax.tree.leaves(got)
  assert len(leaves_w) == len(leaves_g) > 10
  for w, g in zip(leaves_w, leaves_g, strict=True):
    assert g.dtype == jnp.dtype(param_dtype)
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(w.astype(param_dtype), np.float32))
