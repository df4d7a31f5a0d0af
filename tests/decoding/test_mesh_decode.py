"""Decoding with the parameters sharded over a device mesh (4 forced host devices, in a
subprocess: tests/decoding/mesh_decode_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.decoding.test_commands import _trained


@pytest.mark.slow
def test_decoding_on_a_mesh_gives_the_tokens_of_one_device(tmp_path_factory):
  """``generate`` (every cache kind, int8, beam search on (1, 1, 2); the contiguous cache
  on (2, 1, 2)) and ``generate_requests`` (every cache kind on (1, 1, 2), paged on
  (1, 1, 4)) produce the one-device tokens;
  the serving cache holds half the KV heads per device on (1, 1, 2) (whole ones where 4
  does not divide the 2 KV heads) and a second run compiles nothing; ``load_checkpoint``
  with a mesh restores the same values in the training layout, and ``attnlab decode
  --mesh_shape`` prints the one-device text."""
  workdir = _trained(tmp_path_factory, "lm_stdlib_tiny.gin", "DataConfig.max_files=2",
                     "DataConfig.seq_len=32", "ModelConfig.d_model=32", "ModelConfig.d_ff=64",
                     "ModelConfig.num_kv_heads=2")
  script = os.path.join(os.path.dirname(__file__), "mesh_decode_check.py")
  res = subprocess.run([sys.executable, script, workdir], capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  assert out.pop("devices") == 4
  one = out.pop("one device")
  assert out["(1, 1, 2)"]["generate"] == one["generate"] and len(one["generate"]) == 4
  [(kind, tokens)] = out["(2, 1, 2)"]["generate"].items()
  assert tokens == one["generate"][kind]
  assert out["(1, 1, 2)"]["beam"] == one["beam"]
  for cache, got in out["(1, 1, 2)"]["serve"].items():
    want = one["serve"][cache]
    assert got["tokens"] == want["tokens"], cache
    # Every decode call got the cache laid out alike: K/V heads split over tensor.
    [(spec, shard)] = got["k_buffers"]
    [(_, whole)] = want["k_buffers"]
    k_axis = 2 if cache == "paged" else 1  # [P, C, K, H] / [B, K, S, H]
    assert "tensor" in spec and shard[k_axis] * 2 == whole[k_axis] == 2, (cache, spec, shard)
    assert got["compiled_again"] == 0 and want["compiled_again"] == 0
  got = out["(1, 1, 4)"]["serve"]["paged"]
  assert got["tokens"] == one["serve"]["paged"]["tokens"]
  assert got["k_buffers"] == [["P()", one["serve"]["paged"]["k_buffers"][0][1]]]
  assert out["restored_equal"] and out["restored_layout"]
  assert out["restored_q_spec"] == "P(None, 'tensor', None)"  # [embed, heads, head_dim]
  cli = out["cli"]  # (exit code, stdout, the mesh the checkpoint was restored onto)
  mesh = {"data": 1, "fsdp": 1, "tensor": 2}
  assert cli["one device"][:2] == cli["1,1,2"][:2] and cli["one device"][0] == 0
  assert cli["served, one device"][:2] == cli["served, 1,1,2"][:2]
  assert cli["served, one device"][1].startswith("0\tdef f(\t")
  assert cli["one device"][2] == cli["served, one device"][2] == [None]
  assert cli["1,1,2"][2] == cli["served, 1,1,2"][2] == [mesh]
