"""``attnlab convert --from-hf / --to-hf`` against transformers itself.

Random-weight transformers models (Llama with 1, 2 and 4 KV heads and
non-default rope_theta, Mistral with a sliding window shorter than the
sequence, Qwen2, GPT-2; tied and untied) are saved with save_pretrained and
converted with the CLI. Checked: logits over a padded batch, greedy
generation with every cache kind, round trips in both directions, a
tokenizer.json trained here, fine-tuning from a converted workdir, and the
documented errors (exit 2, nothing written).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from flax import nnx  # noqa: E402

import attnlab  # noqa: E402
from attnlab.cli import main  # noqa: E402

transformers.utils.logging.disable_progress_bar()

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128, bos_token_id=1,
             eos_token_id=2, initializer_range=0.1)
HF_CONFIGS = {
    "llama_kv1": lambda: transformers.LlamaConfig(
        **SMALL, num_key_value_heads=1, rope_theta=500.0, tie_word_embeddings=False),
    "llama_kv2": lambda: transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, rope_theta=20000.0, tie_word_embeddings=True),
    "llama_kv4": lambda: transformers.LlamaConfig(
        **SMALL, num_key_value_heads=4, rope_theta=1000.0, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True),
    "mistral": lambda: transformers.MistralConfig(
        **SMALL, num_key_value_heads=2, sliding_window=6, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1,
        eos_token_id=2, initializer_range=0.1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}
NEW_TOKENS = 32


def _hf_model(name: str, seed: int = 0):
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[name]())
  # Random norm weights and biases too (the init leaves them at 1 / 0).
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  return model.float().eval()


def _convert(argv, capsys=None):
  rc = main(["convert", *argv])
  if capsys is not None:
    out, err = capsys.readouterr()
    return rc, out, err
  return rc


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """{name: (hf model, hf dir, converted attnlab workdir)}."""
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for name in HF_CONFIGS:
    model = _hf_model(name)
    hf_dir, workdir = root / name, root / f"{name}_attnlab"
    model.save_pretrained(hf_dir)
    assert _convert(["--from-hf", str(hf_dir), "--workdir", str(workdir)]) == 0
    out[name] = (model, str(hf_dir), str(workdir))
  return out


def _hf_logits(model, tokens_BT, mask_BT=None):
  with torch.no_grad():
    kw = {} if mask_BT is None else {"attention_mask": torch.tensor(mask_BT)}
    return model(torch.tensor(tokens_BT), **kw).logits.numpy()


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_match_transformers_on_a_padded_batch(models, name):
  hf_model, _, workdir = models[name]
  model, cfg = attnlab.load_checkpoint(workdir)
  assert cfg.vocab_size == 100
  rng = np.random.default_rng(1)
  lengths = np.array([20, 13, 7])
  tokens = rng.integers(3, 100, (3, 20))
  mask = (np.arange(20)[None, :] < lengths[:, None]).astype(np.int64)
  tokens = np.where(mask == 1, tokens, cfg.pad_id)
  want = _hf_logits(hf_model, tokens, mask)
  got = np.asarray(nnx.jit(lambda m, t, s: m(t, segment_ids_BT=s))(
      model, tokens, mask.astype(np.int32)))
  assert np.abs(want).max() > 1.0  # the weights are large enough for a meaningful check
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(got[b, :n], want[b, :n], atol=1e-4, rtol=0)


def _hf_greedy(model, prompt):
  model.generation_config.eos_token_id = None  # attnlab's side runs eos_id=None too
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0)
  return out[0, len(prompt):].numpy()


# Every family and every cache kind; each case compiles a generation loop (~5 s
# of CPU), so not every pair. llama_kv2 generates through `attnlab decode` below.
GENERATION_CASES = [("llama_kv1", "contiguous"), ("qwen2", "paged"), ("gpt2", "paged"),
                    ("mistral", "contiguous"), ("mistral", "ring"), ("mistral", "paged")]


@pytest.mark.parametrize("name,cache", GENERATION_CASES)
def test_greedy_generation_matches_transformers(models, name, cache):
  hf_model, _, workdir = models[name]
  model, cfg = attnlab.load_checkpoint(workdir)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(3, 100, 9).tolist(), rng.integers(3, 100, 4).tolist()]
  prompt_BT = np.full((2, 9), cfg.pad_id, np.int32)
  for b, p in enumerate(prompts):
    prompt_BT[b, :len(p)] = p
  got = np.asarray(attnlab.generate(model, prompt_BT, prompt_lengths_B=np.array([9, 4]),
                                    max_new_tokens=NEW_TOKENS, cache=cache, eos_id=None,
                                    page_size=4, rng=jax.random.key(0)))
  for b, p in enumerate(prompts):
    np.testing.assert_array_equal(got[b], _hf_greedy(hf_model, p), err_msg=f"prompt {b}")


def _flat_params(workdir):
  """{parameter path: array} of a workdir's latest checkpoint."""
  from attnlab import config_gin as gin_config
  from attnlab.commands.convert import _restore_weights

  cfg, _, _ = gin_config.read_workdir_config(os.path.join(workdir, "config.gin"))
  params, _ = _restore_weights(workdir, cfg, None)
  return {path: np.asarray(v) for path, v in params.items()}


