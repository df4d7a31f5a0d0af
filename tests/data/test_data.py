"""Data: tokenizer, synthetic tasks, packing (no attention across documents),
corpus splits, TSV, and checkpointable iterator state."""

import dataclasses
import os
import re
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab.config import DataConfig, ModelConfig
from attnlab.data import packing, pipeline, text
from attnlab.data.synthetic import SyntheticPairs
from attnlab.data.tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trip_and_ids():
  tok = ByteTokenizer()
  ids = tok.encode("déf x")
  assert ids.min() >= 3 and tok.vocab_size == ModelConfig().vocab_size == 259
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) == (ModelConfig().pad_id, 1, 2)
  assert tok.decode(np.concatenate([[1], ids, [2, 0, 0]])) == "déf x"
  assert tok.encode("A")[0] == ord("A") + 3


@pytest.mark.parametrize("task,check", [
    ("copy", lambda s, t: s == t),
    ("reverse", lambda s, t: s[::-1] == t),
    ("sort", lambda s, t: "".join(sorted(s)) == t),
    ("add", lambda s, t: sum(int(x) for x in s.split("+")) == int(t)),
])
def test_synthetic_tasks_are_correct_and_seeded(task, check):
  a = SyntheticPairs(task, seed=3, split="train", min_len=2, max_len=9, vocab_chars=6)
  b = SyntheticPairs(task, seed=3, split="train", min_len=2, max_len=9, vocab_chars=6)
  v = SyntheticPairs(task, seed=3, split="validation", min_len=2, max_len=9, vocab_chars=6)
  pairs = [a[i] for i in range(50)]
  assert pairs == [b[i] for i in range(50)]
  assert pairs != [v[i] for i in range(50)]
  assert all(check(s, t) for s, t in pairs)


def test_packing_segments_positions_and_loss_mask():
  docs = [np.array([10, 11, 12]), np.array([20, 21]), np.array([30, 31, 32, 33])]
  tokens, doc_ids = packing.concat_documents(docs, bos_id=1, eos_id=2)
  # stream: 1 10 11 12 2 | 1 20 21 2 | 1 30 31 32 33 2
  batch = packing.packed_rows(tokens, doc_ids, np.array([0, 1]), seq_len=7)
  np.testing.assert_array_equal(batch["tokens_BT"][0], [1, 10, 11, 12, 2, 1, 20])
  np.testing.assert_array_equal(batch["targets_BT"][0], [10, 11, 12, 2, 1, 20, 21])
  np.testing.assert_array_equal(batch["segment_ids_BT"][0], [1, 1, 1, 1, 1, 2, 2])
  np.testing.assert_array_equal(batch["positions_BT"][0], [0, 1, 2, 3, 4, 0, 1])
  # The eos -> next bos target crosses documents: not trained on.
  np.testing.assert_array_equal(batch["loss_mask_BT"][0], [1, 1, 1, 1, 0, 1, 1])
  # Row 2 starts mid-document: positions count from the row start.
  np.testing.assert_array_equal(batch["tokens_BT"][1], [21, 2, 1, 30, 31, 32, 33])
  np.testing.assert_array_equal(batch["positions_BT"][1], [0, 1, 0, 1, 2, 3, 4])
  np.testing.assert_array_equal(batch["segment_ids_BT"][1], [1, 1, 2, 2, 2, 2, 2])


def test_packed_documents_do_not_attend_to_each_other():
  cfg = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  doc2 = rng.integers(3, 259, 6)
  rows = []
  for _ in range(2):  # two different first documents, same second document
    tokens, doc_ids = packing.concat_documents([rng.integers(3, 259, 5), doc2], 1, 2)
    rows.append(packing.packed_rows(tokens, doc_ids, np.array([0]), seq_len=len(tokens) - 1))
  run = nnx.jit(lambda m, t, p, s: m(t, positions_BT=p, segment_ids_BT=s))
  logits = [run(model, jnp.asarray(r["tokens_BT"]), jnp.asarray(r["positions_BT"]),
                jnp.asarray(r["segment_ids_BT"])) for r in rows]
  seg = rows[0]["segment_ids_BT"][0]
  assert not np.allclose(logits[0][0, seg == 1], logits[1][0, seg == 1])
  np.testing.assert_allclose(logits[0][0, seg == 2], logits[1][0, seg == 2], atol=1e-5)
  # ... and equal the second document run on its own at positions 0..n-1.
  alone = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(rows[0]["tokens_BT"][:, seg == 2]))
  np.testing.assert_allclose(logits[0][0, seg == 2], alone[0], atol=1e-5)


