"""``attnlab decode`` / ``attnlab kv-size`` and generate's input checks."""

from __future__ import annotations

import io
import os
import re
import sys

import jax
import numpy as np
import pytest

import attnlab
from attnlab.cli import main
from attnlab.commands import decode as decode_command
from attnlab.data.tokenizer import ByteTokenizer, HFJsonTokenizer
from attnlab.decoding.generate import GenerateInputError
from tests.decoding.tiny_models import decoder_model, encdec_model, random_tokens
from tests.streams import MinimalStream


def _run(argv, capsys):
  rc = main(argv)
  out, err = capsys.readouterr()
  return rc, out, err


@pytest.mark.parametrize("kv_heads,want", [(8, "1.00 GiB"), (64, "8.00 GiB")])
def test_kv_size_worked_examples(kv_heads, want, capsys):
  rc, out, _ = _run(["kv-size", "--layers", "32", "--seq", "8192", "--kv_heads", str(kv_heads),
                     "--head_dim", "128", "--dtype", "bfloat16"], capsys)
  assert rc == 0 and out.startswith(want)


def test_kv_size_batch_and_model_config_agree(capsys):
  cfg = attnlab.ModelConfig(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                            head_dim=128, dtype="bfloat16")
  assert cfg.kv_cache_bytes_per_token() * 8192 == 1 << 30  # the model reports the same size
  rc, out, _ = _run(["kv-size", "--layers", "32", "--seq", "8192", "--kv_heads", "8",
                     "--head_dim", "128", "--dtype", "bfloat16", "--batch", "4"], capsys)
  assert rc == 0 and out.startswith("4.00 GiB")


def test_kv_size_bad_input_exits_2(capsys):
  rc, _, err = _run(["kv-size", "--layers", "0", "--seq", "8", "--kv_heads", "1",
                     "--head_dim", "8"], capsys)
  assert rc == 2 and "--layers=0" in err
  rc, _, err = _run(["kv-size", "--layers", "2"], capsys)
  assert rc == 2 and "required" in err


def _trained(tmp_path_factory, gin_name, *bindings):
  """A real (2-step) training run written by ``attnlab train``: the package's gin file
  ``gin_name`` with ``bindings`` (and a checkpoint at step 2)."""
  path = tmp_path_factory.mktemp("run") / "w"
  gin_file = os.path.join(os.path.dirname(attnlab.__file__), "configs", gin_name)
  common = ("TrainConfig.steps=2", "TrainConfig.checkpoint_every=2", "TrainConfig.log_every=0",
            "DataConfig.batch_size=2", "ModelConfig.num_layers=1", "ModelConfig.num_heads=2")
  rc = main(["train", "--gin_file", gin_file, *(f"--gin.{b}" for b in common + bindings),
             "--workdir", str(path)])
  assert rc == 0
  return str(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A tiny decoder-only model (GQA, one KV head) on the stdlib corpus (checkpoints at steps
  1 and 2)."""
  return _trained(tmp_path_factory, "lm_stdlib_tiny.gin", "DataConfig.max_files=2",
                  "DataConfig.seq_len=32", "ModelConfig.d_model=32", "ModelConfig.d_ff=64",
                  "ModelConfig.num_kv_heads=1", "TrainConfig.checkpoint_every=1")


def _expected(workdir, prompts, **kw):
  """What ``attnlab decode`` should print for ``prompts``: ``attnlab.generate`` on the
  checkpoint (a decoder-only LM's) with ``[bos]`` and the tokenizer's ids, the rows
  right-padded, cut at eos, detokenized."""
  import jax

  from attnlab.config import DecodeConfig

  model, cfg = attnlab.load_checkpoint(workdir)
  tok = decode_command._tokenizer(workdir)
  ids = [[tok.bos_id, *tok.encode(p)] for p in prompts]
  prompt_BT = np.full((len(ids), max(map(len, ids))), cfg.pad_id, np.int32)
  for b, x in enumerate(ids):
    prompt_BT[b, :len(x)] = x
  d = DecodeConfig()
  sampling = attnlab.Sampling(temperature=kw.pop("temperature", d.temperature),
                              top_k=kw.pop("top_k", d.top_k), top_p=kw.pop("top_p", d.top_p))
  out = np.asarray(attnlab.generate(
      model, prompt_BT, prompt_lengths_B=np.array([len(x) for x in ids], np.int32),
      eos_id=tok.eos_id, rng=jax.random.key(kw.pop("seed", d.seed)), sampling=sampling,
      max_new_tokens=kw.pop("max_new_tokens", d.max_new_tokens), **kw))
  rows = [list(r[:list(r).index(tok.eos_id)]) if tok.eos_id in r else list(r) for r in out]
  return [tok.decode(np.asarray(r, np.int32)) for r in rows]


def test_decode_stops_at_the_eos_ids_of_a_generation_config_too(workdir, capsys, tmp_path):
  """A workdir's generation_config.json (an HF import's) may list several eos ids (Llama 3:
  <|end_of_text|> and <|eot_id|>): decode stops at any of them, with and without --slots,
  the text cut before it. Until 2026-12-04 it stopped at the tokenizer's eos alone."""
  import json
  import shutil

  wd = str(tmp_path / "w")
  shutil.copytree(workdir, wd)
  model, cfg = attnlab.load_checkpoint(wd)
  tok = decode_command._tokenizer(wd)
  prompt = "def main("
  ids = [tok.bos_id, *tok.encode(prompt)]
  free = np.asarray(attnlab.generate(model, np.asarray([ids], np.int32), max_new_tokens=6,
                                     eos_id=None))[0]
  # The first token not seen before it: the text is what precedes it.
  j = next(j for j in range(1, 6) if free[j] not in free[:j] and free[j] != tok.eos_id)
  stop = int(free[j])
  want = tok.decode(free[:j])
  with open(os.path.join(wd, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [tok.eos_id, stop, cfg.vocab_size + 5]}, f)  # one outside
  assert decode_command.stop_ids(wd, tok.eos_id, cfg.vocab_size) == [tok.eos_id, stop]
  for extra in ([], ["--slots", "2"]):
    rc, out, err = _run(["decode", "--workdir", wd, "--prompt", prompt, "--max_new_tokens",
                         "6", *extra], capsys)
    assert rc == 0, err
    assert out.rstrip("\n").split("\t")[-1] == want, (extra, out)
  with open(os.path.join(wd, "generation_config.json"), "w") as f:
    f.write("{not json")
  rc, _, err = _run(["decode", "--workdir", wd, "--prompt", prompt], capsys)
  assert rc == 2 and "generation_config.json is not readable JSON" in err, err


def test_stop_ids_are_the_tokenizers_eos_then_the_generation_configs(tmp_path, caplog):
  """Without an eos (an hf_json tokenizer may have none) the stop ids are the generation
  config's alone; one id is an int, none is None; ids outside the vocabulary (0 is in it),
  bools and repeats are left out, and a file that is no JSON object adds none; at most
  MAX_STOP_IDS are kept, the others named in a warning (dropped silently until 2026-12-06)."""
  import json

  from attnlab.decoding.generate import MAX_STOP_IDS

  path = tmp_path / "generation_config.json"
  assert decode_command.stop_ids(str(tmp_path), None, 10) is None
  assert decode_command.stop_ids(str(tmp_path), 3, 10) == 3
  path.write_text(json.dumps({"eos_token_id": 5}))
  assert decode_command.stop_ids(str(tmp_path), None, 10) == 5
  assert decode_command.stop_ids(str(tmp_path), 5, 10) == 5
  assert decode_command.stop_ids(str(tmp_path), 3, 10) == [3, 5]
  path.write_text(json.dumps({"eos_token_id": [7, True, 10, -1, "4", 7, 0]}))
  assert decode_command.stop_ids(str(tmp_path), None, 10) == [7, 0]
  path.write_text(json.dumps([5]))  # not an object: no eos_token_id in it
  assert decode_command.stop_ids(str(tmp_path), 3, 10) == 3
  assert caplog.messages == []
  path.write_text(json.dumps({"eos_token_id": list(range(20))}))
  assert decode_command.stop_ids(str(tmp_path), 19, 20) == [19, *range(MAX_STOP_IDS - 1)]
  assert decode_command.stop_ids(str(tmp_path), None, 20) == list(range(MAX_STOP_IDS))
  assert caplog.messages == [
      f"the tokenizer's eos and {path} give 20 stop ids; decoding stops at the first "
      f"{MAX_STOP_IDS} only ({[19, *range(MAX_STOP_IDS - 1)]}), not at "
      f"{list(range(MAX_STOP_IDS - 1, 19))}",
      f"{path} give 20 stop ids; decoding stops at the first {MAX_STOP_IDS} only "
      f"({list(range(MAX_STOP_IDS))}), not at {list(range(MAX_STOP_IDS, 20))}"]


def test_decode_builds_the_tokenizer_with_the_workdirs_special_ids(tmp_path):
  """An hf_json tokenizer's bos and eos are DataConfig's (a workdir trained with its own
  tokenizer.json has no generation_config.json: without them decode would not stop)."""
  from attnlab.config import DataConfig
  from tests.data.hf_tokenizer import word_level_tokenizer_json

  path = word_level_tokenizer_json(tmp_path / "tokenizer.json", ["<unk>", "<s>", "</s>", "a"],
                                   specials=("<s>", "</s>"))
  tok = decode_command._make_tokenizer(DataConfig(
      tokenizer="hf_json", tokenizer_model=str(path), bos_id=1, eos_id=2))
  assert (tok.bos_id, tok.eos_id) == (1, 2)


def test_decode_prints_what_generate_gives_with_every_flag(workdir, capsys, tmp_path):
  """The printed completions are ``attnlab.generate``'s with the flags passed on: greedy
  with one prompt (the completion alone); sampling (temperature, top_k, top_p, seed) with
  a prompts file ("prompt<TAB>completion"); an int8 cache; the contiguous cache with
  eos; another checkpoint step."""
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompt", "def main(",
                       "--max_new_tokens", "5", "--cache", "paged", "--page_size", "4"], capsys)
  assert rc == 0, err
  assert out == _expected(workdir, ["def main("], max_new_tokens=5, cache="paged",
                          page_size=4)[0] + "\n"
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("import os\n\nx = 1\n")  # the blank line is skipped
  flags = dict(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_new_tokens=4)
  argv = ["decode", "--workdir", workdir, "--prompts_file", str(prompts)]
  for name, value in flags.items():
    argv += [f"--{name}", str(value)]
  rc, out, err = _run(argv, capsys)
  assert rc == 0, err
  want = _expected(workdir, ["import os", "x = 1"], **flags)
  assert out.splitlines() == [f"import os\t{want[0]}", f"x = 1\t{want[1]}"]
  rc, other_seed, _ = _run(argv[:-6] + ["--seed", "4", "--max_new_tokens", "4"], capsys)
  assert other_seed != out  # the seed reaches the sampler
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompt", "x", "--max_new_tokens",
                       "6", "--cache_dtype", "int8", "--cache", "contiguous"], capsys)
  assert rc == 0, err
  assert out == _expected(workdir, ["x"], max_new_tokens=6, cache_dtype="int8",
                          cache="contiguous")[0] + "\n"


def test_decode_slots_pass_every_flag_to_generate_requests(workdir, monkeypatch, capsys,
                                                            tmp_path):
  from attnlab.decoding import batching

  seen = {}
  real = batching.generate_requests

  def spy(model, ids, max_new_tokens, **kw):
    seen.update(kw, ids=ids, max_new_tokens=max_new_tokens)
    return real(model, ids, max_new_tokens, **kw)

  monkeypatch.setattr(batching, "generate_requests", spy)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("ab\ncd\n")
  rc, _, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts),
                     "--slots", "3", "--page_size", "8", "--num_pages", "5", "--max_new_tokens",
                     "3", "--cache_dtype", "int8", "--temperature", "0.5", "--top_k", "4",
                     "--top_p", "0.7", "--seed", "9"], capsys)
  assert rc == 0, err
  tok = decode_command._tokenizer(workdir)
  assert [list(x) for x in seen.pop("ids")] == [[tok.bos_id, *tok.encode("ab")],
                                                [tok.bos_id, *tok.encode("cd")]]
  sampling, rng = seen.pop("sampling"), seen.pop("rng")
  assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.5, 4, 0.7)
  import jax

  np.testing.assert_array_equal(jax.random.key_data(rng),
                                jax.random.key_data(jax.random.key(9)))
  assert callable(seen.pop("on_result"))
  # One call: its cache sized for its own requests (bucket=False), no more.
  assert seen == dict(max_new_tokens=3, slots=3, cache="paged", page_size=8, num_pages=5,
                      cache_dtype="int8", eos_id=tok.eos_id, bucket=False)
  assert "attnlab decode: 2/2 requests" in err and err.endswith("\n")


