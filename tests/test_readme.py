"""The README's Python: its first example runs as written, and every call it shows of an
attnlab function names only parameters that function has."""

import ast
import inspect
import os
import re

import jax
import numpy as np
import pytest

import attnlab
from attnlab.ops.pallas import decode, flash
from attnlab.training import sharding

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")

# What the README's blocks call, by the name they call it (their imports: `import attnlab`,
# `from attnlab.ops.pallas import flash, decode`, `from attnlab.training.sharding import
# make_mesh`).
CALLABLES = {
    "attnlab.ModelConfig": attnlab.ModelConfig,
    "attnlab.build_model": attnlab.build_model,
    "attnlab.count_params": attnlab.count_params,
    "attnlab.attention": attnlab.attention,
    "attnlab.load_checkpoint": attnlab.load_checkpoint,
    "attnlab.generate": attnlab.generate,
    "attnlab.generate_requests": attnlab.generate_requests,
    "attnlab.Sampling": attnlab.Sampling,
    "flash.flash_attention": flash.flash_attention,
    "decode.decode_attention": decode.decode_attention,
    "decode.paged_decode_attention": decode.paged_decode_attention,
    "decode.decode_attention_heads_major": decode.decode_attention_heads_major,
    "make_mesh": sharding.make_mesh,
}


def _python_blocks() -> list[str]:
  with open(README, encoding="utf-8") as f:
    return re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)


def _calls():
  for block in _python_blocks():
    for node in ast.walk(ast.parse(block)):
      if isinstance(node, ast.Call):
        yield ast.unparse(node.func), node


def test_the_readmes_calls_name_only_parameters_the_functions_have():
  seen = set()
  for name, call in _calls():
    if not (name.startswith("attnlab.") or name in CALLABLES):
      continue
    assert name in CALLABLES, f"the README calls {name}, which this test does not know"
    seen.add(name)
    params = inspect.signature(CALLABLES[name]).parameters
    keywords = {k.arg for k in call.keywords}
    assert keywords <= set(params), (name, keywords - set(params))
    # Positional arguments fit the positional parameters (a placeholder `...` stands for
    # arguments left out, as in `attnlab.ModelConfig(..., attention_impl="pallas")`).
    args = [a for a in call.args if not (isinstance(a, ast.Constant) and a.value is ...)]
    positional = [p for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert len(args) <= len(positional), (name, ast.unparse(call))
  # The blocks still show each of these (a renamed block would otherwise check nothing).
  assert seen == set(CALLABLES), set(CALLABLES) - seen


def test_the_readmes_first_example_runs_as_written():
  (first,) = [b for b in _python_blocks()[:1] if "attnlab.build_model" in b]
  namespace = {}
  exec(compile(first, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
  cfg, logits = namespace["cfg"], namespace["logits_BTV"]
  assert (cfg.num_heads, cfg.num_kv_heads) == (8, 2)
  assert logits.shape == (2, 16, cfg.vocab_size) and bool(np.isfinite(logits).all())
  q, k, v = namespace["q_BTNH"], namespace["k_BSKH"], namespace["v_BSKH"]
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(namespace["out_BTNH"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["flash.flash_attention", "decode.decode_attention",
                                  "decode.paged_decode_attention",
                                  "decode.decode_attention_heads_major",
                                  "attnlab.generate_requests"])
def test_the_readmes_signature_blocks_list_every_keyword_with_its_default(name):
  """Where the README writes a function's whole signature (every keyword = its value),
  it lists every keyword-only parameter, each with the default it has (flash's
  ``causal=True``, generate_requests' ``sampling`` apart: shown as used)."""
  calls = [call for n, call in _calls() if n == name and len(call.keywords) > 3]
  assert calls, name
  params = inspect.signature(CALLABLES[name]).parameters
  shown_as_used = {"causal", "sampling"}
  for call in calls:
    keywords = {k.arg: k.value for k in call.keywords}
    assert set(keywords) == {p for p, v in params.items() if v.kind == v.KEYWORD_ONLY}, (
        name, ast.unparse(call))
    for key, value in keywords.items():
      if key not in shown_as_used:
        assert ast.literal_eval(value) == params[key].default, (name, key)
