"""Seq2seq evaluation through the real path: train a tiny model to memorize a
4-line TSV (validation = the same lines), then ``attnlab eval`` must decode
every line exactly (exact match 1, BLEU 100), and at an early checkpoint the
reported exact match / BLEU must equal what sacrebleu computes from the
predictions file the eval writes. The BLEU of hand-made partial matches is
checked against a value worked out from n-gram counts by hand."""

import json
import logging
import math
import os
import re

import numpy as np
import pytest
import sacrebleu

import attnlab
from attnlab import config_gin as gin_config
from attnlab.data.tokenizer import ByteTokenizer
from attnlab.training import evaluate as eval_lib
from attnlab.training import trainer
from attnlab.training.checkpoint import load_checkpoint

# Four or more words per line: corpus BLEU needs 4-grams (with only 3-word
# sentences it is 0 even for perfect output).
LINES = [("the cat sat down", "le chat est assis"),
         ("a red door here", "une porte rouge ici"),
         ("I see you now", "je te vois maintenant"),
         ("good night my friend", "bonne nuit mon ami")]
# Validation: the same lines and the first again, 5 rows over batches of 4 (the last batch
# is filled up with rows that must be neither scored nor counted in the loss).
VALIDATION = LINES + LINES[:1]
# The byte-level models decode every line exactly from step 70 (encoder-decoder) or 40
# (decoder-only) on; the word-level one from step 30.
STEPS = 100
WORD_STEPS = 60


def _train(tmp_path, arch, tokenizer=()):
  tsv = tmp_path / "pairs.tsv"
  tsv.write_text("".join(f"{s}\t{t}\n" for s, t in LINES))
  val = tmp_path / "validation.tsv"
  val.write_text("".join(f"{s}\t{t}\n" for s, t in VALIDATION))
  model = "encdec_tiny.gin" if arch == "encoder_decoder" else "decoder_tiny.gin"
  gin = tmp_path / "task.gin"
  gin.write_text(f"include 'models/{model}'\n")
  bindings = [
      "ModelConfig.d_model = 32", "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 1",
      "ModelConfig.num_heads = 2",
      "DataConfig.task = 'tsv'", f"DataConfig.paths = ('{tsv}', '{val}')",
      "DataConfig.seq_len = 48", "DataConfig.batch_size = 4",
      f"TrainConfig.steps = {STEPS}", "TrainConfig.learning_rate = 3e-3",
      "TrainConfig.schedule = 'constant'", "TrainConfig.warmup_steps = 10",
      "TrainConfig.weight_decay = 0.0", "TrainConfig.eval_every = 0",
      "TrainConfig.checkpoint_every = 30", "TrainConfig.keep_checkpoints = 10",
      "TrainConfig.log_every = 50", "TrainConfig.progress = False", *tokenizer]
  if arch == "encoder_decoder":
    bindings.append("ModelConfig.num_encoder_layers = 1")
  configs = gin_config.parse([str(gin)], bindings)
  mcfg, dcfg, tcfg = configs
  workdir = tmp_path / "run"
  trainer.train(mcfg, tcfg, dcfg, str(workdir), config_text=gin_config.operative_config(*configs))
  return str(workdir)


def test_eval_with_a_word_level_tokenizer_stops_at_its_eos(tmp_path):
  """A transformers tokenizer.json (word level, bos 1 and eos 2 from the config, as after
  `attnlab convert`): the eval starts the decoder at the config's bos and cuts the decoded
  rows at its eos, so the memorized lines come back word for word, specials dropped."""
  from tests.data.hf_tokenizer import word_level_tokenizer_json

  words = sorted({w for pair in LINES for line in pair for w in line.split()})
  path = word_level_tokenizer_json(tmp_path / "tokenizer.json", ["<unk>", "<s>", "</s>", *words],
                                   specials=("<s>", "</s>"))
  workdir = _train(tmp_path, "encoder_decoder", [
      "DataConfig.tokenizer = 'hf_json'", f"DataConfig.tokenizer_model = '{path}'",
      "DataConfig.bos_id = 1", "DataConfig.eos_id = 2", "DataConfig.seq_len = 16",
      f"TrainConfig.steps = {WORD_STEPS}", "TrainConfig.checkpoint_every = 0"])
  final = trainer.evaluate_workdir(workdir)
  rows = _predictions(workdir, WORD_STEPS)
  assert [(r["source"], r["reference"], r["prediction"]) for r in rows] == [
      (s, t, t) for s, t in VALIDATION]
  assert final["exact_match"] == 1.0 and final["bleu"] == pytest.approx(100.0)


def test_eval_reads_the_parameters_alone_into_a_state_of_shapes(tmp_path, monkeypatch):
  """``evaluate_workdir`` builds the train state as shapes only and reads a checkpoint's
  parameters alone: its metrics are those of the run's whole state restored (how it read
  one until 2026-12-07, when the eager initialization of that state cost ~1.6-2.2 s of a
  3.3-4.0 s demo-sized eval); and a checkpoint whose optimizer state is damaged is still
  evaluated (its parameters read fine; a resume falls back past it)."""
  from attnlab.training import steps as steps_lib
  from attnlab.training.checkpoint import Checkpointer
  from tests.training.test_checkpoint import _flip, _largest

  workdir = _train(tmp_path, "decoder_only", ["TrainConfig.steps = 20",
                                              "TrainConfig.checkpoint_every = 10"])
  calls, init_train = [], steps_lib.init_train
  monkeypatch.setattr(steps_lib, "init_train",
                      lambda *a, **kw: calls.append(kw) or init_train(*a, **kw))
  got = trainer.evaluate_workdir(workdir)
  assert calls == [{"abstract": True}] and got["step"] == 20
  # The whole state, initialized and then restored as a resume restores it.
  mcfg, dcfg, tcfg = gin_config.read_workdir_config(f"{workdir}/config.gin")
  run = trainer.Run(mcfg, tcfg, dcfg)
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    assert run.restore(ckpt) == 20
  finally:
    ckpt.close()
  want = run.evaluate(str(tmp_path / "whole_state.jsonl"))
  assert {k: got[k] for k in want} == want
  _flip(_largest(f"{workdir}/checkpoints/20", "opt_state"), 0.5)
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    assert run.restore(ckpt) == 10  # damaged for a resume
  finally:
    ckpt.close()
  assert trainer.evaluate_workdir(workdir) == got