def test_a_prompt_too_long_in_a_prompts_file_is_named(workdir, capsys, tmp_path):
  """The batch is as wide as its longest prompt: the refusal names that prompt (its line in
  the file, blank lines counted: it was its number among the prompts; its tokens with the
  bos, its start). A Windows or old Mac line end counts as one line end."""
  _, cfg = attnlab.load_checkpoint(workdir)
  prompts = tmp_path / "p.txt"
  for end in ("\n", "\r\n", "\r"):
    prompts.write_bytes(end.join(["ab", "", "  ", "x" * (cfg.max_len - 3), "cd", ""]).encode())
    rc, out, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts),
                         "--max_new_tokens", "4"], capsys)
    assert rc == 2 and out == ""
    assert err.strip() == (
        f"attnlab decode: error: the prompt plus max_new_tokens needs {cfg.max_len + 1} "
        f"positions, more than the model's max_len={cfg.max_len} (the longest is line 4 of "
        f"{prompts}, {cfg.max_len - 2} tokens: {'x' * 40!r})"), (repr(end), err)
  # A file of that one prompt names it too (until 2026-12-06 only a file of several did).
  prompts.write_text("\n\n" + "x" * (cfg.max_len - 3) + "\n")
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts),
                       "--max_new_tokens", "4"], capsys)
  assert rc == 2 and err.strip().endswith(
      f"(the longest is line 3 of {prompts}, {cfg.max_len - 2} tokens: {'x' * 40!r})"), err


def test_a_prompts_file_prints_one_escaped_line_per_prompt(workdir, monkeypatch, capsys,
                                                          tmp_path):
  """With a prompts file (one prompt or more; --slots or not) every result is one line of
  tab-separated fields, the texts' backslashes, tabs, newlines and carriage returns
  escaped (a completion of source code holds newlines: it split its line before
  2026-12-04); --prompt prints the completion as it is."""
  from attnlab.decoding import batching

  tok = decode_command._tokenizer(workdir)
  text = "x\ny\tz\\w\r"
  ids = np.asarray([*tok.encode(text), tok.eos_id], np.int32)
  monkeypatch.setattr(decode_command, "generate",
                      lambda model, prompt_BT, **kw: np.stack([ids] * len(prompt_BT)))

  def requests(model, prompts, max_new_tokens, *, on_result, **kw):
    for i in reversed(range(len(prompts))):
      on_result(i, ids)

  monkeypatch.setattr(batching, "generate_requests", requests)
  escaped = "x\\ny\\tz\\\\w\\r"
  prompts = tmp_path / "p.txt"
  for lines in (["a\tb"], ["a\tb", "c\\d"]):
    prompts.write_text("\n".join(lines) + "\n")
    shown = [line.replace("\\", "\\\\").replace("\t", "\\t") for line in lines]
    base = ["decode", "--workdir", workdir, "--prompts_file", str(prompts)]
    rc, out, err = _run(base, capsys)
    assert rc == 0, err
    assert out.splitlines() == [f"{p}\t{escaped}" for p in shown]
    rc, out, err = _run(base + ["--slots", "2"], capsys)
    assert rc == 0, err
    assert out.splitlines() == [f"{i}\t{shown[i]}\t{escaped}"
                                for i in reversed(range(len(lines)))]
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompt", "a\tb"], capsys)
  assert rc == 0 and out == text + "\n", err
  # A byte order mark is not text of the first prompt (it was three tokens of it).
  seen = []
  monkeypatch.setattr(decode_command, "generate", lambda model, prompt_BT, **kw: (
      seen.append(prompt_BT.copy()), np.stack([ids] * len(prompt_BT)))[1])
  prompts.write_bytes("\ufeffa\tb\n".encode("utf-8"))
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts)], capsys)
  assert rc == 0 and out.splitlines() == [f"a\\tb\t{escaped}"], err
  assert seen[-1][0, :4].tolist() == [tok.bos_id, *tok.encode("a\tb")]
  # Windows and old Mac line ends end a prompt as "\n" does; blank lines are skipped.
  prompts.write_bytes(b"a\tb\r\n\r\nc\rd\n")
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts)], capsys)
  assert rc == 0 and out.splitlines() == [f"{p}\t{escaped}" for p in ("a\\tb", "c", "d")], err
  # Bytes of an argument that are not UTF-8 (Python keeps them as surrogates): one line, exit
  # 2 (a UnicodeEncodeError traceback before).
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompt", "a\udcff"], capsys)
  assert rc == 2 and out == "" and err.strip() == (
      "attnlab decode: error: --prompt is not UTF-8 text (it holds bytes that decode to no "
      "character)"), err
  # Every line break of str.splitlines is escaped (until 2026-12-04 \v, \f, \x1c-\x1e, \x85,
  # \u2028 and \u2029 were not: a line reader split one result in two); Python's own
  # unicode_escape codec reads the field back.
  breaks = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
  assert len(("a" + "a".join(breaks) + "a").splitlines()) == len(breaks) + 1
  for s in ("", "plain", "\\t", "a\\\nb", "\t\r\n\\", "\\\\n", "x\\x85" + breaks + "é\\u2028",
            "\\\v\\x1c"):
    field = decode_command.tsv_field(s)
    assert "\t" not in field and field.splitlines() == ([field] if field else [])
    assert field.encode("latin-1", "backslashreplace").decode("unicode_escape") == s, field


def test_text_stdout_cannot_encode_is_printed_as_escapes_and_a_c_locale_prompt_is_utf8(
    workdir, monkeypatch, capsys, tmp_path):
  """A stdout whose encoding lacks a character of a completion or a prompt (a C or latin-1
  locale, PYTHONIOENCODING=ascii): decode prints it as a Python escape, exit 0, with
  --prompt, a prompts file and --slots (until 2026-12-07 a UnicodeEncodeError traceback,
  exit 1, after decoding). A --prompt whose UTF-8 bytes the locale's codec could not decode
  (kept as surrogates by Python) is the UTF-8 text it was typed as (it was refused as "not
  UTF-8"); bytes that are not UTF-8 are still refused."""
  from attnlab.decoding import batching

  tok = decode_command._tokenizer(workdir)
  ids = np.asarray([*tok.encode("é ✓"), tok.eos_id], np.int32)
  seen = []
  monkeypatch.setattr(decode_command, "generate", lambda model, prompt_BT, **kw: (
      seen.append(prompt_BT.copy()), np.stack([ids] * len(prompt_BT)))[1])

  def requests(model, prompts, max_new_tokens, *, on_result, **kw):
    for i in range(len(prompts)):
      on_result(i, ids)

  monkeypatch.setattr(batching, "generate_requests", requests)
  prompts = tmp_path / "p.txt"
  prompts.write_text("naïve\n", encoding="utf-8")
  base = ["decode", "--workdir", workdir]
  for encoding, completion, prompt in (("ascii", "\\xe9 \\u2713", "na\\xefve"),
                                       ("latin-1", "é \\u2713", "naïve")):
    for argv, want in ((["--prompt", "x"], completion),
                       (["--prompts_file", str(prompts)], f"{prompt}\t{completion}"),
                       (["--prompts_file", str(prompts), "--slots", "2"],
                        f"0\t{prompt}\t{completion}")):
      raw = io.BytesIO()
      with monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding=encoding))
        rc = main(base + argv)
        sys.stdout.flush()
        out = raw.getvalue().decode(encoding)
      err = capsys.readouterr().err
      assert (rc, out) == (0, want + "\n"), (encoding, argv, err)
  # A stream of the caller's with no encoding (write and flush only): the text as it is.
  with monkeypatch.context() as patch:
    patch.setattr(sys, "stdout", MinimalStream())
    rc = main(base + ["--prompt", "x"])
    assert (rc, "".join(sys.stdout.text)) == (0, "é ✓\n")
  # "é" typed in a UTF-8 terminal under the C locale: Python keeps its two bytes as the
  # surrogates U+DCC3 U+DCA9.
  rc, out, err = _run(base + ["--prompt", "h\udcc3\udca9"], capsys)
  assert rc == 0, err
  assert seen[-1][0, :4].tolist() == [tok.bos_id, *tok.encode("hé")]
  rc, out, err = _run(base + ["--prompt", "h\udce9"], capsys)  # latin-1's byte for é
  assert (rc, out) == (2, "") and "--prompt is not UTF-8 text" in err, err


def test_the_text_stops_before_eos_with_and_without_slots(workdir, monkeypatch, capsys,
                                                          tmp_path):
  """A tokenizer whose decode shows eos (a tokenizer.json that does not mark it special):
  neither path prints it (until 2026-12-04 --slots left the eos to the tokenizer)."""
  from attnlab.decoding import batching

  real = decode_command._make_tokenizer

  class ShowsEos:
    def __init__(self, tok):
      self._tok = tok
      self.bos_id, self.eos_id, self.pad_id = tok.bos_id, tok.eos_id, tok.pad_id

    def encode(self, text, **kw):
      return self._tok.encode(text, **kw)

    def decode(self, ids):
      return "".join("<eos>" if int(i) == self.eos_id else self._tok.decode([i]) for i in ids)

  monkeypatch.setattr(decode_command, "_make_tokenizer", lambda dcfg: ShowsEos(real(dcfg)))
  tok = real(decode_command._data_config(workdir))
  ids = np.asarray([*tok.encode("ok"), tok.eos_id], np.int32)
  monkeypatch.setattr(decode_command, "generate",
                      lambda model, prompt_BT, **kw: np.stack([ids] * len(prompt_BT)))
  monkeypatch.setattr(batching, "generate_requests",
                      lambda model, prompts, n, *, on_result, **kw: [
                          on_result(i, ids) for i in range(len(prompts))])
  prompts = tmp_path / "p.txt"
  prompts.write_text("a\nb\n")
  base = ["decode", "--workdir", workdir, "--prompts_file", str(prompts)]
  rc, out, err = _run(base, capsys)
  assert rc == 0 and out.splitlines() == ["a\tok", "b\tok"], (out, err)
  rc, out, err = _run(base + ["--slots", "2"], capsys)
  assert rc == 0 and out.splitlines() == ["0\ta\tok", "1\tb\tok"], (out, err)
  assert "2/2 requests, 6 tokens," in err  # the rate counts the eos: a generated token


@pytest.mark.parametrize("extra,needle", [
    (["--beam_size", "2", "--temperature", "0.8"], "beam_size=2 decodes deterministically"),
    # its beam_size 1 is greedy: "give --beam_size too" with --beam_size given until 12-06
    (["--beam_size", "1", "--length_penalty", "0.5"],
     "--length_penalty is the beam search's: give --beam_size 2 or more (--beam_size 1 "
     "decodes greedily)"),
    (["--length_penalty", "0.5"], "give --beam_size 2 or more (--beam_size 1 decodes"),
    (["--step", "7"], "step=7"),
    (["--prompt", ""], "empty"),
    (["--cache", "nope"], "cache='nope'"),
    (["--top_p", "2"], "top_p=2.0"),
    (["--beam_size", "2", "--cache", "paged"], "beam search reorders whole cache rows"),
    (["--cache", "ring"], "window"),
    (["--max_new_tokens", "5000"], "max_len"),
    (["--mesh_shape", "1,2"], "--mesh_shape=1,2: give 3 comma-separated positive ints"),
    (["--mesh_shape", "1,x,1"], "--mesh_shape=1,x,1: give 3"),
    (["--mesh_shape=-1,-1,1"], "at most one -1"),
    (["--mesh_shape", "1,0,1"], "--mesh_shape=1,0,1"),
    (["--mesh_shape=1,-2,1"], "--mesh_shape=1,-2,1: give 3"),
    (["--mesh_shape", "1,1,8"], "needs 8 devices, only 1 exist"),
])
def test_decode_bad_input_exits_2(workdir, capsys, extra, needle):
  argv = ["decode", "--workdir", workdir] + extra
  if "--prompt" not in extra:
    argv += ["--prompt", "hi"]
  rc, _, err = _run(argv, capsys)
  assert rc == 2 and needle in err, err
  assert len(err.strip().splitlines()) == 1