@pytest.mark.parametrize("name", ["llama_kv1", "mistral", "qwen2", "gpt2"])
def test_hf_to_attnlab_to_hf_keeps_weights_and_logits(models, name, tmp_path):
  hf_model, _, workdir = models[name]
  out = tmp_path / "back"
  assert _convert(["--to-hf", "--workdir", workdir, "--out", str(out)]) == 0
  back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  assert type(back) is type(hf_model)
  want, got = hf_model.state_dict(), back.state_dict()
  for key, value in want.items():
    torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
  tokens = np.random.default_rng(3).integers(0, 100, (2, 16))
  np.testing.assert_array_equal(_hf_logits(back, tokens), _hf_logits(hf_model, tokens))


def _attnlab_workdir(path, cfg: attnlab.ModelConfig, seed: int) -> str:
  """A workdir holding a randomly initialized attnlab model (weights-only checkpoint)."""
  from flax import nnx

  from attnlab import config_gin as gin_config
  from attnlab.commands.convert import finetune_train_config
  from attnlab.config import DataConfig
  from attnlab.training.checkpoint import Checkpointer

  # Random values everywhere (norms and biases too, so a swapped or dropped one
  # shows), drawn with numpy into the abstract model: no initialization.
  rng = np.random.default_rng(seed)
  state = nnx.state(nnx.eval_shape(lambda: attnlab.build_model(cfg, rngs=nnx.Rngs(0))),
                    nnx.Param)
  for _, var in nnx.to_flat_state(state):
    var.set_value((0.2 * rng.standard_normal(var.shape)).astype(np.float32))
  os.makedirs(path)
  ckpt = Checkpointer(str(path))
  ckpt.save_params(0, state)
  ckpt.close()
  with open(os.path.join(path, "config.gin"), "w") as f:
    f.write(gin_config.operative_config(cfg, DataConfig(), finetune_train_config()))
  return str(path)


BASE = dict(vocab_size=100, d_model=64, num_layers=2, num_heads=4, d_ff=128, max_len=128)
ATTNLAB_CONFIGS = {
    "gqa_untied_biases": dict(num_kv_heads=2, rope_theta=3000.0, tie_embeddings=False,
                              use_bias=True, norm_eps=1e-5),
    "mqa_head_dim": dict(num_kv_heads=1, head_dim=8, window=5),
    "qkv_bias": dict(num_kv_heads=2, qkv_bias=True),
    "gpt2_like": dict(pos="learned", norm="layernorm", mlp="gelu", use_bias=True),
    # head_dim 16 = floor(66 / 4), yet 4 x 16 != 66: explicit (the import refused it as
    # "d_model=66 must be divisible by num_heads=4" until 2026-12-06)
    "head_dim_floor": dict(d_model=66, num_kv_heads=2, head_dim=16),
}
# The transformers models above already check the other layouts' logits; these
# combinations (MQA, head_dim != d_model / num_heads, a window; a d_model no multiple of
# the heads) are new here.
CHECK_LOGITS = ("mqa_head_dim", "head_dim_floor")


