"""gin configs: every file parses and builds its model; bad input exits 2
naming the problem and writes nothing; --gin. overrides beat files; the
written config.gin reproduces the run's configs."""

import dataclasses
import glob
import os
import re
import sys
import threading

import gin
import pytest
from flax import nnx

import attnlab
from attnlab import cli
from attnlab import config_gin as gin_config
from attnlab.config import DataConfig, ModelConfig, TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "attnlab", "configs")  # the top-level configs/ links here
GIN_FILES = sorted(glob.glob(os.path.join(CONFIGS, "**", "*.gin"), recursive=True))


def test_there_are_configs():
  names = {os.path.relpath(p, CONFIGS) for p in GIN_FILES}
  for want in ("lm_stdlib_tiny.gin", "lm_stdlib.gin", "seq2seq_reverse.gin", "seq2seq_sort.gin",
               "seq2seq_add.gin", "translation_tsv.gin", "models/transformer_base.gin"):
    assert want in names


@pytest.mark.parametrize("path", GIN_FILES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_gin_file_parses_and_builds(path):
  mcfg, dcfg, tcfg = gin_config.parse([path], [])
  # Shapes only: the 7B config must not allocate.
  model = nnx.eval_shape(lambda: attnlab.build_model(mcfg, rngs=nnx.Rngs(0)))
  assert attnlab.count_params(model) > 0


def test_paper_base_config_is_the_paper():
  mcfg, _, tcfg = gin_config.parse([os.path.join(CONFIGS, "translation_tsv.gin")], [])
  assert (mcfg.d_model, mcfg.num_heads, mcfg.d_ff, mcfg.num_layers, mcfg.num_encoder_layers) == (
      512, 8, 2048, 6, 6)
  assert (mcfg.norm_position, mcfg.norm, mcfg.pos, mcfg.mlp) == (
      "post", "layernorm", "sinusoidal", "relu")
  assert mcfg.tie_embeddings and mcfg.scale_embeddings and mcfg.dropout_rate == 0.1
  assert tcfg.label_smoothing == 0.1 and tcfg.schedule == "inverse_sqrt"
  assert tcfg.warmup_steps == 4000 and (tcfg.b2, tcfg.eps) == (0.98, 1e-9)


def _train(argv, capsys):
  rc = cli.main(["train", *argv])
  return rc, capsys.readouterr().err


@pytest.mark.parametrize("binding,needle", [
    ("--gin.ModelConfig.d_modle=64", "d_modle"),
    ("--gin.ModelConfg.d_model=64", "ModelConfg"),
    ("--gin.ModelConfig.d_model='big'", "d_model"),
    ("--gin.TrainConfig.mesh_shape=(1,1)", "mesh_shape"),
])
def test_bad_binding_exits_2_naming_it(tmp_path, capsys, binding, needle):
  workdir = tmp_path / "run"
  rc, err = _train(["--gin_file", os.path.join(CONFIGS, "seq2seq_reverse.gin"),
                    binding, "--workdir", str(workdir)], capsys)
  assert rc == 2
  assert needle in err and len(err.strip().splitlines()) == 1
  assert not workdir.exists()


def test_missing_file_and_include_exit_2(tmp_path, capsys):
  rc, err = _train(["--gin_file", str(tmp_path / "nope.gin"), "--workdir",
                    str(tmp_path / "w")], capsys)
  assert rc == 2 and "nope.gin" in err
  bad = tmp_path / "bad.gin"
  bad.write_text("include 'models/no_such_model.gin'\n")
  rc, err = _train(["--gin_file", str(bad), "--workdir", str(tmp_path / "w")], capsys)
  assert rc == 2 and "no_such_model.gin" in err
  assert not (tmp_path / "w").exists()


def test_an_include_under_a_folder_importable_as_a_package_is_searched_like_any_other(
    tmp_path, monkeypatch):
  """gin also reads 'pkg/x.gin' as the file x.gin of an importable package ``pkg``; for a
  namespace package (a folder on sys.path without __init__.py, as a checkout's configs/
  under an editable install) its check raised a TypeError that ended the search:
  "expected str, bytes or os.PathLike object, not NoneType" (until 2026-12-06). A missing
  include is named as any other, and one beside the file is still found."""
  (tmp_path / "path" / "nspkg").mkdir(parents=True)
  monkeypatch.syspath_prepend(str(tmp_path / "path"))
  user = tmp_path / "user"
  (user / "nspkg").mkdir(parents=True)
  mine = user / "mine.gin"
  mine.write_text("include 'nspkg/gone.gin'\n")
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse([str(mine)], [])
  assert str(e.value).startswith("Unable to open file: nspkg/gone.gin. Searched config paths: "
                                 f"[{str(user)!r}, {gin_config.CONFIGS_DIR!r}, '']"), str(e.value)
  (user / "nspkg" / "steps.gin").write_text("TrainConfig.steps = 7\n")
  mine.write_text("include 'nspkg/steps.gin'\n")
  readers = list(gin.config._FILE_READERS)
  assert gin_config.parse([str(mine)], [])[2].steps == 7
  # gin's readers are the caller's again after a parse (until 2026-12-07 they stayed wrapped
  # for good), and wrapped once during one.
  assert readers == gin.config._FILE_READERS
  assert not any(getattr(exists, "_attnlab_checked", False) for _, exists in readers)
  with gin_config._include_folders([]):
    inside = list(gin.config._FILE_READERS)
    assert all(getattr(exists, "_attnlab_checked", False) for _, exists in inside[:len(readers)])
    with gin_config._include_folders([]):  # nested: not wrapped again
      assert gin.config._FILE_READERS[:len(readers)] == inside[:len(readers)]
  assert readers == gin.config._FILE_READERS


def test_overrides_beat_files_and_config_gin_reproduces(tmp_path):
  base = os.path.join(CONFIGS, "seq2seq_reverse.gin")
  extra = tmp_path / "extra.gin"
  extra.write_text("ModelConfig.d_model = 48\nTrainConfig.steps = 7\n")
  configs = gin_config.parse([base, str(extra)], ["ModelConfig.d_model = 32"])
  assert configs[0].d_model == 32 and configs[2].steps == 7  # later file, then --gin.
  written = tmp_path / "config.gin"
  written.write_text(gin_config.operative_config(*configs))
  assert gin_config.read_workdir_config(str(written)) == configs


def test_relative_inside_resolves_links_and_is_not_fooled_by_a_shared_prefix(tmp_path):
  run = tmp_path / "run"
  (run / "tok").mkdir(parents=True)
  (tmp_path / "run2").mkdir()
  (tmp_path / "link").symlink_to(run)
  assert gin_config.relative_inside(str(run / "tok" / "t.json"), str(run)) == "tok/t.json"
  assert gin_config.relative_inside(str(tmp_path / "link" / "t.json"), str(run)) == "t.json"
  assert gin_config.relative_inside(str(tmp_path / "run2" / "t.json"), str(run)) is None
  assert gin_config.relative_inside(str(tmp_path / "t.json"), str(run)) is None


def test_gin_values_read_back_as_written():
  assert [gin_config.gin_value(v) for v in ((), (1,), ("a",), (1, (2,), "b"), None, True, 0.5,
                                            "x", -1)] == [
      "()", "(1,)", "('a',)", "(1, (2,), 'b')", "None", "True", "0.5", "'x'", "-1"]
  # A one-element tuple stays a tuple through config.gin (not a parenthesized string).
  configs = (ModelConfig(d_model=32, num_heads=4, d_ff=64), DataConfig(paths=("/d/a.txt",)),
             TrainConfig(mesh_shape=(1, -1, 1)))
  text = gin_config.operative_config(*configs)
  assert text.splitlines()[:3] == [
      "# The operative config of this run, written by `attnlab train`.",
      "# `attnlab train --gin_file THIS_FILE --workdir ...` reproduces it.", ""]
  assert "DataConfig.paths = ('/d/a.txt',)" in text.splitlines()
  assert text.endswith("\n") and "\n\n" in text
  assert gin_config.parse([], text.splitlines()) == configs


def test_the_operative_config_names_a_tokenizer_inside_the_workdir_relative_to_it(tmp_path,
                                                                                   monkeypatch,
                                                                                   warned):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "tokenizer.json").write_text("{}")
  inside = DataConfig(tokenizer="hf_json", tokenizer_model=str(workdir / "tokenizer.json"))
  outside = dataclasses.replace(inside, tokenizer_model=str(tmp_path / "elsewhere.json"))
  text = gin_config.operative_config(inside, workdir=str(workdir))
  assert "DataConfig.tokenizer_model = 'tokenizer.json'" in text.splitlines()
  assert f"DataConfig.tokenizer_model = {str(workdir / 'tokenizer.json')!r}" in \
      gin_config.operative_config(inside).splitlines()  # no workdir: as given
  assert f"DataConfig.tokenizer_model = {str(tmp_path / 'elsewhere.json')!r}" in \
      gin_config.operative_config(outside, workdir=str(workdir)).splitlines()
  # Read back from anywhere, the relative name is found next to config.gin.
  (workdir / "config.gin").write_text(gin_config.operative_config(
      ModelConfig(d_model=32, num_heads=4, d_ff=64), inside, TrainConfig(), workdir=str(workdir)))
  _, dcfg, _ = gin_config.read_workdir_config(str(workdir / "config.gin"))
  assert dcfg.tokenizer_model == str(workdir / "tokenizer.json")
  # ... also from a directory that has a tokenizer.json of its own (a hub snapshot).
  (tmp_path / "tokenizer.json").write_text('{"other": 1}')
  monkeypatch.chdir(tmp_path)
  _, dcfg, _ = gin_config.read_workdir_config(str(workdir / "config.gin"))
  assert dcfg.tokenizer_model == str(workdir / "tokenizer.json")
  # ... and when the workdir's own is gone: that path, named in the error to come, or the
  # working directory's file of that name with a warning naming both (a workdir written
  # before 2026-12-04 named an outside tokenizer relative to where it trained; until then
  # decode read another vocabulary so without a word).
  (workdir / "tokenizer.json").unlink()
  for _ in range(2):  # once per process: decode reads config.gin twice (warned twice, 12-06)
    _, dcfg, _ = gin_config.read_workdir_config(str(workdir / "config.gin"))
    assert dcfg.tokenizer_model == str(tmp_path / "tokenizer.json")
  assert warned() == [
      f"{workdir}/config.gin names tokenizer_model='tokenizer.json', which is not beside it "
      f"({workdir}/tokenizer.json); reading {tmp_path}/tokenizer.json from the working "
      "directory, where a workdir written before 2026-12-04 named an outside tokenizer from "
      "(write its absolute path into the file if it is the run's)"]
  (tmp_path / "tokenizer.json").unlink()
  _, dcfg, _ = gin_config.read_workdir_config(str(workdir / "config.gin"))
  assert dcfg.tokenizer_model == str(workdir / "tokenizer.json") and len(warned()) == 1
  # A relative path outside the workdir (or with no workdir, as a sweep's runs had until
  # 2026-12-06) is written absolute: it named the training's working directory until
  # 2026-12-04.
  relative = dataclasses.replace(inside, tokenizer_model="elsewhere.json")
  for where in (str(workdir), None):
    assert f"DataConfig.tokenizer_model = {str(tmp_path / 'elsewhere.json')!r}" in \
        gin_config.operative_config(relative, workdir=where).splitlines()