def test_decode_lets_errors_that_are_not_bad_input_through(workdir, monkeypatch, capsys):
  """Only input checks (ValueError) become one line + exit 2; a failure inside
  generation keeps its type and traceback."""
  from attnlab.commands import decode

  def broken(*args, **kwargs):
    raise RuntimeError("something inside generate broke")

  monkeypatch.setattr(decode, "generate", broken)
  with pytest.raises(RuntimeError, match="inside generate"):
    main(["decode", "--workdir", workdir, "--prompt", "hi", "--max_new_tokens", "2"])


def test_decode_defaults_are_decode_config_defaults():
  from attnlab.commands import decode

  args = decode._decode_parser().parse_args(["--workdir", "w", "--prompt", "p"])
  defaults = attnlab.config.DecodeConfig()
  for name in ("temperature", "top_k", "top_p", "beam_size", "max_new_tokens", "seed",
               "num_pages"):
    assert getattr(args, name) == getattr(defaults, name), name
  # --cache is resolved in main: paged with --slots, else DecodeConfig's default; so are
  # --length_penalty and --page_size (given without a beam or a paged cache: refused), whose
  # help states DecodeConfig's default.
  text = " ".join(decode._decode_parser().format_help().split())
  assert args.cache is None and f"else {defaults.cache}" in text
  assert args.length_penalty is None and f"(default {defaults.length_penalty};" in text
  assert args.page_size is None and f"(default {defaults.page_size})" in text
  # Every setting's help names its default (as the README says; --top_k, --top_p and
  # --slots did not until 2026-12-06); the inputs (workdir, prompt or prompts file) have none.
  inputs = {"--help", "--workdir", "--prompt", "--prompts_file"}
  for action in decode._decode_parser()._actions:
    if action.option_strings and action.option_strings[-1] not in inputs:
      assert "default" in action.help, action.option_strings

def test_decode_workdir_without_config_exits_2(tmp_path, capsys):
  rc, _, err = _run(["decode", "--workdir", str(tmp_path), "--prompt", "hi"], capsys)
  assert rc == 2 and "config.gin" in err
  rc, _, err = _run(["decode", "--workdir", str(tmp_path)], capsys)
  assert rc == 2 and "--prompt" in err


@pytest.mark.parametrize("beam_size", [None, 2])
def test_padding_past_the_longest_prompt_takes_no_position(beam_size):
  """A right-padded batch whose width plus max_new_tokens exceeds max_len (or cache_len),
  while its longest prompt plus max_new_tokens fits, decodes as the unpadded batch (it was
  refused, counting the padding as positions)."""
  model = decoder_model("mqa_rope_window3", varied=True)
  prompts = np.zeros((2, 60), np.int32)
  prompts[0, :2], prompts[1, :3] = [5, 6], [7, 8, 9]
  kw = dict(prompt_lengths_B=np.array([2, 3], np.int32), eos_id=None, beam_size=beam_size)
  want = np.asarray(attnlab.generate(model, prompts[:, :3], max_new_tokens=10, **kw))
  np.testing.assert_array_equal(
      np.asarray(attnlab.generate(model, prompts, max_new_tokens=10, **kw)), want)
  np.testing.assert_array_equal(np.asarray(attnlab.generate(
      model, prompts[:, :8], max_new_tokens=10, cache_len=12, **kw)), want)
  with pytest.raises(ValueError, match=re.escape(
      "the prompt plus max_new_tokens needs 65 positions, more than the model's max_len=64")):
    attnlab.generate(model, prompts, max_new_tokens=63, **kw)  # the longest prompt's 3 + 62


def test_generate_rejects_bad_prompts():
  model = decoder_model("mha_rope")
  with pytest.raises(ValueError, match="empty"):
    attnlab.generate(model, np.zeros((1, 0), np.int32))
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    attnlab.generate(model, np.array([[5, 6], [0, 0]]))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    attnlab.generate(model, np.array([[5, model.cfg.vocab_size]]))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    attnlab.generate(model, np.array([[5, -1]]))
  # Ragged rows: numpy's "inhomogeneous shape", a plain ValueError, until 2026-12-06.
  with pytest.raises(GenerateInputError, match="^" + re.escape(
      "prompt_BT is not a [B, T] array (its rows have lengths [3, 2]): give one, rows "
      "right-padded with pad_id=0 (attnlab.generate_requests takes a list of prompts of any "
      "lengths)") + "$"):
    attnlab.generate(model, [[5, 6, 7], [8, 9]])
  # A beam whose candidates pass int32: JAX's top_k refused it naming no argument.
  most = (2**31 - 1) // model.cfg.vocab_size
  with pytest.raises(GenerateInputError, match="^" + re.escape(
      f"beam_size={most + 1} times the vocabulary ({model.cfg.vocab_size}) is more candidates "
      f"than a step can rank (2**31 - 1, int32 indices): give beam_size <= {most}") + "$"):
    attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=2, beam_size=most + 1)
  # A length penalty whose factor ((5 + n) / 6) ** alpha overflows float32 at the longest
  # output: every finished score was -0 and the first hypothesis to finish won (until
  # 2026-12-06), and a factor near 1e38 flushes any score to -0 in float32 (its quotients fall
  # below the smallest normal number). The factor is kept <= 2**64: at the bound printed,
  # which is accepted, a score of log P = -1e-12 keeps its sign and size.
  with pytest.raises(GenerateInputError, match="^" + re.escape(
      "length_penalty=300 makes the penalty ((5 + n) / 6) ** alpha of an output of 4 tokens "
      "larger than 2**64, past which float32 scores underflow: give at most 109.408") + "$"):
    attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=4, beam_size=2,
                     length_penalty=300)
  with pytest.raises(GenerateInputError, match="give at most 109.408$"):
    attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=4, beam_size=2,
                     length_penalty=109.409)
  attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=4, beam_size=2,
                   length_penalty=109.408)
  from attnlab.decoding.beam import length_penalty_factor

  score = jax.jit(lambda logp, alpha: logp / length_penalty_factor(4, alpha))
  assert float(length_penalty_factor(4, 109.408)) <= 2.0**64
  for logp in (-0.5, -1e-12):
    got = float(score(logp, 109.408))
    assert got < 0 and got == pytest.approx(logp / 1.5**109.408, rel=1e-5)
  assert float(score(-0.5, 214.0)) == 0  # what a factor near 1e38 did (allowed until now)
  with pytest.raises(ValueError, match=re.escape(
      "the prompt plus max_new_tokens needs 7 cache slots, more than cache_len=4")):
    attnlab.generate(model, np.array([[5, 6, 7, 8, 9, 10]]), max_new_tokens=2, cache_len=4)
  # A cache_len past max_len holds max_len slots (no position past it is written; init_cache
  # refuses more): it decodes as cache_len=max_len does (one compiled program, the same
  # tokens), for either model, greedy or beam, each cache with a length. (That a cache with
  # slots to spare decodes as one that fits: the parity tests of
  # tests/decoding/test_cache_parity.py.)
  encdec = encdec_model("paper_gqa")
  prompt = np.array([[5, 6, 7, 8, 9], [5, 6, 0, 0, 0]])
  for m, kind, beam in ((model, "contiguous", None), (model, "paged", None),
                        (model, "contiguous", 2), (encdec, "contiguous", None),
                        (encdec, "contiguous", 2)):
    kw = dict(max_new_tokens=4, cache=kind, beam_size=beam, eos_id=None)
    np.testing.assert_array_equal(
        attnlab.generate(m, prompt, cache_len=m.cfg.max_len + 8, **kw),
        attnlab.generate(m, prompt, cache_len=m.cfg.max_len, **kw))
  with pytest.raises(ValueError, match=re.escape(
      "the prompt plus max_new_tokens needs 101 positions, more than the model's max_len=64")):
    attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=100)
  # cache_len: a positive int, for the caches that have one (10.0 and "9" were errors from
  # inside JAX, True a cache of one slot, and a ring checked a length it ignores).
  for bad, message in ((10.0, "cache_len=10.0 must be a positive integer"),
                       ("9", "cache_len='9' must be a positive integer"),
                       (True, "cache_len=True must be a positive integer"),
                       (0, "cache_len=0 must be a positive integer")):
    with pytest.raises(ValueError) as e:
      attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=2, cache_len=bad)
    assert str(e.value) == message
  with pytest.raises(ValueError) as e:
    attnlab.generate(decoder_model("mqa_rope_window3"), np.array([[5, 6]]), max_new_tokens=2,
                     cache="ring", cache_len=8)
  assert str(e.value) == ("cache_len=8 is for cache='contiguous' or 'paged'; a ring holds the "
                          "model's window")
  with pytest.raises(ValueError, match=re.escape(
      "cache='ring' needs a sliding-window model (ModelConfig.window), got window=None; use "
      "cache='contiguous' or 'paged'")):
    attnlab.generate(model, np.array([[5, 6]]), cache="ring")
  # with beam_size, only the cache beam search takes (it offered 'paged', refused next, until
  # 2026-12-06)
  with pytest.raises(ValueError, match="^" + re.escape(
      "cache='ring' needs a sliding-window model (ModelConfig.window), got window=None; use "
      "cache='contiguous'") + "$"):
    attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=2, beam_size=2, cache="ring")
  with pytest.raises(ValueError, match=re.escape(
      "beam search reorders whole cache rows: use cache='contiguous' or 'ring' with beam_size")):
    attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=2, beam_size=2, cache="paged")
  for beam_size in (0, 2.5):
    with pytest.raises(ValueError, match=f"beam_size={beam_size} must be a positive integer"):
      attnlab.generate(model, np.array([[5, 6]]), beam_size=beam_size)
  with pytest.raises(ValueError, match=re.escape(
      "cache='nope' is not one of 'contiguous', 'ring', 'paged'")):
    attnlab.generate(model, np.array([[5, 6]]), cache="nope")
  # A length given as 0 is named as such (until 2026-12-04 "all padding" of a row that had
  # none); a row of padding without lengths is named as padding.
  with pytest.raises(ValueError, match=re.escape(
      "prompt 1 is empty (prompt_lengths_B[1]=0): give at least one token")):
    attnlab.generate(model, np.array([[5, 6], [5, 6]]), prompt_lengths_B=[2, 0])
  with pytest.raises(ValueError, match=re.escape(
      "prompt 1 is empty (all padding, pad_id=0): give at least one token")):
    attnlab.generate(model, np.array([[5, 6], [0, 0]]))
  for bad in ([2, 2, 2], [2.0, 1.7]):  # a float length is not cut to an int
    with pytest.raises(ValueError, match=re.escape(
        f"prompt_lengths_B (shape {np.shape(bad)}, dtype {np.asarray(bad).dtype}) must be "
        "integers [B] = (2,)")):
      attnlab.generate(model, np.array([[5, 6], [5, 6]]), prompt_lengths_B=bad)
  # The paged cache's sizes and the sampling are checked before anything is traced.
  for name, bad in (("page_size", 0), ("page_size", -4), ("num_pages", 0), ("num_pages", 2.5)):
    with pytest.raises(ValueError, match=re.escape(f"{name}={bad!r} must be a positive integer")):
      attnlab.generate(model, np.array([[5, 6]]), cache="paged", **{name: bad})
  # A page longer than max_len = 64 is never filled: refused before a cache of that size is
  # allocated (until 2026-12-06 a page of 2**31 was an OverflowError from inside JAX); the
  # other caches ignore page_size.
  for bad in (65, 2**31):
    with pytest.raises(ValueError) as e:
      attnlab.generate(model, np.array([[5, 6]]), cache="paged", page_size=bad)
    assert str(e.value) == (f"page_size={bad} is more than 64: the model's max_len=64 never "
                            "fills such a page; give at most 64 (the smallest power of two >= "
                            "max_len, 16 at least)")
  # The bound is max_len rounded up to a power of two, 16 at least (the default page and the
  # GPU kernel's smallest, whatever max_len).
  from attnlab.decoding.generate import check_page_size
  assert [check_page_size(c, n) for c, n in ((16, 1), (16, 8), (64, 48), (64, 33), (7, 7))] == [
      16, 16, 64, 64, 7]
  for c, n, most in ((17, 8, 16), (65, 48, 64), (33, 32, 32)):
    with pytest.raises(ValueError, match=f"^page_size={c} is more than {most}: the model's "
                                         f"max_len={n} never"):
      check_page_size(c, n)
  want = attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=2, cache="contiguous",
                          page_size=2**31)
  got = attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=2, cache="paged",
                         page_size=64)  # one page of max_len
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=re.escape(
      "num_pages=4 is for cache='paged', got cache='contiguous'")):
    attnlab.generate(model, np.array([[5, 6]]), cache="contiguous", num_pages=4)
  for bad in (None, "greedy"):
    with pytest.raises(ValueError, match=f"sampling must be a Sampling, got {type(bad).__name__}$"):
      attnlab.generate(model, np.array([[5, 6]]), sampling=bad)
  with pytest.raises(ValueError, match=re.escape(
      "prompt_lengths_B=[2, 3] exceeds the prompt width T=2")):
    attnlab.generate(model, np.array([[5, 6], [5, 6]]), prompt_lengths_B=[2, 3])
  encdec = encdec_model("paper_gqa")
  with pytest.raises(ValueError, match=re.escape(
      "beam search reorders whole cache rows: use cache='contiguous' or 'ring' with beam_size")):
    attnlab.generate(encdec, np.array([[5, 6]]), beam_size=2, cache="paged")
  with pytest.raises(ValueError, match=re.escape(
      "max_new_tokens needs 8 cache slots, more than cache_len=5")):
    attnlab.generate(encdec, np.array([[5, 6]]), max_new_tokens=8, cache_len=5)
  # A source longer than the model's positions: the input error, not one from the trace.
  too_long = np.full((1, encdec.cfg.max_len + 1), 5)
  with pytest.raises(GenerateInputError, match=re.escape(
      f"the source has {encdec.cfg.max_len + 1} positions, more than the model's "
      f"max_len={encdec.cfg.max_len}")):
    attnlab.generate(encdec, too_long, max_new_tokens=2)
  # Padding past the last token is cut where it alone would not fit, as a decoder-only
  # prompt's (refused until 2026-12-04): the same tokens as the source without it. (A cache
  # of max_len: the compiled program of the source above.)
  padded = np.zeros((2, encdec.cfg.max_len + 6), np.int32)
  padded[0, :5], padded[1, :2] = [5, 6, 7, 8, 9], [5, 6]
  kw = dict(max_new_tokens=4, eos_id=None, cache_len=encdec.cfg.max_len)
  for lengths in (None, [5, 2]):
    np.testing.assert_array_equal(
        attnlab.generate(encdec, padded, prompt_lengths_B=lengths, **kw),
        attnlab.generate(encdec, padded[:, :5], prompt_lengths_B=lengths, **kw))
  # A source of exactly max_len tokens fits, padded past it or not.
  full = np.zeros((1, encdec.cfg.max_len + 3), np.int32)
  full[0, :encdec.cfg.max_len] = random_tokens(9, (encdec.cfg.max_len,))
  np.testing.assert_array_equal(attnlab.generate(encdec, full, **kw),
                                attnlab.generate(encdec, full[:, :encdec.cfg.max_len], **kw))
  # What the decoder-only path refuses, the encoder-decoder one refuses too.
  with pytest.raises(GenerateInputError, match=re.escape(
      "source 1 is empty (all padding, pad_id=0): give at least one token")):
    attnlab.generate(encdec, np.array([[5, 6], [0, 0]]), max_new_tokens=2)
  for bad in (encdec.cfg.vocab_size, -5):
    with pytest.raises(GenerateInputError, match=re.escape(
        f"bos_id={bad} is outside the vocabulary [0, {encdec.cfg.vocab_size})")):
      attnlab.generate(encdec, np.array([[5, 6]]), max_new_tokens=2, bos_id=bad)
  # Source lengths are checked like prompt lengths (the first empty one named), and mark
  # the first lengths[b] positions of each row, pad ids among them.
  with pytest.raises(GenerateInputError, match=re.escape(
      "source 1 is empty (prompt_lengths_B[1]=0): give at least one token")):
    attnlab.generate(encdec, np.array([[5, 6], [0, 0]]), max_new_tokens=2,
                     prompt_lengths_B=[1, 0])
  from attnlab.decoding.generate import _source_segment_ids

  seg = _source_segment_ids(encdec.cfg, np.array([[5, 0, 6], [7, 0, 0]]), [3, 1])
  assert seg.dtype == np.int32 and seg.tolist() == [[1, 1, 1], [1, 0, 0]]
  with pytest.raises(GenerateInputError, match=re.escape(
      "prompt_lengths_B=[3] exceeds the prompt width T=2")):
    attnlab.generate(encdec, np.array([[5, 6]]), max_new_tokens=2, prompt_lengths_B=[3])
  for bad in (-1.0, float("inf"), float("nan")):  # inf and nan were accepted
    with pytest.raises(GenerateInputError, match=re.escape(
        f"length_penalty={bad!r} must be a finite number >= 0")):
      attnlab.generate(encdec, np.array([[5, 6]]), max_new_tokens=2, beam_size=2,
                       length_penalty=bad)