@pytest.mark.parametrize("name", list(ATTNLAB_CONFIGS))
def test_attnlab_to_hf_to_attnlab_is_bitwise(name, tmp_path):
  cfg = attnlab.ModelConfig(**{**BASE, **ATTNLAB_CONFIGS[name]})
  src = _attnlab_workdir(tmp_path / "src", cfg, seed=4)
  hf_dir, again = tmp_path / "hf", tmp_path / "again"
  assert _convert(["--to-hf", "--workdir", src, "--out", str(hf_dir)]) == 0
  assert _convert(["--from-hf", str(hf_dir), "--workdir", str(again)]) == 0
  want, got = _flat_params(src), _flat_params(again)
  assert want.keys() == got.keys()
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
  _, cfg_again = attnlab.load_checkpoint(again)
  for field in ("d_model", "num_heads", "head_dim", "window", "rope_theta", "norm_eps", "pos",
                "mlp", "norm", "tie_embeddings", "max_len"):
    assert getattr(cfg_again, field) == getattr(cfg, field), field
  if name not in CHECK_LOGITS:
    return
  # transformers computes what attnlab computes: the export is right, not only reversible.
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
  model, _ = attnlab.load_checkpoint(src)
  tokens = np.random.default_rng(5).integers(0, 100, (2, 12))
  np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens)),
                             _hf_logits(hf_model, tokens),
                             atol=1e-4, rtol=0)


@pytest.mark.parametrize("family,heads", [("llama", 4), ("mistral", 16), ("qwen2", 32)])
@pytest.mark.parametrize("leave_out", [(), ("num_key_value_heads", "max_position_embeddings",
                                            "sliding_window", "rope_theta", "rms_norm_eps",
                                            "tie_word_embeddings", "head_dim"), "null"])