def test_with_a_workdir_relative_data_paths_are_written_absolute_and_absolute_ones_as_given(
    tmp_path, monkeypatch):
  """config.gin names the corpus files wherever it is read from: a relative path (``~``
  and ``..`` too) is written from the working directory, normalized; an absolute one as
  given. Without a workdir too (a sweep's runs and its sweep.gin): until 2026-12-06 they were
  written as given there, so ``attnlab eval`` on a sweep's run from another folder read that
  folder's files."""
  (tmp_path / "cwd").mkdir()
  monkeypatch.chdir(tmp_path / "cwd")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  dcfg = DataConfig(paths=("corpus/*.txt", "~/v.txt", "../up/./x.txt", "/data/./valid.txt"))
  for workdir in (str(tmp_path / "run"), None):
    text = gin_config.operative_config(dcfg, workdir=workdir)
    assert (f"DataConfig.paths = ('{tmp_path}/cwd/corpus/*.txt', '{tmp_path}/home/v.txt', "
            f"'{tmp_path}/up/x.txt', '/data/./valid.txt')") in text.splitlines()


def test_a_saved_config_gin_with_fields_its_task_does_not_read_is_read_as_the_defaults(
    tmp_path, warned):
  """attnlab before 2026-12-06 took (and ignored) DataConfig fields the task does not read,
  and wrote them into config.gin: such a workdir still evaluates, decodes and resumes, the
  fields read as their defaults (what the run read) with one warning naming them; a new
  config with them is refused."""
  fields = ["DataConfig.task = 'reverse'", "DataConfig.validation_percent = 10",
            "DataConfig.paths = ('pairs.tsv',)", "DataConfig.tokenizer_model = 'x.json'"]
  path = tmp_path / "config.gin"
  path.write_text("\n".join(fields) + "\n")
  with pytest.raises(gin_config.GinConfigError, match=r"^paths=\('pairs.tsv',\) does not apply"):
    gin_config.parse([str(path)], [])
  for _ in range(2):  # warned once per process (decode reads config.gin twice)
    _, dcfg, _ = gin_config.read_workdir_config(str(path))
    assert dcfg == DataConfig(task="reverse")
  assert warned() == [
      f"{path} sets DataConfig.paths = ('pairs.tsv',), DataConfig.validation_percent = 10, "
      "DataConfig.tokenizer_model = 'x.json', which task='reverse' with tokenizer='byte' does "
      "not read (attnlab before 2026-12-06 took and ignored it): read as the default"]
  # ... and the strict check is back after it
  with pytest.raises(ValueError, match="^paths=.* does not apply"):
    DataConfig(task="reverse", paths=("a",))
  # A binding given with it (convert-heads', a resume's) is the user's own: refused as new.
  with pytest.raises(gin_config.GinConfigError, match=r"^max_files=3 does not apply to "
                                                      r"task='reverse'"):
    gin_config.parse_saved(str(path), ["DataConfig.max_files = 3"])
  _, dcfg, _ = gin_config.parse_saved(str(path), ["DataConfig.seed = 4"])
  assert dcfg == DataConfig(task="reverse", seed=4)
  # a binding is named by what comes before its first "=" (a value may hold one), its module
  # and scope aside (gin takes attnlab.DataConfig.x: it slipped past the check until
  # 2026-12-07)
  for binding in ("DataConfig.tokenizer_model = 'a=b.json'",
                  "attnlab.DataConfig.tokenizer_model = 'a=b.json'"):
    with pytest.raises(gin_config.GinConfigError, match=r"^tokenizer_model='a=b.json' is read"):
      gin_config.parse_saved(str(path), [binding])
  # Binding the task or tokenizer the file has leaves the same fields unread: the file's own,
  # reset with the warning (the first version of the refusal below refused any such binding).
  for binding in ("DataConfig.task = 'reverse'", "DataConfig.tokenizer = 'byte'"):
    assert gin_config.parse_saved(str(path), [binding])[1] == DataConfig(task="reverse")


def test_a_saved_config_gin_with_betas_at_1_in_float32_is_read_as_it_is(tmp_path):
  """b2 = 0.99999999 (1 in float32) was taken before 2026-12-07: the run trained (its Adam
  updates all 0) and wrote checkpoints, and its workdir still loads, evaluates and decodes;
  a new config with it, or a binding of it, is refused."""
  path = tmp_path / "config.gin"
  path.write_text("TrainConfig.b2 = 0.99999999\n")
  with pytest.raises(gin_config.GinConfigError, match=r"^b2=0.99999999 is 1 in float32"):
    gin_config.parse([str(path)], [])
  assert gin_config.read_workdir_config(str(path))[2].b2 == 0.99999999
  assert gin_config.parse_saved(str(path), ["TrainConfig.seed = 3"])[2].b2 == 0.99999999
  for binding in ("TrainConfig.b1 = 0.99999999", "TrainConfig.b2=0.999999999"):
    with pytest.raises(gin_config.GinConfigError, match=r"is 1 in float32"):
      gin_config.parse_saved(str(path), [binding])
  assert gin_config.parse_saved(str(path), ["TrainConfig.b2 = 0.999"])[2].b2 == 0.999
  with pytest.raises(ValueError, match=r"^b1=0.99999999 is 1 in float32"):
    TrainConfig(b1=0.99999999)  # the strict check is back after it
  # Its copies too (eval's grad_accum=1, a resume's checkpoint schedule, a sweep's runs,
  # convert-heads' bindings refused them until 2026-12-07); a copy that sets b2 is checked.
  saved = gin_config.read_workdir_config(str(path))[2]
  copy = saved.replace(grad_accum=1, seed=3, mesh_shape=(1, 1, 1))
  assert copy.b2 == 0.99999999 and copy.grad_accum == 1 and copy.seed == 3
  with pytest.raises(ValueError, match=r"^b2=0.99999999 is 1 in float32"):
    TrainConfig().replace(b2=0.99999999)
  with pytest.raises(ValueError, match=r"^b1=0.99999999 is 1 in float32"):
    saved.replace(b1=0.99999999)  # b1 too: a copy that sets it is checked
  with pytest.raises(ValueError, match=r"^b2=0.999999999 is 1 in float32"):
    saved.replace(b2=0.999999999)
  with pytest.raises(ValueError, match=r"^warmup_steps=-1 must be a non-negative integer"):
    saved.replace(warmup_steps=-1)  # the other checks as for any config
  # A new optimizer reads the betas anew: sgd reads no b2, adam does (the first version of
  # replace took this copy).
  with pytest.raises(ValueError, match=r"^b2=0.999999999 is 1 in float32"):
    TrainConfig(optimizer="sgd", b2=0.999999999).replace(optimizer="adam")
  # ... and so does a binding of the optimizer on a saved config (a resume's, convert-heads')
  path.write_text("TrainConfig.optimizer = 'sgd'\nTrainConfig.b2 = 0.999999999\n")
  assert gin_config.parse_saved(str(path), [])[2].b2 == 0.999999999  # sgd reads no b2
  for binding in ("TrainConfig.optimizer = 'adam'", "attnlab.TrainConfig.optimizer = 'adam'"):
    with pytest.raises(gin_config.GinConfigError, match=r"^b2=0.999999999 is 1 in float32"):
      gin_config.parse_saved(str(path), [binding])
  with pytest.raises(ValueError, match=r"^b1=0.99999999 is 1 in float32"):
    TrainConfig(b1=0.99999999)