def test_generate_refuses_a_non_model_and_arguments_that_would_do_nothing():
  """Until 2026-12-07: ``load_checkpoint``'s (model, cfg) pair given whole (or a config) was
  an AttributeError on ``model.cfg``; a length penalty without a beam and a decoder-only
  model's bos_id were ignored unchecked (`attnlab decode` refuses such flags); a 0-d JAX
  array as max_new_tokens / beam_size / length_penalty was refused ("Array(3) must be a
  positive integer") while generate_requests took it. Each now as the numbers it holds."""
  from attnlab.decoding.generate import GenerateInputError

  model = decoder_model("mha_rope")
  V = model.cfg.vocab_size
  prompt = np.array([[5, 6, 7]])
  models = ("a DecoderOnly or EncoderDecoder: build_model(cfg, rngs=...) or "
            "load_checkpoint(workdir)[0]")
  for call, name in ((lambda m: attnlab.generate(m, prompt, max_new_tokens=2), "generate"),
                     (lambda m: attnlab.generate_requests(m, [[5, 6]], 2), "generate_requests")):
    for bad, what in (((model, model.cfg), "tuple (load_checkpoint returns (model, cfg): give "
                       "its first item)"), (model.cfg, "ModelConfig"), (None, "NoneType")):
      with pytest.raises(GenerateInputError) as e:
        call(bad)
      assert str(e.value) == f"{name} needs a model ({models}), got {what}"
  for bad in (0.8, 0.0, "x", jax.numpy.float32(1.0)):
    with pytest.raises(GenerateInputError) as e:
      attnlab.generate(model, prompt, max_new_tokens=2, length_penalty=bad)
    assert str(e.value) == f"length_penalty={bad!r} is the beam search's: give beam_size too"
  for bad, message in (("x", f"bos_id='x' must be an integer token id in [0, {V})"),
                       (10**9, f"bos_id={10**9} is outside the vocabulary [0, {V})"),
                       (-1, f"bos_id=-1 is outside the vocabulary [0, {V})")):
    with pytest.raises(GenerateInputError) as e:
      attnlab.generate(model, prompt, max_new_tokens=2, bos_id=bad)
    assert str(e.value) == message
  greedy = np.asarray(attnlab.generate(model, prompt, max_new_tokens=3, eos_id=None))
  beam = np.asarray(attnlab.generate(model, prompt, max_new_tokens=3, eos_id=None, beam_size=2,
                                     length_penalty=0.5))
  jnp = jax.numpy
  for kw in (dict(length_penalty=0.6), dict(length_penalty=np.float32(0.6)),
             dict(length_penalty=None),  # the default, as a wrapper's "unset" passes it
             dict(length_penalty=jnp.float32(0.6)), dict(bos_id=None), dict(bos_id=V - 1),
             dict(max_new_tokens=jnp.int32(3)), dict(max_new_tokens=np.array(3))):
    np.testing.assert_array_equal(
        attnlab.generate(model, prompt, **{"max_new_tokens": 3, "eos_id": None, **kw}), greedy)
  for kw in (dict(beam_size=jnp.int32(2), length_penalty=jnp.float32(0.5)),
             dict(beam_size=np.array(2), length_penalty=np.array(0.5))):
    np.testing.assert_array_equal(
        attnlab.generate(model, prompt, max_new_tokens=3, eos_id=None, **kw), beam)
  # an integer 0-d array is its number as a penalty too; a bool one is no number
  np.testing.assert_array_equal(
      attnlab.generate(model, prompt, max_new_tokens=3, eos_id=None, beam_size=2,
                       length_penalty=jnp.int32(1)),
      attnlab.generate(model, prompt, max_new_tokens=3, eos_id=None, beam_size=2,
                       length_penalty=1.0))
  for bad in (jnp.array(True), np.array(True)):
    with pytest.raises(GenerateInputError) as e:
      attnlab.generate(model, prompt, max_new_tokens=3, beam_size=2, length_penalty=bad)
    assert str(e.value) == f"length_penalty={bad!r} must be a finite number >= 0"
  with pytest.raises(GenerateInputError) as e:  # a 0-d float is no count
    attnlab.generate(model, prompt, max_new_tokens=jnp.float32(3))
  assert str(e.value) == f"max_new_tokens={jnp.float32(3)!r} must be a positive integer"
  # A model whose class a notebook's reload of attnlab.nn.transformer made anew (another
  # class object of the same name) is a model (the first check_model, by class, refused it).
  import importlib.util

  from flax import nnx

  spec = importlib.util.spec_from_file_location("attnlab.nn.transformer",  # (not in
                                                attnlab.nn.transformer.__file__)  # sys.modules)
  again = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(again)
  other = again.build_model(model.cfg, rngs=nnx.Rngs(0))
  assert type(other) is not type(model)

  class MyLM(attnlab.DecoderOnly):  # a subclass is a model (refused by the second version)
    pass

  want = attnlab.generate(attnlab.build_model(model.cfg, rngs=nnx.Rngs(0)), prompt,
                          max_new_tokens=3, eos_id=None)
  for m in (other, MyLM(model.cfg, rngs=nnx.Rngs(0))):
    np.testing.assert_array_equal(attnlab.generate(m, prompt, max_new_tokens=3, eos_id=None),
                                  want)

  class DecoderOnly(nnx.Module):  # a module of another name's: no model (taken by the second)
    def __init__(self):
      self.cfg = model.cfg

  with pytest.raises(GenerateInputError) as e:
    attnlab.generate(DecoderOnly(), prompt, max_new_tokens=2)
  assert str(e.value) == f"generate needs a model ({models}), got DecoderOnly"
  # evaluate_workdir refuses a length penalty without a beam before any work (generate
  # refused it after the loss; an LM's eval ignored it)
  from attnlab.training import trainer

  with pytest.raises(ValueError, match=r"^length_penalty=1.0 is the beam search's: give "
                                       r"beam_size too$"):
    trainer.evaluate_workdir("/nonexistent/workdir", length_penalty=1.0)
  for default in (None, 0.6, np.float32(0.6)):  # past the check: the workdir is read next
    with pytest.raises(FileNotFoundError):
      trainer.evaluate_workdir("/nonexistent/workdir", length_penalty=default)