def _predictions(workdir, step):
  with open(trainer.predictions_path(workdir, step), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_eval_decodes_memorized_tsv_and_bleu_matches_sacrebleu(tmp_path, arch):
  workdir = _train(tmp_path, arch)
  final = trainer.evaluate_workdir(workdir)
  assert final["step"] == STEPS
  rows = _predictions(workdir, STEPS)
  assert [(r["source"], r["reference"]) for r in rows] == VALIDATION
  assert [r["prediction"] for r in rows] == [t for _, t in VALIDATION]
  assert final["exact_match"] == 1.0
  assert final["bleu"] == pytest.approx(100.0)
  # The loss counts the target bytes and eos of the 5 rows, none of the filling rows.
  assert final["tokens"] == sum(len(t.encode()) + 1 for _, t in VALIDATION)

  # Early on the outputs are partly wrong: the reported numbers must still
  # be those of the written predictions.
  early = trainer.evaluate_workdir(workdir, step=30)
  rows = _predictions(workdir, 30)
  preds, refs = [r["prediction"] for r in rows], [r["reference"] for r in rows]
  assert early["exact_match"] == np.mean([r["prediction_ids"] == r["reference_ids"]
                                          for r in rows])
  tok = ByteTokenizer()
  assert [tok.decode(r["prediction_ids"]) for r in rows] == preds
  assert early["exact_match"] < 1.0
  assert early["bleu"] == pytest.approx(sacrebleu.corpus_bleu(preds, [refs]).score, abs=1e-9)
  assert early["bleu"] < 100.0
  for kw, message in ((dict(beam_size=0), "beam_size=0 must be a positive integer"),
                      (dict(beam_size=True), "beam_size=True must be a positive integer"),
                      (dict(beam_size=2, length_penalty=-1.0), "length_penalty=-1.0 must be >= 0"),
                      (dict(beam_size=2, length_penalty=float("nan")),
                       "length_penalty=nan must be a finite number")):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
      trainer.evaluate_workdir(workdir, step=30, **kw)
  # Beam search (the paper's width; an alpha that is not the default 0.6, so that one
  # dropped on the way would show): its own predictions file, whose ids are what
  # attnlab.generate's beam search gives each source alone (an encoder-decoder's source
  # [eos]; a decoder-only model's prompt [bos] source [eos]).
  beam = trainer.evaluate_workdir(workdir, step=30, beam_size=4, length_penalty=1.5)
  assert (beam["beam_size"], beam["length_penalty"], beam["loss"]) == (4, 1.5, early["loss"])
  path = trainer.predictions_path(workdir, 30, beam_size=4, length_penalty=1.5)
  assert path.endswith("predictions_30_beam4_lp1.5.jsonl")
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  model, _ = load_checkpoint(workdir, step=30)
  tok = ByteTokenizer()
  for r, (src, _) in zip(rows, VALIDATION, strict=True):
    ids = [*tok.encode(src), tok.eos_id]
    if arch == "decoder_only":
      ids = [tok.bos_id, *ids]
    # The eval's prompt width: an encoder-decoder's source row, seq_len; a decoder-only
    # prompt, the evaluation's longest.
    width = 48 if arch == "encoder_decoder" else 2 + max(len(s.encode()) for s, _ in VALIDATION)
    row = np.zeros((1, width), np.int32)
    row[0, :len(ids)] = ids
    new_tokens = 48 if arch == "encoder_decoder" else min(48, model.cfg.max_len - width + 1)
    want = np.asarray(attnlab.generate(model, row, max_new_tokens=new_tokens,
                                       prompt_lengths_B=[len(ids)],
                                       eos_id=tok.eos_id, bos_id=tok.bos_id, beam_size=4,
                                       length_penalty=1.5))[0].tolist()
    assert r["prediction_ids"] == eval_lib._until_eos(want, tok.eos_id)
  assert beam["exact_match"] == np.mean([r["prediction_ids"] == r["reference_ids"] for r in rows])
  greedy = _predictions(workdir, 30)  # the greedy file is its own, and decoded otherwise
  assert [r["prediction_ids"] for r in rows] != [r["prediction_ids"] for r in greedy]


def test_bleu_of_hand_made_partial_matches_is_the_hand_computed_value(tmp_path):
  tok = ByteTokenizer()
  pairs = [  # (prediction, reference)
      ("the cat sat on the mat", "the cat sat on a mat"),
      ("good night", "good night my friend"),
      ("a red door here", "a red door here"),
  ]
  examples = [{"source": tok.encode("x"), "prediction": list(tok.encode(p)),
               "reference": list(tok.encode(r))} for p, r in pairs]
  # Clipped n-gram matches / n-grams of the predictions, summed over the corpus:
  #   1-grams: 5/6 (one "the" too many) + 2/2 + 4/4 = 11/12
  #   2-grams: 3/5 ("the cat", "cat sat", "sat on") + 1/1 + 3/3 = 7/9
  #   3-grams: 2/4 + 0/0 + 2/2 = 4/6
  #   4-grams: 1/3 ("the cat sat on") + 0/0 + 1/1 = 2/4
  # Prediction length c = 6 + 2 + 4 = 12 < reference length r = 6 + 4 + 4 = 14:
  # brevity penalty exp(1 - r / c).
  precisions = [11 / 12, 7 / 9, 4 / 6, 2 / 4]
  want = 100 * math.exp(1 - 14 / 12) * math.exp(sum(math.log(p) for p in precisions) / 4)
  out = eval_lib.seq2seq_metrics(examples, tok, bleu=True,
                                 predictions_path=str(tmp_path / "p.jsonl"))
  assert out["bleu"] == pytest.approx(want, rel=1e-9)  # 59.10...
  assert out["exact_match"] == pytest.approx(1 / 3)
  rows = [json.loads(line) for line in
          (tmp_path / "p.jsonl").read_text(encoding="utf-8").splitlines()]
  assert [(r["prediction"], r["reference"]) for r in rows] == pairs


# ----------------------------------------------------------------- the pieces, by hand

BOS, EOS, PAD = 1, 2, 0


def test_until_eos_cuts_at_the_first_eos():
  assert eval_lib._until_eos(np.array([5, 6, EOS, 7, EOS]), EOS) == [5, 6]
  assert eval_lib._until_eos(np.array([EOS, 5]), EOS) == []
  assert eval_lib._until_eos([5, 6, 7], EOS) == [5, 6, 7]


def test_split_rows_of_a_decoder_only_batch():
  """Rows ``[bos] source [eos] target [eos] pad...``: the prompt is the row through the first
  eos (pad after it), its length that many tokens; the reference is the target (targets
  are the row shifted by one)."""
  tokens = np.array([[BOS, 5, 6, EOS, 7, 8, 9, EOS, PAD, PAD],
                     [BOS, 5, EOS, 9, EOS, PAD, PAD, PAD, PAD, PAD]])
  targets = np.concatenate([tokens[:, 1:], np.full((2, 1), PAD)], axis=1)
  prompt, lengths, sources, refs, fits = eval_lib._split_rows(
      {"tokens_BT": tokens, "targets_BT": targets}, "decoder_only", EOS, PAD)
  np.testing.assert_array_equal(prompt, [[BOS, 5, 6, EOS], [BOS, 5, EOS, PAD]])  # widest
  assert prompt.dtype == lengths.dtype == np.int32
  np.testing.assert_array_equal(lengths, [4, 3])
  assert sources == [[5, 6], [5]]
  assert refs == [[7, 8, 9], [9]] and fits.tolist() == [True, True]
  # bos == eos (GPT-2's 50256): the source ends at the first eos after the bos (it was
  # the bos itself: every example scored its source as the reference).
  same = np.where(tokens == BOS, EOS, tokens)
  _, lengths, sources, refs, _ = eval_lib._split_rows(
      {"tokens_BT": same, "targets_BT": targets}, "decoder_only", EOS, PAD)
  assert lengths.tolist() == [4, 3] and sources == [[5, 6], [5]] and refs == [[7, 8, 9], [9]]
  # Rows cut by seq_len: no source eos, or no target eos, in the row: not scored.
  cut = np.array([[BOS, 5, 6, 7, 8, 9], [BOS, 5, EOS, 7, 8, 9], [BOS, 5, EOS, 7, EOS, PAD]])
  cut_targets = np.concatenate([cut[:, 1:], [[9], [9], [PAD]]], axis=1)
  prompt, lengths, _, refs, fits = eval_lib._split_rows(
      {"tokens_BT": cut, "targets_BT": cut_targets}, "decoder_only", EOS, PAD)
  assert fits.tolist() == [False, False, True] and refs[2] == [7]
  assert lengths.tolist() == [1, 1, 3] and prompt.shape == (3, 3)


def test_split_rows_of_an_encoder_decoder_batch():
  """The source lengths come from the batch's source segment ids (a real token with the
  pad id, row 0's PAD, stays in the source); without them generate masks pad ids. Sources
  and references of T - 1 tokens are whole."""
  src = np.array([[5, PAD, EOS, PAD], [7, EOS, PAD, PAD]])
  targets = np.array([[8, 9, EOS, PAD], [EOS, PAD, PAD, PAD]])
  seg = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
  prompt, lengths, sources, refs, fits = eval_lib._split_rows(
      {"src_BS": src, "targets_BT": targets, "src_segment_ids_BS": seg}, "encoder_decoder",
      EOS, PAD)
  assert fits.tolist() == [True, True]
  assert lengths.tolist() == [3, 2] and lengths.dtype == np.int32
  np.testing.assert_array_equal(prompt, src)
  assert sources == [[5, PAD], [7]] and refs == [[8, 9], []]
  _, lengths, *_ = eval_lib._split_rows({"src_BS": src, "targets_BT": targets},
                                        "encoder_decoder", EOS, PAD)
  assert lengths is None
  # With the examples' lengths (the pipeline's validation batches): a source and a target
  # of T - 1 tokens, the longest that fit, are whole; longer ones (cut by the layout, which
  # keeps the eos) stop at T - 1.
  src, targets = np.array([[5, 6, 7, EOS]] * 2), np.array([[8, 9, 10, EOS]] * 2)
  _, _, sources, refs, _ = eval_lib._split_rows(
      {"src_BS": src, "targets_BT": targets, eval_lib.SOURCE_LENGTH: np.array([3, 5]),
       eval_lib.TARGET_LENGTH: np.array([3, 4])}, "encoder_decoder", EOS, PAD)
  assert sources == [[5, 6, 7]] * 2 and refs == [[8, 9, 10]] * 2


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_a_text_holding_the_eos_id_is_split_by_the_examples_lengths(arch, monkeypatch,
                                                                    caplog):
  """A tokenizer.json encodes "</s>" inside a text as its eos: the validation batches carry
  each example's source and target length, and the rows are split by them (until
  2026-12-04 by the first eos, so "a</s>b" -> "def" was scored as source "a", reference
  "b"). Cut examples stay unscored, and so does a reference holding the eos; over several
  batches both are counted in every batch."""
  from types import SimpleNamespace

  from attnlab.config import DataConfig
  from attnlab.data import pipeline

  class EosInText(ByteTokenizer):  # "#" is the eos id, as "</s>" is in a tokenizer.json
    def encode(self, text, **kw):
      return np.asarray([self.eos_id if c == "#" else int(i)
                         for c, i in zip(text, super().encode(text, **kw))], np.int32)

  tok = EosInText()
  pairs = [("a#b", "def"), ("xy", "z#w"), ("q" * 30, "r")]
  src = pipeline.PairBatches(pairs, tok, seq_len=12, arch=arch, loss_on_prompt=False)
  (batch,) = pipeline.validation_batches({"validation": src}, DataConfig(batch_size=3), 1)
  assert batch[pipeline.SOURCE_LENGTH].tolist() == [3, 2, 30]
  assert batch[pipeline.TARGET_LENGTH].tolist() == [3, 3, 1]
  _, _, sources, refs, fits = eval_lib._split_rows(batch, arch, tok.eos_id, tok.pad_id)
  fits = fits & batch[pipeline.EXAMPLE_FITS]
  assert fits.tolist() == [True, True, False]
  assert sources[:2] == [list(tok.encode("a#b")), list(tok.encode("xy"))]
  assert refs[:2] == [list(tok.encode("def")), list(tok.encode("z#w"))]
  # Without the lengths (a batch from elsewhere): the first eos, as before.
  plain = {k: v for k, v in batch.items()
           if k not in (pipeline.SOURCE_LENGTH, pipeline.TARGET_LENGTH)}
  _, _, sources, refs, _ = eval_lib._split_rows(plain, arch, tok.eos_id, tok.pad_id)
  assert sources[0] == list(tok.encode("a"))
  # Scoring: the source may hold the eos, the reference may not (decoding stops at eos,
  # so "z#w" could never be matched): that example is counted, not scored.
  seen = []

  def fake_generate(model, prompt_BT, *, prompt_lengths_B, **kw):
    seen.append(prompt_BT[0, :prompt_lengths_B[0]].tolist())
    return np.array([list(tok.encode("def")) + [tok.eos_id]] * len(prompt_BT))

  monkeypatch.setattr(eval_lib, "generate", fake_generate)
  model = SimpleNamespace(cfg=SimpleNamespace(arch=arch, pad_id=tok.pad_id, max_len=64))
  with caplog.at_level("WARNING", logger=eval_lib.__name__):
    out = eval_lib.decode_batches(model, [batch], eos_id=tok.eos_id, bos_id=tok.bos_id)
  assert out == [{"source": list(tok.encode("a#b")), "reference": list(tok.encode("def")),
                  "prediction": list(tok.encode("def"))}]
  want_prompt = list(tok.encode("a#b")) + [tok.eos_id]
  assert seen == [want_prompt if arch == "encoder_decoder" else [tok.bos_id, *want_prompt]]
  one_batch = [r.getMessage() for r in caplog.records]
  assert one_batch == [
      "1 validation example(s) do not fit seq_len with their eos (cut by the data layout): "
      "not scored",
      "1 validation example(s) hold the eos id inside their reference (the tokenizer's eos "
      "string in the text), which decoding stops at: not scored"]
  # Over two batches both counts are the batches' sum.
  caplog.clear()
  with caplog.at_level("WARNING", logger=eval_lib.__name__):
    out = eval_lib.decode_batches(model, [batch, batch], eos_id=tok.eos_id, bos_id=tok.bos_id)
  assert [e["source"] for e in out] == [list(tok.encode("a#b"))] * 2
  assert [r.getMessage() for r in caplog.records] == ["2" + m[1:] for m in one_batch]


def test_validation_loss_is_token_weighted_over_the_batches(caplog):
  seen = []

  def eval_step(params, batch):
    seen.append((params, batch))
    return {"a": (6.0, 3.0), "b": (2.0, 1.0)}[batch]

  out = eval_lib.validation_loss(eval_step, "P", ["a", "b"], lambda b: b)
  assert out == {"loss": 2.0, "perplexity": pytest.approx(math.exp(2.0)), "tokens": 4.0}
  assert seen == [("P", "a"), ("P", "b")]
  assert eval_lib.validation_loss(eval_step, "P", ["b"], lambda b: b)["loss"] == 2.0  # 1 token
  # No counted token: nan and a warning (a loss of 0.0, perplexity 1.0 until 2026-12-04).
  with caplog.at_level(logging.WARNING, logger=eval_lib.__name__):
    for batches in ([], ["none"]):
      out = eval_lib.validation_loss(lambda p, b: (0.0, 0.0), "P", batches, lambda b: b)
      assert math.isnan(out["loss"]) and math.isnan(out["perplexity"]) and out["tokens"] == 0
  assert [r.getMessage() for r in caplog.records if r.name == eval_lib.__name__] == [
      "the validation batches count no token (every target cut by seq_len, say): the "
      "validation loss and perplexity are reported as nan"] * 2


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_decode_batches_asks_generate_for_room_to_the_row_width(monkeypatch, arch):
  """A decoder-only prompt is cut to its longest row, W, and gets min(T, max_len - W + 1)
  new tokens (its prompt lengths say where each ends; with the row width T in place of W a
  max_len of 2T - 1 or less left too little room to finish a target), an encoder-decoder T;
  predictions stop before eos."""
  from types import SimpleNamespace

  calls = []

  def generate(model_arg, prompt, **kw):
    assert model_arg is model
    calls.append((prompt, kw))
    return np.array([[9, EOS, 4], [EOS, 9, 9]])

  monkeypatch.setattr(eval_lib, "generate", generate)
  T = 6
  if arch == "decoder_only":
    tokens = np.array([[BOS, 5, EOS, 7, EOS, PAD], [BOS, 5, 6, EOS, 8, EOS]])
    batch = {"tokens_BT": tokens, "targets_BT": np.roll(tokens, -1, axis=1)}
  else:
    batch = {"src_BS": np.array([[5, EOS, PAD], [6, 7, EOS]]),
             "src_segment_ids_BS": np.array([[1, 1, 0], [1, 1, 1]]),
             "targets_BT": np.array([[9, EOS] + [PAD] * 4, [9, 9, EOS] + [PAD] * 3])}
  for max_len, want_new in ((64, T), (9, T), (7, 4)):
    model = SimpleNamespace(cfg=SimpleNamespace(arch=arch, pad_id=PAD, max_len=max_len))
    calls.clear()
    out = eval_lib.decode_batches(model, [batch, batch], eos_id=EOS, bos_id=BOS)
    assert len(calls) == 2
    prompt, kw = calls[0]
    new = T if arch == "encoder_decoder" else want_new
    assert kw["max_new_tokens"] == new and kw["eos_id"] == EOS and kw["bos_id"] == BOS
    assert kw["bucket"] is False  # one width per run: padding would only slow it
    if arch == "decoder_only":
      np.testing.assert_array_equal(kw["prompt_lengths_B"], [3, 4])
      np.testing.assert_array_equal(prompt, [[BOS, 5, EOS, PAD], [BOS, 5, 6, EOS]])
      assert [e["source"] for e in out[:2]] == [[5], [5, 6]]
      assert [e["reference"] for e in out[:2]] == [[7], [8]]
    else:
      np.testing.assert_array_equal(kw["prompt_lengths_B"], [2, 3])
      assert [e["source"] for e in out[:2]] == [[5], [6, 7]]
      assert [e["reference"] for e in out[:2]] == [[9], [9, 9]]
    assert [e["prediction"] for e in out] == [[9], []] * 2
  if arch == "decoder_only":  # every batch gets the evaluation's widest prompt: one shape
    short = dict(batch, tokens_BT=np.array([[BOS, EOS, 7, EOS, PAD, PAD]] * 2))
    short["targets_BT"] = np.roll(short["tokens_BT"], -1, axis=1)
    calls.clear()
    eval_lib.decode_batches(model, [short, batch], eos_id=EOS, bos_id=BOS)
    assert [(c[0].shape, c[1]["max_new_tokens"]) for c in calls] == [((2, 4), 4)] * 2
    np.testing.assert_array_equal(calls[0][0], [[BOS, EOS, PAD, PAD]] * 2)
  if arch == "decoder_only":  # a row cut by seq_len is left out (and counted in the log)
    cut = dict(batch, tokens_BT=np.array([[BOS, 5, 6, 7, 8, 9], tokens[1]]))
    cut["targets_BT"] = np.roll(cut["tokens_BT"], -1, axis=1)
    out = eval_lib.decode_batches(model, [cut], eos_id=EOS, bos_id=BOS)
    assert [e["source"] for e in out] == [[5, 6]] and [e["prediction"] for e in out] == [[]]


def test_a_short_prompt_with_a_long_reference_gets_its_room(monkeypatch, caplog):
  """max_len = T = 10; prompts of 8, 3 and 5 tokens with references of 1, 6 and 3: the batch
  call (width 8) leaves 3 new tokens, too few for the second and third rows; they go again
  at the width of their longest prompt (5: 6 new tokens, enough for the third), then the
  second alone at width 3 (8 new tokens). With an oracle for a model (the reference and eos
  after each prompt), every example matches; until 2026-12-04 only the first did. A row with
  no room at any width (max_len < T) is left out and counted."""
  from types import SimpleNamespace

  rows = [[BOS, 11, 12, 13, 14, 15, 16, EOS, 30, EOS],
          [BOS, 11, EOS, 40, 41, 42, 43, 44, 45, EOS],
          [BOS, 17, 18, 19, EOS, 50, 51, 52, EOS, PAD],
          [BOS, 11, 12, 13, 14, 15, 16, EOS, 30, EOS]]  # fills the batch: not scored
  tokens = np.array(rows)
  batch = {"tokens_BT": tokens, "targets_BT": np.roll(tokens, -1, axis=1),
           eval_lib.EXAMPLE_MASK: np.array([True, True, True, False])}
  answers = {tuple(r[:r.index(EOS) + 1]): r[r.index(EOS) + 1:] for r in rows}
  calls = []

  def oracle(model_arg, prompt_BW, *, max_new_tokens, prompt_lengths_B, **kw):
    W = prompt_BW.shape[1]
    assert max(prompt_lengths_B) <= W and W + max_new_tokens - 1 <= model.cfg.max_len
    calls.append((prompt_BW.shape, max_new_tokens))
    out = np.full((len(prompt_BW), max_new_tokens), PAD)
    for b, (p, n) in enumerate(zip(prompt_BW, prompt_lengths_B, strict=True)):
      answer = [t for t in answers[tuple(p[:n].tolist())] if t != PAD][:max_new_tokens]
      out[b, :len(answer)] = answer
    return out

  monkeypatch.setattr(eval_lib, "generate", oracle)
  model = SimpleNamespace(cfg=SimpleNamespace(arch="decoder_only", pad_id=PAD, max_len=10))
  out = eval_lib.decode_batches(model, [batch], eos_id=EOS, bos_id=BOS)
  assert [e["prediction"] for e in out] == [e["reference"] for e in out] == [
      [30], [40, 41, 42, 43, 44, 45], [50, 51, 52]]
  assert calls == [((4, 8), 3), ((4, 5), 6), ((4, 3), 8)]
  # A batch from elsewhere (the pipeline keeps seq_len <= max_len), max_len 8 < T = 10: a
  # prompt of 3 with a reference of 6 has no room at any width (3 + 6 > 8); it is left out
  # and counted in the warning with the cut rows; the prompt of 5 with a reference of 1 is
  # decoded.
  rows = [[BOS, 11, EOS, 40, 41, 42, 43, 44, 45, EOS],
          [BOS, 17, 18, 19, EOS, 50, EOS, PAD, PAD, PAD]]
  tokens = np.array(rows)
  answers = {tuple(r[:r.index(EOS) + 1]): r[r.index(EOS) + 1:] for r in rows}
  model = SimpleNamespace(cfg=SimpleNamespace(arch="decoder_only", pad_id=PAD, max_len=8))
  calls.clear()
  with caplog.at_level("WARNING", logger=eval_lib.__name__):
    out = eval_lib.decode_batches(model, [{"tokens_BT": tokens,
                                           "targets_BT": np.roll(tokens, -1, axis=1)}],
                                  eos_id=EOS, bos_id=BOS)
  assert [e["prediction"] for e in out] == [e["reference"] for e in out] == [[50]]
  assert calls == [((2, 5), 4)]
  assert caplog.messages == ["1 validation example(s) do not fit seq_len with their eos (cut "
                             "by the data layout): not scored"]
  # Widths rounded up to a multiple of 16 where a row has its room there (fewer programs):
  # max_len = T = 48; prompts of 40, 5 and 7 tokens, references of 1, 19 and 19 tokens: the
  # second call is at width 16, not 7.
  rows = [[BOS, *range(11, 49), EOS, 30, EOS] + [PAD] * 6,
          [BOS, 11, 12, 13, EOS, *range(60, 79), EOS] + [PAD] * 23,
          [BOS, *range(14, 19), EOS, *range(80, 99), EOS] + [PAD] * 21]
  assert {len(r) for r in rows} == {48}
  tokens = np.array(rows)
  answers = {tuple(r[:r.index(EOS) + 1]): r[r.index(EOS) + 1:] for r in rows}
  model = SimpleNamespace(cfg=SimpleNamespace(arch="decoder_only", pad_id=PAD, max_len=48))
  calls.clear()
  out = eval_lib.decode_batches(model, [{"tokens_BT": tokens,
                                         "targets_BT": np.roll(tokens, -1, axis=1)}],
                                eos_id=EOS, bos_id=BOS)
  assert [e["prediction"] for e in out] == [e["reference"] for e in out]
  assert calls == [((3, 40), 9), ((3, 16), 33)]


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_decode_batches_skips_the_rows_that_fill_up_the_last_batch(monkeypatch, caplog, arch):
  """Rows whose EXAMPLE_MASK is False (validation_batches' filling) are decoded with the
  batch but neither scored nor counted as cut by seq_len."""
  from types import SimpleNamespace

  from attnlab.data.pipeline import EXAMPLE_MASK

  monkeypatch.setattr(eval_lib, "generate",
                      lambda model, prompt, **kw: np.array([[9, EOS]] * len(prompt)))
  model = SimpleNamespace(cfg=SimpleNamespace(arch=arch, pad_id=PAD, max_len=64))
  if arch == "decoder_only":  # the filling rows: one a whole example, one cut by seq_len
    tokens = np.array([[BOS, 5, EOS, 7, EOS, PAD], [BOS, 6, EOS, 8, EOS, PAD],
                       [BOS, 5, 6, 7, 8, 9]])
    batch = {"tokens_BT": tokens, "targets_BT": np.roll(tokens, -1, axis=1)}
  else:
    batch = {"src_BS": np.array([[5, EOS], [6, EOS], [5, 6]]),
             "targets_BT": np.array([[7, EOS], [8, EOS], [7, 8]])}
  batch[EXAMPLE_MASK] = np.array([True, False, False])
  with caplog.at_level("WARNING", logger=eval_lib.__name__):
    out = eval_lib.decode_batches(model, [batch], eos_id=EOS, bos_id=BOS)
  assert out == [{"source": [5], "reference": [7], "prediction": [9]}]
  assert not caplog.records  # nothing counted as cut
  batch[EXAMPLE_MASK] = np.array([True, True, True])
  with caplog.at_level("WARNING", logger=eval_lib.__name__):
    out = eval_lib.decode_batches(model, [batch], eos_id=EOS, bos_id=BOS)
  assert [e["source"] for e in out] == [[5], [6]] + ([] if arch == "decoder_only" else [[5, 6]])
  if arch == "decoder_only":
    assert "1 validation example(s) do not fit" in caplog.text


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_decode_batches_leaves_out_the_examples_the_pipeline_cut(monkeypatch, caplog, arch):
  """An example whose EXAMPLE_FITS is False (``PairBatches.fits``: seq_len cut it) is not
  scored and is counted in the warning, for either model. An encoder-decoder's cut source
  and target still end with eos, so only the pipeline can tell; until 2026-12-04 eval
  scored them, a cut reference against the prediction."""
  from types import SimpleNamespace

  from attnlab.data.pipeline import EXAMPLE_FITS

  monkeypatch.setattr(eval_lib, "generate",
                      lambda model, prompt, **kw: np.array([[9, EOS]] * len(prompt)))
  model = SimpleNamespace(cfg=SimpleNamespace(arch=arch, pad_id=PAD, max_len=64))
  if arch == "decoder_only":
    tokens = np.array([[BOS, 5, EOS, 7, EOS, PAD], [BOS, 6, EOS, 8, EOS, PAD]])
    batch = {"tokens_BT": tokens, "targets_BT": np.roll(tokens, -1, axis=1)}
  else:
    batch = {"src_BS": np.array([[5, EOS], [6, EOS]]),
             "targets_BT": np.array([[7, EOS], [8, EOS]])}
  batch[EXAMPLE_FITS] = np.array([True, False])
  with caplog.at_level("WARNING", logger=eval_lib.__name__):
    out = eval_lib.decode_batches(model, [batch, batch], eos_id=EOS, bos_id=BOS)
  assert out == [{"source": [5], "reference": [7], "prediction": [9]}] * 2
  assert [r.getMessage() for r in caplog.records] == [
      "2 validation example(s) do not fit seq_len with their eos (cut by the data layout): "
      "not scored"]


def test_decode_batches_counts_the_cut_rows_of_every_batch_and_pads_with_pad_id(
    monkeypatch, caplog):
  """The warning counts the rows cut by seq_len over the whole evaluation; prompts are
  padded with the model's pad_id (here 7, not 0); no batches decode nothing."""
  from types import SimpleNamespace

  pad = 7
  calls = []

  def generate(model, prompt, **kw):
    calls.append(prompt)
    return np.array([[9, EOS]] * len(prompt))

  monkeypatch.setattr(eval_lib, "generate", generate)
  model = SimpleNamespace(cfg=SimpleNamespace(arch="decoder_only", pad_id=pad, max_len=64))
  cut = np.array([[BOS, 5, 6, 8, 8, 9], [BOS, 5, EOS, 8, EOS, pad]])
  short = np.array([[BOS, 5, 6, 8, 8, 9], [BOS, EOS, 8, EOS, pad, pad]])
  batches = [{"tokens_BT": t, "targets_BT": np.roll(t, -1, axis=1)} for t in (cut, short)]
  with caplog.at_level("WARNING", logger=eval_lib.__name__):
    out = eval_lib.decode_batches(model, batches, eos_id=EOS, bos_id=BOS)
  assert [e["source"] for e in out] == [[5], []]
  assert [r.getMessage() for r in caplog.records] == [
      "2 validation example(s) do not fit seq_len with their eos (cut by the data layout): "
      "not scored"]
  np.testing.assert_array_equal(calls[1], [[BOS, pad, pad], [BOS, EOS, pad]])
  assert eval_lib.decode_batches(model, [], eos_id=EOS, bos_id=BOS) == []


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_decode_batches_hands_the_beam_to_generate(monkeypatch, arch):
  from types import SimpleNamespace

  calls = []
  monkeypatch.setattr(eval_lib, "generate",
                      lambda model, prompt, **kw: calls.append(kw) or np.array([[9, EOS]]))
  if arch == "decoder_only":
    tokens = np.array([[BOS, 5, EOS, 9, EOS]])
    batch = {"tokens_BT": tokens, "targets_BT": np.roll(tokens, -1, axis=1)}
  else:
    batch = {"src_BS": np.array([[5, EOS]]), "targets_BT": np.array([[9, EOS]])}
  model = SimpleNamespace(cfg=SimpleNamespace(arch=arch, pad_id=PAD, max_len=64))
  eval_lib.decode_batches(model, [batch], eos_id=EOS, bos_id=BOS, beam_size=4,
                          length_penalty=0.7)
  eval_lib.decode_batches(model, [batch], eos_id=EOS, bos_id=BOS)
  assert [(c["beam_size"], c["length_penalty"]) for c in calls] == [(4, 0.7), (None, 0.6)]


def test_seq2seq_metrics_without_bleu_writes_its_folder_and_counts_nothing_on_nothing(
    tmp_path):
  """Exact match compares token ids; the file holds them beside the text, which can hide a
  difference (a special id the tokenizer drops: the third example reads as a hit)."""
  tok = ByteTokenizer()
  bc = [int(i) for i in tok.encode("bc")]
  ex = [{"source": tok.encode("a"), "reference": bc, "prediction": bc},
        {"source": tok.encode("d"), "reference": list(tok.encode("e")),
         "prediction": list(tok.encode("f"))},
        {"source": tok.encode("g"), "reference": bc, "prediction": [bc[0], BOS, bc[1]]}]
  path = tmp_path / "new" / "deeper" / "p.jsonl"
  out = eval_lib.seq2seq_metrics(ex, tok, bleu=False, predictions_path=str(path))
  assert out == {"exact_match": pytest.approx(1 / 3)}
  rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
  e, f = [int(i) for i in tok.encode("e")], [int(i) for i in tok.encode("f")]
  assert rows == [
      {"source": "a", "reference": "bc", "prediction": "bc", "reference_ids": bc,
       "prediction_ids": bc},
      {"source": "d", "reference": "e", "prediction": "f", "reference_ids": e,
       "prediction_ids": f},
      {"source": "g", "reference": "bc", "prediction": "bc", "reference_ids": bc,
       "prediction_ids": [bc[0], BOS, bc[1]]}]
  assert np.mean([r["prediction_ids"] == r["reference_ids"] for r in rows]) == (
      out["exact_match"])
  assert eval_lib.seq2seq_metrics(ex[:1], tok, bleu=False) == {"exact_match": 1.0}


def test_no_scored_example_is_nan_not_a_score(tmp_path, caplog):
  """Every validation example cut by seq_len: exact match and BLEU are nan, with a warning,
  and the predictions file is empty (until 2026-12-04 exact match read 0.0, and BLEU raised
  sacrebleu's IndexError out of the training run). Without BLEU the metrics and the warning
  name exact match alone."""
  path = tmp_path / "p.jsonl"
  with caplog.at_level(logging.WARNING, logger=eval_lib.__name__):
    out = eval_lib.seq2seq_metrics([], ByteTokenizer(), bleu=True, predictions_path=str(path))
  assert set(out) == {"exact_match", "bleu"} and all(math.isnan(v) for v in out.values())
  assert caplog.messages == [
      "no validation example could be scored: exact match and BLEU reported as nan"]
  assert path.read_text(encoding="utf-8") == ""
  # Without BLEU: exact match alone, and the warning names it alone.
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger=eval_lib.__name__):
    out = eval_lib.seq2seq_metrics([], ByteTokenizer(), bleu=False)
  assert list(out) == ["exact_match"] and math.isnan(out["exact_match"])
  assert caplog.messages == [
      "no validation example could be scored: exact match reported as nan"]