def test_a_saved_config_gin_with_a_field_its_run_ignored_is_read_as_the_default(tmp_path,
                                                                               warned):
  """Before 2026-12-03 a weight decay with optimizer 'adam' / 'sgd' was taken and dropped,
  before 2026-12-04 loss_on_prompt of a language model: such a run's workdir did not
  evaluate, decode, load or resume (until 2026-12-07). Read as the default (what the run
  did), with one warning per config; refused in a new config or as a binding."""
  path = tmp_path / "config.gin"
  path.write_text("TrainConfig.optimizer = 'adam'\nTrainConfig.weight_decay = 0.01\n"
                  "DataConfig.loss_on_prompt = True\n")
  with pytest.raises(gin_config.GinConfigError, match=r"^loss_on_prompt=True does not apply"):
    gin_config.parse([str(path)], [])
  for _ in range(2):
    _, dcfg, tcfg = gin_config.read_workdir_config(str(path))
    assert dcfg == DataConfig() and tcfg == TrainConfig(optimizer="adam")
  assert warned() == [
      f"{path} sets DataConfig.loss_on_prompt = True, which task='lm' with tokenizer='byte' "
      "does not read (attnlab before 2026-12-04 took and ignored it): read as the default",
      f"{path} sets TrainConfig.weight_decay = 0.01, which optimizer='adam' does not read "
      "(attnlab before 2026-12-03 took and ignored it): read as the default"]
  assert gin_config.parse_saved(str(path), ["TrainConfig.steps = 7"])[2].steps == 7
  for binding in ("TrainConfig.weight_decay = 0.5", "attnlab.TrainConfig.weight_decay = 0.5"):
    with pytest.raises(gin_config.GinConfigError, match=r"^weight_decay=0.5 is applied by "
                                                        r"optimizer='adamw' only"):
      gin_config.parse_saved(str(path), [binding])
  # the optimizer the file has: its weight_decay is still the file's own, reset
  assert gin_config.parse_saved(str(path), ["TrainConfig.optimizer = 'adam'"])[2] == \
      TrainConfig(optimizer="adam")
  with pytest.raises(gin_config.GinConfigError, match=r"^loss_on_prompt=True does not apply"):
    gin_config.parse_saved(str(path), ["DataConfig.loss_on_prompt = True"])
  # Another optimizer that reads it does not revive it: the run never trained with it (until
  # 2026-12-07 a resume with this binding trained with decay 0.01, without a word, while
  # convert-heads dropped it); the warning names the run's own optimizer. A value the user
  # binds is theirs.
  other = tmp_path / "other.gin"  # warned once per file and fields: a file of its own
  other.write_text(path.read_text() + "DataConfig.min_len = 5\n")
  seen = len(warned())
  for _ in range(2):
    tcfg = gin_config.parse_saved(str(other), ["TrainConfig.optimizer = 'adamw'"])[2]
    assert tcfg == TrainConfig(optimizer="adamw", weight_decay=0.0)
  assert warned()[seen:] == [  # one warning per date the fields were refused from
      f"{other} sets DataConfig.loss_on_prompt = True, which task='lm' with tokenizer='byte' "
      "does not read (attnlab before 2026-12-04 took and ignored it): read as the default",
      f"{other} sets DataConfig.min_len = 5, which task='lm' with tokenizer='byte' "
      "does not read (attnlab before 2026-12-06 took and ignored it): read as the default",
      f"{other} sets TrainConfig.weight_decay = 0.01, which optimizer='adam' does not read "
      "(attnlab before 2026-12-03 took and ignored it): read as the default"]
  assert gin_config.parse_saved(str(other), ["TrainConfig.optimizer = 'adamw'",
                                             "TrainConfig.weight_decay = 0.2"])[2] == \
      TrainConfig(optimizer="adamw", weight_decay=0.2)
  _, dcfg, _ = gin_config.parse_saved(str(other), ["DataConfig.task = 'reverse'"])
  assert dcfg == DataConfig(task="reverse")  # the lm run's loss_on_prompt stays unread
  # A field a binding of the user's leaves unread is theirs to mend, not reset with a warning
  # about an old attnlab (the run read it): refused as in a new config.
  path.write_text("TrainConfig.weight_decay = 0.1\nDataConfig.task = 'reverse'\n"
                  "DataConfig.loss_on_prompt = True\n")
  assert gin_config.parse_saved(str(path), [])[2].weight_decay == 0.1
  with pytest.raises(gin_config.GinConfigError, match=r"^weight_decay=0.1 is applied by "
                                                      r"optimizer='adamw' only; got "
                                                      r"optimizer='adam'"):
    gin_config.parse_saved(str(path), ["TrainConfig.optimizer = 'adam'"])
  with pytest.raises(gin_config.GinConfigError, match=r"^loss_on_prompt=True does not apply"):
    gin_config.parse_saved(str(path), ["DataConfig.task = 'lm'"])
  with pytest.raises(ValueError, match=r"^weight_decay=0.01 is applied by optimizer='adamw'"):
    TrainConfig(optimizer="adam", weight_decay=0.01)


def test_a_saved_field_its_run_never_read_stays_unread_under_any_binding(tmp_path, warned):
  """The cases of the review of 2026-12-07's first version (a field its run did not read
  stays at its default under a binding of a reader that reads it): fields of one class reset
  together; a value bound on a binding's second line or in a file it includes is the user's;
  a file that needs a binding to parse is read with the bindings that change no reader; a
  field the new reader needs is named, with how to bind it."""
  path = tmp_path / "config.gin"
  path.write_text("DataConfig.min_len = 1\nDataConfig.max_len = 2\n")  # an lm run's
  assert gin_config.parse_saved(str(path), ["DataConfig.task = 'copy'"])[1] == \
      DataConfig(task="copy")  # min_len alone reset first: "min_len=3 must be <= max_len=2"
  assert warned()[-1].startswith(f"{path} sets DataConfig.min_len = 1, DataConfig.max_len = 2,")
  path.write_text("TrainConfig.optimizer = 'adam'\nTrainConfig.weight_decay = 0.01\n")
  (tmp_path / "adamw.gin").write_text("TrainConfig.optimizer = 'adamw'\n"
                                      "TrainConfig.weight_decay = 0.2\n")
  for bindings in (["TrainConfig.optimizer = 'adamw'\nTrainConfig.weight_decay = 0.2"],
                   [f"include '{tmp_path / 'adamw.gin'}'"]):
    assert gin_config.parse_saved(str(path), bindings)[2] == \
        TrainConfig(optimizer="adamw", weight_decay=0.2), bindings
  with pytest.raises(gin_config.GinConfigError, match=r"^b2=0.99999999 is 1 in float32"):
    gin_config.parse_saved(str(path), ["TrainConfig.steps = 5\nTrainConfig.b2 = 0.99999999"])
  # a value that a macro of the user's gives (a file written by hand reads it) is theirs too
  macro = tmp_path / "macro.gin"
  macro.write_text("TrainConfig.optimizer = 'adam'\nTrainConfig.weight_decay = %WD\nWD = 0.01\n")
  assert gin_config.parse_saved(str(macro), ["TrainConfig.optimizer = 'adamw'", "WD = 0.25"])[2] \
      == TrainConfig(optimizer="adamw", weight_decay=0.25)
  assert gin_config.parse_saved(str(macro), ["TrainConfig.optimizer = 'adamw'"])[2] == \
      TrainConfig(optimizer="adamw")
  assert gin_config.parse_saved(str(macro), ["TrainConfig.optimizer = 'adamw'", "LR = 0.5",
                                             "TrainConfig.learning_rate = %LR"])[2] == \
      TrainConfig(optimizer="adamw", learning_rate=0.5)  # a macro of a binding's own
  # eps=1e-40 is refused since 2026-12-06: the file parses with the user's eps alone
  path.write_text("TrainConfig.optimizer = 'adam'\nTrainConfig.weight_decay = 0.01\n"
                  "TrainConfig.eps = 1e-40\n")
  seen = len(warned())
  tcfg = gin_config.parse_saved(str(path), ["TrainConfig.eps = 1e-8",
                                            "TrainConfig.optimizer = 'adamw'"])[2]
  assert tcfg == TrainConfig(optimizer="adamw", eps=1e-8, weight_decay=0.0)
  assert warned()[seen:] == [
      f"{path} sets TrainConfig.weight_decay = 0.01, which optimizer='adam' does not read "
      "(attnlab before 2026-12-03 took and ignored it): read as the default"]
  (tmp_path / "tok.json").write_text("{}")
  path.write_text("DataConfig.tokenizer_model = 'tok.json'\n")  # a byte run's
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse_saved(str(path), ["DataConfig.tokenizer = 'hf_json'"])
  assert str(e.value).startswith("tokenizer='hf_json' needs tokenizer_model")
  assert str(e.value).endswith(
      f"({path} sets DataConfig.tokenizer_model = 'tok.json', which its run did not read: "
      "read as the default; bind it to use it, --gin.DataConfig.tokenizer_model=...)")
  dcfg = gin_config.parse_saved(str(path), ["DataConfig.tokenizer = 'hf_json'",
                                            "DataConfig.tokenizer_model = 'tok.json'"])[1]
  assert dcfg.tokenizer_model == str(tmp_path / "tok.json")
  # (the third review) The flag named is the field the refusal is about; a refusal about
  # none of them is its own message alone.
  path.write_text("DataConfig.task = 'copy'\nDataConfig.paths = ('a.tsv',)\n"
                  "DataConfig.tokenizer_model = 'tok.json'\n")
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse_saved(str(path), ["DataConfig.task = 'tsv'",
                                       "DataConfig.tokenizer = 'hf_json'"])
  assert "bind it to use it, --gin.DataConfig.tokenizer_model=...)" in str(e.value)
  assert "DataConfig.paths" not in str(e.value)
  path.write_text("TrainConfig.optimizer = 'adam'\nTrainConfig.b1 = 0.99999999\n"
                  "TrainConfig.weight_decay = 0.01\n")
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse_saved(str(path), ["TrainConfig.optimizer = 'adamw'"])
  assert str(e.value).startswith("b1=0.99999999 is 1 in float32")
  assert "weight_decay" not in str(e.value)
  # An include found beside the saved file (as parse finds it) binds what it holds: the
  # user's (reset as the file's until the third review, from another working directory).
  (tmp_path / "adamw.gin").write_text("TrainConfig.optimizer = 'adamw'\n"
                                      "TrainConfig.weight_decay = 0.2\n")
  path.write_text("TrainConfig.optimizer = 'adam'\nTrainConfig.weight_decay = 0.01\n")
  with pytest.MonkeyPatch.context() as m:
    m.chdir(tmp_path.parent)
    assert gin_config.parse_saved(str(path), ["include 'adamw.gin'"])[2] == \
        TrainConfig(optimizer="adamw", weight_decay=0.2)
  # One warning for one set of fields, with or without bindings (in the fields' order), and
  # the date a task's own field was refused from.
  seen = len(warned())
  order = tmp_path / "order.gin"
  order.write_text("DataConfig.task = 'copy'\nDataConfig.paths = ('/x.txt',)\n"
                   "DataConfig.tokenizer_model = 't.json'\n")
  gin_config.parse_saved(str(order), [])
  gin_config.parse_saved(str(order), ["DataConfig.task = 'lm'", "DataConfig.max_len = 12"])
  assert warned()[seen:] == [
      f"{order} sets DataConfig.paths = ('/x.txt',), DataConfig.tokenizer_model = 't.json', "
      "which task='copy' with tokenizer='byte' does not read (attnlab before 2026-12-06 took "
      "and ignored it): read as the default"]
  # A second read that leaves another set of fields unread names only those not named yet
  # (convert-heads reads with its bindings, then without: paths twice until 2026-12-07).
  twice = tmp_path / "twice.gin"
  twice.write_text("DataConfig.task = 'copy'\nDataConfig.paths = ('/x.txt',)\n"
                   "DataConfig.max_files = 3\n")
  seen = len(warned())
  gin_config.parse_saved(str(twice), ["DataConfig.task = 'lm'", "DataConfig.max_files = 5"])
  gin_config.read_workdir_config(str(twice))
  assert [w.split(", which")[0] for w in warned()[seen:]] == [
      f"{twice} sets DataConfig.paths = ('/x.txt',)",
      f"{twice} sets DataConfig.max_files = 3"]
  add = tmp_path / "add.gin"
  add.write_text("DataConfig.task = 'add'\nDataConfig.min_len = 5\nDataConfig.max_len = 8\n"
                 "DataConfig.vocab_chars = 20\n")
  gin_config.parse_saved(str(add), [])
  assert warned()[-1] == (
      f"{add} sets DataConfig.min_len = 5, DataConfig.vocab_chars = 20, which task='add' with "
      "tokenizer='byte' does not read (attnlab before 2026-12-03 took and ignored it): read as "
      "the default")