def test_generate_checks_eos_id_the_rng_and_the_length_penalty():
  """Refused by name before anything is traced: an eos outside the vocabulary was accepted
  (and never matched), rng=0 and length_penalty='0.6' were TypeErrors from inside."""
  from attnlab.config import seed_key
  from attnlab.decoding.generate import GenerateInputError, as_key

  model, encdec = decoder_model("mha_rope"), encdec_model("paper_gqa")
  V = model.cfg.vocab_size
  prompt = np.array([[5, 6]])
  not_eos = f"[0, {V}), or None (no eos)"
  bad_eos = [(V, f"eos_id={V} is outside the vocabulary {not_eos}"),
             (-1, f"eos_id=-1 is outside the vocabulary {not_eos}"),  # None means no eos
             ("2", f"eos_id='2' must be an integer token id in {not_eos}"),
             (2.0, f"eos_id=2.0 must be an integer token id in {not_eos}"),
             (np.True_, f"eos_id=np.True_ must be an integer token id in {not_eos}"),
             # one of several stop ids, named by its place in the list
             ([3, V + 1], f"eos_id[1]={V + 1} is outside the vocabulary [0, {V})")]
  for m in (model, encdec):
    for bad, message in bad_eos:
      with pytest.raises(GenerateInputError) as e:
        attnlab.generate(m, prompt, max_new_tokens=2, eos_id=bad)
      assert str(e.value) == message
    for bad in ("0.6", True):  # (None is the default since 2026-12-07)
      with pytest.raises(GenerateInputError) as e:
        attnlab.generate(m, prompt, max_new_tokens=2, beam_size=2, length_penalty=bad)
      assert str(e.value) == f"length_penalty={bad!r} must be a finite number >= 0"
  with pytest.raises(GenerateInputError) as e:
    attnlab.generate(encdec, prompt, max_new_tokens=2, bos_id="1")
  assert str(e.value) == f"bos_id='1' must be an integer token id in [0, {V})"
  allowed = "must be a jax.random.key (or its uint32 key data), an integer seed or None"
  data_of = jax.random.key_data
  for bad, what in (("0", "rng='0'"), (1.5, "rng=1.5"), (True, "rng=True"),
                    (np.zeros(2, np.float32), "rng (an array of dtype float32)")):
    with pytest.raises(GenerateInputError) as e:
      attnlab.generate(model, prompt, max_new_tokens=2, rng=bad)
    assert str(e.value) == f"{what} {allowed}"
  # One key: a batch of keys, key data of another shape and a seed past int64 were errors
  # from inside JAX until 2026-12-04 (a ValueError from split, a TypeError, an OverflowError).
  for bad, message in (
      (jax.random.split(jax.random.key(0), 2), "rng must be one key (shape ()), got a key "
       "array of shape (2,): give one key; a call draws every row from it"),
      (np.array([1, 2, 3], np.uint32), "rng (uint32 key data of shape (3,)) must be one key's "
       "data, of shape (2,)"),
      (2**63, f"rng={2**63}: an integer seed must be in [-2**63, 2**63)"),
      (-2**63 - 1, f"rng={-2**63 - 1}: an integer seed must be in [-2**63, 2**63)")):
    for call in (lambda r: attnlab.generate(model, prompt, max_new_tokens=2, rng=r),
                 lambda r: attnlab.generate_requests(model, [[5, 6]], 2, rng=r)):
      with pytest.raises(GenerateInputError) as e:
        call(bad)
      assert str(e.value) == message
  # The ends of the range, and every bit of a seed in between, are in the key (JAX without
  # x64 kept a seed's low 32 bits: 2**32 + 7 was seed 7): attnlab.config.seed_key, which
  # tests/test_config.py checks against x64 JAX.
  for seed in (2**63 - 1, -2**63, 2**32 + 7):
    np.testing.assert_array_equal(data_of(as_key(seed)), data_of(seed_key(seed)))
  assert not np.array_equal(data_of(as_key(2**32 + 7)), data_of(as_key(7)))
  # An int seed is jax.random.key(seed); a key and its raw data are taken as before.
  data = jax.random.key_data
  # A 0-d integer array is its int (refused as "not an integer" until 2026-12-04).
  for rng, seed in ((0, 0), (7, 7), (np.int64(7), 7), (np.uint32(7), 7), (None, 0),
                    (jax.random.key(7), 7), (jax.random.PRNGKey(7), 7), (np.array(7), 7),
                    (jax.numpy.int32(7), 7)):
    np.testing.assert_array_equal(data(as_key(rng)), data(jax.random.key(seed)))
  for m in (model, encdec):
    # max_new_tokens=3, as below: the same compiled program (the eos is traced).
    first = int(attnlab.generate(m, prompt, max_new_tokens=3)[0, 0])
    for eos in (jax.numpy.int32(first), np.array(first)):
      np.testing.assert_array_equal(attnlab.generate(m, prompt, max_new_tokens=3, eos_id=eos),
                                    attnlab.generate(m, prompt, max_new_tokens=3, eos_id=first))
  # Beam search does not sample: a sampling other than greedy with it is refused (it was
  # ignored).
  for m in (model, encdec):
    for sampling in (attnlab.Sampling(temperature=0.5),
                     attnlab.Sampling(temperature=1.0, top_k=3)):
      with pytest.raises(GenerateInputError) as e:
        attnlab.generate(m, prompt, max_new_tokens=2, beam_size=2, sampling=sampling)
      assert str(e.value) == (f"beam search (beam_size=2) is deterministic: sampling="
                              f"{sampling} is not used with it; give one or the other")
  # The sampling program of test_generate_rng_none_is_key_zero_and_raw_key_data_is_a_key
  # (its model's graph, its prompt, budget and sampling): compiled once for both.
  hot = attnlab.Sampling(temperature=2.0)
  np.testing.assert_array_equal(
      attnlab.generate(model, prompt, max_new_tokens=8, eos_id=None, sampling=hot,
                       rng=np.int64(3)),
      attnlab.generate(model, prompt, max_new_tokens=8, eos_id=None, sampling=hot,
                       rng=jax.random.key(3)))
  np.testing.assert_array_equal(attnlab.generate(model, prompt, max_new_tokens=3,
                                                 eos_id=np.int64(7)),
                                attnlab.generate(model, prompt, max_new_tokens=3, eos_id=7))


def test_generate_checks_max_new_tokens_and_the_prompt_array():
  model = decoder_model("mha_rope")
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match=re.escape(
        f"max_new_tokens={bad!r} must be a positive integer")):
      attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=bad)
  for bad in (np.array([5, 6]), np.array([[5.0, 6.0]])):
    with pytest.raises(ValueError, match=re.escape(
        f"prompt must be an int array [B, T], got dtype {bad.dtype} and shape {bad.shape}")):
      attnlab.generate(model, bad)
  with pytest.raises(ValueError, match=re.escape("the prompt is empty (shape (0, 3))")):
    attnlab.generate(model, np.zeros((0, 3), np.int32))
  # The smallest request there is: one token of prompt, one new token (a NumPy int budget).
  assert attnlab.generate(model, np.array([[5]]), max_new_tokens=np.int64(1)).shape == (1, 1)


def test_generate_rng_none_is_key_zero_and_raw_key_data_is_a_key():
  """``rng=None`` samples as ``jax.random.key(0)``; raw uint32 key data (the old-style
  ``PRNGKey``) is wrapped, drawing what its typed key draws."""
  import jax

  model = decoder_model("mha_rope", varied=True)
  sample = lambda rng: np.asarray(attnlab.generate(
      model, np.array([[5, 6]]), max_new_tokens=8, eos_id=None,
      sampling=attnlab.Sampling(temperature=2.0), rng=rng))
  assert np.array_equal(sample(None), sample(jax.random.key(0)))
  assert np.array_equal(sample(jax.random.key_data(jax.random.key(3))), sample(jax.random.key(3)))
  assert not np.array_equal(sample(jax.random.key(3)), sample(jax.random.key(0)))


def test_generate_default_eos_is_the_tokenizers():
  """``generate`` (and the serving loop) stop at the byte tokenizer's eos unless told
  otherwise: the id the training data ends documents with."""
  import inspect

  from attnlab.data.tokenizer import EOS_ID

  for fn in (attnlab.generate, attnlab.generate_requests):
    assert inspect.signature(fn).parameters["eos_id"].default == EOS_ID


def test_generate_input_errors_have_their_own_type():
  """What ``attnlab decode`` maps to exit 2 is a ValueError subclass raised only for input."""
  from attnlab.decoding.generate import GenerateInputError

  assert issubclass(GenerateInputError, ValueError)
  model = decoder_model("mha_rope")
  with pytest.raises(GenerateInputError, match="max_len=64"):
    attnlab.generate(model, np.array([[5, 6]]), max_new_tokens=100)
  with pytest.raises(GenerateInputError, match="cache='nope'"):
    attnlab.generate(model, np.array([[5, 6]]), cache="nope")


@pytest.mark.parametrize("error", [ValueError("internal: a shape bug"),
                                   RuntimeError("internal: paged cache ran out")])
def test_decode_lets_internal_errors_propagate(workdir, monkeypatch, capsys, error):
  """A ValueError / RuntimeError that is not an input error is not turned into exit 2.

  It leaves ``main`` (so ``attnlab`` exits 1 with its traceback); an input
  error from the same call is still one line and exit 2.
  """

  def broken_generate(*args, **kwargs):
    raise error

  monkeypatch.setattr(decode_command, "generate", broken_generate)
  argv = ["decode", "--workdir", workdir, "--prompt", "hi", "--max_new_tokens", "3"]
  with pytest.raises(type(error), match="internal"):
    main(argv)
  assert capsys.readouterr().err == ""

  from attnlab.decoding.generate import GenerateInputError

  def refusing_generate(*args, **kwargs):
    raise GenerateInputError("max_new_tokens=3 is refused")

  monkeypatch.setattr(decode_command, "generate", refusing_generate)
  rc, out, err = _run(argv, capsys)
  assert rc == 2 and out == "" and err.strip().endswith("max_new_tokens=3 is refused")
  assert len(err.strip().splitlines()) == 1


def test_decode_internal_error_exits_1_with_a_traceback(workdir, tmp_path):
  """The real process: an internal error exits 1 (not 2) and prints a traceback."""
  import os
  import subprocess
  import sys

  script = tmp_path / "run.py"
  script.write_text(
      "import sys\n"
      "from attnlab.cli import main\n"
      "from attnlab.commands import decode\n"
      "def broken(*a, **k):\n"
      "  raise ValueError('internal: a shape bug')\n"
      "decode.generate = broken\n"
      "sys.exit(main(sys.argv[1:]))\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(script), "decode", "--workdir", workdir, "--prompt",
                         "hi", "--max_new_tokens", "3"], capture_output=True, text=True, env=env,
                        timeout=300)
  assert proc.returncode == 1, proc.stderr
  assert "Traceback" in proc.stderr and "internal: a shape bug" in proc.stderr
  assert proc.stdout == ""


