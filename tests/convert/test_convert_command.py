"""``attnlab convert`` (attnlab/commands/convert.py) on hand-made checkpoints, without torch.

The checkpoints come from tests/convert/hf_checkpoints.py (random tensors under
transformers' names, a float64 NumPy forward of the layout). Checked: the imported
workdir (its summary line, config.gin, the fine-tuning TrainConfig, the logits of
``load_checkpoint`` against the NumPy forward, ``--dtype``), a tokenizer.json carried in
and out with its ids, the export (every tensor back bitwise, config.json, ``--step``,
``--max_shard_mb``), and every refused flag combination or path: exit 2, one line,
nothing written, no temporary folder left. tests/convert/test_hf.py runs the command
against transformers itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

import attnlab
from attnlab import config_gin as gin_config
from attnlab.cli import main
from attnlab.commands import decode as decode_command
from attnlab.config import DataConfig
from attnlab.convert import hf

pytest.importorskip("safetensors")

from tests.convert.hf_checkpoints import (  # noqa: E402
  FAMILY_CONFIGS,
  T,
  V,
  flat_params,
  gpt2_forward,
  llama_forward,
  random_tensors,
  shapes_of,
  write_checkpoint,
)
from tests.fifos import released_after  # noqa: E402


def _convert(capsys, *argv):
  capsys.readouterr()
  rc = main(["convert", *argv])
  out, err = capsys.readouterr()
  return rc, out, err


def _convert_heads(capsys, *argv):
  rc = main(["convert-heads", *argv])
  out, err = capsys.readouterr()
  return rc, out, err


def _hf_dir(tmp_path, name="llama_bias_head_dim", seed=0, **changes):
  c = dict(FAMILY_CONFIGS[name], **changes)
  tensors = random_tensors(shapes_of(c), seed=seed)
  return write_checkpoint(tmp_path / f"hf_{name}", c, tensors), c, tensors


@pytest.mark.parametrize("name", ["llama_bias_head_dim", "gpt2"])
def test_from_hf_writes_a_workdir_whose_model_computes_the_checkpoint(name, tmp_path, capsys):
  src, c, tensors = _hf_dir(tmp_path, name)
  work = tmp_path / "work"
  rc, out, err = _convert(capsys, "--from-hf", src, "--workdir", str(work))
  assert rc == 0, err
  summary = json.loads(out)
  n_params = sum(v.size for v in tensors.values())
  assert summary == {"workdir": str(work), "family": c["model_type"], "params": n_params,
                     "step": 0, "tokenizer": "byte"}
  assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(src), "work"])  # no temp
  model, cfg = attnlab.load_checkpoint(str(work))
  tokens = np.random.default_rng(1).integers(0, V, T)
  want = (gpt2_forward if name == "gpt2" else llama_forward)(c, tensors, tokens)
  got = np.asarray(jax.jit(lambda t: model(t))(tokens[None]))[0]
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
  assert not (work / "generation_config.json").exists()  # one eos id: nothing to add
  # The checkpoint records where its weights came from.
  meta = json.loads((work / "checkpoints" / "0" / "meta" / "metadata").read_text())
  assert (meta["converted_from"], meta["family"]) == (os.path.abspath(src), c["model_type"])
  text = (work / "config.gin").read_text()
  assert text.startswith(f"# Converted by `attnlab convert --from-hf {os.path.abspath(src)}`.\n"
                         "# Fine-tune: attnlab train --gin_file THIS_FILE --workdir ")
  mcfg, dcfg, tcfg = gin_config.read_workdir_config(str(work / "config.gin"))
  assert mcfg == cfg == hf.from_hf_config(c)[1]
  # no tokenizer.json: the byte tokenizer's defaults, rows no longer than the model's positions
  # (seq_len 128 past max_position_embeddings=64 made `attnlab train` of the workdir fail
  # until 2026-12-06)
  assert mcfg.max_len < DataConfig.seq_len  # these checkpoints' 32 or 64 positions
  assert dcfg == DataConfig(seq_len=mcfg.max_len)
  assert (tcfg.steps, tcfg.learning_rate, tcfg.schedule, tcfg.warmup_steps, tcfg.weight_decay,
          tcfg.checkpoint_every) == (100, 2e-5, "constant", 10, 0.0, 100)


def test_from_hf_dtype_flag_sets_the_parameter_and_compute_dtype(tmp_path, capsys):
  src, _, tensors = _hf_dir(tmp_path, "qwen2")
  rc, _, err = _convert(capsys, "--from-hf", src, "--workdir", str(tmp_path / "w"),
                        "--dtype", "bfloat16")
  assert rc == 0, err
  model, cfg = attnlab.load_checkpoint(str(tmp_path / "w"))
  assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "bfloat16")
  params = flat_params(model)
  assert {v.dtype.name for v in params.values()} == {"bfloat16"}
  np.testing.assert_array_equal(
      params[("embedder", "embed_tokens")].astype(np.float32),
      np.asarray(jax.numpy.asarray(tensors["model.embed_tokens.weight"], "bfloat16"),
                 np.float32))


def _tokenizer_json(path, vocab: int):
  """A word-level tokenizer.json with ``vocab`` tokens, <s> = 1 and </s> = 2."""
  tokenizers = pytest.importorskip("tokenizers")
  words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(path))
  return tok


def test_a_generation_config_comes_in_with_the_workdir_and_goes_back_out(tmp_path, capsys):
  """transformers' generation_config.json (sampling defaults, several eos ids) is kept in
  the workdir and given back by the export, byte for byte (until 2026-12-04 both dropped it:
  the exported model sampled with transformers' plain defaults); config.json's own list of
  eos ids does not replace it."""
  src, _, _ = _hf_dir(tmp_path, "llama_mqa_tied", eos_token_id=[2, 5])
  text = '{"eos_token_id": [2, 7], "do_sample": true, "temperature": 0.6, "top_p": 0.9}'
  with open(os.path.join(src, "generation_config.json"), "w") as f:
    f.write(text)
  work, back = tmp_path / "work", tmp_path / "back"
  rc, _, err = _convert(capsys, "--from-hf", src, "--workdir", str(work))
  assert rc == 0, err
  assert (work / "generation_config.json").read_text() == text
  rc, _, err = _convert(capsys, "--to-hf", "--workdir", str(work), "--out", str(back))
  assert rc == 0, err
  assert (back / "generation_config.json").read_text() == text


def test_convert_heads_keeps_an_hf_imports_stop_ids(tmp_path, capsys):
  """convert-heads of an HF import copies its generation_config.json into the new run:
  decode stops at all of its eos ids, and the export gives them back (until 2026-12-06 the
  new run had none: it stopped at DataConfig.eos_id alone, and so did its export). A run
  without one gets none."""
  src, _, _ = _hf_dir(tmp_path, eos_token_id=[2, 5])  # 2 KV heads
  work, mqa, back = tmp_path / "work", tmp_path / "mqa", tmp_path / "back"
  rc, _, err = _convert(capsys, "--from-hf", src, "--workdir", str(work))
  assert rc == 0, err
  rc, _, err = _convert_heads(capsys, "--from", str(work), "--to", str(mqa),
                              "--num_kv_heads", "1", "--method", "mean")
  assert rc == 0, err
  text = (work / "generation_config.json").read_text()
  assert json.loads(text) == {"eos_token_id": [2, 5]}
  assert (mqa / "generation_config.json").read_text() == text
  _, dcfg, _ = gin_config.read_workdir_config(str(mqa / "config.gin"))
  assert decode_command.stop_ids(str(mqa), dcfg.eos_id, V) == [2, 5]
  rc, _, err = _convert(capsys, "--to-hf", "--workdir", str(mqa), "--out", str(back))
  assert rc == 0, err
  assert (back / "generation_config.json").read_text() == text
  os.remove(work / "generation_config.json")
  rc, _, err = _convert_heads(capsys, "--from", str(work), "--to", str(tmp_path / "mqa2"),
                              "--num_kv_heads", "1", "--method", "mean")
  assert rc == 0, err
  assert not (tmp_path / "mqa2" / "generation_config.json").exists()


def test_a_tokenizer_json_comes_in_with_its_ids_and_goes_back_out(tmp_path, capsys):
  # bos / eos ids other than the byte tokenizer's (1, 2): the export must take these.
  src, c, _ = _hf_dir(tmp_path, "llama_mqa_tied", bos_token_id=3, eos_token_id=[4, 2])
  _tokenizer_json(os.path.join(src, "tokenizer.json"), V)
  with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
    json.dump({"model_max_length": 64}, f)
  work = tmp_path / "work"
  rc, out, err = _convert(capsys, "--from-hf", src, "--workdir", str(work))
  assert rc == 0, err
  assert json.loads(out)["tokenizer"] == "hf_json"
  for name in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(src, name), "rb") as f:
      assert (work / name).read_bytes() == f.read(), name
  assert not (work / "special_tokens_map.json").exists()  # only the files that exist
  assert "DataConfig.tokenizer_model = 'tokenizer.json'" in (work / "config.gin").read_text()
  _, dcfg, _ = gin_config.read_workdir_config(str(work / "config.gin"))
  assert (dcfg.tokenizer, dcfg.bos_id, dcfg.eos_id) == ("hf_json", 3, 4)
  assert dcfg.tokenizer_model == str(work / "tokenizer.json")
  # config.json's eos list without a generation_config.json: the workdir keeps one eos
  # (DataConfig.eos_id) and writes the list where decode reads stop ids (until 2026-12-04
  # decode stopped at 4 alone; transformers stops at both).
  assert json.loads((work / "generation_config.json").read_text()) == {"eos_token_id": [4, 2]}
  assert decode_command.stop_ids(str(work), dcfg.eos_id, V) == [4, 2]
  back = tmp_path / "back"
  files = lambda: {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
                   for d, _, names in os.walk(work) for f in names}
  before = files()
  rc, out, err = _convert(capsys, "--to-hf", "--workdir", str(work), "--out", str(back))
  assert rc == 0, err
  assert files() == before  # the export reads the workdir, writes nothing there
  config = json.loads((back / "config.json").read_text())
  assert (config["bos_token_id"], config["eos_token_id"]) == (3, 4)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (back / name).read_bytes() == (work / name).read_bytes(), name
  assert not (back / "special_tokens_map.json").exists()
  assert json.loads((back / "generation_config.json").read_text()) == {"eos_token_id": [4, 2]}
  # No pad named by the tokenizer files: none in config.json (until 2026-12-04 the workdir's
  # ModelConfig.pad_id, 0 for a model without one, for which transformers' generate masked
  # every prompt token 0 and its models froze embedding row 0).
  assert config["pad_token_id"] is None


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json"])
@pytest.mark.parametrize("make, what", [(os.mkdir, "a folder"), (os.mkfifo, "a FIFO")])
def test_a_tokenizer_companion_that_is_no_regular_file_is_one_line_both_ways(
    tmp_path, capsys, name, make, what):
  """A folder or a FIFO for a tokenizer.json's companion file (tokenizer_config.json,
  special_tokens_map.json): the import and the export each refuse it naming it, and write
  nothing (until 2026-12-07 both passed it over: the copy lacked it and the export's pad was
  read without it, where convert-heads refused the same file)."""
  src, _, _ = _hf_dir(tmp_path, "llama_mqa_tied")
  _tokenizer_json(os.path.join(src, "tokenizer.json"), V)
  work, back = tmp_path / "work", tmp_path / "back"
  assert _convert(capsys, "--from-hf", src, "--workdir", str(work))[0] == 0
  for folder, argv, doing in (
      (src, ["--from-hf", src, "--workdir", str(tmp_path / "new")], "the import"),
      (str(work), ["--to-hf", "--workdir", str(work), "--out", str(back)], "the export")):
    path = os.path.join(folder, name)
    make(path)
    with released_after(30, path):
      rc, out, err = _convert(capsys, *argv)
    assert (rc, out, err) == (2, "", (
        f"attnlab convert: error: {path} is {what}, not a regular file: put the file back or "
        f"move it away ({doing} copies it with the tokenizer.json beside it)\n")), argv
    os.remove(path) if what == "a FIFO" else os.rmdir(path)
  assert sorted(os.listdir(tmp_path)) == sorted(["work", os.path.basename(src)])
  assert _convert(capsys, "--to-hf", "--workdir", str(work), "--out", str(back))[0] == 0


@pytest.mark.parametrize("files", [
    {"tokenizer_config.json": {"pad_token": "<pad>"}},
    {"tokenizer_config.json": {"pad_token": {"content": "w1", "special": True}}},
    {"tokenizer_config.json": {"pad_token": None},
     "special_tokens_map.json": {"pad_token": "w1"}},
    {"tokenizer_config.json": {"pad_token": "not-a-token"}},
    {"special_tokens_map.json": ["not", "an", "object"]},
])
def test_the_exported_pad_is_the_one_the_tokenizer_files_name(tmp_path, capsys, files):
  """pad_token of tokenizer_config.json, else of special_tokens_map.json, as its id in
  tokenizer.json (<pad> is 0, w1 is 5); none for a token not in it or no pad named."""
  src, _, _ = _hf_dir(tmp_path, "llama_mqa_tied", pad_token_id=None)
  _tokenizer_json(os.path.join(src, "tokenizer.json"), V)
  for name, content in files.items():
    with open(os.path.join(src, name), "w") as f:
      json.dump(content, f)
  work, back = tmp_path / "work", tmp_path / "back"
  assert _convert(capsys, "--from-hf", src, "--workdir", str(work))[0] == 0
  rc, _, err = _convert(capsys, "--to-hf", "--workdir", str(work), "--out", str(back))
  assert rc == 0, err
  named = [c.get("pad_token") for c in files.values() if isinstance(c, dict)]
  named = next((n for n in named if n is not None), None)
  named = named["content"] if isinstance(named, dict) else named
  want = {"<pad>": 0, "w1": 5}.get(named)
  assert json.loads((back / "config.json").read_text())["pad_token_id"] == want


@pytest.mark.parametrize("adds_bos", [True, False])
def test_without_bos_token_id_the_bos_is_the_one_the_post_processor_adds(tmp_path, capsys,
                                                                         adds_bos):
  """A config.json without bos_token_id whose tokenizer.json's post-processor puts <s> in
  front (transformers' prompts start with it): the workdir's bos is <s>, so the pipeline
  and `attnlab decode` put it in front too (until 2026-12-04 the bos was None and prompts
  lost it). A post-processor that adds nothing in front leaves no bos."""
  tokenizers = pytest.importorskip("tokenizers")
  src, c, _ = _hf_dir(tmp_path, "llama_mqa_tied")
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  del config["bos_token_id"]
  with open(os.path.join(src, "config.json"), "w") as f:
    json.dump(config, f)
  path = os.path.join(src, "tokenizer.json")
  tok = _tokenizer_json(path, V)
  if adds_bos:
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
  else:  # an eos after the text: not a bos
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 2)])
  tok.save(path)
  work = tmp_path / "work"
  rc, _, err = _convert(capsys, "--from-hf", src, "--workdir", str(work))
  assert rc == 0, err
  _, dcfg, _ = gin_config.read_workdir_config(str(work / "config.gin"))
  assert (dcfg.bos_id, dcfg.eos_id) == ((1 if adds_bos else None), c["eos_token_id"])
  from attnlab.commands import decode as decode_command
  from attnlab.data import pipeline

  ids = pipeline.prompt_ids(decode_command._tokenizer(str(work)), "w5 w6", "decoder_only", "lm")
  want = [int(i) for i in tok.encode("w5 w6").ids]  # transformers' prompt
  assert ids.tolist() == (want if adds_bos else want[:-1])


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
  src, _, _ = _hf_dir(tmp_path, "llama_mqa_tied")
  _tokenizer_json(os.path.join(src, "tokenizer.json"), V + 1)
  before = sorted(os.listdir(tmp_path))
  rc, out, err = _convert(capsys, "--from-hf", src, "--workdir", str(tmp_path / "w"))
  assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert f"tokenizer.json has {V + 1} tokens, more than config.json vocab_size={V}" in err
  assert sorted(os.listdir(tmp_path)) == before
  with open(os.path.join(src, "tokenizer.json"), "w") as f:
    f.write("{not json")
  rc, _, err = _convert(capsys, "--from-hf", src, "--workdir", str(tmp_path / "w"))
  assert rc == 2 and "tokenizer.json" in err and sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("name", ["llama_bias_head_dim", "mistral", "gpt2_untied"])
def test_to_hf_gives_back_every_tensor_and_a_config_that_maps_back(name, tmp_path, capsys):
  src, c, tensors = _hf_dir(tmp_path, name)
  work, back = tmp_path / "work", tmp_path / "back"
  assert _convert(capsys, "--from-hf", src, "--workdir", str(work))[0] == 0
  rc, out, err = _convert(capsys, "--to-hf", "--workdir", str(work), "--out", str(back))
  assert rc == 0, err
  assert json.loads(out) == {"out": str(back), "family": c["model_type"], "step": 0,
                             "files": [str(back / "model.safetensors")]}
  assert sorted(os.listdir(back)) == ["config.json", "model.safetensors"]
  assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(src), "work", "back"])
  from safetensors.numpy import load_file

  got = load_file(str(back / "model.safetensors"))
  assert sorted(got) == sorted(tensors)
  for key, value in tensors.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  config = json.loads((back / "config.json").read_text())
  assert hf.from_hf_config(config) == hf.from_hf_config(c)
  # No tokenizer.json in the workdir: attnlab's byte tokenizer's ids.
  from attnlab.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
      BOS_ID, EOS_ID, PAD_ID)


def test_to_hf_step_and_shard_size(tmp_path, capsys, warned):
  from attnlab.training.checkpoint import Checkpointer

  src, c, tensors = _hf_dir(tmp_path, "llama_bias_head_dim")
  work = tmp_path / "work"
  assert _convert(capsys, "--from-hf", src, "--workdir", str(work))[0] == 0
  # A later step with other weights: the latest is exported unless --step says otherwise.
  model, cfg = attnlab.load_checkpoint(str(work))
  from flax import nnx

  state = nnx.state(model, nnx.Param)
  state = jax.tree.map(lambda x: x + 1.0, state)
  ckpt = Checkpointer(str(work))
  try:
    ckpt.save_params(5, state)
  finally:
    ckpt.close()
  from safetensors.numpy import load_file

  name = "model.layers.0.self_attn.q_proj.weight"
  for step, offset in ((None, 1.0), (0, 0.0), (5, 1.0)):
    out = tmp_path / f"out_{step}"
    rc, printed, err = _convert(capsys, "--to-hf", "--workdir", str(work), "--out", str(out),
                                *([] if step is None else ["--step", str(step)]))
    assert rc == 0, err
    assert json.loads(printed)["step"] == (5 if step is None else step)
    np.testing.assert_allclose(load_file(str(out / "model.safetensors"))[name],
                               tensors[name] + offset, rtol=1e-6)
  rc, _, err = _convert(capsys, "--to-hf", "--workdir", str(work), "--out",
                        str(tmp_path / "o7"), "--step", "7")
  assert rc == 2 and "--step=7 has no checkpoint" in err and "saved steps: [0, 5]" in err
  # Bytes changed inside step 5's largest array file: --step 5 is refused in one line,
  # nothing written; without --step the newest that reads, 0, is exported, with a warning
  # (as decode and eval fall back; until 2026-12-04 it was refused too).
  data = [os.path.join(r, f) for r, _, fs in os.walk(work / "checkpoints" / "5" / "params")
          for f in fs if f"{os.sep}d{os.sep}" in os.path.join(r, f)]
  biggest = max(data, key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.seek(os.path.getsize(biggest) // 2)
    chunk = f.read(8)
    f.seek(-len(chunk), os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in chunk))
  rc, _, err = _convert(capsys, "--to-hf", "--workdir", str(work), "--out", str(tmp_path / "o5"),
                        "--step", "5")
  assert rc == 2 and "Traceback" not in err and err.count("\n") == 1, err
  # Where the flipped bytes land in the file (its arrays' order varies with the save) decides
  # who notices: attnlab's checksum (the values read back differ) or the compressed chunk's
  # own decoder (a CI run of 2026-12-06 22:35 hit "ZSTD_decompressStream() failed"); either
  # way the step is named as not restorable, in one line.
  assert "checkpoints/5 could not be restored (" in err, err
  assert ("reads other values than were saved" in err if "CorruptCheckpointError: " in err
          else "Data corruption detected" in err), err
  assert not (tmp_path / "o5").exists()
  rc, printed, err = _convert(capsys, "--to-hf", "--workdir", str(work), "--out",
                              str(tmp_path / "o0"))
  assert rc == 0 and json.loads(printed)["step"] == 0, err
  np.testing.assert_allclose(load_file(str(tmp_path / "o0" / "model.safetensors"))[name],
                             tensors[name], rtol=1e-6)
  assert [m for m in warned() if "checkpoints/5 could not be restored" in m]
  # --max_shard_mb 1 with a 8192-token vocabulary: the embedding alone is 1.5 MiB.
  big, bc, bt = _hf_dir(tmp_path, "llama_mqa_tied", vocab_size=8192)
  assert _convert(capsys, "--from-hf", big, "--workdir", str(tmp_path / "bw"))[0] == 0
  rc, printed, err = _convert(capsys, "--to-hf", "--workdir", str(tmp_path / "bw"), "--out",
                              str(tmp_path / "bo"), "--max_shard_mb", "1")
  assert rc == 0, err
  files = json.loads(printed)["files"]
  assert len(files) == 2  # the 1.5 MiB embedding alone, then the rest
  assert sorted(load_file(files[0])) == ["model.embed_tokens.weight"]
  index = json.loads((tmp_path / "bo" / "model.safetensors.index.json").read_text())
  assert sorted(index["weight_map"]) == sorted(bt)
  rc, printed, err = _convert(capsys, "--to-hf", "--workdir", str(tmp_path / "bw"), "--out",
                              str(tmp_path / "bo2"), "--max_shard_mb", "2")
  assert rc == 0 and len(json.loads(printed)["files"]) == 1, err


BAD_FLAGS = {
    "out_with_from": (["--from-hf", "SRC", "--workdir", "NEW", "--out", "X"],
                      "--out is only for --to-hf"),
    "step_with_from": (["--from-hf", "SRC", "--workdir", "NEW", "--step", "0"],
                       "--step is only for --to-hf"),
    # ignored, whatever its value, until 2026-12-06
    "shard_with_from": (["--from-hf", "SRC", "--workdir", "NEW", "--max_shard_mb", "-5"],
                        "--max_shard_mb is only for --to-hf"),
    "no_out": (["--to-hf", "--workdir", "WORK"], "--to-hf needs --out DIR"),
    "dtype_with_to": (["--to-hf", "--workdir", "WORK", "--out", "NEW", "--dtype", "float32"],
                      "--dtype is only for --from-hf (--to-hf keeps the checkpoint's)"),
    "shard_size": (["--to-hf", "--workdir", "WORK", "--out", "NEW", "--max_shard_mb", "0"],
                   "--max_shard_mb=0 must be a positive integer"),
    "workdir_exists": (["--from-hf", "SRC", "--workdir", "WORK"],
                       "--workdir WORK already exists; give a new directory"),
    "out_exists": (["--to-hf", "--workdir", "WORK", "--out", "SRC"],
                   "--out SRC already exists; give a new directory"),
    # A path under a file (named "its parent does not exist" until 2026-12-04; a missing
    # parent is made now).
    "under_a_file": (["--from-hf", "SRC", "--workdir", "FILE/deeper"],
                     "--workdir FILE/deeper: cannot make this directory (FILE is a file)"),
    "out_under_a_file": (["--to-hf", "--workdir", "WORK", "--out", "FILE/deeper"],
                         "--out FILE/deeper: cannot make this directory (FILE is a file)"),
    # Under or at a symbolic link to nothing (a FileExistsError traceback until 2026-12-05).
    "under_a_dangling_link": (["--from-hf", "SRC", "--workdir", "LINK/deeper"],
                              "--workdir LINK/deeper: cannot make this directory (LINK is a "
                              "symbolic link to GONE, which does not exist)"),
    "out_at_a_dangling_link": (["--to-hf", "--workdir", "WORK", "--out", "LINK"],
                               "--out LINK: cannot make this directory (LINK is a symbolic "
                               "link to GONE, which does not exist)"),
    "not_a_workdir": (["--to-hf", "--workdir", "SRC", "--out", "NEW"],
                      "SRC/config.gin does not exist: not a training workdir"),
    "no_source": (["--from-hf", "NEW", "--workdir", "NEW2"], "--from-hf NEW is not a directory"),
    "both_ways": (["--from-hf", "SRC", "--to-hf", "--workdir", "NEW"], "not allowed with"),
    "bad_config_gin": (["--to-hf", "--workdir", "BROKEN", "--out", "NEW"],
                       "Configurable 'ModelConfig' doesn't have a parameter named 'no_such_field'"),
    # A config.gin that no longer describes the checkpoint (was a traceback, exit 1).
    "edited_config_gin": (["--to-hf", "--workdir", "EDITED", "--out", "NEW"],
                          "params holds arrays of other shapes: "),
    # A tokenizer file that does not read: its own error, one line.
    "unreadable_tokenizer": (["--to-hf", "--workdir", "BADTOK", "--out", "NEW"],
                             "tokenizer_model='BADTOK/tokenizer.json' is not a readable "
                             "tokenizer.json: "),
}


def _copy_with_a_bad_tokenizer(work, dst) -> str:
  """``work`` naming a tokenizer.json beside it that is no tokenizer."""
  shutil.copytree(work, dst)
  (dst / "tokenizer.json").write_text("not json")
  path = os.path.join(dst, "config.gin")
  with open(path) as f:
    text = f.read()
  text = re.sub(r"DataConfig.tokenizer = .*", "DataConfig.tokenizer = 'hf_json'", text)
  text = re.sub(r"DataConfig.tokenizer_model = .*",
                f"DataConfig.tokenizer_model = '{dst / 'tokenizer.json'}'", text)
  with open(path, "w") as f:
    f.write(text)
  return str(dst)


def _edited_copy(work, dst) -> str:
  """``work`` with its config.gin's d_ff doubled: the checkpoint no longer fits."""
  shutil.copytree(work, dst)
  path = os.path.join(dst, "config.gin")
  with open(path) as f:
    text = f.read()
  d_ff = int(re.search(r"ModelConfig.d_ff = (\d+)", text).group(1))
  with open(path, "w") as f:
    f.write(text.replace(f"ModelConfig.d_ff = {d_ff}", f"ModelConfig.d_ff = {2 * d_ff}"))
  return str(dst)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(a transformers dir, the workdir converted from it)."""
  root = tmp_path_factory.mktemp("converted")
  c = FAMILY_CONFIGS["gpt2"]
  src = write_checkpoint(root / "src", c, random_tensors(shapes_of(c)))
  assert main(["convert", "--from-hf", src, "--workdir", str(root / "work")]) == 0
  return src, str(root / "work")


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flags_and_paths_exit_2_and_write_nothing(case, converted, tmp_path, capsys):
  src, work = converted
  argv, message = BAD_FLAGS[case]
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "config.gin").write_text("ModelConfig.no_such_field = 1\n")
  (tmp_path / "file").write_text("")
  (tmp_path / "link").symlink_to(tmp_path / "gone")
  subst = {"LINK/deeper": str(tmp_path / "link" / "deeper"), "LINK": str(tmp_path / "link"),
           "GONE": str(tmp_path / "gone"), "SRC": src, "WORK": work,
           "NEW": str(tmp_path / "new"), "BROKEN": str(broken),
           "NEW2": str(tmp_path / "new2"), "FILE/deeper": str(tmp_path / "file" / "deeper"),
           "FILE": str(tmp_path / "file")}
  if "EDITED" in argv:
    subst["EDITED"] = _edited_copy(work, tmp_path / "edited")
  if "BADTOK" in argv:
    subst["BADTOK"] = _copy_with_a_bad_tokenizer(work, tmp_path / "badtok")
  argv = [subst.get(a, a) for a in argv]
  for key in sorted(subst, key=len, reverse=True):
    message = message.replace(key, subst[key])
  before = {d: sorted(os.listdir(d)) for d in (tmp_path, src, work)}
  rc, out, err = _convert(capsys, *argv)
  assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
  assert message in err, err
  if case not in ("both_ways", "bad_config_gin", "edited_config_gin", "unreadable_tokenizer"):
    assert err == f"attnlab convert: error: {message}\n", err  # the whole line
  assert {d: sorted(os.listdir(d)) for d in before} == before


@pytest.mark.parametrize("make, what", [(os.mkdir, "a folder"), (os.mkfifo, "a FIFO")])
def test_a_workdirs_tokenizer_json_that_is_no_regular_file_is_one_line(converted, tmp_path,
                                                                        capsys, make, what):
  """A folder or a FIFO where the workdir's config.gin names tokenizer.json: decode, eval and
  the export each refuse it at once, naming it (until 2026-12-07 a FIFO made all three wait
  for a writer for good); the export writes nothing."""
  work = _copy_with_a_bad_tokenizer(converted[1], tmp_path / "work")
  path = os.path.join(work, "tokenizer.json")
  os.remove(path)
  make(path)
  message = (f"tokenizer_model={path!r} is {what}, not a regular file: give the "
             "tokenizer.json file itself")
  for argv in (["decode", "--workdir", work, "--prompt", "w1", "--max_new_tokens", "1"],
               ["eval", "--workdir", work],
               ["convert", "--to-hf", "--workdir", work, "--out", str(tmp_path / "back")]):
    capsys.readouterr()
    with released_after(30, path):
      rc = main(argv)
    out, err = capsys.readouterr()
    assert (rc, out, err) == (2, "", f"attnlab {argv[0]}: error: {message}\n"), argv
  assert sorted(os.listdir(tmp_path)) == ["work"]


@pytest.mark.parametrize("make, what", [(os.mkdir, "a folder"), (os.mkfifo, "a FIFO")])
def test_a_sources_tokenizer_json_that_is_no_regular_file_is_one_line(converted, tmp_path,
                                                                      capsys, make, what):
  """``convert --from-hf`` of a transformers folder whose tokenizer.json is a folder or a FIFO
  (or a dangling link): refused naming it, nothing written (until 2026-12-07 it was passed
  over and the workdir got the byte tokenizer, another vocabulary, without a word)."""
  src = shutil.copytree(converted[0], tmp_path / "src")
  path = os.path.join(src, "tokenizer.json")
  make(path)
  new = str(tmp_path / "new")
  with released_after(30, path):
    rc, out, err = _convert(capsys, "--from-hf", str(src), "--workdir", new)
  assert (rc, out, err) == (2, "", (
      f"attnlab convert: error: tokenizer_model={path!r} is {what}, not a regular file: give "
      "the tokenizer.json file itself\n"))
  os.remove(path) if what == "a FIFO" else os.rmdir(path)
  os.symlink(tmp_path / "gone", path)
  rc, out, err = _convert(capsys, "--from-hf", str(src), "--workdir", new)
  assert rc == 2 and out == "" and f"tokenizer_model={path!r} is not a readable" in err, err
  assert sorted(os.listdir(tmp_path)) == ["src"]


def test_empty_or_blank_paths_are_refused_by_name(converted, tmp_path, capsys, monkeypatch):
  """Run inside a workdir (a copy of one): until 2026-12-06 `convert --to-hf --workdir ""`
  exported the working directory's run, `convert-heads --from ""` converted it, `--workdir
  "  "` made a folder named two spaces and `--workdir ""` / `--out ""` were named as the
  working directory "already exists"; train, eval and decode refused them by name."""
  src, work = converted
  here = tmp_path / "here"
  shutil.copytree(work, here)
  monkeypatch.chdir(here)
  new = str(tmp_path / "new")
  cases = [
      (["convert", "--from-hf", src, "--workdir", "  "],
       "attnlab convert: error: --workdir '  ' is only whitespace: give a directory"),
      (["convert", "--from-hf", src, "--workdir", ""],
       "attnlab convert: error: --workdir is empty: give a directory"),
      (["convert", "--from-hf", " ", "--workdir", new],
       "attnlab convert: error: --from-hf ' ' is only whitespace: give a directory"),
      (["convert", "--to-hf", "--workdir", "", "--out", new],
       "attnlab convert: error: --workdir '' is empty: give a training workdir"),
      (["convert", "--to-hf", "--workdir", work, "--out", ""],
       "attnlab convert: error: --out is empty: give a directory"),
      (["convert-heads", "--from", "", "--to", new, "--num_kv_heads", "1", "--method", "mean"],
       "attnlab convert-heads: error: --from '' is empty: give a training workdir"),
  ]
  before = sorted(os.listdir(here)), sorted(os.listdir(tmp_path))
  for argv, message in cases:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err == message + "\n", (argv, err)
    assert (sorted(os.listdir(here)), sorted(os.listdir(tmp_path))) == before, argv


def test_a_failure_while_writing_leaves_no_output_and_no_temporary_folder(tmp_path, capsys,
                                                                            monkeypatch):
  from attnlab.commands import convert

  src, _, _ = _hf_dir(tmp_path, "mistral")
  real = convert._write_config

  def fail_after_writing(tmp, *args):
    real(tmp, *args)
    assert sorted(os.listdir(tmp)) == ["checkpoints", "config.gin"]  # half there
    raise OSError("disk full")

  monkeypatch.setattr(convert, "_write_config", fail_after_writing)
  with pytest.raises(OSError, match="disk full"):  # the parents made for it go too
    main(["convert", "--from-hf", src, "--workdir", str(tmp_path / "runs" / "a" / "out")])
  assert sorted(os.listdir(tmp_path)) == [os.path.basename(src)]
  monkeypatch.undo()
  # Missing parents are made (the README's `--workdir runs/llama` in a fresh folder was
  # refused until 2026-12-04).
  work = tmp_path / "runs" / "work"
  assert main(["convert", "--from-hf", src, "--workdir", str(work)]) == 0
  real_write = hf.write_params

  def fail_writing(*args, **kwargs):
    real_write(*args, **kwargs)
    raise OSError("disk full")

  monkeypatch.setattr(hf, "write_params", fail_writing)
  with pytest.raises(OSError, match="disk full"):
    main(["convert", "--to-hf", "--workdir", str(work), "--out",
          str(tmp_path / "exports" / "back")])
  assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(src), "runs"])
  assert sorted(os.listdir(tmp_path / "runs")) == ["work"]
  monkeypatch.undo()
  assert main(["convert", "--to-hf", "--workdir", str(work), "--out",
               str(tmp_path / "exports" / "back")]) == 0
  assert (tmp_path / "exports" / "back" / "config.json").is_file()


def _modes(root) -> dict[str, int]:
  """{path under ``root`` (``root`` itself "."): its permission bits}."""
  out = {".": os.stat(root).st_mode & 0o777}
  for folder, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(folder, name)
      out[os.path.relpath(path, root)] = os.stat(path).st_mode & 0o777
  return out


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_output_folders_and_files_get_the_modes_of_the_process_umask(umask, tmp_path,
                                                                         capsys):
  """Every folder and file ``convert --from-hf`` and ``--to-hf`` make has the mode a plain
  mkdir / open gives under the process umask (0755 / 0644 under 022), so colleagues on a
  shared filesystem read them. Until 2026-12-07 the output folder was mkdtemp's (0700,
  whatever the umask) and model.safetensors safetensors' (0600)."""
  src, _, _ = _hf_dir(tmp_path, "gpt2")
  work, back = tmp_path / "runs" / "work", tmp_path / "exports" / "back"
  before = os.umask(umask)
  try:
    assert main(["convert", "--from-hf", src, "--workdir", str(work)]) == 0
    assert main(["convert", "--to-hf", "--workdir", str(work), "--out", str(back)]) == 0
  finally:
    os.umask(before)
  for root in (work, back):
    modes = _modes(root)
    assert "model.safetensors" in modes or root == work
    wrong = {path: oct(mode) for path, mode in modes.items()
             if mode != (0o777 if os.path.isdir(os.path.join(root, path)) else 0o666) & ~umask}
    assert not wrong, (root, wrong)
  for folder in (tmp_path / "runs", tmp_path / "exports"):  # the parents made for them
    assert os.stat(folder).st_mode & 0o777 == 0o777 & ~umask


def test_a_filesystem_that_refuses_chmod_still_converts(tmp_path, capsys, monkeypatch):
  """Where chmod is refused (some FUSE or SMB mounts), the modes stay as made and the
  conversion goes on (a review: the mode change of 2026-12-07 failed the conversion
  there)."""
  src, _, _ = _hf_dir(tmp_path, "gpt2")

  def refused(path, mode, **kw):
    raise PermissionError(1, "Operation not permitted", str(path))

  monkeypatch.setattr(os, "chmod", refused)
  work = tmp_path / "work"
  assert main(["convert", "--from-hf", src, "--workdir", str(work)]) == 0
  assert main(["convert", "--to-hf", "--workdir", str(work), "--out", str(tmp_path / "b")]) == 0
  assert (tmp_path / "b" / "model.safetensors").is_file()


def test_a_missing_optional_package_is_named(tmp_path, capsys, monkeypatch):
  import sys

  src, _, _ = _hf_dir(tmp_path, "qwen2")
  monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors now fails
  rc, out, err = _convert(capsys, "--from-hf", src, "--workdir", str(tmp_path / "w"))
  assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert ("(attnlab convert needs safetensors, in the hf extra, and for a tokenizer.json "
          "tokenizers, in the tokenizers extra)") in err
  assert not (tmp_path / "w").exists()


def test_convert_heads_of_a_workdir_its_config_gin_no_longer_describes(converted, tmp_path,
                                                                        capsys):
  """One line naming the first array that does not fit, exit 2, nothing written (was a
  CheckpointMismatchError traceback, exit 1)."""
  edited = _edited_copy(converted[1], tmp_path / "edited")
  rc, out, err = _convert_heads(capsys, "--from", edited, "--to", str(tmp_path / "mqa"),
                                "--num_kv_heads", "1", "--method", "mean")
  assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
  assert "params holds arrays of other shapes: " in err, err
  assert not (tmp_path / "mqa").exists()


@pytest.mark.parametrize("make, what", [
    (lambda p: open(p, "w").close(), "is not a readable tokenizer.json: EOF while parsing"),
    (os.mkfifo, "is a FIFO, not a regular file: give the tokenizer.json file itself")],
    ids=["empty", "fifo"])
def test_convert_heads_of_a_workdir_whose_tokenizer_json_would_not_read(converted, tmp_path,
                                                                        capsys, make, what):
  """An empty tokenizer.json (or a FIFO in its place) in the source workdir: one line naming
  it, exit 2, nothing written (until 2026-12-07 the empty file was copied into the new run,
  whose decode then failed, and the new config.gin named the FIFO in the source)."""
  work = _copy_with_a_bad_tokenizer(converted[1], tmp_path / "work")
  path = os.path.join(work, "tokenizer.json")
  os.remove(path)
  make(path)
  with released_after(30, path):
    rc, out, err = _convert_heads(capsys, "--from", work, "--to", str(tmp_path / "mqa"),
                                  "--num_kv_heads", "1", "--method", "mean")
  assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
  assert err.startswith(f"attnlab convert-heads: error: tokenizer_model={path!r} {what}"), err
  assert err.endswith(f" (the tokenizer of --from {work}, which the new run gets a copy of)\n")
  assert sorted(os.listdir(tmp_path)) == ["work"]


def test_filled_params_names_a_missing_mismatched_or_extra_parameter():
  """``filled_params`` (what the import saves, and the test checkpoints' builder) takes
  every parameter with the model's shape and dtype, consuming the dict; a parameter no
  rule fills, one of another shape or dtype, or one the model lacks is named."""
  from flax import nnx

  from attnlab.commands.convert import filled_params

  mcfg = attnlab.ModelConfig(vocab_size=16, d_model=8, num_heads=2, num_layers=1, d_ff=16,
                             max_len=8)
  abstract = nnx.state(nnx.eval_shape(lambda: attnlab.build_model(mcfg, rngs=nnx.Rngs(0))),
                       nnx.Param)
  full = {tuple(p): np.full(v.shape, i, v.dtype)
          for i, (p, v) in enumerate(nnx.to_flat_state(abstract))}
  given = dict(full)
  state, n = filled_params(mcfg, given)
  assert given == {} and n == sum(x.size for x in full.values())
  for p, v in nnx.to_flat_state(state):
    np.testing.assert_array_equal(np.asarray(v.get_value()), full[tuple(p)])
  first = next(iter(full))
  name, shape = "/".join(map(str, first)), full[first].shape
  cases = [
      ({k: v for k, v in full.items() if k != first}, f"no rule fills the parameter {name}"),
      ({**full, first: full[first].astype(np.float16)},
       f"parameter {name}: {shape} float16, the model has {shape} float32"),
      ({**full, first: np.zeros((*shape, 1), np.float32)},
       f"parameter {name}: {(*shape, 1)} float32, the model has {shape} float32"),
      ({**full, **{("extra", c): np.zeros(1, np.float32) for c in "dcba"}},  # the first 3
       "rules fill parameters the model lacks: [('extra', 'a'), ('extra', 'b'), ('extra', "
       "'c')]")]
  for params, message in cases:
    with pytest.raises(AssertionError) as e:
      filled_params(mcfg, params)
    assert str(e.value) == message