def test_a_relative_tokenizer_is_found_beside_the_last_gin_file_else_as_given(tmp_path,
                                                                              monkeypatch):
  a, b, cwd = tmp_path / "a", tmp_path / "b", tmp_path / "cwd"
  HF = "DataConfig.tokenizer = 'hf_json'\n"  # the byte tokenizer takes no model file
  for d in (a, b, cwd):
    d.mkdir()
  for d in (a, b):
    (d / "t.json").write_text("{}")
    (d / "x.gin").write_text(f"{HF}DataConfig.tokenizer_model = 't.json'\n")
  monkeypatch.chdir(cwd)
  dcfg = lambda files: gin_config.parse([str(f) for f in files], [])[1]
  assert dcfg([a / "x.gin"]).tokenizer_model == str(a / "t.json")
  assert dcfg([a / "x.gin", b / "x.gin"]).tokenizer_model == str(b / "t.json")  # the last first
  assert dcfg([b / "x.gin", a / "x.gin"]).tokenizer_model == str(a / "t.json")
  (a / "y.gin").write_text(f"{HF}DataConfig.tokenizer_model = 'missing.json'\n")
  assert dcfg([a / "y.gin"]).tokenizer_model == "missing.json"  # not found: as given
  # Beside the gin file first: a tokenizer.json in the working directory does not replace
  # the one a workdir's config.gin names (it did before 2026-12-04); a file only there is
  # found as given.
  (cwd / "t.json").write_text("{}")
  assert dcfg([a / "x.gin"]).tokenizer_model == str(a / "t.json")
  (cwd / "only_here.json").write_text("{}")
  (a / "w.gin").write_text(f"{HF}DataConfig.tokenizer_model = 'only_here.json'\n")
  assert dcfg([a / "w.gin"]).tokenizer_model == "only_here.json"
  absolute = str(b / "t.json")
  (a / "z.gin").write_text(f"{HF}DataConfig.tokenizer_model = {absolute!r}\n")
  assert dcfg([a / "z.gin"]).tokenizer_model == absolute
  (a / "e.gin").write_text("DataConfig.seq_len = 8\n")
  assert dcfg([a / "e.gin"]).tokenizer_model == ""


def test_parse_leaves_no_binding_and_no_log_level_behind(tmp_path):
  import logging

  import gin

  (tmp_path / "x.gin").write_text("ModelConfig.d_model = 48\n")
  root = logging.getLogger()
  level = root.level
  root.setLevel(logging.WARNING)
  try:
    mcfg, _, _ = gin_config.parse([str(tmp_path / "x.gin")], ["TrainConfig.steps = 3"])
    assert mcfg.d_model == 48 and root.level == logging.WARNING
    assert gin.config_str() == ""  # cleared: the next parse starts from nothing
    assert gin_config.parse([], [])[0].d_model == ModelConfig().d_model
    with pytest.raises(gin_config.GinConfigError):
      gin_config.parse([str(tmp_path / "x.gin")], ["ModelConfig.d_modle = 1"])
    assert root.level == logging.WARNING and gin.config_str() == ""
  finally:
    root.setLevel(level)


def test_the_callers_own_gin_state_is_left_as_it_was(tmp_path):
  """A caller's own gin bindings, a configurable of theirs named like ours and a config they
  finalized: a parse (every load_checkpoint, eval and train runs one) uses none of them
  and leaves them as they were. Until 2026-12-07 it cleared the caller's bindings
  (``gin.clear_config``), unlocked their finalized config, and left our classes
  registered under their bare names, so that the caller's ``TrainConfig`` and ours were
  an "Ambiguous selector" for both."""
  @gin.configurable(module="callers_project")
  class TrainConfig:  # the caller's own class, of our name
    def __init__(self, lr=0.1):
      self.lr = lr

  @gin.configurable(module="callers_project")
  def schedule(warmup=1):
    return warmup

  (tmp_path / "x.gin").write_text("TrainConfig.steps = 7\n")
  # A config file may refer to the caller's configurables, and import a module of its own
  # (gin's `import`): what that module registers stays registered (Python imports it once).
  (tmp_path / "callers_module.py").write_text(
      "import gin\n@gin.configurable\ndef steps(n=11):\n  return n\n")
  (tmp_path / "y.gin").write_text("import callers_module\n"
                                  "TrainConfig.steps = @callers_module.steps()\n"
                                  "TrainConfig.warmup_steps = @schedule()\n")
  sys.path.insert(0, str(tmp_path))
  try:
    gin.parse_config("TrainConfig.lr = 0.5\nschedule.warmup = 9")
    for _ in range(2):
      _, _, tcfg = gin_config.parse([str(tmp_path / "x.gin")], ["ModelConfig.d_model = 48"])
      assert tcfg.steps == 7 and (TrainConfig().lr, schedule()) == (0.5, 9)
      _, _, tcfg = gin_config.parse([str(tmp_path / "y.gin")], [])
      assert (tcfg.steps, tcfg.warmup_steps) == (11, 1)  # their binding of schedule unread
    import callers_module
    gin.parse_config("callers_module.steps.n = 4")
    assert callers_module.steps() == 4
    gin_config.parse([], ["schedule.warmup = 3"])  # a binding of the parse's own
    assert (TrainConfig().lr, schedule()) == (0.5, 9)
    with pytest.raises(gin_config.GinConfigError, match="nope"):  # an error: put back too
      gin_config.parse([str(tmp_path / "y.gin")], ["TrainConfig.nope = 1"])
    assert (TrainConfig().lr, schedule()) == (0.5, 9)
    gin.parse_config("TrainConfig.lr = 0.25")  # the bare name is theirs alone again
    assert TrainConfig().lr == 0.25
    gin.finalize()
    assert gin_config.parse([str(tmp_path / "x.gin")], [])[2].steps == 7
    assert gin.config_is_locked() and TrainConfig().lr == 0.25
  finally:
    gin.clear_config()  # unlocks too
    sys.path.remove(str(tmp_path))
    module = sys.modules.pop("callers_module", None)
    for fn in (TrainConfig, schedule, getattr(module, "steps", None)):
      info = gin.config._INVERSE_REGISTRY.pop(getattr(fn, "__wrapped__", fn), None)
      if info is not None:
        gin.config._REGISTRY.pop(info.selector)
    assert not [k for k, _ in gin.config._REGISTRY.items() if "callers_" in k]