def test_eval_and_decode_fall_back_past_a_damaged_checkpoint_with_one_plain_line(
    workdir, capsys, tmp_path):
  """In their own processes, ``attnlab eval`` and ``attnlab decode`` fall back past a
  damaged newest checkpoint with one warning line in attnlab's plain format, and decode
  what the previous checkpoint decodes; given the damaged step, they name it. Until
  2026-12-04 eval printed the warning twice (a UserWarning and a log line), the log line
  as "WARNING:attnlab.training.checkpoint:..." (absl had configured logging first), and
  decode did not fall back: "error: Expecting value: line 1 column 1 (char 0)". The damage
  is in the parameters' array data (tensorstore's files: the JSON metadata reads): until
  2026-12-07 orbax's and tensorstore's work of the failed read then printed ~2000 lines of
  tracebacks around that line ("Exception ignored in: <coroutine object
  _read_array_index_and_device_put ...>", "Event loop is closed", "Future exception was
  never retrieved")."""
  import shutil
  import subprocess
  import sys

  workdir = str(shutil.copytree(workdir, tmp_path / "w"))  # the module's run, step 2 damaged
  data = os.path.join(workdir, "checkpoints", "2", "params", "ocdbt.process_0")
  damaged_files = [os.path.join(root, name) for root, _, files in os.walk(data)
                   for name in files]
  assert len(damaged_files) > 1, damaged_files
  for path in damaged_files:
    with open(path, "wb") as f:
      f.write(b"garbage" * 40)
  capsys.readouterr()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  decode = ["decode", "--prompt", "a", "--max_new_tokens", "4"]
  damaged = f"checkpoint {workdir}/checkpoints/2 could not be restored ("
  for argv in (["eval"], decode):
    proc = subprocess.run([sys.executable, "-m", "attnlab.cli", *argv, "--workdir", workdir],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "could not be restored" in x]
    assert len(lines) == 1 and lines[0].startswith(damaged), proc.stderr
    assert lines[0].endswith("; falling back to the previous one"), lines[0]
    assert proc.stderr.splitlines()[0] == lines[0], proc.stderr[-3000:]
    assert len(proc.stderr.splitlines()) <= 2, proc.stderr[-3000:]  # decode: its tok/s
  rc, out, err = _run([*decode, "--workdir", workdir, "--step", "1"], capsys)
  assert rc == 0 and out == proc.stdout, err
  for argv in (["eval"], decode):
    rc, out, err = _run([*argv, "--workdir", workdir, "--step", "2"], capsys)
    assert rc == 2 and out == "", err
    assert err.startswith(f"attnlab {argv[0]}: error: {damaged}") and err.count("\n") == 1, err


def test_decode_slots_batches_continuously_and_matches_plain_decode(workdir, capsys, tmp_path):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("import os\nx = 1\ndef f(a, b):\n")
  base = ["decode", "--workdir", workdir, "--prompts_file", str(prompts), "--max_new_tokens", "6"]
  rc, plain, err = _run(base, capsys)
  assert rc == 0, err
  rc, served, err = _run(base + ["--slots", "2", "--page_size", "4"], capsys)
  assert rc == 0, err
  assert "3/3 requests" in err and "tok/s" in err
  rows = sorted(line.split("\t", 1) for line in served.splitlines())
  assert [int(i) for i, _ in rows] == [0, 1, 2]
  assert [text for _, text in rows] == plain.splitlines()
  rc, served, err = _run(base + ["--slots", "2", "--cache", "contiguous"], capsys)
  assert rc == 0, err
  assert sorted(line.split("\t", 1)[1] for line in served.splitlines()) == sorted(
      plain.splitlines())
  rc, _, err = _run(base + ["--slots", "0"], capsys)
  assert rc == 2 and "--slots=0" in err


def test_decode_slots_serves_the_others_and_names_a_request_that_can_never_fit(
    workdir, capsys, tmp_path, monkeypatch):
  """A prompt longer than the model's max_len cannot be served: the others print, then one
  line names each such prompt by its line in the file (blank lines counted, as without
  --slots; until 2026-12-04 by its request index alone) and its index (its tokens count
  the bos before the text), exit status 1. On a terminal that line starts after the
  progress bar's last frame."""
  _, cfg = attnlab.load_checkpoint(workdir)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("ab\n\n" + "x" * cfg.max_len + "\ncd\n" + "y" * (cfg.max_len + 1) + "\n")
  monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts),
                       "--slots", "2", "--max_new_tokens", "3"], capsys)
  assert rc == 1
  assert sorted(int(line.split("\t")[0]) for line in out.splitlines()) == [0, 2]
  why = lambda line, i, n: (f"line {line} of {prompts} (request {i}): prompt of {n} tokens + "
                            f"max_new_tokens 3 needs {n + 2} positions, more than the model's "
                            f"max_len={cfg.max_len}")
  bar, message = err.rsplit("\r", 1)[-1].split("\n", 1)
  assert re.fullmatch(r"\[#{10} {10}\] 2/4 requests, \d+ tokens, [\d.]+ tok/s", bar), err
  assert message == (f"attnlab decode: 2 request(s) can never be served ("
                     f"{why(3, 1, cfg.max_len + 1)}; {why(5, 3, cfg.max_len + 2)}); the other "
                     f"2 completed\n"), message
  # One --prompt is named as such; no bar was drawn, so no line ends it.
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompt", "x" * cfg.max_len,
                       "--slots", "1", "--max_new_tokens", "3"], capsys)
  assert rc == 1 and out == ""
  assert err == (
      f"attnlab decode: 1 request(s) can never be served (the prompt (request 0): prompt of "
      f"{cfg.max_len + 1} tokens + max_new_tokens 3 needs {cfg.max_len + 3} positions, more "
      f"than the model's max_len={cfg.max_len}); the other 0 completed\n"), err


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "log"])
def test_decode_slots_progress_counts_requests_tokens_and_rate(workdir, monkeypatch, capsys,
                                                               tmp_path, tty):
  """One progress frame per completed request: a 20-wide bar of the requests done, the
  requests, the tokens so far and tokens / s (a fake clock: 0.5 s per reading). In a log
  (stderr not a terminal) plain lines without the bar, no carriage return (until 2026-12-04
  the bar's frames went into log files). The serving is a stand-in that completes the
  requests out of order with 4, 1 and 3 tokens (the real one from the command:
  test_decode_slots_batches_continuously_and_matches_plain_decode)."""
  import itertools
  from types import SimpleNamespace

  from attnlab.decoding import batching

  clock = itertools.count(100.0, 0.5)  # the rate counts from the first reading
  monkeypatch.setattr(decode_command, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
  tokens = np.asarray(decode_command._tokenizer(workdir).encode("wxyz"), np.int32)

  def served(model, ids, max_new_tokens, *, on_result, **kw):
    assert max_new_tokens == 4 and kw["slots"] == 1 and len(ids) == 3
    for i, n in ((1, 4), (0, 1), (2, 3)):
      on_result(i, tokens[:n])

  lengths = []

  def spy(*args, on_result, **kw):  # records each completed request's token count
    return served(*args, on_result=lambda i, t: (lengths.append(len(t)), on_result(i, t)), **kw)

  monkeypatch.setattr(batching, "generate_requests", spy)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("a\nbb\nccc\n")
  monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts),
                       "--slots", "1", "--max_new_tokens", "4"], capsys)
  assert rc == 0, err
  if tty:
    # before each result after the first the bar's line is cleared (\r ESC[K), so the result
    # starts a clean line on the terminal (it followed the bar on its line until 2026-12-06)
    frames = err.split("\r\x1b[K")
    assert len(frames) == 3 and all(f.startswith("\r") and f.count("\r") == 1 for f in frames)
    frames = [f[1:] for f in frames]
    assert frames[-1].endswith("\n")
  else:
    assert "\r" not in err and err.endswith("\n")
    frames = err.splitlines()[-3:]
  assert len(out.splitlines()) == len(lengths) == 3
  done = 0
  for k, (n, frame) in enumerate(zip(lengths, frames, strict=True), start=1):
    done += n
    bar = "#" * (20 * k // 3)
    counts = f"{k}/3 requests, {done} tokens, {done / (0.5 * k):.1f} tok/s"
    want = f"[{bar:<20}] {counts}" if tty else f"attnlab decode: {counts}"
    assert frame.rstrip("\n") == want, frame


def test_decode_slots_progress_in_a_log_is_a_line_per_tenth_of_the_requests(
    workdir, monkeypatch, capsys, tmp_path):
  """25 requests into a log: a line at 3, 5, 8, 10, 13, 15, 18, 20, 23 and 25 (a tenth of
  the requests, not of the tokens, each), not 25. Each result line is flushed as it is
  printed (a pipe sees it when the request completes, not at the end). (The serving: a
  stand-in that completes request i with 1 + i % 3 tokens.)"""
  import io

  from attnlab.decoding import batching

  tokens = np.asarray(decode_command._tokenizer(workdir).encode("xyz"), np.int32)

  def served(model, ids, max_new_tokens, *, on_result, **kw):
    assert max_new_tokens == 3 and kw["slots"] == 4
    for i in range(len(ids)):
      on_result(i, tokens[:1 + i % 3])

  class Stdout(io.StringIO):  # records how many lines had been written at each flush
    def __init__(self):
      super().__init__()
      self.flushed = []

    def flush(self):
      self.flushed.append(self.getvalue().count("\n"))

  stdout = Stdout()
  monkeypatch.setattr(batching, "generate_requests", served)
  monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
  monkeypatch.setattr(sys, "stdout", stdout)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("".join(f"p{i}\n" for i in range(25)))
  rc, _, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts),
                     "--slots", "4", "--max_new_tokens", "3"], capsys)
  assert rc == 0 and len(stdout.getvalue().splitlines()) == 25, err
  assert set(range(1, 26)) <= set(stdout.flushed), stdout.flushed
  lines = [line for line in err.splitlines() if line.startswith("attnlab decode: ")]
  assert [int(line.split()[2].split("/")[0]) for line in lines] == [
      3, 5, 8, 10, 13, 15, 18, 20, 23, 25], err


def test_decode_slots_input_errors_exit_2_with_one_line(workdir, capsys):
  rc, _, err = _run(["decode", "--workdir", workdir, "--prompt", "hi", "--slots", "2",
                     "--cache", "contiguous", "--num_pages", "4"], capsys)
  assert rc == 2
  assert err.strip() == ("attnlab decode: error: num_pages=4 is for cache='paged', got "
                         "cache='contiguous'"), err


class _GenerateSpy:
  """Stands in for ``decode.generate``: records the call, then runs the real one (or, with
  ``real`` set False, returns one token per row: for a call whose arguments alone are
  checked, and which would compile a program of its own)."""

  def __init__(self, monkeypatch):
    self.calls = []
    self.real = True
    real = decode_command.generate

    def spy(model, prompt, **kw):
      self.calls.append((model, np.asarray(prompt), kw))
      if not self.real:
        return np.full((len(prompt), 1), ord("x"), np.int32)
      return real(model, prompt, **kw)

    monkeypatch.setattr(decode_command, "generate", spy)