def test_a_config_json_means_what_it_means_to_transformers(family, heads, leave_out):
  """Keys a hand-written config.json leaves out take transformers' own class defaults,
  which differ by family (until 2026-12-04 a Mistral config without sliding_window was read
  as full attention, transformers' is 4096, and without num_key_value_heads as MHA, its 8);
  an explicit null num_key_value_heads is MHA, a null sliding_window none (a null read as
  missing gave Mistral 8 KV heads); keys given are read as given."""
  from attnlab.convert import hf

  given = dict(model_type=family, vocab_size=64, hidden_size=heads * 8,
               num_attention_heads=heads, num_hidden_layers=1, intermediate_size=48,
               num_key_value_heads=heads // 4, max_position_embeddings=96, rope_theta=500.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, head_dim=8)
  if family == "mistral":
    given["sliding_window"] = 7
  null = leave_out == "null"
  if null:
    given.update(num_key_value_heads=None, sliding_window=None)
    leave_out = () if family == "mistral" else ("sliding_window",)
  config = {k: v for k, v in given.items() if k not in leave_out}
  if family == "mistral" and null:
    # transformers 5 refuses it for Mistral alone (a strict int field); its Llama, Qwen2 and
    # earlier Mistral read null as num_attention_heads, as attnlab does.
    _, ours = hf.from_hf_config(config)
    assert (ours.num_kv_heads, ours.window) == (heads, None)
    config["num_key_value_heads"] = heads
  theirs = transformers.AutoConfig.for_model(**config)
  _, ours = hf.from_hf_config(config)
  window = getattr(theirs, "sliding_window", None) if family == "mistral" else None
  assert (ours.num_heads, ours.num_kv_heads, ours.max_len, ours.window, ours.norm_eps,
          ours.tie_embeddings, ours.head_dim or ours.d_model // ours.num_heads) == (
      theirs.num_attention_heads, theirs.num_key_value_heads, theirs.max_position_embeddings,
      window, theirs.rms_norm_eps, theirs.tie_word_embeddings,
      getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
  assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
  if not leave_out:  # as given
    kv_heads = heads if null else heads // 4
    assert (ours.num_kv_heads, ours.max_len, ours.rope_theta) == (kv_heads, 96, 500.0)


def test_sharded_checkpoints_read_and_write(models, tmp_path):
  from attnlab.commands.convert import _restore_weights
  from attnlab.convert import hf

  hf_model, _, workdir = models["llama_kv2"]
  sharded = tmp_path / "sharded"
  hf_model.save_pretrained(sharded, max_shard_size="40KB")
  assert (sharded / "model.safetensors.index.json").exists()
  assert _convert(["--from-hf", str(sharded), "--workdir", str(tmp_path / "w")]) == 0
  want, got = _flat_params(workdir), _flat_params(str(tmp_path / "w"))
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
  # Writing shards: an index and several files that transformers loads.
  _, cfg = attnlab.load_checkpoint(workdir)
  params, _ = _restore_weights(workdir, cfg, None)
  out = tmp_path / "out"
  out.mkdir()
  files = hf.write_params(hf.weight_rules("llama", cfg), params, str(out),
                          max_shard_bytes=40_000)
  assert len(files) > 2 and (out / "model.safetensors.index.json").exists()
  with open(out / "config.json", "w") as f:
    json.dump(hf.to_hf_config(cfg, bos_id=1, eos_id=2), f)
  back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  tokens = np.random.default_rng(6).integers(0, 100, (1, 10))
  np.testing.assert_array_equal(_hf_logits(back, tokens), _hf_logits(hf_model, tokens))


# --------------------------------------------------------------------------- tokenizer


TEXT = ("the quick brown fox jumps over the lazy dog. " * 3 +
        "attention is all you need; heads share keys and values. " * 3).split(". ")


@pytest.fixture(scope="module")
def with_tokenizer(models, tmp_path_factory):
  """The llama_kv2 checkpoint plus a BPE tokenizer.json trained here (100 tokens)."""
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import models as tmodels
  from tokenizers import pre_tokenizers, processors, trainers

  tok = tokenizers.Tokenizer(tmodels.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())[:40])
  tok.train_from_iterator(TEXT, trainer)
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  assert tok.get_vocab_size() <= 100 and tok.token_to_id("</s>") == 2
  hf_model, hf_dir, _ = models["llama_kv2"]
  root = tmp_path_factory.mktemp("tok")
  src = root / "llama_tok"
  hf_model.save_pretrained(src)
  tok.save(str(src / "tokenizer.json"))
  workdir = root / "w"
  assert _convert(["--from-hf", str(src), "--workdir", str(workdir)]) == 0
  return hf_model, tok, str(workdir)


def test_decode_prompt_uses_the_tokenizer_json(with_tokenizer, capsys):
  from attnlab import config_gin as gin_config
  from attnlab.data.tokenizer import make_tokenizer

  hf_model, tok, workdir = with_tokenizer
  _, dcfg, _ = gin_config.read_workdir_config(os.path.join(workdir, "config.gin"))
  assert (dcfg.tokenizer, dcfg.bos_id, dcfg.eos_id) == ("hf_json", 1, 2)
  assert dcfg.tokenizer_model == os.path.join(workdir, "tokenizer.json")
  prompt = "the lazy fox shares keys"
  ours = make_tokenizer(dcfg.tokenizer, dcfg.tokenizer_model, bos_id=1, eos_id=2)
  ids = tok.encode(prompt).ids
  assert ids[0] == 1 and ours.encode(prompt).tolist() == ids
  rc, out, err = _convert_decode(workdir, prompt, capsys)
  assert rc == 0, err
  # The whole path: transformers' own greedy continuation, detokenized up to eos.
  hf_model.generation_config.eos_token_id = 2
  with torch.no_grad():
    cont = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             pad_token_id=0)[0, len(ids):].tolist()
  cont = cont[:cont.index(2)] if 2 in cont else cont
  assert out.rstrip("\n") == tok.decode(cont, skip_special_tokens=True)
  assert out.strip()  # it printed text


def _convert_decode(workdir, prompt, capsys):
  rc = main(["decode", "--workdir", workdir, "--prompt", prompt, "--max_new_tokens", "12"])
  out, err = capsys.readouterr()
  return rc, out, err