def test_predictions_are_utf8_text_and_bleu_without_sacrebleu_says_what_to_install(
    tmp_path, monkeypatch):
  import sys

  from attnlab.extras import MissingDependencyError

  tok = ByteTokenizer()
  ex = [{"source": tok.encode("thé"), "reference": list(tok.encode("café crème")),
         "prediction": list(tok.encode("café"))}]
  path = tmp_path / "p.jsonl"
  eval_lib.seq2seq_metrics(ex, tok, bleu=False, predictions_path=str(path))
  line = json.loads(path.read_bytes().decode("utf-8"))
  assert path.read_bytes().decode("utf-8").startswith(
      '{"source": "thé", "reference": "café crème", "prediction": "café", ')
  assert line["prediction_ids"] == list(tok.encode("café"))
  monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import sacrebleu raises ImportError
  with pytest.raises(MissingDependencyError, match="^" + re.escape(
      "task='tsv' (BLEU in eval) needs the sacrebleu package: pip install sacrebleu (a "
      "dependency of attnlab: reinstall it)") + "$"):
    eval_lib.seq2seq_metrics(ex, tok, bleu=True)


def test_predictions_are_written_whole_or_not_at_all(tmp_path, monkeypatch, caplog):
  """An eval stopped while it writes its predictions (a kill, a full disk, an error) leaves
  the file an earlier eval of that step wrote as it was (until 2026-12-07 it was opened for
  writing first and cut short at the line reached). A write that fails with an OSError (a
  full disk) is a warning naming the file, and the metrics stand (until 2026-12-07 the
  error came through: a traceback after the whole eval, its metrics lost, or a training run
  stopped at its periodic eval)."""
  path = tmp_path / "predictions_30.jsonl"
  path.write_text("the earlier eval's lines\n")
  examples = [dict(source=[5, 6], reference=[7, 8], prediction=[7, 8]) for _ in range(3)]
  tok = ByteTokenizer()
  dumps, calls = json.dumps, []

  def fails_on_the_second_line(obj, **kw):
    calls.append(obj)
    if len(calls) == 2:
      raise OSError(28, "No space left on device")
    return dumps(obj, **kw)

  monkeypatch.setattr(eval_lib.json, "dumps", fails_on_the_second_line)
  out = eval_lib.seq2seq_metrics(examples, tok, bleu=False, predictions_path=str(path))
  assert out == {"exact_match": 1.0}
  assert caplog.messages == [
      f"the decoded examples could not be written to {path} (OSError: [Errno 28] No space "
      "left on device); the metrics stand"]
  assert path.read_text() == "the earlier eval's lines\n" and os.listdir(tmp_path) == [path.name]
  # a folder that cannot be made (a file in its place): the same
  caplog.clear()
  (tmp_path / "eval").write_text("")
  monkeypatch.setattr(eval_lib.json, "dumps", dumps)
  out = eval_lib.seq2seq_metrics(examples, tok, bleu=False,
                                 predictions_path=str(tmp_path / "eval" / "p.jsonl"))
  assert out == {"exact_match": 1.0} and len(caplog.messages) == 1, caplog.messages
  assert caplog.messages[0].startswith(f"the decoded examples could not be written to "
                                       f"{tmp_path}/eval/p.jsonl (FileExistsError: ")
  (tmp_path / "eval").unlink()
  monkeypatch.setattr(eval_lib.json, "dumps", dumps)
  eval_lib.seq2seq_metrics(examples, tok, bleu=False, predictions_path=str(path))
  assert len(path.read_text().splitlines()) == 3