def test_decode_hands_every_flag_to_generate(workdir, monkeypatch, capsys, tmp_path):
  import jax

  from attnlab.config import DecodeConfig

  spy = _GenerateSpy(monkeypatch)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("abc\nd\n")
  rc, _, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts),
                     "--max_new_tokens", "3", "--cache", "paged", "--cache_dtype", "int8",
                     "--page_size", "8", "--num_pages", "7", "--temperature", "0.5", "--top_k",
                     "4", "--top_p", "0.7", "--seed", "9"], capsys)
  assert rc == 0, err
  (model, prompt, kw), = spy.calls
  tok = decode_command._tokenizer(workdir)
  assert model.cfg.arch == "decoder_only"
  np.testing.assert_array_equal(prompt, [[tok.bos_id, *tok.encode("abc")],
                                         [tok.bos_id, *tok.encode("d")] + [model.cfg.pad_id] * 2])
  assert prompt.dtype == np.int32
  np.testing.assert_array_equal(kw.pop("prompt_lengths_B"), [4, 2])
  sampling, rng = kw.pop("sampling"), kw.pop("rng")
  assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.5, 4, 0.7)
  np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(jax.random.key(9)))
  # One call: no program to share, so the prompts keep their width (no bucket padding).
  assert kw == dict(max_new_tokens=3, cache="paged", eos_id=tok.eos_id, bos_id=tok.bos_id,
                    cache_dtype="int8", page_size=8, num_pages=7, bucket=False)
  spy.calls.clear()
  # Its arguments alone are checked here: the defaults (all but max_new_tokens) decode for
  # real in test_decode_prompt_sources_and_their_errors.
  spy.real = False
  rc, _, err = _run(["decode", "--workdir", workdir, "--prompt", "x"], capsys)
  spy.real = True
  assert rc == 0, err
  d = DecodeConfig()
  (_, _, kw), = spy.calls
  assert (kw["cache"], kw["max_new_tokens"], kw["cache_dtype"], kw["page_size"],
          kw["num_pages"]) == (d.cache, d.max_new_tokens, None, d.page_size, d.num_pages)
  assert (kw["sampling"].temperature, kw["sampling"].top_k, kw["sampling"].top_p) == (
      d.temperature, d.top_k, d.top_p)
  assert "beam_size" not in kw
  # bos is the tokenizer's, whatever it is (an hf_json one may hold another id, or none:
  # then 1, which a decoder-only model never reads).
  make_tokenizer = decode_command._make_tokenizer
  for bos, want in ((7, 7), (None, 1)):
    other = ByteTokenizer()
    other.bos_id = bos
    monkeypatch.setattr(decode_command, "_make_tokenizer", lambda cfg, tok=other: tok)
    spy.calls.clear()
    spy.real = False
    rc, _, err = _run(["decode", "--workdir", workdir, "--prompt", "x"], capsys)
    spy.real = True
    assert rc == 0 and spy.calls[0][2]["bos_id"] == want, (bos, err)
  monkeypatch.setattr(decode_command, "_make_tokenizer", make_tokenizer)
  # Beam search of a decoder-only model: its width, alpha and the prompts' lengths; the
  # printed completion is the search's.
  spy.calls.clear()
  rc, out, err = _run(["decode", "--workdir", workdir, "--prompts_file", str(prompts),
                       "--max_new_tokens", "3", "--beam_size", "3", "--length_penalty", "1.0"],
                      capsys)
  assert rc == 0, err
  (model, prompt, kw), = spy.calls
  assert (kw["beam_size"], kw["length_penalty"]) == (3, 1.0)
  np.testing.assert_array_equal(kw["prompt_lengths_B"], [4, 2])
  want = np.asarray(attnlab.generate(model, prompt, **kw))
  for line, row in zip(out.splitlines(), want, strict=True):
    row = row.tolist()
    row = row[:row.index(tok.eos_id)] if tok.eos_id in row else row
    assert line.split("\t", 1)[1] == tok.decode(row)


def test_serving_past_memory_is_one_line(workdir, capsys, monkeypatch):
  """XLA's RESOURCE_EXHAUSTED while serving (--slots) was a traceback (until 2026-12-06): one
  line naming the flags that size it, exit 2; any other error of the loop keeps its traceback.
  No flag sizes serving past memory on this model (num_pages is capped at the worst case), so
  the allocation's error is made to happen."""
  import jax

  from attnlab.decoding import batching

  argv = ["decode", "--workdir", workdir, "--prompt", "def", "--slots", "2"]
  for message in ("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.", "INTERNAL: x"):
    def serve(*a, message=message, **kw):
      raise jax.errors.JaxRuntimeError(message)

    monkeypatch.setattr(batching, "generate_requests", serve)
    if message.startswith("INTERNAL"):
      with pytest.raises(jax.errors.JaxRuntimeError, match="^INTERNAL: x$"):
        main(argv)
      continue
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and err.strip() == (
        "attnlab decode: error: out of memory serving the requests (RESOURCE_EXHAUSTED: Out of "
        "memory allocating 9 bytes.): give fewer --slots, a smaller --num_pages or "
        "--max_new_tokens"), err

@pytest.fixture(scope="module")
def encdec_workdir(tmp_path_factory):
  """A tiny encoder-decoder on the reverse task."""
  return _trained(tmp_path_factory, "seq2seq_reverse.gin", "TrainConfig.eval_every=0",
                  "ModelConfig.d_model=16", "ModelConfig.num_encoder_layers=1",
                  "ModelConfig.d_ff=32")


def test_decode_an_encoder_decoder_with_beam_search(encdec_workdir, monkeypatch, capsys):
  """An encoder-decoder decodes from the source (its length given: a token with the pad id
  would be a token, as in training) with the tokenizer's bos, and takes --beam_size /
  --length_penalty; --slots needs a decoder-only model."""
  spy = _GenerateSpy(monkeypatch)
  base = ["decode", "--workdir", encdec_workdir, "--prompt", "abc", "--max_new_tokens", "4"]
  rc, out, err = _run(base + ["--beam_size", "2", "--length_penalty", "0.8"], capsys)
  assert rc == 0, err
  (model, src, kw), = spy.calls
  tok = decode_command._tokenizer(encdec_workdir)
  assert model.cfg.arch == "encoder_decoder"
  np.testing.assert_array_equal(src, [[*tok.encode("abc"), tok.eos_id]])  # as in training
  assert kw["prompt_lengths_B"].tolist() == [4]
  assert (kw["beam_size"], kw["length_penalty"], kw["bos_id"]) == (2, 0.8, tok.bos_id)
  spy.calls.clear()
  spy.real = False  # its arguments alone are checked: the beam search above ran for real
  rc, _, err = _run(base, capsys)
  assert rc == 0, err
  assert "beam_size" not in spy.calls[0][2] and "length_penalty" not in spy.calls[0][2]
  rc, _, err = _run(base + ["--slots", "2"], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: --slots=2 needs a decoder-only "
                                     "checkpoint and no beam search"), err


def test_a_source_too_long_in_a_prompts_file_is_named_a_target_too_long_is_not(
    encdec_workdir, capsys, tmp_path):
  """An encoder-decoder's too-long source is named like a too-long prompt; max_new_tokens
  past the model's positions is about no prompt, so none is named."""
  _, cfg = attnlab.load_checkpoint(encdec_workdir)
  prompts = tmp_path / "p.txt"
  prompts.write_text("ab\n" + "y" * cfg.max_len + "\n")
  base = ["decode", "--workdir", encdec_workdir, "--prompts_file", str(prompts)]
  rc, out, err = _run(base + ["--max_new_tokens", "4"], capsys)
  assert rc == 2 and out == ""
  assert err.strip() == (
      f"attnlab decode: error: the source has {cfg.max_len + 1} positions, more than the "
      f"model's max_len={cfg.max_len} (the longest is line 2 of {prompts}, {cfg.max_len + 1} "
      f"tokens: {'y' * 40!r})"), err
  prompts.write_text("ab\ncd\n")
  rc, out, err = _run(base + ["--max_new_tokens", str(cfg.max_len + 1)], capsys)
  assert rc == 2 and out == ""
  assert err.strip() == (f"attnlab decode: error: max_new_tokens needs {cfg.max_len + 1} "
                         f"positions, more than the model's max_len={cfg.max_len}"), err


def test_decode_refuses_slots_with_beams_and_unknown_cache_dtypes(workdir, monkeypatch, capsys):
  from attnlab.config import CACHE_DTYPES

  base = ["decode", "--workdir", workdir, "--prompt", "x"]
  rc, _, err = _run(base + ["--slots", "2", "--beam_size", "2"], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: --slots=2 needs a decoder-only "
                                     "checkpoint and no beam search"), err
  rc, _, err = _run(base + ["--cache_dtype", "int4"], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: --cache_dtype=int4 is not one of "
                                     + ", ".join(CACHE_DTYPES)), err
  rc, _, err = _run(base + ["--max_new_tokens", "0"], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: max_new_tokens=0 must be a "
                                     "positive integer"), err
  # Flags that would do nothing (ignored until 2026-12-04; eval refused the first).
  rc, _, err = _run(base + ["--length_penalty", "0.5"], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: --length_penalty is the beam "
                                     "search's: give --beam_size 2 or more (--beam_size 1 "
                                     "decodes greedily)"), err
  # a width that is no width is named as such, not as greedy
  rc, _, err = _run(base + ["--beam_size", "0", "--length_penalty", "0.5"], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: beam_size=0 must be a positive "
                                     "integer"), err
  rc, _, err = _run(base + ["--page_size", "8", "--cache", "contiguous"], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: --page_size is the paged cache's, "
                                     "got --cache contiguous"), err
  # ... and where they do something, accepted. What each combination hands on is decoded for
  # real by test_decode_hands_every_flag_to_generate and
  # test_decode_slots_pass_every_flag_to_generate_requests: here generate and
  # generate_requests are stand-ins that return one token per prompt.
  from attnlab.decoding import batching

  token = np.asarray(decode_command._tokenizer(workdir).encode("x"), np.int32)
  monkeypatch.setattr(decode_command, "generate",
                      lambda model, prompt_BT, **kw: np.stack([token] * len(prompt_BT)))
  monkeypatch.setattr(batching, "generate_requests",
                      lambda model, prompts, n, *, on_result, **kw: [
                          on_result(i, token) for i in range(len(prompts))])
  for flags in (["--page_size", "8", "--slots", "2"], ["--page_size", "8", "--cache", "paged"],
                ["--beam_size", "2", "--length_penalty", "0.5", "--max_new_tokens", "2"]):
    rc, out, err = _run(base + flags, capsys)
    assert rc == 0 and out.rstrip("\n").endswith("x"), (flags, err)


def test_decode_prompt_sources_and_their_errors(workdir, capsys, tmp_path):
  """A prompts file (or standard input, "-"): one prompt per non-blank line, trailing spaces
  kept (only the newline goes); a missing file, a blank file and an empty --prompt are
  one-line errors; --workdir is required, --step takes a saved step number."""
  prompts = tmp_path / "p.txt"
  prompts.write_text("ab  \n   \nXcX\n", encoding="utf-8")
  base = ["decode", "--workdir", workdir, "--max_new_tokens", "2"]
  rc, out, err = _run(base + ["--prompts_file", str(prompts), "--step", "2"], capsys)
  assert rc == 0, err
  assert [line.split("\t")[0] for line in out.splitlines()] == ["ab  ", "XcX"]
  rc, _, err = _run(base + ["--prompt", "x", "--temperature", "-1"], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: temperature=-1.0 must be 0 "
                                     "(greedy) or >= 1e-06"), err
  missing = tmp_path / "nope.txt"
  rc, _, err = _run(base + ["--prompts_file", str(missing)], capsys)
  assert rc == 2 and err.strip() == (f"attnlab decode: error: cannot read --prompts_file: "
                                     f"[Errno 2] No such file or directory: '{missing}'"), err
  # Too few pages for the one sequence: bad input (--num_pages), not a crash.
  rc, _, err = _run(base + ["--prompt", "a longer prompt", "--cache", "paged", "--page_size",
                            "4", "--num_pages", "1"], capsys)
  assert rc == 2 and err.strip() == (
      "attnlab decode: error: the paged cache ran out of pages (num_pages=1, page_size=4); "
      "pass a larger num_pages or fewer / shorter sequences"), err
  (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
  rc, _, err = _run(base + ["--prompts_file", str(tmp_path / "latin1.txt")], capsys)
  assert rc == 2 and err.strip() == (f"attnlab decode: error: --prompts_file "
                                     f"{tmp_path / 'latin1.txt'} is not UTF-8 text (invalid "
                                     "continuation byte at byte 3)"), err
  # The byte is counted in the file: a byte order mark's three bytes too, and past the first
  # 8 KiB (until 2026-12-06 "byte 2" and "byte 1809": counted from after the mark, and from
  # the start of the chunk the line reader was in).
  for data, at in (("\ufeffab".encode() + b"\xffc\n", 5),
                   (b"x" * 9999 + b"\n" + b"\xff\n", 10000)):
    (tmp_path / "bad.txt").write_bytes(data)
    rc, _, err = _run(base + ["--prompts_file", str(tmp_path / "bad.txt")], capsys)
    assert rc == 2 and err.strip() == (f"attnlab decode: error: --prompts_file "
                                       f"{tmp_path / 'bad.txt'} is not UTF-8 text (invalid "
                                       f"start byte at byte {at})"), err
  # "-" is standard input (until 2026-12-07 "No such file or directory: '-'"): its binary
  # buffer, or a stand-in's text; its errors name it; a process without one is told so.
  for stdin in (io.TextIOWrapper(io.BytesIO(b"ab  \n\nXcX\n")), io.StringIO("ab  \n\nXcX\n")):
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(sys, "stdin", stdin)
      rc, out, err = _run(base + ["--prompts_file", "-"], capsys)
    assert rc == 0, err
    assert [line.split("\t")[0] for line in out.splitlines()] == ["ab  ", "XcX"]
  for data, message in ((b"\xff\n", "is not UTF-8 text (invalid start byte at byte 0)"),
                        (b"\n \n", "holds no prompt")):
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
      rc, _, err = _run(base + ["--prompts_file", "-"], capsys)
    assert (rc, err.strip()) == (2, "attnlab decode: error: --prompts_file - (standard input) "
                                    f"{message}"), err
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n" + b"x" * 5000 + b"\n")))
    rc, _, err = _run(base + ["--prompts_file", "-", "--max_new_tokens", "4"], capsys)
  assert rc == 2 and "(the longest is line 2 of standard input, " in err, err
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sys, "stdin", None)
    rc, _, err = _run(base + ["--prompts_file", "-"], capsys)
  assert (rc, err.strip()) == (2, "attnlab decode: error: --prompts_file -: this process has no "
                                  "standard input"), err
  closed = io.TextIOWrapper(io.BytesIO(b"x\n"))
  closed.close()  # closed inside the process: its read is a ValueError
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sys, "stdin", closed)
    rc, _, err = _run(base + ["--prompts_file", "-"], capsys)
  assert (rc, err.strip()) == (2, "attnlab decode: error: cannot read --prompts_file: I/O "
                                  "operation on closed file."), err
  (tmp_path / "blank.txt").write_text("\n  \n")
  rc, _, err = _run(base + ["--prompts_file", str(tmp_path / "blank.txt")], capsys)
  assert rc == 2 and err.strip() == (f"attnlab decode: error: --prompts_file "
                                     f"{tmp_path / 'blank.txt'} holds no prompt"), err
  rc, _, err = _run(base + ["--prompt", ""], capsys)
  assert rc == 2 and err.strip() == ("attnlab decode: error: the prompt is empty: give at "
                                     "least one character"), err
  rc, _, err = _run(["decode", "--prompt", "x"], capsys)
  assert rc == 2 and "the following arguments are required: --workdir" in err
  rc, _, err = _run(base + ["--prompt", "x", "--step", "two"], capsys)
  assert rc == 2 and "--step: invalid int value: 'two'" in err