def test_finetune_and_eval_start_from_the_converted_weights(with_tokenizer, tmp_path, capsys):
  _, _, workdir = with_tokenizer
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(". ".join(TEXT * 8))
  before = _flat_params(workdir)
  rc = main(["train", "--gin_file", os.path.join(workdir, "config.gin"), "--workdir", workdir,
             f"--gin.DataConfig.paths=('{corpus}',)", "--gin.DataConfig.validation_percent=0",
             "--gin.DataConfig.seq_len=16", "--gin.DataConfig.batch_size=2",
             "--gin.TrainConfig.steps=2", "--gin.TrainConfig.progress=False",
             "--gin.TrainConfig.log_every=1"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert json.loads(out.splitlines()[-1])["step"] == 2
  after = _flat_params(workdir)  # the step-2 checkpoint
  moved = max(float(np.abs(after[p] - before[p]).max()) for p in before)
  # A few steps at lr <= 2e-5 move the converted weights a little (AdamW steps
  # are about lr each); a restart from a random init would move them by ~0.1.
  assert 0 < moved < 1e-3
  # The rewritten config.gin still names its tokenizer relative to the workdir.
  with open(os.path.join(workdir, "config.gin"), encoding="utf-8") as f:
    assert "DataConfig.tokenizer_model = 'tokenizer.json'" in f.read()


def _decode_without(gone: str, workdir: str, capsys) -> str:
  """What ``attnlab decode --workdir workdir`` prints while ``gone`` is renamed away."""
  os.rename(gone, gone + ".away")
  try:
    rc, out, err = _convert_decode(workdir, "the lazy fox", capsys)
  finally:
    os.rename(gone + ".away", gone)
  assert rc == 0, err
  return out


def test_a_converted_workdir_can_move(with_tokenizer, tmp_path, monkeypatch, capsys):
  """config.gin names the tokenizer.json beside it relatively: a copy of the workdir
  elsewhere decodes with its own tokenizer, from any working directory, with the
  original gone (renamed for the test)."""
  import shutil

  from attnlab import config_gin as gin_config

  _, tok, workdir = with_tokenizer
  with open(os.path.join(workdir, "config.gin"), encoding="utf-8") as f:
    assert "DataConfig.tokenizer_model = 'tokenizer.json'" in f.read()
  moved = str(tmp_path / "moved")
  shutil.copytree(workdir, moved)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  _, dcfg, _ = gin_config.read_workdir_config(os.path.join(moved, "config.gin"))
  assert dcfg.tokenizer_model == os.path.join(moved, "tokenizer.json")
  assert _decode_without(workdir, moved, capsys).strip()
  # A convert-heads run made from it holds its own copy of the tokenizer, named relatively.
  mqa = str(tmp_path / "mqa")
  assert main(["convert-heads", "--from", moved, "--to", mqa, "--num_kv_heads", "1",
               "--method", "mean"]) == 0
  capsys.readouterr()
  with open(os.path.join(mqa, "config.gin"), encoding="utf-8") as f:
    assert "DataConfig.tokenizer_model = 'tokenizer.json'" in f.read()
  with open(os.path.join(mqa, "tokenizer.json"), "rb") as a, \
       open(os.path.join(moved, "tokenizer.json"), "rb") as b:
    assert a.read() == b.read()
  assert _decode_without(moved, mqa, capsys).strip()
  # Next to the config file wins over the working directory (a hub snapshot folder with a
  # tokenizer.json of its own; it was the other way until 2026-12-04).
  (elsewhere / "tokenizer.json").write_text("{}")
  _, dcfg, _ = gin_config.read_workdir_config(os.path.join(moved, "config.gin"))
  assert dcfg.tokenizer_model == os.path.join(moved, "tokenizer.json")
  assert _decode_without(workdir, moved, capsys).strip()


# --------------------------------------------------------------------------- errors


def _tiny_llama_dir(path, **config_changes):
  model = _hf_model("llama_kv1")
  model.save_pretrained(path)
  if config_changes:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config_changes)
    cfg_path.write_text(json.dumps(cfg))
  return model


def _rewrite_tensors(path, change):
  from safetensors.torch import load_file, save_file

  tensors = load_file(path / "model.safetensors")
  change(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


BAD_INPUTS = {
    "no_config": (lambda p: (p.mkdir(), (p / "model.safetensors").write_bytes(b"")),
                  "config.json does not exist"),
    "model_type": (lambda p: _tiny_llama_dir(p, model_type="gpt_neox"),
                   "model_type='gpt_neox' is not supported"),
    "rope_scaling": (lambda p: _tiny_llama_dir(p, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}),
                     "rope_parameters.rope_type='llama3' is not supported"),
    "hidden_act": (lambda p: _tiny_llama_dir(p, hidden_act="gelu"),
                   "hidden_act='gelu' is not supported"),
    "wrong_shape": (lambda p: (_tiny_llama_dir(p), _rewrite_tensors(p, lambda t: t.update({
        "model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 64)}))),
                    "tensor model.layers.1.self_attn.k_proj.weight has shape [32, 64], "
                    "expected [16, 64]"),
    "missing": (lambda p: (_tiny_llama_dir(p), _rewrite_tensors(
        p, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))),
                "tensor model.layers.0.mlp.up_proj.weight is missing"),
    "extra": (lambda p: (_tiny_llama_dir(p), _rewrite_tensors(p, lambda t: t.update({
        "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))),
              "tensor model.layers.0.self_attn.q_norm.weight has no place"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_problem_and_writes_nothing(case, tmp_path, capsys):
  make, needle = BAD_INPUTS[case]
  src = tmp_path / "src"
  make(src)
  before = sorted(os.listdir(tmp_path))
  capsys.readouterr()
  rc, out, err = _convert(["--from-hf", str(src), "--workdir", str(tmp_path / "out")], capsys)
  assert rc == 2 and needle in err, err
  assert len(err.strip().splitlines()) == 1 and out == ""
  assert sorted(os.listdir(tmp_path)) == before  # no OUT, no temporary folder


def test_failure_while_writing_leaves_no_workdir(tmp_path, monkeypatch, capsys):
  from attnlab.commands import convert

  src = tmp_path / "src"
  _tiny_llama_dir(src)
  real = convert._write_config

  def fail_after_writing(tmp, *args):
    real(tmp, *args)
    assert os.listdir(tmp)  # the checkpoint and config.gin are half there
    raise OSError("disk full")

  monkeypatch.setattr(convert, "_write_config", fail_after_writing)
  with pytest.raises(OSError, match="disk full"):
    main(["convert", "--from-hf", str(src), "--workdir", str(tmp_path / "out")])
  assert sorted(os.listdir(tmp_path)) == ["src"]


def test_export_refuses_a_model_without_a_transformers_layout(tmp_path, capsys):
  cfg = attnlab.ModelConfig(**BASE, pos="sinusoidal")
  src = _attnlab_workdir(tmp_path / "src", cfg, seed=0)
  rc, _, err = _convert(["--to-hf", "--workdir", src, "--out", str(tmp_path / "hf")], capsys)
  assert rc == 2 and "ModelConfig.pos='sinusoidal'" in err
  assert not (tmp_path / "hf").exists()
  rc, _, err = _convert(["--to-hf", "--workdir", src, "--out", src], capsys)
  assert rc == 2 and "already exists" in err


def test_export_of_a_step_that_was_not_saved_lists_the_saved_ones(tmp_path, capsys):
  src = _attnlab_workdir(tmp_path / "src", attnlab.ModelConfig(**BASE), seed=0)
  rc, out, err = _convert(["--to-hf", "--workdir", src, "--step", "7", "--out",
                           str(tmp_path / "hf")], capsys)
  assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert "--step=7 has no checkpoint" in err and "saved steps: [0]" in err, err
  assert not (tmp_path / "hf").exists()


def test_convert_heads_of_a_weights_only_checkpoint_starts_its_data_at_batch_0(tmp_path):
  """A converted (weights-only) checkpoint has no data position: the MQA run made
  from it by convert-heads starts reading at batch 0, and its logits keep the
  mean-pooled model's."""
  from attnlab.training.checkpoint import Checkpointer

  src = _attnlab_workdir(tmp_path / "src", attnlab.ModelConfig(**BASE), seed=1)
  dst = str(tmp_path / "mqa")
  assert main(["convert-heads", "--from", src, "--to", dst, "--num_kv_heads", "1",
               "--method", "mean"]) == 0
  ckpt = Checkpointer(dst)
  try:
    state = ckpt.restore_data(0)
    assert ckpt.steps() == [0] and (state["index"], state["example"]) == (0, 0)
  finally:
    ckpt.close()
  model, cfg = attnlab.load_checkpoint(src)
  converted, new_cfg = attnlab.load_checkpoint(dst)
  assert new_cfg.num_kv_heads == 1 and cfg.num_kv_heads == 4
  tokens = jax.numpy.arange(12).reshape(1, 12) % 100
  run = nnx.jit(lambda m, t: m(t))
  want = run(attnlab.convert_heads(model, 1, "mean"), tokens)
  np.testing.assert_allclose(run(converted, tokens), want, rtol=1e-5, atol=1e-5)