def test_parses_in_two_threads_each_read_their_own_files(tmp_path):
  """One parse at a time: until 2026-12-07 two threads' parses (two load_checkpoint calls)
  shared gin's process-wide config unguarded, and one built its configs from the other's
  bindings (a model of another window, without a word) or failed."""
  import threading

  files = {}
  for d_model in (32, 48):
    files[d_model] = tmp_path / f"{d_model}.gin"
    files[d_model].write_text(f"ModelConfig.d_model = {d_model}\nModelConfig.window = "
                              f"{d_model // 8}\nTrainConfig.steps = {d_model}\n")
  got = {32: [], 48: []}

  def read(d_model):
    for _ in range(40):
      try:
        mcfg, _, tcfg = gin_config.parse([str(files[d_model])], [])
        got[d_model].append((mcfg.d_model, mcfg.window, tcfg.steps))
      except Exception as e:  # noqa: BLE001 - counted as a wrong read
        got[d_model].append(repr(e))

  interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
  try:
    threads = [threading.Thread(target=read, args=(d,)) for d in got]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  finally:
    sys.setswitchinterval(interval)
  assert got == {d: [(d, d // 8, d)] * 40 for d in got}


def _parse_with_an_include_found_last(tmp_path, steps_fn: str):
  """``parse`` of sub/x.gin, whose include is found in the working directory, last: gin
  logs its misses in the folders before (records of its own); its steps come from the
  caller's configurable ``steps_fn``."""
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "x.gin").write_text(f"include 'base.gin'\n"
                                          f"TrainConfig.steps = @{steps_fn}()\n")
  (tmp_path / "base.gin").write_text("ModelConfig.d_model = 48\n")
  with pytest.MonkeyPatch.context() as m:
    m.chdir(tmp_path)
    return gin_config.parse([str(tmp_path / "sub" / "x.gin")], [])


def _unregister(fn) -> None:
  """Take a test's own gin configurable out of gin's registry."""
  info = gin.config._INVERSE_REGISTRY.pop(fn.__wrapped__, None)
  if info is not None:
    gin.config._REGISTRY.pop(info.selector)


def test_a_command_starting_in_another_thread_does_not_make_a_running_one_warn_again(
    tmp_path, warned):
  """A command reads its workdir's config.gin more than once and warns about an unread field
  once; another command starting meanwhile in another thread forgets its own warnings
  (``forget_warnings``, as ``cli._dispatch`` does), not this one's (a process-wide set until
  2026-12-07's review: the running command warned twice)."""
  path = tmp_path / "config.gin"
  path.write_text("DataConfig.min_len = 5\n")
  gin_config.forget_warnings()
  gin_config.parse_saved(str(path))
  other = threading.Thread(target=gin_config.forget_warnings)
  other.start()
  other.join(60)
  gin_config.parse_saved(str(path))
  assert warned() == [f"{path} sets DataConfig.min_len = 5, which task='lm' with "
                      "tokenizer='byte' does not read (attnlab before 2026-12-06 took and "
                      "ignored it): read as the default"]


def test_another_threads_warnings_are_not_silenced_by_a_parse(tmp_path):
  """gin's own log records are dropped while it parses, nothing else: until 2026-12-07 the
  root logger's level was CRITICAL for the parse, so every logger without a level of its
  own (another thread's, the caller's configurable's) logged nothing meanwhile."""
  import logging

  @gin.configurable(module="callers_project")
  def logged_steps():
    logging.getLogger("callers_project").warning("building the steps")
    return 3

  records = []
  handler = logging.Handler()
  handler.emit = records.append
  root = logging.getLogger()
  root.addHandler(handler)
  try:
    mcfg, _, tcfg = _parse_with_an_include_found_last(tmp_path, "logged_steps")
    assert (mcfg.d_model, tcfg.steps) == (48, 3)
  finally:
    root.removeHandler(handler)
    _unregister(logged_steps)
  assert [(r.name, r.getMessage()) for r in records] == [
      ("callers_project", "building the steps")]
  assert not root.filters


def test_a_parse_leaves_the_root_logger_as_other_threads_see_it(tmp_path):
  """While a parse runs, another thread sees the root logger as it was (no handler, no filter
  of attnlab's), and gin logs through ``logging`` again after it: until 2026-12-07 the root
  logger had a handler of attnlab's for the parse, so another thread's ``basicConfig`` (or a
  command's handler) added none and was left without one."""
  import logging

  inside, checked = threading.Event(), threading.Event()

  @gin.configurable(module="callers_project")
  def waiting_steps():
    inside.set()
    assert checked.wait(60)
    return 3

  root = logging.getLogger()
  handlers = root.handlers[:]  # pytest's own: taken away, as in a plain script
  for h in handlers:
    root.removeHandler(h)
  seen = {}

  def other():
    assert inside.wait(60)
    seen.update(handlers=list(root.handlers), filters=list(root.filters))
    checked.set()

  thread = threading.Thread(target=other)
  thread.start()
  try:
    assert _parse_with_an_include_found_last(tmp_path, "waiting_steps")[2].steps == 3
  finally:
    thread.join(60)
    for h in handlers:
      root.addHandler(h)
    _unregister(waiting_steps)
  assert seen == {"handlers": [], "filters": []}
  assert gin.config.logging is logging and gin.resource_reader.logging is logging


def test_warnings_during_a_parse_reach_stderr_where_no_logging_is_configured(tmp_path,
                                                                              capsys):
  """With no handler on the root logger (a plain script), a parse leaves it without one (gin's
  logging calls, which would configure it, are silenced); the records not gin's go to stderr
  (``logging.lastResort``), as without the parse: until 2026-12-07 a NullHandler of attnlab's
  swallowed them, then a handler of attnlab's stood in for the parse."""
  import logging

  @gin.configurable(module="callers_project")
  def warned_steps():
    logging.getLogger("callers_project").info("an info line")  # below lastResort's level
    logging.getLogger("callers_project").warning("building the steps")
    logging.getLogger("callers_project.sub").warning("and its part")
    return 3

  root = logging.getLogger()
  handlers = root.handlers[:]  # pytest's own: taken away, as in a plain script
  logging.getLogger("callers_project").setLevel(logging.INFO)
  for h in handlers:
    root.removeHandler(h)
  try:
    assert _parse_with_an_include_found_last(tmp_path, "warned_steps")[2].steps == 3
    assert root.handlers == []
  finally:
    for h in handlers:
      root.addHandler(h)
  assert capsys.readouterr().err == "building the steps\nand its part\n"
  # A record that a handler on its way took is not handed on a second time (a parent's too).
  own = logging.StreamHandler(sys.stdout)
  logging.getLogger("callers_project").addHandler(own)
  for h in handlers:
    root.removeHandler(h)
  try:
    assert gin_config.parse([], ["TrainConfig.steps = @warned_steps()"])[2].steps == 3
  finally:
    logging.getLogger("callers_project").removeHandler(own)
    logging.getLogger("callers_project").setLevel(logging.NOTSET)
    for h in handlers:
      root.addHandler(h)
    _unregister(warned_steps)
  assert capsys.readouterr() == ("an info line\nbuilding the steps\nand its part\n", "")


def test_a_first_parse_under_a_config_the_caller_finalized(monkeypatch, tmp_path):
  """gin registers nothing while a config is locked: the process's first parse, after the
  caller's ``gin.finalize()``, was a RuntimeError until 2026-12-07 ("Attempted to add a new
  configurable after the config was locked"). The lock is theirs, put back after."""
  monkeypatch.setattr(gin_config, "_configurables", {})  # as in a fresh process
  (tmp_path / "x.gin").write_text("TrainConfig.steps = 7\n")
  gin.finalize()
  try:
    assert gin_config.parse([str(tmp_path / "x.gin")], [])[2].steps == 7
    assert gin.config_is_locked()
  finally:
    gin.clear_config()  # unlocks too


def test_includes_resolve_beside_this_calls_files_before_the_working_directory(
    tmp_path, monkeypatch):
  """An include is looked up beside the files of this call, then in the built-in configs,
  then in the working directory: not in a folder an earlier call added (gin's search list
  is global and outlived every call), nor first in the working directory; the list is
  left as it was."""
  import gin

  for name, d_model in (("a", 64), ("b", 512)):
    (tmp_path / name).mkdir()
    (tmp_path / name / "main.gin").write_text("include 'base.gin'\n")
    (tmp_path / name / "base.gin").write_text(f"ModelConfig.d_model = {d_model}\n")
  (tmp_path / "base.gin").write_text("ModelConfig.d_model = 96\n")
  monkeypatch.chdir(tmp_path)
  before = list(gin.config._LOCATION_PREFIXES)
  assert gin_config.parse(["a/main.gin"], [])[0].d_model == 64
  assert gin_config.parse([str(tmp_path / "b" / "main.gin")], [])[0].d_model == 512
  assert gin_config.parse(["a/main.gin"], [])[0].d_model == 64
  assert list(gin.config._LOCATION_PREFIXES) == before
  # Only the working directory has it: found there (last).
  (tmp_path / "a" / "base.gin").unlink()
  assert gin_config.parse(["a/main.gin"], [])[0].d_model == 96
  (tmp_path / "base.gin").unlink()
  with pytest.raises(gin_config.GinConfigError, match="base.gin"):
    gin_config.parse(["a/main.gin"], [])
  assert list(gin.config._LOCATION_PREFIXES) == before


@pytest.mark.parametrize("files,bindings,message", [
    (["nope.gin"], [], "gin file 'nope.gin' does not exist"),
    # a folder: named as one (until 2026-12-04 "does not exist")
    (["."], [], "gin file '.' is a directory, not a file"),
    ([], ["ModelConfig.d_model = 'big'"],
     "d_model='big' must be a positive integer"),
    # Quoted: gin passes strings, which would be truthy / compared with numbers.
    ([], ["ModelConfig.scale_embeddings = 'false'"],
     "scale_embeddings='false' must be True or False"),
    ([], ["TrainConfig.learning_rate = '1e-3'"], "learning_rate='1e-3' must be a number"),
    ([], ["DataConfig.paths = ('/data/train.tsv')"],  # no trailing comma: a string
     "paths='/data/train.tsv' must be a list of strings, e.g. ('/data/train.tsv',)"),
    ([], ["DataConfig.tokenizer_model = 5"], "tokenizer_model=5 must be a string"),
    ([], ["ModelConfig.d_modle = 1"], None),
    # gin's own text named neither the macro nor the binding ("macro() missing 1 required
    # positional argument: 'value'").
    ([], ["TrainConfig.learning_rate = %LR"],
     "gin macro %LR is used but never bound: bind it in a gin file (LR = ...) or with "
     "--gin.LR=..."),
    ([], ["TrainConfig.learning_rate = %lr"],  # a name in lower case is a macro too
     "gin macro %lr is used but never bound: bind it in a gin file (lr = ...) or with "
     "--gin.lr=..."),
    ([], ["LR = 0.1", "TrainConfig.learning_rate = %LR", "ModelConfig.d_model = %D_MODEL",
          "TrainConfig.seed = %SEED"],
     "gin macros %D_MODEL, %SEED are used but never bound: bind each in a gin file "
     "(D_MODEL = ...) or with --gin.D_MODEL=..."),
    # A value gin cannot parse: named with its binding (gin's text named neither, and held a
    # memory address: "malformed node or string on line 1: <ast.Name object at 0x...>").
    ([], ["TrainConfig.steps = 3", "TrainConfig.schedule = cosine"],
     "binding 'TrainConfig.schedule = cosine': its value does not parse (a string needs quotes, "
     "a tuple parentheses: TrainConfig.schedule = 'cosine', TrainConfig.mesh_shape = (2, 1, 1))"),
    ([], ["TrainConfig.mesh_shape = 2,1,1"], "binding 'TrainConfig.mesh_shape = 2,1,1': its value "
     "does not parse"),
    ([], ["TrainConfig.steps = )"], "binding 'TrainConfig.steps = )': its value does not parse"),
    ([], ["TrainConfig.steps == 1"], "binding 'TrainConfig.steps == 1': its value does not "
     "parse"),  # the name ends at the first "="
    # ... and one whose name does not parse: named as such (until 2026-12-06 "its value").
    ([], ["a.b/TrainConfig.steps = 1"], "binding 'a.b/TrainConfig.steps = 1': "
     "'a.b/TrainConfig.steps' is not a gin name (a binding is NAME = VALUE, NAME a field or a "
     "macro, after scopes without dots if any: TrainConfig.steps = 100, train/LR = 0.5)"),
    ([], ["TrainConfig..steps = 1"], "binding 'TrainConfig..steps = 1': 'TrainConfig..steps' is "
     "not a gin name"),
    ([], ["Train Config.steps = 1"], "binding 'Train Config.steps = 1': 'Train Config.steps' is "
     "not a gin name"),
    ([], [".a/TrainConfig.steps = 1"], "binding '.a/TrainConfig.steps = 1': "
     "'.a/TrainConfig.steps' is not a gin name"),
    ([], ["TrainConfig.steps 1"], "binding 'TrainConfig.steps 1' has no '=' (a binding is "
     "NAME = VALUE: TrainConfig.steps = 100)"),
    ([], ["TrainConfig.steps"], "binding 'TrainConfig.steps' has no '='"),
    # A module-qualified name is a gin name: its value is what does not parse.
    ([], ["attnlab.config.TrainConfig.schedule = cosine"],
     "binding 'attnlab.config.TrainConfig.schedule = cosine': its value does not parse"),
    # A scope: the configs are built unscoped, and gin dropped these without a word until
    # 2026-12-04 (found by a review).
    ([], ["train/ModelConfig.d_model = 64", "ModelConfig.d_ff = 64", "x/TrainConfig.steps = 1"],
     "scoped bindings train/ModelConfig.d_model, x/TrainConfig.steps: attnlab builds each "
     "config once, without a scope: bind it as Name.field"),
    ([], ["ModelConfig.d_ff = 64", "train/ModelConfig.d_model = 64"],
     "scoped binding train/ModelConfig.d_model: attnlab builds each config once, without a "
     "scope: bind it as Name.field"),
])
def test_parse_errors_are_one_line_gin_config_errors(files, bindings, message):
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse(files, bindings)
  assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
  if message is not None:
    assert str(e.value).startswith(message), str(e.value)
  else:
    assert "d_modle" in str(e.value)


def test_a_refused_value_is_its_message_without_gins_context(tmp_path):
  """gin wraps a config's own refusal with where it was ("In call to configurable
  'ModelConfig' (<class ...>)", until 2026-12-04 appended to the one line); the binding
  of an unknown parameter is kept (it names it)."""
  for bindings, message in (
      (["ModelConfig.num_heads = 6", "ModelConfig.num_kv_heads = 4"],
       "num_heads=6 must be a multiple of num_kv_heads=4"),
      # A misspelt name gets the nearest one attnlab has, or where the names are (gin's
      # message alone until 2026-12-04).
      (["TrainConfig.stepz = 3"],
       "Configurable 'TrainConfig' doesn't have a parameter named 'stepz'. "
       "TrainConfig.stepz = 3 (did you mean TrainConfig.steps?)"),
      # ... also beside a macro still unbound when gin stopped (not the macro's message).
      (["TrainConfig.learning_rate = %LR", "TrainConfig.stepz = 3"],
       "Configurable 'TrainConfig' doesn't have a parameter named 'stepz'. "
       "TrainConfig.stepz = 3 (did you mean TrainConfig.steps?)"),
      (["ModelConfig.zzzzzz = 3"],
       "Configurable 'ModelConfig' doesn't have a parameter named 'zzzzzz'. "
       "ModelConfig.zzzzzz = 3 (ModelConfig's fields are documented in attnlab/config.py)"),
      (["TrainConfg.steps = 3"],
       "No configurable matching 'TrainConfg'. TrainConfg.steps = 3 (did you mean "
       "TrainConfig?)"),
      (["Foo.bar = 3"],
       "No configurable matching 'Foo'. Foo.bar = 3 (attnlab's configurables: ModelConfig, "
       "DataConfig, TrainConfig, Sweep)")):
    with pytest.raises(gin_config.GinConfigError) as e:
      gin_config.parse([], bindings)
    assert str(e.value) == message
  # A sweep file given to train, or a Sweep binding, also after a sweep was read in the
  # process (until 2026-12-07 every later parse knew Sweep, and `train` took
  # --gin.Sweep.seeds and ignored it).
  sweep = tmp_path / "sweep.gin"
  sweep.write_text("Sweep.base = ['seq2seq_reverse.gin']\nSweep.seeds = [0]\n")
  assert gin_config.parse_sweep(str(sweep), [])[0].seeds == (0,)
  for files, bindings in (([], ["Sweep.seeds = [0]"]), ([str(sweep)], [])):
    with pytest.raises(gin_config.GinConfigError) as e:
      gin_config.parse(files, bindings)
    assert str(e.value).endswith(
        "(Sweep.* belongs to a sweep file: run it with attnlab ablate)"), str(e.value)
  # Sweep.* in a base file (ignored until 2026-12-07: the sweep file alone makes the Sweep)
  (tmp_path / "base.gin").write_text("include 'seq2seq_reverse.gin'\nSweep.seeds = [7]\n"
                                     "Sweep.curve_points = 3\n")
  (tmp_path / "more.gin").write_text("TrainConfig.steps = 5\n")
  sweep.write_text(f"Sweep.base = ['{tmp_path / 'base.gin'}', '{tmp_path / 'more.gin'}']\n")
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse_sweep(str(sweep), [])
  assert str(e.value) == (f"Sweep.seeds, Sweep.curve_points bound in a base file "
                          f"({tmp_path / 'base.gin'}, {tmp_path / 'more.gin'}): Sweep.* belongs "
                          f"to the sweep file {sweep}")
  assert gin_config._with_hint("No configurable matching 'Sweep'. Sweep.seeds = [0]") == (
      "No configurable matching 'Sweep'. Sweep.seeds = [0] (Sweep.* belongs to a sweep file: "
      "run it with attnlab ablate)")
  # ... also named with its module, as attnlab registers it or as the module it is in.
  for name in ("attnlab.Sweep", "attnlab.config.Sweep"):
    assert gin_config._with_hint(f"No configurable matching '{name}'. {name}.seeds = [0]") == (
        f"No configurable matching '{name}'. {name}.seeds = [0] (Sweep.* belongs to a sweep "
        "file: run it with attnlab ablate)")


def test_a_gin_file_that_is_not_utf8_is_named(tmp_path):
  (tmp_path / "latin.gin").write_bytes(b"ModelConfig.d_model = 32\n# caf\xe9\n")
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse([str(tmp_path / "latin.gin")], [])
  assert str(e.value) == (f"gin file {str(tmp_path / 'latin.gin')!r} is not UTF-8 text "
                          "(invalid continuation byte at byte 30)")


def test_an_included_gin_file_that_is_not_utf8_is_named_with_its_includer(tmp_path):
  """a.gin includes b.gin, which includes c.gin, not UTF-8: c.gin and b.gin are named
  (until 2026-12-04 gin's codec error named a.gin, line 1)."""
  (tmp_path / "a.gin").write_text("include 'b.gin'\nTrainConfig.steps = 3\n")
  (tmp_path / "b.gin").write_text("include 'c.gin'\n")
  (tmp_path / "c.gin").write_bytes(b"# caf\xe9\nModelConfig.d_model = 32\n")
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse([str(tmp_path / "a.gin")], [])
  assert str(e.value) == (
      f"gin file {str(tmp_path / 'c.gin')!r}, included by {str(tmp_path / 'b.gin')!r}, is not "
      "UTF-8 text (invalid continuation byte at byte 5)")
  (tmp_path / "c.gin").write_text("# café\nModelConfig.d_model = 32\n")
  assert gin_config.parse([str(tmp_path / "a.gin")], [])[0].d_model == 32


def test_a_non_utf8_include_is_found_past_a_file_included_twice_and_a_missing_include(tmp_path):
  """The include walk visits a file that two files include once and goes on past it, and
  skips an include that does not exist (gin stopped at the non-UTF-8 file before it)."""
  (tmp_path / "top.gin").write_text("include 'common.gin'\ninclude 'x.gin'\n")
  (tmp_path / "common.gin").write_text("ModelConfig.d_model = 32\n")
  (tmp_path / "x.gin").write_text("include 'common.gin'\ninclude 'bad.gin'\n"
                                  "include 'missing.gin'\n")
  (tmp_path / "bad.gin").write_bytes(b"# caf\xe9\n")
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse([str(tmp_path / "top.gin")], [])
  assert str(e.value) == (
      f"gin file {str(tmp_path / 'bad.gin')!r}, included by {str(tmp_path / 'x.gin')!r}, is "
      "not UTF-8 text (invalid continuation byte at byte 5)")


def test_an_unbound_macro_in_a_gin_file_is_named(tmp_path):
  (tmp_path / "x.gin").write_text("TrainConfig.warmup_steps = %WARMUP\n")
  with pytest.raises(gin_config.GinConfigError, match=re.escape("gin macro %WARMUP is used")):
    gin_config.parse([str(tmp_path / "x.gin")], [])
  assert gin_config.parse([str(tmp_path / "x.gin")], ["WARMUP = 7"])[2].warmup_steps == 7
  # In an included file too (gin's own "macro() missing 1 required positional argument"
  # until 2026-12-05).
  (tmp_path / "top.gin").write_text("include 'x.gin'\n")
  with pytest.raises(gin_config.GinConfigError, match=re.escape("gin macro %WARMUP is used")):
    gin_config.parse([str(tmp_path / "top.gin")], [])


def test_a_binding_that_gin_reads_as_an_unused_macro_is_refused(tmp_path):
  """A name without a dot binds a gin macro, not a field, and gin drops a macro nothing
  reads: until 2026-12-05 ``--gin.steps=1`` trained the file's steps without a word (found by
  an audit), as did a scoped ``TrainConfig/steps = 1``."""
  for binding, hint in (("steps = 1", "did you mean TrainConfig.steps?"),
                        ("TrainConfig/steps = 9", "did you mean TrainConfig.steps?"),
                        ("x/TrainConfig/steps = 2", "did you mean TrainConfig.steps?"),
                        ("d_mdl = 3", "a field is bound as Name.field, e.g. TrainConfig.steps")):
    with pytest.raises(gin_config.GinConfigError) as e:
      gin_config.parse([], ["ModelConfig.d_model = 32", binding])
    name = binding.split(" =")[0]
    assert str(e.value) == (f"binding {binding!r} sets nothing: {name!r} is no config field, "
                            f"and no %{name} macro reads it ({hint})")
  # The macro named is the binding's own, its scope included: %LR reads no train/LR (the
  # message named %LR until 2026-12-07, read by the file beside it).
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse([], ["LR = 3", "TrainConfig.steps = %LR", "train/LR = 3"])
  assert str(e.value) == ("binding 'train/LR = 3' sets nothing: 'train/LR' is no config field, "
                          "and no %train/LR macro reads it (a field is bound as Name.field, "
                          "e.g. TrainConfig.steps)")
  # A macro that a binding, a file or a file it includes reads is a macro.
  assert gin_config.parse([], ["LR = 0.5", "TrainConfig.learning_rate = %LR"])[2] \
      .learning_rate == 0.5
  # A scoped macro too (refused as unread until 2026-12-06: gin reads %train/LR).
  assert gin_config.parse([], ["train/LR = 0.25", "TrainConfig.learning_rate = %train/LR"])[2] \
      .learning_rate == 0.25
  (tmp_path / "inner.gin").write_text("TrainConfig.steps = %STEPS\n")
  (tmp_path / "outer.gin").write_text("include 'inner.gin'\n")
  assert gin_config.parse([str(tmp_path / "outer.gin")], ["STEPS = 4"])[2].steps == 4
  # A file that a binding includes, and a binding of several lines, read alike (a review
  # found both refused in a first version); each line of such a binding is checked.
  inner = str(tmp_path / "inner.gin")
  assert gin_config.parse([], [f"include {inner!r}", "STEPS = 6"])[2].steps == 6
  assert gin_config.parse([], ["STEPS = 5", f"include {inner!r}"])[2].steps == 5
  assert gin_config.parse([], ["X = 3\nTrainConfig.steps = %X"])[2].steps == 3
  with pytest.raises(gin_config.GinConfigError, match="binding 'steps = 3' sets nothing"):
    gin_config.parse([], ["ModelConfig.d_model = 32\nsteps = 3"])
  # Spelt without spaces (as --gin.steps=1 comes), with a '=' in its value, or after a
  # comment line: refused alike; a line of a value (a tuple over several lines) is no binding.
  for bindings, name, field, owner in (
      (["steps=1"], "steps", "steps", "TrainConfig"),
      (["tokenizer_model = 'a=b.json'"], "tokenizer_model", "tokenizer_model", "DataConfig"),
      (["# the run", "steps = 3"], "steps", "steps", "TrainConfig"),
      (["# the run\nsteps = 3"], "steps", "steps", "TrainConfig")):
    with pytest.raises(gin_config.GinConfigError) as e:
      gin_config.parse([], bindings)
    assert str(e.value) == (f"binding {bindings[-1].splitlines()[-1]!r} sets nothing: {name!r} is "
                            f"no config field, and no %{field} macro reads it (did you mean "
                            f"{owner}.{field}?)")
  assert gin_config.parse([], ["TrainConfig.mesh_shape = (\n1,\n1,\n1\n)"])[2].mesh_shape == (
      1, 1, 1)
  # In a gin file, or a file it includes, alike: named with the file and line (until
  # 2026-12-06 a file's own `steps = 5` was dropped without a word, and the run trained the
  # steps bound elsewhere).
  (tmp_path / "own.gin").write_text("include 'inner.gin'\n# the run\nSTEPS = 2\nsteps = 5\n")
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse([str(tmp_path / "own.gin")], [])
  assert str(e.value) == (f"gin file {str(tmp_path / 'own.gin')!r}, line 4: binding "
                          "'steps = 5' sets nothing: 'steps' is no config field, and no %steps "
                          "macro reads it (did you mean TrainConfig.steps?)")
  (tmp_path / "scoped.gin").write_text("TrainConfig.steps = 1\nTrainConfig/steps = 5\n")
  (tmp_path / "top.gin").write_text("include 'scoped.gin'\n")
  with pytest.raises(gin_config.GinConfigError, match=re.escape(
      f"gin file {str(tmp_path / 'scoped.gin')!r}, line 2: binding 'TrainConfig/steps = 5' "
      "sets nothing")):
    gin_config.parse([str(tmp_path / "top.gin")], [])
  # A file's macro that another file (or a binding) reads is one; a line of a value over
  # several lines, with a '=' in it, is no binding.
  (tmp_path / "own.gin").write_text("include 'inner.gin'\nSTEPS = 2\nDataConfig.paths = (\n"
                                    "    'a=b.txt',)\n")
  assert gin_config.parse([str(tmp_path / "own.gin")], [])[2].steps == 2
  (tmp_path / "own.gin").write_text("WIDTH = 48\n")
  assert gin_config.parse([str(tmp_path / "own.gin")], ["ModelConfig.d_model = %WIDTH"])[
      0].d_model == 48


def test_include_cycles_imports_and_unparsable_file_values_are_one_line(tmp_path):
  """Each a traceback, or gin's message with a Python object's address, until 2026-12-05
  (found by an audit)."""
  (tmp_path / "self.gin").write_text("include 'self.gin'\n")
  (tmp_path / "a.gin").write_text("include 'b.gin'\n")
  (tmp_path / "b.gin").write_text("include 'a.gin'\n")
  (tmp_path / "imp.gin").write_text("import nosuchmodule_of_attnlab\n")
  (tmp_path / "bare.gin").write_text("ModelConfig.d_model = 32\nDataConfig.task = reverse\n")
  (tmp_path / "open.gin").write_text("ModelConfig.d_model = 32\nDataConfig.task = (1,\n")
  (tmp_path / "bom.gin").write_bytes(b"\xef\xbb\xbfModelConfig.d_model = 32\n")
  (tmp_path / "nosep.gin").write_text("ModelConfig.d_model 32\n")
  (tmp_path / "latin.gin").write_bytes(b"# caf\xe9\n")
  (tmp_path / "early.gin").write_text("ModelConfig.d_modle = 1\ninclude 'latin.gin'\n")
  cycle = ("gin config recursion: a gin file includes itself (directly or through the files "
           "it includes), or a binding's value refers to its own configurable")
  for files, bindings, message in (
      (["self.gin"], [], cycle), (["a.gin"], [], cycle),
      ([], ["ModelConfig.dtype = @ModelConfig()"], cycle),
      (["imp.gin"], [], "No module named 'nosuchmodule_of_attnlab'"),
      (["bare.gin"], [], f"gin file {str(tmp_path / 'bare.gin')!r}, line 2: 'DataConfig.task = "
                         "reverse': its value does not parse (a string needs quotes, a tuple "
                         "parentheses: TrainConfig.schedule = 'cosine', TrainConfig.mesh_shape = "
                         "(2, 1, 1))"),
      # Another fault of a line's syntax: gin's own message, which names the file and line.
      (["nosep.gin"], [], "Couldn't parse statement, expected ':' or '='. (nosep.gin, line 1)"),
      # gin stopped at the misspelt field before it read the include that is not UTF-8.
      (["early.gin"], [], "Configurable 'ModelConfig' doesn't have a parameter named 'd_modle'. "
                          "ModelConfig.d_modle = 1 (did you mean ModelConfig.d_model?)"),
      # gin reads the files before the bindings: a binding that does not parse either, or
      # that includes the file, was named instead until 2026-12-06.
      (["bare.gin"], ["TrainConfig.schedule = cosine"],
       f"gin file {str(tmp_path / 'bare.gin')!r}, line 2: 'DataConfig.task = reverse': its value "
       "does not parse (a string needs quotes"),
      ([], ["TrainConfig.steps = 3", f"include {str(tmp_path / 'bare.gin')!r}"],
       f"gin file {str(tmp_path / 'bare.gin')!r}, line 2: 'DataConfig.task = reverse': its value "
       "does not parse (a string needs quotes"),
      # A tokenize.TokenError traceback, and gin's "Unexpected token", until 2026-12-05. Then
      # Python's own words, which vary: 3.11 "EOF in multi-line statement, line 3", 3.12
      # "unexpected EOF in multi-line statement, line 2".
      (["open.gin"], [], "a gin file or binding ends inside an open bracket or string ("),
      (["bom.gin"], [], f"gin file {str(tmp_path / 'bom.gin')!r} starts with a UTF-8 byte order "
                        "mark, which gin cannot read: save it without one")):
    with pytest.raises(gin_config.GinConfigError) as e:
      gin_config.parse([str(tmp_path / f) for f in files], bindings)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    if files == ["open.gin"]:  # Python's words, as this Python gives them
      assert re.search(r"\((unexpected )?EOF in multi-line statement, line \d+\)$",
                       str(e.value)), str(e.value)


def test_first_line_keeps_at_most_two_lines_joined():
  assert gin_config._first_line(ValueError("one")) == "one"
  assert gin_config._first_line(ValueError("  one\ntwo\nthree ")) == "one two"
  assert gin_config._first_line(KeyError()) == "KeyError"
  assert gin_config._first_line(ValueError("\n")) == "ValueError"


def test_configs_slash_names_the_built_in_configs_outside_a_checkout(tmp_path, monkeypatch):
  """A gin file written in a checkout (``include 'configs/models/llama_tiny.gin'``, a sweep's
  ``Sweep.base = ["configs/lm_stdlib_tiny.gin"]``) read where the working directory has no
  configs/ folder (an installed attnlab): the built-in files, as ``--gin_file configs/...``
  already was (until 2026-12-07 "Unable to open file" and "Sweep.base file ... was not
  found"). A configs/ folder of the working directory's own comes first."""
  monkeypatch.chdir(tmp_path)
  mine = tmp_path / "mine.gin"
  mine.write_text("include 'configs/models/llama_tiny.gin'\nDataConfig.task = 'lm'\n")
  mcfg = gin_config.parse([str(mine)], [])[0]
  assert (mcfg.d_model, mcfg.num_kv_heads, mcfg.d_ff) == (128, 2, 344)
  assert gin_config.resolve_base(("configs/lm_stdlib_tiny.gin",), str(mine),
                                 gin_config.CONFIGS_DIR) == [
      os.path.join(gin_config.CONFIGS_DIR, "lm_stdlib_tiny.gin")]
  # The configs folder the caller names (a sweep's own): configs/NAME is its NAME.
  other = tmp_path / "other_configs"
  other.mkdir()
  (other / "x.gin").write_text("")
  assert gin_config.resolve_base(("configs/x.gin",), str(mine), str(other)) == [
      str(other / "x.gin")]
  # Only a configs/ prefix is dropped: a path of another folder that does not hold the file
  # is not the built-in file of that name, it is missing.
  for name in ("elsewhere/lm_stdlib_tiny.gin", "configs"):
    with pytest.raises(FileNotFoundError, match=f"Sweep.base file '{name}' was not found"):
      gin_config.resolve_base((name,), str(mine), gin_config.CONFIGS_DIR)
  # Nothing else of attnlab's package folder is an include (until 2026-12-07 the folder was
  # searched: 'nn/layers.py' went to gin as a config, "Unexpected token. (layers.py, line 1)").
  for name in ("nn/layers.py", "configs/../cli.py", "configs/models/../../version.py",
               "configs", "configs/"):
    mine.write_text(f"include '{name}'\n")
    with pytest.raises(gin_config.GinConfigError, match=re.escape(
        f"Unable to open file: {name}. Searched config paths: ")):
      gin_config.parse([str(mine)], [])
  # What attnlab reads of the included files itself (the macros they read, for the check of
  # bindings that set nothing) it finds as gin does: a built-in file's %STEPS is read.
  builtin = tmp_path / "builtin"
  builtin.mkdir()
  (builtin / "m.gin").write_text("TrainConfig.steps = %STEPS\nSTEPS = 3\n")
  with monkeypatch.context() as patch:
    patch.setattr(gin_config, "CONFIGS_DIR", str(builtin))
    mine.write_text("include 'configs/m.gin'\n")
    assert gin_config.parse([str(mine)], ["STEPS = 5"])[2].steps == 5
  mine.write_text("include 'configs/models/llama_tiny.gin'\nDataConfig.task = 'lm'\n")
  (tmp_path / "configs" / "models").mkdir(parents=True)
  (tmp_path / "configs" / "models" / "llama_tiny.gin").write_text("ModelConfig.d_model = 64\n")
  assert gin_config.parse([str(mine)], [])[0].d_model == 64


def test_gins_logging_while_attnlab_parses_logs_nothing_and_passes_the_rest_through(caplog):
  """What gin's modules see as ``logging`` during a parse: its logging functions log nothing
  (the module's own would reach the root logger); anything else (a level, ``getLogger``) is
  the logging module's."""
  import logging

  silent = gin_config._SilentLogging()
  with caplog.at_level(logging.DEBUG):
    for name in ("debug", "info", "warning", "error", "critical", "exception"):
      getattr(silent, name)("gin says %s", name)
    silent.log(logging.ERROR, "gin says log")
    assert caplog.records == []
    logging.warning("the module's own")  # what the stand-in replaces: it does log
    assert [r.getMessage() for r in caplog.records] == ["the module's own"]
  assert (silent.DEBUG, silent.getLogger) == (logging.DEBUG, logging.getLogger)


def test_sweep_base_files_are_found_as_given_beside_the_sweep_or_in_configs(tmp_path,
                                                                           monkeypatch):
  sweeps = tmp_path / "sweeps"
  sweeps.mkdir()
  (sweeps / "mine.gin").write_text("ModelConfig.d_model = 48\n")
  (tmp_path / "given.gin").write_text("ModelConfig.num_layers = 3\n")
  monkeypatch.chdir(tmp_path)
  sweep_file = sweeps / "s.gin"
  # Read in order (a later file wins), then the sweep file, then the bindings.
  sweep_file.write_text('Sweep.base = ["lm_stdlib_tiny.gin", "given.gin", "mine.gin"]\n'
                        "Sweep.seeds = (0,)\nModelConfig.d_ff = 96\n")
  assert gin_config.resolve_base(("lm_stdlib_tiny.gin", "given.gin", "mine.gin"),
                                 str(sweep_file), gin_config.CONFIGS_DIR) == [
      os.path.join(gin_config.CONFIGS_DIR, "lm_stdlib_tiny.gin"), "given.gin",
      str(sweeps / "mine.gin")]
  sweep, mcfg, dcfg, tcfg = gin_config.parse_sweep(str(sweep_file), ["TrainConfig.steps = 5"])
  assert sweep.seeds == (0,)
  # The bindings bind the Sweep too (`attnlab ablate --gin.Sweep.seeds=...`).
  assert gin_config.parse_sweep(str(sweep_file), ["Sweep.seeds = (4, 5)"])[0].seeds == (4, 5)
  assert (mcfg.d_model, mcfg.num_layers, mcfg.d_ff, tcfg.steps) == (48, 3, 96, 5)
  # A macro that a base file reads may be bound by a flag; one that nothing reads is refused.
  (sweeps / "mine.gin").write_text("ModelConfig.d_model = %WIDTH\n")
  assert gin_config.parse_sweep(str(sweep_file), ["WIDTH = 40"])[1].d_model == 40
  with pytest.raises(gin_config.GinConfigError, match="binding 'steps = 5' sets nothing"):
    gin_config.parse_sweep(str(sweep_file), ["WIDTH = 40", "steps = 5"])
  (sweeps / "mine.gin").write_text("ModelConfig.d_model = 48\n")
  tiny = gin_config.parse([os.path.join(gin_config.CONFIGS_DIR, "lm_stdlib_tiny.gin")], [])
  assert dcfg == tiny[1]  # the base file's data config
  sweep_file.write_text('Sweep.base = ["lost.gin"]\n')
  with pytest.raises(gin_config.GinConfigError) as e:
    gin_config.parse_sweep(str(sweep_file), [])
  assert str(e.value) == (f"Sweep.base file 'lost.gin' was not found (as given, next to "
                          f"{sweep_file}, or in {gin_config.CONFIGS_DIR})")


def test_a_gin_file_missing_as_given_is_the_built_in_config_of_that_name(tmp_path, monkeypatch):
  """An installed attnlab runs its own configs from any directory: by name, by a path under
  models/, or spelt configs/... as in a checkout. A file as given wins; a name that is
  neither is refused with the built-in names."""
  monkeypatch.chdir(tmp_path)
  builtin = gin_config.parse([os.path.join(gin_config.CONFIGS_DIR, "seq2seq_reverse.gin")], [])
  assert builtin[1].task == "reverse"
  for name in ("seq2seq_reverse.gin", "configs/seq2seq_reverse.gin",
               os.path.join("configs", "models", "..", "seq2seq_reverse.gin")):
    assert gin_config.find_gin_file(name) == os.path.join(gin_config.CONFIGS_DIR,
                                                          "seq2seq_reverse.gin")
    assert gin_config.parse([name], []) == builtin
  assert gin_config.find_gin_file("models/llama_tiny.gin") == os.path.join(
      gin_config.CONFIGS_DIR, "models", "llama_tiny.gin")
  assert gin_config.parse(["models/llama_tiny.gin"], [])[0].num_kv_heads == 2
  # With the sweep's own file too (its Sweep.base is found beside the built-in file).
  assert gin_config.parse_sweep("seq2seq_reverse.gin", [])[2].task == "reverse"
  (tmp_path / "seq2seq_reverse.gin").write_text("DataConfig.task = 'sort'\n")
  assert gin_config.find_gin_file("seq2seq_reverse.gin") == "seq2seq_reverse.gin"
  assert gin_config.parse(["seq2seq_reverse.gin"], [])[1].task == "sort"
  assert gin_config.builtin_configs()[:2] == ["lm_stdlib.gin", "lm_stdlib_tiny.gin"]
  assert "models/llama_tiny.gin" in gin_config.builtin_configs()
  for missing in ("lm_stdlib_tiny", "configs", "models", "config/lm_stdlib.gin"):
    with pytest.raises(gin_config.GinConfigError) as e:
      gin_config.parse([missing], [])
    assert str(e.value) == (f"gin file {missing!r} does not exist, as given or among the "
                            f"built-in configs ({', '.join(gin_config.builtin_configs())})")
  with pytest.raises(gin_config.GinConfigError) as e:  # an absolute path is only itself
    gin_config.parse([str(tmp_path / "lm_stdlib.gin")], [])
  assert str(e.value) == f"gin file {str(tmp_path / 'lm_stdlib.gin')!r} does not exist"


def test_the_configurables_also_answer_to_their_module_qualified_names():
  """``attnlab.ModelConfig`` names the same configurable as ``ModelConfig`` (and keeps a
  user's own ``ModelConfig`` configurable apart)."""
  mcfg, dcfg, tcfg = gin_config.parse([], ["attnlab.ModelConfig.d_model = 48",
                                           "attnlab.DataConfig.seq_len = 32",
                                           "attnlab.TrainConfig.steps = 9"])
  assert (mcfg.d_model, dcfg.seq_len, tcfg.steps) == (48, 32, 9)