def test_decode_a_workdir_whose_tokenizer_cannot_load_exits_2(workdir, capsys, tmp_path):
  """config.gin names a sentencepiece model that is not there (moved with the run): one line
  naming it, exit 2."""
  import shutil

  pytest.importorskip("sentencepiece")
  copy = tmp_path / "w"
  shutil.copytree(workdir, copy)
  gin = (copy / "config.gin").read_text()
  missing = str(tmp_path / "gone.model")
  gin = gin.replace("DataConfig.tokenizer = 'byte'", "DataConfig.tokenizer = 'sentencepiece'")
  gin = gin.replace("DataConfig.tokenizer_model = ''", f"DataConfig.tokenizer_model = '{missing}'")
  (copy / "config.gin").write_text(gin)
  rc, _, err = _run(["decode", "--workdir", str(copy), "--prompt", "x"], capsys)
  assert rc == 2
  assert err.strip().startswith(f"attnlab decode: error: tokenizer_model={missing!r} is not a "
                                "readable sentencepiece model: NOT_FOUND"), err
  assert len(err.strip().splitlines()) == 1


def test_prompts_are_laid_out_as_the_training_data_was(tmp_path):
  """A decoder-only LM reads [bos] text, a decoder-only pair task [bos] source [eos], an
  encoder-decoder source [eos] (data/pipeline.py); a tokenizer.json's post-processor bos
  is not added twice, and a tokenizer without bos starts with the text. Until 2026-12-03
  the prompt was the text alone: a position-0 token the model had never seen there (the
  demo's validation loss over the first 64 tokens: 1.655 against 1.604 with bos)."""
  from attnlab.data import pipeline

  tok = ByteTokenizer()
  text = list(tok.encode("ab"))
  lay = lambda *a: list(pipeline.prompt_ids(*a))
  assert lay(tok, "ab", "decoder_only", "lm") == [tok.bos_id, *text]
  for task in ("tsv", "reverse"):
    assert lay(tok, "ab", "decoder_only", task) == [tok.bos_id, *text, tok.eos_id]
  assert lay(tok, "ab", "encoder_decoder", "reverse") == [*text, tok.eos_id]
  # int32, as the training rows are (a list of int32 ids and an int eos was int64 to NumPy).
  assert {pipeline.prompt_ids(tok, "ab", arch, task).dtype for arch, task in (
      ("decoder_only", "lm"), ("decoder_only", "tsv"), ("encoder_decoder", "tsv"))} == {
          np.dtype(np.int32)}
  # ... which is how the training layouts begin an example.
  assert list(pipeline.PackedText(["ab"], tok, seq_len=3, seed=0).tokens_Y[:3]) == lay(
      tok, "ab", "decoder_only", "lm")
  for arch, key in (("decoder_only", "tokens_BT"), ("encoder_decoder", "src_BS")):
    row = pipeline.PairBatches([("ab", "xy")], tok, seq_len=8, arch=arch,
                               loss_on_prompt=False).batch([0])[key][0]
    want = lay(tok, "ab", arch, "reverse")
    assert list(row[:len(want)]) == want, arch
  pytest.importorskip("tokenizers")
  from tests.data.test_pipeline import _llama_like_tokenizer

  hf = HFJsonTokenizer(_llama_like_tokenizer(tmp_path), bos_id=3, eos_id=4)
  assert list(hf.encode("a !")) == [3, 1, 0]  # its post-processor adds bos
  assert lay(hf, "a !", "decoder_only", "lm") == [3, 1, 0]
  nobos = HFJsonTokenizer(str(tmp_path / "tokenizer.json"), bos_id=None, eos_id=4)
  assert lay(nobos, "a !", "decoder_only", "lm") == [1, 0]


def test_page_size_compiles_nothing_new_for_caches_without_pages():
  """page_size is the paged cache's: the contiguous and ring caches decode the same tokens
  with one compiled program whatever it says (each page_size was its own program until
  2026-12-05); the paged cache's page sizes give those tokens too."""
  from attnlab.decoding import generate as generate_lib

  model = decoder_model("mqa_rope_window3")
  prompt = np.array([[5, 6, 7]])
  for cache in ("contiguous", "ring"):
    want = attnlab.generate(model, prompt, max_new_tokens=3, cache=cache, eos_id=None)
    compiled = generate_lib._sample_decoder_only._cache_size()
    for page_size in (4, 8):
      got = attnlab.generate(model, prompt, max_new_tokens=3, cache=cache, eos_id=None,
                             page_size=page_size)
      np.testing.assert_array_equal(got, want)
      assert generate_lib._sample_decoder_only._cache_size() == compiled, (cache, page_size)
  for page_size in (2, 4):
    np.testing.assert_array_equal(attnlab.generate(model, prompt, max_new_tokens=3,
                                                   cache="paged", eos_id=None,
                                                   page_size=page_size), want)


@pytest.mark.parametrize("error, rc, message", [
    (KeyboardInterrupt, 130, "\nattnlab decode: interrupted\n"),
    (BrokenPipeError, 141, ""),
])
def test_ctrl_c_and_a_closed_pipe_end_a_command_with_one_line_or_none(
    error, rc, message, monkeypatch, capsys):
  """Ctrl-C in a command that does not stop at a step (decode, eval, convert): one line, then
  ``main`` raises the KeyboardInterrupt to its caller in the process (until 2026-12-07 it
  killed the process by SIGINT: a notebook's kernel), and the console script dies by SIGINT
  (stood in for here; the real one: the next test); stdout's reader gone (`| head -1`; a
  captured stdout, which has no descriptor to ask, counts as gone): no line, exit 141, as a
  Unix filter, from both. Both were a traceback until 2026-12-06."""
  from attnlab import cli

  def interrupted(argv):
    print("0\tprinted before", flush=True)
    raise error

  died = []
  monkeypatch.setattr(cli, "_die_by_sigint", lambda: died.append(True))
  monkeypatch.setattr(decode_command, "main", interrupted)
  if error is KeyboardInterrupt:
    with pytest.raises(KeyboardInterrupt):
      main(["decode", "--workdir", "w"])
  else:
    assert main(["decode", "--workdir", "w"]) == rc
  assert capsys.readouterr() == ("0\tprinted before\n", message) and died == []
  monkeypatch.setattr(sys, "argv", ["/venv/bin/attnlab", "decode", "--workdir", "w"])
  assert cli.console_main() == rc
  assert capsys.readouterr() == ("0\tprinted before\n", message)
  assert died == ([True] if error is KeyboardInterrupt else [])


def test_ctrl_c_kills_the_console_script_by_sigint_and_reaches_a_caller_in_the_process(
    tmp_path):
  """A real SIGINT while a command runs. The console script (``console_main``) and ``python
  -m attnlab.cli`` print the line, then die by SIGINT, as Python does, so that a shell script
  running them stops too (with exit 130 alone the script went on). ``main`` called in the
  process raises KeyboardInterrupt after the line, and its caller goes on (until 2026-12-07
  the process died: a notebook's kernel with it). A BrokenPipeError that is not stdout's
  (stdout here a healthy file) is not hidden: its traceback, exit 1."""
  import signal
  import subprocess

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  # SIGINT as Python's default has it (a shell's background job inherits it ignored).
  prelude = ("import signal, sys, time\nimport attnlab.commands.kv_size as k\n"
             "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
             "def main(argv):\n  print('before', flush=True)\n  {body}\n"
             "k.main = main\nsys.argv = ['attnlab', 'kv-size']\n")
  calls = {
      "console_main": "from attnlab.cli import console_main\nsys.exit(console_main())\n",
      "python -m attnlab.cli": ("import runpy\n"
                                "runpy.run_module('attnlab.cli', run_name='__main__')\n"),
      "main": ("from attnlab.cli import main\ntry:\n  main(['kv-size'])\n"
               "except KeyboardInterrupt:\n  print('the caller goes on', flush=True)\n"),
  }
  for how, call in calls.items():
    proc = subprocess.Popen([sys.executable, "-c", prelude.format(body="time.sleep(300)") + call],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    assert proc.stdout.readline() == "before\n", how
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert err.endswith("\nattnlab kv-size: interrupted\n"), (how, err)
    if how == "main":
      assert (proc.returncode, out) == (0, "the caller goes on\n"), (how, err)
    else:
      assert (proc.returncode, out) == (-signal.SIGINT, ""), (how, err)
      assert "Traceback" not in err, (how, err)
  out = tmp_path / "out.txt"
  with open(out, "w") as f:
    proc = subprocess.run([sys.executable, "-c", prelude.format(body="raise BrokenPipeError")
                           + calls["console_main"]], stdout=f, stderr=subprocess.PIPE,
                          env=env, timeout=120)
  assert proc.returncode == 1 and "Traceback" in proc.stderr.decode(), proc.stderr.decode()
  assert out.read_text() == "before\n"


def test_decode_into_a_pipe_closed_early_exits_quietly(workdir, tmp_path):
  """`attnlab decode --prompts_file F --slots 1 | head -1`: the reader leaves after the first
  result; the next print meets a closed pipe. No traceback, exit 141 (a BrokenPipeError
  traceback and exit 1 until 2026-12-06)."""
  import subprocess

  prompts = tmp_path / "prompts.txt"
  prompts.write_text("".join(f"line {i}\n" for i in range(40)))
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.Popen(
      [sys.executable, "-m", "attnlab.cli", "decode", "--workdir", workdir, "--prompts_file",
       str(prompts), "--slots", "1", "--max_new_tokens", "2"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
  first = proc.stdout.readline()
  proc.stdout.close()
  err = proc.stderr.read().decode()
  assert proc.wait(timeout=300) == 141, err
  assert first.split(b"\t")[0].isdigit(), first  # a whole result line came first
  assert "Traceback" not in err, err