def test_iterator_state_resumes_the_same_batches(tmp_path):
  for i in range(4):
    (tmp_path / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
  dcfg = DataConfig(task="lm", paths=(str(tmp_path / "*.py"),), seq_len=16, batch_size=4,
                    validation_percent=25)
  sources, _ = pipeline.build_sources(dcfg, ModelConfig())
  it = pipeline.train_iterator(sources, dcfg)
  batches = [next(it) for _ in range(30)]  # several epochs: reshuffled each
  it2 = pipeline.train_iterator(sources, dcfg)
  it2.set_state(pipeline.BatchIterator(sources["train"], 4, 0, index=17).get_state())
  for want in batches[17:]:
    got = next(it2)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def _lm_corpus(tmp_path):
  for i in range(4):
    (tmp_path / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 3)
  return DataConfig(task="lm", paths=(str(tmp_path / "*.py"),), seq_len=16, batch_size=4,
                    validation_percent=25)


def _stream(sources, dcfg, n):
  """The first ``n`` examples of the training stream, one batch of 1 at a time."""
  one = pipeline.train_iterator(sources, dataclasses.replace(dcfg, batch_size=1))
  return np.concatenate([next(one)["tokens_BT"] for _ in range(n)])


def test_the_training_stream_is_a_permutation_per_epoch_and_validation_in_order(tmp_path):
  dcfg = _lm_corpus(tmp_path)
  sources, _ = pipeline.build_sources(dcfg, ModelConfig())
  stream = _stream(sources, dcfg, 80)
  size = sources["train"].size
  assert stream.shape == (80, 16) and size < 30  # 80 examples span several epochs
  # The stream: every epoch a permutation of the rows, seeded by (seed, epoch).
  for epoch in range(2):
    perm = np.random.default_rng([dcfg.seed, epoch]).permutation(size)
    np.testing.assert_array_equal(stream[epoch * size:(epoch + 1) * size],
                                  sources["train"].batch(perm)["tokens_BT"])
  assert not np.array_equal(stream[:size], stream[size:2 * size])
  # A batch may hold every row, not more.
  assert next(pipeline.BatchIterator(sources["train"], size, 0))["tokens_BT"].shape == (size, 16)
  with pytest.raises(ValueError, match=re.escape(
      f"batch_size={size + 1} is larger than the data ({size} rows)")):
    pipeline.BatchIterator(sources["train"], size + 1, 0)
  # The training iterator of a config names the config's data (the size alone named neither
  # the split nor the files before 2026-12-04).
  with pytest.raises(ValueError, match=re.escape(
      f"DataConfig.batch_size={size + 1} is larger than the training split of task='lm', "
      f"paths={dcfg.paths!r} ({size} rows of seq_len=16): lower batch_size or give more data")):
    pipeline.train_iterator(sources, dataclasses.replace(dcfg, batch_size=size + 1))
  assert next(pipeline.train_iterator(sources, dataclasses.replace(dcfg, batch_size=size)))[
      "tokens_BT"].shape == (size, 16)  # every row in one batch: fine
  # Validation batches: the rows in source order from the first row on, every row up to
  # num_batches batches (a last batch is filled up with the first rows, not examples).
  n = sources["validation"].size
  val = pipeline.validation_batches(sources, dcfg, num_batches=(n + 3) // 4)
  assert len(val) == (n + 3) // 4 and n % 4  # this corpus ends inside a batch
  mask = np.concatenate([b[pipeline.EXAMPLE_MASK] for b in val])
  assert mask.tolist() == [True] * n + [False] * (len(mask) - n)
  ids = np.concatenate([np.arange(n), np.arange(len(mask) - n)])
  np.testing.assert_array_equal(np.concatenate([b["tokens_BT"] for b in val]),
                                sources["validation"].batch(ids)["tokens_BT"])
  losses = np.concatenate([b["loss_mask_BT"] for b in val])
  np.testing.assert_array_equal(losses[:n], sources["validation"].batch(np.arange(n))[
      "loss_mask_BT"])
  assert not losses[n:].any()


def test_a_resume_with_another_batch_size_continues_at_the_next_example(tmp_path):
  """The state is the next example's position: batches of 4, then (resumed) of 6, read
  the stream's examples in order, across epochs, none skipped or repeated."""
  dcfg = _lm_corpus(tmp_path)
  sources, _ = pipeline.build_sources(dcfg, ModelConfig())
  stream = _stream(sources, dcfg, 80)
  assert stream.shape == (80, 16) and sources["train"].size < 30
  it = pipeline.train_iterator(sources, dcfg)
  got = [next(it)["tokens_BT"] for _ in range(5)]
  it6 = pipeline.train_iterator(sources, dataclasses.replace(dcfg, batch_size=6))
  it6.set_state(it.get_state())
  got += [next(it6)["tokens_BT"] for _ in range(10)]
  np.testing.assert_array_equal(np.concatenate(got), stream)
  assert it6.get_state() == {"index": 15, "example": 80, "batch_size": 6,
                             "stream": pipeline.stream_fields(dcfg,
                                                              pipeline.training_files(dcfg))}
  # A state saved before the position was (a batch index) counts batches of this size.
  old = pipeline.train_iterator(sources, dcfg)
  old.set_state({"index": 3})
  np.testing.assert_array_equal(next(old)["tokens_BT"], stream[12:16])


def test_a_resume_under_another_training_stream_is_refused(tmp_path, monkeypatch):
  """Only the fields that decide which example is the i-th (per task) are compared; an LM
  corpus as the files it matched (test_a_resume_compares_the_files_an_lm_corpus_matched),
  the paths of a state saved before those were kept as the files they name (another
  spelling of the same files is the same stream)."""
  dcfg = _lm_corpus(tmp_path)
  sources, _ = pipeline.build_sources(dcfg, ModelConfig())
  state = pipeline.train_iterator(sources, dcfg).get_state()
  # A state of before 2026-12-07: its stream without the files it read.
  old_state = {**state, "stream": {k: v for k, v in state["stream"].items() if k != "files"}}
  for change, named in (({"seed": 1}, "DataConfig.seed: 0 -> 1"),
                        ({"seq_len": 8}, "DataConfig.seq_len: 16 -> 8"),
                        ({"max_files": 2, "validation_percent": 10},
                         "DataConfig.max_files: 0 -> 2, DataConfig.validation_percent: 25 -> 10"),
                        # another task: the fields of both tasks, None where one has none
                        ({"task": "copy"}, (
                            "DataConfig.max_files: 0 -> None, DataConfig.max_len: None -> 12, "
                            "DataConfig.min_len: None -> 3, DataConfig.paths: "
                            f"('{tmp_path}/*.py',) -> None, DataConfig.seq_len: 16 -> None, "
                            "DataConfig.task: 'lm' -> 'copy', DataConfig.tokenizer: 'byte' -> "
                            "None, DataConfig.validation_percent: 25 -> None, "
                            "DataConfig.vocab_chars: None -> 10"))):
    if change.get("task") == "copy":  # the fields it does not read at their defaults
      change = {**change, "paths": (), "validation_percent": 5}
    it = pipeline.train_iterator(sources, dataclasses.replace(dcfg, **change))
    with pytest.raises(pipeline.DataStateError, match=re.escape(
        f"the saved data position belongs to another training stream ({named})")):
      it.set_state(state)
  # An old state's patterns are compared as the files they name: another pattern is
  # another stream.
  with pytest.raises(pipeline.DataStateError, match=re.escape(
      f"(DataConfig.paths: ('{tmp_path}/*.py',) -> ('{os.getcwd()}/a.py', "
      f"'{os.getcwd()}/b.py'))")):
    pipeline.train_iterator(sources, dataclasses.replace(dcfg, paths=("a.py", "b.py"))
                            ).set_state(old_state)
  # A state of before 2026-12-06 saved its patterns as spelt: taken from the working
  # directory and normalized.
  monkeypatch.chdir(tmp_path)
  spelt = {**old_state, "stream": {**old_state["stream"], "paths": ["./sub/../*.py"]}}
  pipeline.train_iterator(sources, dcfg).set_state(spelt)
  monkeypatch.chdir(os.path.dirname(tmp_path))
  # The same files spelled otherwise: relative to the working directory, with "./" or "..".
  monkeypatch.chdir(tmp_path)
  for spelling in ("*.py", "./*.py", f"../{tmp_path.name}/*.py", f"{tmp_path}//*.py"):
    for saved in (state, old_state):
      it = pipeline.train_iterator(sources, dataclasses.replace(dcfg, paths=(spelling,)))
      it.set_state({**saved, "example": 5})
      assert it.example == 5, spelling
    assert pipeline.continue_state({**state, "example": 5}, it_cfg := dataclasses.replace(
        dcfg, paths=(spelling,)))["example"] == 5, spelling
    assert pipeline.continue_state({**state, "example": 5}, dataclasses.replace(
        it_cfg, seed=1))["example"] == 0
  # Relative paths name the files under the working directory: elsewhere, other files.
  (tmp_path / "sub").mkdir()
  monkeypatch.chdir(tmp_path / "sub")
  with pytest.raises(pipeline.DataStateError, match=re.escape(
      f"(DataConfig.paths: ('{tmp_path}/*.py',) -> ('{tmp_path}/sub/*.py',))")):
    pipeline.train_iterator(sources, dataclasses.replace(dcfg, paths=("*.py",))).set_state(
        old_state)
  # ... and a state saved under relative paths names the files of the directory it was
  # saved in: the same pattern from another directory is another stream, the absolute
  # spelling of those files the same one (until 2026-12-06 the saved pattern was resolved
  # from the resuming directory: the first was taken, the second refused).
  relative = pipeline.train_iterator(sources, dataclasses.replace(dcfg, paths=("../*.py",)))
  saved = relative.get_state()
  assert saved["stream"]["paths"] == [f"{tmp_path}/*.py"]
  del saved["stream"]["files"]
  (tmp_path / "other" / "sub").mkdir(parents=True)
  (tmp_path / "other" / "g.py").write_text("x = 1\n")
  monkeypatch.chdir(tmp_path / "other" / "sub")
  with pytest.raises(pipeline.DataStateError, match=re.escape(
      f"(DataConfig.paths: ('{tmp_path}/*.py',) -> ('{tmp_path}/other/*.py',))")):
    pipeline.train_iterator(sources, dataclasses.replace(dcfg, paths=("../*.py",))).set_state(
        saved)
  pipeline.train_iterator(sources, dataclasses.replace(dcfg, paths=(f"{tmp_path}/*.py",))
                          ).set_state(saved)
  assert pipeline.continue_state(saved, dataclasses.replace(dcfg, paths=("../*.py",)))[
      "example"] == 0
  # The batch size is not the stream (another task's fields, which stream_fields leaves out
  # too, are refused by DataConfig since 2026-12-06).
  same = dataclasses.replace(dcfg, batch_size=2)
  pipeline.train_iterator(sources, same).set_state(state)
  pairs = DataConfig(task="reverse", seq_len=32, batch_size=4)
  assert pipeline.stream_fields(pairs) == {"task": "reverse", "seed": 0, "min_len": 3,
                                           "max_len": 12, "vocab_chars": 10}
  tsv = DataConfig(task="tsv", paths=("t.tsv",))
  t_tsv = os.path.join(os.getcwd(), "t.tsv")  # saved as the file it names
  assert pipeline.stream_fields(tsv) == {"task": "tsv", "seed": 0, "paths": [t_tsv],
                                         "validation_percent": 5}
  # TSV with a validation file: the first file is the whole training data.
  two = DataConfig(task="tsv", paths=("t.tsv", "v.tsv"), validation_percent=10)
  assert pipeline.stream_fields(two) == {"task": "tsv", "seed": 0, "paths": [t_tsv],
                                         "validation_file": True}
  assert pipeline.stream_fields(dataclasses.replace(two, paths=("t.tsv", "v2.tsv"),
                                                    validation_percent=5)) == \
      pipeline.stream_fields(two)
  # Dropping the validation file is named as the change of paths it is (it was named
  # "DataConfig.validation_file: True -> None", a field DataConfig does not have).
  it = pipeline.BatchIterator(types.SimpleNamespace(size=None), 2, 0,
                              stream=pipeline.stream_fields(tsv))
  with pytest.raises(pipeline.DataStateError) as e:
    it.set_state({"index": 0, "example": 0, "stream": pipeline.stream_fields(two)})
  assert str(e.value) == (
      "the saved data position belongs to another training stream (DataConfig.paths: a "
      "validation file -> no validation file, DataConfig.validation_percent: None -> 5)")
  it.stream = pipeline.stream_fields(two)  # and the other way round
  with pytest.raises(pipeline.DataStateError) as e:
    it.set_state({"index": 0, "example": 0, "stream": pipeline.stream_fields(tsv)})
  assert str(e.value) == (
      "the saved data position belongs to another training stream (DataConfig.paths: no "
      "validation file -> a validation file, DataConfig.validation_percent: 5 -> None)")
  # A state saved before the position was kept is completed from the config it was saved
  # under (the workdir's config.gin): its index counts that config's batches, its stream
  # is that config's.
  old = pipeline.complete_state({"index": 3}, dataclasses.replace(dcfg, batch_size=2))
  assert old == {"index": 3, "example": 6, "batch_size": 2, "stream": old_state["stream"]}
  it = pipeline.train_iterator(sources, dataclasses.replace(dcfg, batch_size=8))
  it.set_state(old)
  assert it.example == 6 and it.index == 3
  with pytest.raises(pipeline.DataStateError, match=re.escape("(DataConfig.seed: 7 -> 0)")):
    it.set_state(pipeline.complete_state({"index": 3}, dataclasses.replace(dcfg, seed=7)))
  assert pipeline.complete_state(state, dataclasses.replace(dcfg, seed=7)) == state
  # A new run (convert-heads) goes on at the same example only on the same stream.
  cont = pipeline.continue_state({**state, "example": 40}, dataclasses.replace(dcfg,
                                                                               batch_size=8))
  assert cont == {"index": 0, "example": 40, "batch_size": 8, "stream": state["stream"]}
  other = pipeline.continue_state({**state, "example": 40}, dataclasses.replace(dcfg, seed=3))
  assert other["example"] == 0 and other["stream"]["seed"] == 3
  # A state saved before the position (a batch index), completed from the source's config,
  # counts the source's batches.
  old = pipeline.continue_state(pipeline.complete_state({"index": 5}, dcfg),
                                dataclasses.replace(dcfg, batch_size=8))
  assert old["example"] == 20 and old["batch_size"] == 8


def test_a_resume_compares_the_files_an_lm_corpus_matched(tmp_path, monkeypatch):
  """A resume compares the training files an LM corpus's patterns matched, not the patterns
  (until 2026-12-07: a glob that matched a file added since the checkpoint was taken for the
  same stream and read other batches; the same files named by other patterns were refused)."""
  dcfg = _lm_corpus(tmp_path)

  def iterator(cfg):
    return pipeline.train_iterator(pipeline.build_sources(cfg, ModelConfig())[0], cfg)

  state = iterator(dcfg).get_state()
  train = pipeline.training_files(dcfg)
  assert state["stream"]["files"] == train and len(train) == 3
  assert all(os.path.isabs(f) for f in train)
  # The same files by other patterns, in another order: the same stream.
  names = tuple(reversed(train)) + (str(tmp_path / "f*.py"),)
  for paths in (names, (str(tmp_path / "f[0-3].py"), str(tmp_path / "*.py"))):
    cfg = dataclasses.replace(dcfg, paths=paths)
    assert pipeline.training_files(cfg) == train
    it = iterator(cfg)
    it.set_state({**state, "example": 6})
    assert it.example == 6, paths
  # A file the glob matches since the checkpoint: another stream, the file named.
  # (e.py: a name the validation hash leaves in training, sorted before the file it held
  # out, f3.py.)
  (tmp_path / "e.py").write_text("def g(y):\n    return y\n" * 3)
  assert pipeline.training_files(dcfg) == [str(tmp_path / "e.py")] + train
  with pytest.raises(pipeline.DataStateError) as e:
    iterator(dcfg).set_state(state)
  assert str(e.value) == (
      "the saved data position belongs to another training stream (DataConfig.paths: 3 "
      f"training files -> 4 (new: '{tmp_path}/e.py'; gone: none))")
  # ... and one gone (a corpus folder the glob no longer matches).
  (tmp_path / "e.py").unlink()
  gone = train[0]
  os.rename(gone, gone + ".bak")
  now = pipeline.training_files(dcfg)
  with pytest.raises(pipeline.DataStateError) as e:
    iterator(dcfg).set_state(state)
  assert gone not in now and len(now) == 2, now
  assert str(e.value).endswith(f"(DataConfig.paths: 3 training files -> 2 (new: none; gone: "
                               f"'{gone}'))")
  # Three are named, more counted.
  a = [f"'{tmp_path}/a{i}.py'" for i in range(5)]
  for n, named in ((3, ", ".join(a[:3]) + ";"), (4, ", ".join(a[:3]) + " and 1 more;"),
                   (5, ", ".join(a[:3]) + " and 2 more;")):
    for i in range(n):
      (tmp_path / f"a{i}.py").write_text("z = 2\n" * 9)
    with pytest.raises(pipeline.DataStateError, match=re.escape(f"(new: {named} gone: ")) as e:
      iterator(dcfg).set_state(state)
    assert e.value.fields == ("files",)  # attnlab train's advice: put the files back
  # A new run (convert-heads) continues only on the same files.
  assert pipeline.continue_state({**state, "example": 6}, dcfg)["example"] == 0
  os.rename(gone + ".bak", gone)
  for i in range(5):
    (tmp_path / f"a{i}.py").unlink()
  cont = pipeline.continue_state({**state, "example": 6}, dcfg)
  assert cont["example"] == 6 and cont["stream"] == state["stream"]
  # A conversion of a run whose corpus is gone (convert-heads needs only the weights): its
  # stream without files, compared by its patterns (refused, "no files match", for a day).
  (tmp_path / "away").mkdir()
  for f in tmp_path.glob("*.py"):
    f.rename(tmp_path / "away" / f.name)
  cont = pipeline.continue_state({**state, "example": 6}, dcfg)
  assert "files" not in cont["stream"] and cont["example"] == 6
  other = dataclasses.replace(dcfg, paths=(str(tmp_path / "elsewhere" / "*.py"),))
  assert pipeline.continue_state({**state, "example": 6}, other)["example"] == 0
  for f in (tmp_path / "away").glob("*.py"):
    f.rename(tmp_path / f.name)
  # ... the files that config reads (max_files too).
  one = dataclasses.replace(dcfg, max_files=1)
  assert pipeline.training_files(one) == train[:1]
  assert pipeline.continue_state(state, one)["stream"] == iterator(one).get_state()["stream"]
  assert pipeline.continue_state({**state, "example": 6}, one)["example"] == 0
  # The default corpus (the standard library) is named from its own folder: the same
  # library under another prefix is the same stream.
  stdlib = DataConfig(task="lm", seq_len=16, batch_size=4, max_files=8)
  files = pipeline.training_files(stdlib)
  fields = pipeline.stream_fields(stdlib, files)
  assert fields["files"] == [os.path.join("<stdlib>", os.path.relpath(f, text.stdlib_root()))
                             for f in files]
  monkeypatch.setattr(text, "stdlib_root", lambda: "/elsewhere/lib/python3")
  moved = pipeline.stream_fields(stdlib, [os.path.join("/elsewhere/lib/python3", os.path.relpath(
      f, os.path.dirname(os.__file__))) for f in files])
  assert pipeline.same_stream(fields, moved)
  # Other tasks save no files.
  assert "files" not in pipeline.stream_fields(DataConfig(task="tsv", paths=("t.tsv",)),
                                               ["t.tsv"])


def test_seq2seq_layouts():
  tok = ByteTokenizer()
  pairs = [("abc", "cba")]
  enc = pipeline.PairBatches(pairs, tok, seq_len=6, arch="encoder_decoder",
                             loss_on_prompt=False).batch([0])
  np.testing.assert_array_equal(enc["src_BS"][0], list(tok.encode("abc")) + [2, 0, 0])
  np.testing.assert_array_equal(enc["tgt_in_BT"][0], [1] + list(tok.encode("cba")) + [0, 0])
  np.testing.assert_array_equal(enc["targets_BT"][0], list(tok.encode("cba")) + [2, 0, 0])
  np.testing.assert_array_equal(enc["loss_mask_BT"][0], [1, 1, 1, 1, 0, 0])
  dec = pipeline.PairBatches(pairs, tok, seq_len=10, arch="decoder_only",
                             loss_on_prompt=False).batch([0])
  # [bos] a b c [eos] c b a [eos]: the loss covers "cba" and the final eos only.
  np.testing.assert_array_equal(dec["loss_mask_BT"][0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(dec["targets_BT"][0, 4:8], list(tok.encode("cba")) + [2])


def test_stdlib_corpus_split_is_deterministic_and_disjoint():
  files = text.stdlib_files()
  assert len(files) > 100 and all(f.endswith(".py") for f in files)
  a = text.lm_files((), validation_percent=5)
  b = text.lm_files((), validation_percent=5)
  assert a == b and a["validation"] and not set(a["train"]) & set(a["validation"])
  assert not any("/test/" in f for f in a["train"])


def test_tsv_reader_and_errors(tmp_path):
  good = tmp_path / "a.tsv"
  good.write_text("hello\tbonjour\n\nyes\toui\n")
  assert text.read_tsv(str(good)) == [("hello", "bonjour"), ("yes", "oui")]
  bad = tmp_path / "b.tsv"
  bad.write_text("no tab here\n")
  with pytest.raises(ValueError, match="b.tsv:1"):
    text.read_tsv(str(bad))
  with pytest.raises(FileNotFoundError, match="nope"):
    text.expand_paths([str(tmp_path / "nope*.txt")])


@pytest.mark.parametrize("task", ["lm", "reverse"])
def test_validation_split_is_the_same_for_every_seed(tmp_path, task):
  """Runs that differ only in their seed are evaluated on the same rows; their
  training data differs."""
  for i in range(12):
    (tmp_path / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (3 + i))
  mcfg = ModelConfig(arch="decoder_only")

  def rows(seed, split):
    fields = (dict(paths=(str(tmp_path / "*.py"),), validation_percent=40) if task == "lm"
              else dict(max_len=6))
    dcfg = DataConfig(task=task, seq_len=32, batch_size=4, seed=seed, **fields)
    sources, _ = pipeline.build_sources(dcfg, mcfg)
    return sources[split].batch(np.arange(4))

  for key, want in rows(0, "validation").items():
    np.testing.assert_array_equal(rows(3, "validation")[key], want, err_msg=key)
  train0, train3 = rows(0, "train"), rows(3, "train")
  assert any(not np.array_equal(train0[k], train3[k]) for k in train0)