def test_host_params_are_numpy_copies():
  import jax.numpy as jnp

  out = eval_lib.host_params({"w": jnp.ones((2, 3)), "n": [jnp.int32(4)]})
  assert isinstance(out["w"], np.ndarray) and isinstance(out["n"][0], np.ndarray)
  np.testing.assert_array_equal(out["w"], np.ones((2, 3)))


def test_decode_prompts_boundaries():
  """``_decode_prompts`` by hand, at its edges: a row whose reference needs exactly the
  budget is served by the first call; a row that has its room only at the last position
  (l + t == max_len) is served, one a position short of it is not (counted); a reference
  longer than T is not (counted) and the loop ends; widths round up to 16 (17 -> 32)."""
  calls = []

  def decode(prompt_BW, lengths_B, budget):
    calls.append((prompt_BW.shape[1], budget))
    assert lengths_B.max() <= prompt_BW.shape[1]
    return np.tile(np.arange(budget), (len(prompt_BW), 1))

  def run(lengths, ref_lens, T, max_len, score=None):
    calls.clear()
    lengths = np.array(lengths)
    score = np.ones(len(lengths), bool) if score is None else np.array(score)
    prompt = np.zeros((len(lengths), int(lengths.max())), np.int32)
    return eval_lib._decode_prompts(decode, prompt, lengths, [[0] * n for n in ref_lens],
                                    score, T, max_len)

  # W = 8, max_len = 10: budget 3; a 2-token reference needs exactly 3.
  out, lost = run([8, 4], [2, 2], T=10, max_len=10)
  assert calls == [(8, 3)] and lost == 0 and [len(o) for o in out] == [3, 3]
  # the second row needs 7 > 3: again at width 4 (budget 7), its room to the last position
  out, lost = run([8, 4], [2, 6], T=10, max_len=10)
  assert calls == [(8, 3), (4, 7)] and lost == 0 and len(out[1]) == 7
  # l + t = 11 > max_len = 10: no room even alone; not decoded again, counted
  out, lost = run([8, 4], [2, 7], T=12, max_len=10)
  assert calls == [(8, 3)] and lost == 1 and out[1] is None and out[0] is not None
  # a row that is not scored is never decoded again, whatever its reference
  out, lost = run([8, 4], [2, 7], T=12, max_len=10, score=[True, False])
  assert calls == [(8, 3)] and lost == 0 and out[1] is not None
  # a reference longer than T (no width gives it room): the loop ends, counted
  out, lost = run([40, 3], [1, 30], T=20, max_len=64)
  assert calls == [(40, 20)] and lost == 1 and out[1] is None
  # a row with no room even alone (7 + 4 > 10) holds the longest prompt left; the row that
  # fits narrower (3 + 5 <= 10) still goes, at its own width (until 2026-12-05 the first
  # stopped the loop and both were counted)
  out, lost = run([8, 7, 3], [1, 4, 5], T=12, max_len=10)
  assert calls == [(8, 3), (3, 8)] and lost == 1 and out[1] is None and len(out[2]) == 8
  # the width rounds up to a multiple of 16: 17 -> 32 (budget 33 holds the 20 needed)
  out, lost = run([60, 17], [1, 19], T=40, max_len=64)
  assert calls == [(60, 5), (32, 33)] and lost == 0 and len(out[1]) == 33
