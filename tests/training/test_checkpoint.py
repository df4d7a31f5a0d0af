"""Checkpointer.restore_latest on a tiny state: it falls back past a damaged
checkpoint (garbled, truncated or missing files, a missing item), but any
other failure (a bug, a checkpoint of another model shape) is raised instead
of turning into a warning and a fresh start."""

import collections
import json
import logging
import os
import re
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.training import checkpoint
from attnlab.training.checkpoint import Checkpointer


def _state(k):
  # "big": 4 KiB of random values (no compression shrinks them), more than orbax inlines
  # in its manifest: the largest data file of its item.
  big = jnp.asarray(np.random.default_rng(k).standard_normal((32, 32)), jnp.float32)
  return {"params": {"w": jnp.full((4, 8), float(k)), "b": jnp.arange(3.0) + k, "big": big},
          "opt_state": {"mu": jnp.full((4, 8), k / 10), "big": big / 10},
          "step": jnp.asarray(k, jnp.int32)}


def _abstract(state):
  device = jax.sharding.make_single_device_sharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def _assert_restored(state, want):
  """Same tree (params, opt_state, step), same values, placed as the abstract state said."""
  assert jax.tree.structure(state) == jax.tree.structure(want)
  device = jax.sharding.make_single_device_sharding(jax.devices()[0])
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
    assert isinstance(a, jax.Array) and a.sharding == device
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A workdir with checkpoints 1 and 2 (states _state(1), _state(2))."""
  workdir = tmp_path_factory.mktemp("ckpt")
  ckpt = Checkpointer(str(workdir))
  for k in (1, 2):
    ckpt.save(k, _state(k), {"next_batch": 10 * k})
  ckpt.close()
  return workdir


def _files(step_dir, pred):
  out = []
  for root, _, files in os.walk(step_dir):
    out += [os.path.join(root, f) for f in files
            if pred(os.path.relpath(os.path.join(root, f), step_dir))]
  assert out, "nothing to damage"
  return out


def _write(path, data):
  with open(path, "wb") as f:
    f.write(data)


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(max(os.path.getsize(path) // 2, 1))


DAMAGE = {
    "garbled array files": lambda d: [_write(p, b"garbage") for p in _files(
        d, lambda r: r.startswith("params") and "/d/" in r)],
    "truncated array files": lambda d: [_truncate(p) for p in _files(
        d, lambda r: r.startswith("params") and "/d/" in r)],
    "missing array files": lambda d: [os.remove(p) for p in _files(
        d, lambda r: r.startswith("opt_state") and "/d/" in r)],
    "garbled manifest": lambda d: [_write(p, b"garbage") for p in _files(
        d, lambda r: r.startswith("params") and "manifest" in r)],
    "truncated metadata": lambda d: [_truncate(p) for p in _files(
        d, lambda r: r.startswith("params") and r.endswith("_METADATA"))],
    "garbled data state": lambda d: [_write(p, b"{not json") for p in _files(
        d, lambda r: r.startswith("data"))],
    "missing data state": lambda d: [os.remove(p) for p in _files(
        d, lambda r: r.startswith("data") and r.endswith("metadata"))],
    "missing item": lambda d: shutil.rmtree(os.path.join(d, "params")),
    # One file of several (orbax raises a plain Exception whose cause is tensorstore's).
    "one truncated array file": lambda d: _truncate(_largest(d, "params")),
    "one missing array file": lambda d: os.remove(_largest(d, "opt_state")),
    "non-UTF-8 metadata": lambda d: [_write(p, b"\xff\xfe{") for p in _files(
        d, lambda r: r.startswith("params") and r.endswith("_METADATA"))],
    "non-UTF-8 data state": lambda d: [_write(p, b"\xff") for p in _files(
        d, lambda r: r.startswith("data"))],
    # Bytes changed in place: the files keep their length and parse; only the checksums
    # saved in meta tell (orbax restored other weights / another position before).
    "bytes changed inside an array file": lambda d: _flip(_largest(d, "params"), 0.5),
    "bytes changed inside an optimizer array file": lambda d: _flip(_largest(d, "opt_state"),
                                                                    0.3),
    "another position in the data state": lambda d: [_rewrite(p, b"20", b"30") for p in
                                                     _files(d, lambda r: r == "data/metadata")],
}


CHANGED_IN_PLACE = {"bytes changed inside an array file": "params array big",
                    "bytes changed inside an optimizer array file": "opt_state array opt_state_big",
                    "another position in the data state": "data state {'next_batch': 30}"}


def _flip(path, where):
  """Invert 8 bytes of ``path`` at ``where`` (a fraction of its size); the length stays."""
  with open(path, "r+b") as f:
    f.seek(int(os.path.getsize(path) * where))
    old = f.read(8)
    f.seek(-len(old), os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in old))


def _rewrite(path, old, new):
  with open(path, "rb") as f:
    text = f.read()
  assert old in text, (path, text)
  _write(path, text.replace(old, new))


def _largest(step_dir, item):
  return max(_files(step_dir, lambda r: r.startswith(item) and "/d/" in r), key=os.path.getsize)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(saved, tmp_path, damage,
                                                                     warned, recwarn):
  workdir = tmp_path / "w"
  shutil.copytree(saved, workdir)
  DAMAGE[damage](str(workdir / "checkpoints" / "2"))
  ckpt = Checkpointer(str(workdir))
  try:
    step, state, data_state = ckpt.restore_latest(_abstract(_state(0)))
  finally:
    ckpt.close()
  assert step == 1 and data_state == {"next_batch": 10}
  _assert_restored(state, _state(1))
  # The message names the checkpoint, the error and what happens, in one log line (until
  # 2026-12-04 also a UserWarning: a command printed it twice).
  (msg,) = [m for m in warned() if "could not be restored" in m]
  m = re.fullmatch(r"checkpoint \S+/checkpoints/2 could not be restored \((\w+): (.+)\); "
                   r"falling back to the previous one", msg)
  assert m and m.group(1).endswith("Error") and m.group(2) != "None", msg
  if damage in CHANGED_IN_PLACE:  # only the checksums tell these, naming what changed
    assert m.group(1) == "CorruptCheckpointError", msg
    what = CHANGED_IN_PLACE[damage]
    assert m.group(2).startswith(f"checkpoint {workdir}/checkpoints/2's {what} "), msg
  assert not [w for w in recwarn if "could not be restored" in str(w.message)]  # once only


def test_no_readable_checkpoint_restores_none_after_a_warning_for_each(saved, tmp_path, warned):
  """``restore_latest`` (a resume) with every checkpoint damaged, or none saved: None (a
  fresh start), each damaged one named in its own warning, nothing deleted."""
  workdir = tmp_path / "w"
  shutil.copytree(saved, workdir)
  for step in ("1", "2"):
    # (Not "missing item": orbax's restore then leaves the other item's reads unawaited, and
    # their coroutines print "Exception ignored" warnings when collected.)
    DAMAGE["truncated metadata"](str(workdir / "checkpoints" / step))
  for folder in (workdir, tmp_path / "nothing"):
    ckpt = Checkpointer(str(folder))
    try:
      assert ckpt.restore_latest(_abstract(_state(0))) is None
    finally:
      ckpt.close()
  assert [re.sub(r" \(.*", "", m) for m in warned()] == [
      f"checkpoint {workdir}/checkpoints/{k} could not be restored" for k in (2, 1)]
  assert _listing(workdir) == ["1", "2"]


def test_healthy_checkpoint_restores_without_warning(saved, recwarn, warned):
  """The whole state, or only its parameters (``load_checkpoint``), of a healthy one."""
  ckpt = Checkpointer(str(saved), read_only=True)
  try:
    step, state, data_state = ckpt.restore_latest(_abstract(_state(0)))
    params = ckpt.restore_params(1, _abstract(_state(0))["params"])
  finally:
    ckpt.close()
  assert step == 2 and data_state == {"next_batch": 20}
  _assert_restored(state, _state(2))
  _assert_restored(params, _state(1)["params"])
  assert not [w for w in recwarn if "could not be restored" in str(w.message)]
  assert not [m for m in warned() if "could not be restored" in m]


def test_a_reader_leaves_a_half_saved_checkpoint_and_a_writer_deletes_it_at_once(saved, tmp_path,
                                                                                caplog,
                                                                                monkeypatch):
  """A save killed before its commit leaves ``<step>.orbax-checkpoint-tmp``. A
  read-only Checkpointer (load_checkpoint, attnlab eval, a sweep's progress
  check) deletes nothing: that directory may be the save of a run still
  training. A writer deletes it before its constructor returns; orbax's own
  cleanup ran in a thread that close() did not wait for, and a second manager
  opened soon after on the same directory raced it (CI: FileNotFoundError in
  rmtree on a resume after a kill mid-save)."""
  workdir = tmp_path / "w"
  shutil.copytree(saved, workdir)
  half = workdir / "checkpoints" / "3.orbax-checkpoint-tmp"
  (half / "params").mkdir(parents=True)
  (half / "params" / "x").write_bytes(b"half written")
  for _ in range(2):  # twice: nothing a first reader started may finish later
    reader = Checkpointer(str(workdir), read_only=True)
    try:
      assert reader.steps() == [1, 2]
      step, state, _ = reader.restore_latest(_abstract(_state(0)))
      assert step == 2
      _assert_restored(state, _state(2))
      with pytest.raises(ValueError, match=r"checkpoints is read-only: open it with "
                                           r"read_only=False to save"):
        reader.save(3, _state(3), {"next_batch": 30})
      with pytest.raises(ValueError, match="is read-only"):
        reader.save_params(3, _state(3)["params"])
    finally:
      reader.close()
    assert (half / "params" / "x").read_bytes() == b"half written"
  assert _listing(workdir) == ["1", "2", "3.orbax-checkpoint-tmp"]

  # On several hosts only process 0 deletes it (the others would race it on the shared
  # directory): a writer on process 1 leaves it.
  class OnProcess1:
    process_index = staticmethod(lambda: 1)

    def __getattr__(self, name):
      return getattr(jax, name)

  with monkeypatch.context() as m:
    m.setattr(checkpoint, "jax", OnProcess1())
    Checkpointer(str(workdir)).close()
  assert _listing(workdir) == ["1", "2", "3.orbax-checkpoint-tmp"]
  with caplog.at_level(logging.INFO, logger=checkpoint.__name__):
    writer = Checkpointer(str(workdir))
  try:
    assert _listing(workdir) == ["1", "2"]
    assert [r.getMessage() for r in caplog.records if r.name == checkpoint.__name__] == [
        f"deleting {half}, a checkpoint left half-saved"]
    writer.save(3, _state(3), {"next_batch": 30})
    assert writer.steps() == [1, 2, 3]
  finally:
    writer.close()
  assert _listing(workdir) == ["1", "2", "3"]
  # A reader of a workdir that saved nothing creates nothing there.
  nothing = tmp_path / "nothing"
  reader = Checkpointer(str(nothing), read_only=True)
  assert reader.steps() == []
  reader.close()
  assert not nothing.exists()


def _listing(workdir):
  return sorted(os.listdir(workdir / "checkpoints"))


def test_a_checkpoint_deleted_while_read_sends_the_reader_to_the_newest(saved, tmp_path, warned,
                                                                        monkeypatch):
  """A run still training deletes its older checkpoints while a reader (eval, decode,
  load_checkpoint) reads one: the reader lists the steps again and reads the newest, with
  no warning of damage. Until 2026-12-07 it fell back to older steps only, from the
  listing it opened with, which that run deletes first: up to 6% of the reads beside a run
  saving every step failed, some with a raw FileNotFoundError (also from opening, which a
  deletion between orbax's listing and its stat of a step failed)."""
  import orbax.checkpoint as ocp

  workdir = tmp_path / "w"
  shutil.copytree(saved, workdir)
  manager, failed = ocp.CheckpointManager, []

  def racing(*args, **kwargs):  # the first open meets a step deleted under it
    if not failed:
      failed.append(True)
      raise FileNotFoundError("[Errno 2] No such file or directory: '.../checkpoints/9'")
    return manager(*args, **kwargs)

  monkeypatch.setattr(ocp, "CheckpointManager", racing)
  reader = Checkpointer(str(workdir), read_only=True)
  monkeypatch.setattr(ocp, "CheckpointManager", manager)
  assert failed and reader.steps() == [1, 2]
  abstract, calls = _abstract(_state(0)), []

  def read(step):  # the writer saves step 3 and deletes step 2 while it is read
    calls.append(step)
    if step == 2:
      writer = Checkpointer(str(workdir), keep=3)
      try:
        writer.save(3, _state(3), {"next_batch": 30})
      finally:
        writer.close()
      shutil.rmtree(workdir / "checkpoints" / "2")
    return reader.restore(step, abstract)

  try:
    step, (state, data_state) = reader.restore_newest(read)
  finally:
    reader.close()
  assert (step, calls, data_state) == (3, [2, 3], {"next_batch": 30})
  _assert_restored(state, _state(3))
  assert not warned()


def test_a_read_through_other_functions_of_a_step_deleted_meanwhile_reads_the_newest(
    saved, tmp_path, warned):
  """``read_as_step``: a read that goes through other functions (convert-heads reads the
  source with ``load_checkpoint``) and meets its step deleted by a run still training
  (``load_checkpoint``'s "no such step", a ValueError) is a gone step, and
  ``restore_newest`` reads the newest again (until 2026-12-07 the ValueError came through:
  a traceback from ``attnlab convert-heads``); the same error with the step still there is
  raised as it is."""
  workdir = tmp_path / "w"
  shutil.copytree(saved, workdir)
  reader = Checkpointer(str(workdir), read_only=True)

  def read(step):
    if step == 2:
      shutil.rmtree(workdir / "checkpoints" / "2")
      raise ValueError("step=2 has no checkpoint in .../checkpoints; saved steps: [1]")
    return f"read {step}"

  try:
    assert reader.restore_newest(lambda s: reader.read_as_step(s, lambda: read(s))) == (
        1, "read 1")
    with pytest.raises(ValueError, match="^a mismatch$"):
      reader.read_as_step(1, lambda: (_ for _ in ()).throw(ValueError("a mismatch")))
  finally:
    reader.close()
  assert not warned()


def test_other_errors_are_raised_not_taken_for_a_damaged_checkpoint(saved, monkeypatch):
  ckpt = Checkpointer(str(saved))
  try:
    # A checkpoint of another model (a shape mismatch) is not "unreadable".
    other = _state(0)
    other["params"]["w"] = jnp.zeros((4, 9))
    with pytest.raises(checkpoint.CheckpointMismatchError, match="shape"):
      ckpt.restore_latest(_abstract(other))

    def broken(self, step, abstract_state, init_state=None):
      raise RuntimeError("a bug in restore")

    monkeypatch.setattr(Checkpointer, "restore", broken)
    with pytest.raises(RuntimeError, match="a bug in restore"):
      ckpt.restore_latest(_abstract(_state(0)))
  finally:
    ckpt.close()


BIG = jnp.zeros((32, 32))


def test_a_state_of_other_shapes_or_arrays_is_refused_before_any_array_is_read(saved,
                                                                               monkeypatch):
  """The shapes saved in the checkpoint's metadata are compared first: the error names the
  first array that differs (and how many more), or what only one side holds; orbax's own
  restore, which would fail with its message and noise from its threads, is not called."""
  ckpt = Checkpointer(str(saved))
  read, real = [], ckpt.manager.restore
  monkeypatch.setattr(ckpt.manager, "restore", lambda *a, **k: read.append(a) or real(*a, **k))
  where = os.path.join(str(saved), "checkpoints", "2")
  try:
    for change, message in (
        ({"w": jnp.zeros((4, 9)), "b": jnp.zeros(2), "big": BIG},
         "holds arrays of other shapes: b is (3,) there, (2,) in this run (and 1 more)"),
        ({"w": jnp.zeros((4, 9)), "b": jnp.zeros(3), "big": BIG},
         "holds arrays of other shapes: w is (4, 8) there, (4, 9) in this run"),
        ({"w": jnp.zeros((4, 8)), "b": jnp.zeros(3), "big": BIG, "c": jnp.zeros(1)},
         "holds other arrays than this run: 1 of this run not in it (first: c)"),
        ({"w": jnp.zeros((4, 8)), "big": BIG},
         "holds other arrays than this run: 1 not in this run (first: b)"),
        ({"w": jnp.zeros((4, 8)), "big": BIG, "c": jnp.zeros(1), "d": jnp.zeros(1)},
         "holds other arrays than this run: 1 not in this run (first: b); 2 of this run not "
         "in it (first: c)")):
      state = {**_state(0), "params": change}
      message = f"checkpoint {where}'s params {message}"
      with pytest.raises(checkpoint.CheckpointMismatchError) as e:
        ckpt.restore(2, _abstract(state))
      assert str(e.value) == message
      with pytest.raises(checkpoint.CheckpointMismatchError) as e:
        ckpt.restore_params(2, _abstract(change))
      assert str(e.value) == message
    state = _state(0)
    state["opt_state"] = {"mu": jnp.zeros((4, 8)), "big": BIG, "nu": jnp.zeros((4, 8))}
    with pytest.raises(checkpoint.CheckpointMismatchError) as e:
      ckpt.restore(2, _abstract(state))
    assert str(e.value) == (f"checkpoint {where}'s opt_state holds other arrays than this run: "
                            "1 of this run not in it (first: opt_state_nu)")
    assert read == []
    # Another dtype is not a mismatch (orbax casts).
    ckpt.restore(2, _abstract(jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                                           if x.dtype == jnp.float32 else x, _state(0))))
    assert len(read) == 1
  finally:
    ckpt.close()
  checkpoint.check_fits({"0000_a_value": (2,), "0001_b": (3,)},
                        {"0001_a_value": (2,), "0000_b": (3,)}, "x")  # indices ignored
  # An nnx parameter's path ends in its "value": the message names the parameter.
  with pytest.raises(checkpoint.CheckpointMismatchError, match=re.escape(
      "x holds arrays of other shapes: decoder_layers_0_mlp_w is (2,) there, (3,) in this "
      "run") + "$"):
    checkpoint.check_fits({"0003_decoder_layers_0_mlp_w_value": (2,)},
                          {"0003_decoder_layers_0_mlp_w_value": (3,)}, "x")
  # Leaves whose paths read alike (keys "a.b" and "a_b") are still two arrays.
  alike = {"0000_a_b": (2,), "0001_a_b": (3,)}
  checkpoint.check_fits(alike, alike, "x")
  with pytest.raises(checkpoint.CheckpointMismatchError, match=re.escape(
      "x holds arrays of other shapes: a_b (2) is (3,) there, (4,) in this run") + "$"):
    checkpoint.check_fits(alike, {"0000_a_b": (2,), "0001_a_b": (4,)}, "x")
  with pytest.raises(checkpoint.CheckpointMismatchError, match=re.escape(
      "x holds other arrays than this run: 1 not in this run (first: a_b (2))") + "$"):
    checkpoint.check_fits(alike, {"0000_a_b": (2,)}, "x")


def test_metadata_naming_no_array_of_the_state_is_left_to_orbaxs_restore(saved, monkeypatch):
  """An item whose metadata names none of the state's arrays (a layout of another orbax
  version) is not refused by the shape check: orbax's restore compares it (here it reads)."""
  import orbax.checkpoint as ocp

  class OtherLayout:
    def metadata(self, path):
      leaves = jax.tree.leaves(ocp.StandardCheckpointHandler().metadata(path))
      return {"item": {f"leaf{i}": m for i, m in enumerate(leaves)}}

  ckpt = Checkpointer(str(saved), read_only=True)
  try:
    monkeypatch.setattr(ckpt, "_ocp", type("Orbax", (), {"StandardCheckpointHandler": OtherLayout,
                                                         "args": ocp.args}))
    state, data_state = ckpt.restore(2, _abstract(_state(0)))
    _assert_restored(state, _state(2))
    assert data_state == {"next_batch": 20}
  finally:
    ckpt.close()


def _chained(outer, cause):
  outer.__cause__ = cause
  return outer


def _cycle(first, second):
  """Two errors, each the other's cause."""
  first.__cause__, second.__cause__ = second, first
  return first


def _in_handler(error, handled):
  """``error`` as raised inside ``except`` for ``handled`` (its context, not its cause)."""
  error.__context__ = handled
  return error


@pytest.mark.parametrize("error,unreadable", [
    (FileNotFoundError("x"), True), (ValueError("DATA_LOSS: Error reading x"), True),
    (NotADirectoryError("x"), True), (PermissionError(13, "x"), False),
    (OSError(5, "Input/output error"), False), (OSError(24, "Too many open files"), False),
    (ValueError("OUT_OF_RANGE: x"), True), (ValueError("NOT_FOUND: x"), True),
    (KeyError('Item "params" was not found in the checkpoint.'), True),
    (ValueError("Found incomplete checkpoint at /w/checkpoints/2."), True),
    (ValueError("Requested shape: (3,) is not compatible with the stored shape"), False),
    (KeyError("0001_w"), False), (RuntimeError("x"), False), (TypeError("x"), False),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), True),
    (checkpoint.CorruptCheckpointError("x reads other values than were saved"), True),
    (_chained(Exception("Encountered error while reading array index"),
              ValueError("OUT_OF_RANGE: x")), True),
    (_chained(Exception("x"), ValueError("Requested shape: (3,) is not compatible")), False),
    (ValueError('FAILED_PRECONDITION: Error reading "0000_w/0.0" in OCDBT database'), True),
    (_in_handler(ValueError("Requested shape: (3,)"), FileNotFoundError("x")), False),
    (ValueError("FAILED_PRECONDITION: something else"), False),
    # A cycle of causes is followed once round (it looped for ever without the ids seen).
    (_cycle(Exception("x"), RuntimeError("y")), False),
    (_cycle(Exception("x"), ValueError("DATA_LOSS: y")), True),
])
def test_is_unreadable_classifies_errors(error, unreadable):
  # In a thread with a time limit: a cycle of causes followed for ever fails this test
  # instead of hanging the suite.
  got = []
  worker = threading.Thread(target=lambda: got.append(checkpoint.is_unreadable(error)),
                            daemon=True)
  worker.start()
  worker.join(timeout=30)
  assert not worker.is_alive(), "is_unreadable did not return in 30 s: a cycle followed for ever?"
  assert got == [unreadable]


def test_an_unreadable_step_is_named_with_the_first_line_of_its_cause(saved):
  """``UnreadableCheckpointError``: the checkpoint, the cause's type and the first line of
  its text, at most 500 characters (an empty text stays empty); other errors pass as they
  are, and so does one already named."""
  ckpt = Checkpointer(str(saved), read_only=True)

  def raising(error):
    def read():
      raise error
    return read

  where = f"checkpoint {saved}/checkpoints/2 could not be restored"
  try:
    for error, text in ((FileNotFoundError(), ""),
                        (FileNotFoundError("a" * 600 + "\nb"), "a" * 500),
                        (ValueError("DATA_LOSS: x\ny"), "DATA_LOSS: x")):
      with pytest.raises(checkpoint.UnreadableCheckpointError) as e:
        ckpt._named(2, raising(error))
      assert str(e.value) == f"{where} ({type(error).__name__}: {text})"
      assert e.value.__cause__ is error
    for error in (ValueError("Requested shape: (3,)"), checkpoint.UnreadableCheckpointError("n")):
      with pytest.raises(type(error)) as e:
        ckpt._named(2, raising(error))
      assert e.value is error
    assert ckpt._named(2, lambda: 7) == 7
  finally:
    ckpt.close()


def test_restore_data_gives_the_saved_position_or_none_for_weights_only(saved, tmp_path):
  ckpt = Checkpointer(str(saved))
  try:
    assert [ckpt.restore_data(k) for k in (1, 2)] == [{"next_batch": 10}, {"next_batch": 20}]
  finally:
    ckpt.close()
  weights = Checkpointer(str(tmp_path / "weights"))
  try:
    weights.save_params(0, _state(3)["params"])
    assert not weights.has_train_state(0) and weights.restore_data(0) is None
  finally:
    weights.close()
  # A data position changed on disk is refused here too, naming the checkpoint.
  workdir = tmp_path / "w"
  shutil.copytree(saved, workdir)
  DAMAGE["another position in the data state"](str(workdir / "checkpoints" / "2"))
  ckpt = Checkpointer(str(workdir), read_only=True)
  try:
    assert ckpt.restore_data(1) == {"next_batch": 10}
    with pytest.raises(checkpoint.UnreadableCheckpointError, match=re.escape(
        f"checkpoint {workdir}/checkpoints/2 could not be restored (CorruptCheckpointError: "
        f"checkpoint {workdir}/checkpoints/2's data state {{'next_batch': 30}} is not the one "
        "that was saved (its checksum differs))")) as raised:
      ckpt.restore_data(2)
    assert isinstance(raised.value.__cause__, checkpoint.CorruptCheckpointError)
  finally:
    ckpt.close()


def test_verify_compares_the_items_the_checksums_name_and_only_those(saved):
  """``_verify``: an item restored without checksums in meta (a weights-only checkpoint's
  optimizer state comes from init) is not compared; one with them is, leaf by leaf; a
  meta without checksums (saved before 2026-12-04) is taken as it is."""
  ckpt = Checkpointer(str(saved), read_only=True)
  try:
    params = checkpoint.flatten(_state(2)["params"])
    meta = {"checksums": {"params": checkpoint.checksums(params)}}
    other = checkpoint.flatten(_state(5)["opt_state"])
    ckpt._verify(2, meta, {"params": params, "opt_state": other})
    ckpt._verify(2, {"step": 2}, {"params": checkpoint.flatten(_state(5)["params"])})
    with pytest.raises(checkpoint.CorruptCheckpointError, match="params array b reads other"):
      ckpt._verify(2, meta, {"params": checkpoint.flatten(_state(5)["params"])})
  finally:
    ckpt.close()


def test_weights_only_checkpoint_restores_its_params_and_the_rest_from_init_state(tmp_path):
  """``save_params`` (what ``attnlab convert`` writes): restoring it into a train state
  takes the optimizer state and step of a fresh init, and has no data position."""
  ckpt = Checkpointer(str(tmp_path))
  try:
    ckpt.save_params(5, _state(5)["params"], meta={"source": "hf"})
    ckpt.save_params(6, _state(6)["params"])
    assert ckpt.steps() == [5, 6] and not ckpt.has_train_state(5)
    import orbax.checkpoint as ocp
    meta = ckpt.manager.restore(5, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    sums = {"params": checkpoint.checksums(checkpoint.flatten(_state(5)["params"]))}
    assert dict(meta) == {"step": 5, "source": "hf", "checksums": sums}
    init = _state(0)
    with pytest.raises(ValueError) as e:
      ckpt.restore(5, _abstract(init))
    assert str(e.value) == (f"checkpoint 5 in {tmp_path}/checkpoints holds weights only; "
                            "restoring it needs a fresh init_state")
    state, data_state = ckpt.restore(5, _abstract(init), init)
    want = {"params": _state(5)["params"], "opt_state": init["opt_state"], "step": init["step"]}
    assert data_state is None
    _assert_restored(state, want)
    step, state, data_state = ckpt.restore_latest(_abstract(init), init)
    assert step == 6 and data_state is None
    _assert_restored(state, dict(want, params=_state(6)["params"]))
  finally:
    ckpt.close()


def test_three_checkpoints_kept_by_default_and_a_step_saved_again_is_replaced(tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  try:
    for k in range(1, 6):
      ckpt.save(k, _state(k), {"next_batch": k}, meta={"seed": 7})
    assert ckpt.steps() == [3, 4, 5]
    # A resume past a corrupted checkpoint saves its step again: the new state wins.
    ckpt.save(5, _state(9), {"next_batch": 90})
    assert ckpt.steps() == [3, 4, 5]
    state, data_state = ckpt.restore(5, _abstract(_state(0)))
    assert data_state == {"next_batch": 90}
    _assert_restored(state, _state(9))
    import orbax.checkpoint as ocp
    meta = ckpt.manager.restore(4, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    state4 = _state(4)
    sums = {"params": checkpoint.checksums(checkpoint.flatten(state4["params"])),
            "opt_state": checkpoint.checksums(checkpoint.flatten(
                {"opt_state": state4["opt_state"], "step": state4["step"]})),
            "data": checkpoint._data_digest({"next_batch": 4})}
    assert dict(meta) == {"step": 4, "seed": 7, "checksums": sums}
  finally:
    ckpt.close()


def test_a_state_is_restored_in_the_layout_asked_for_not_the_one_it_was_saved_in(tmp_path):
  """Parameters, optimizer state and step saved on a mesh (as training saves them, a
  one-device mesh here) restore onto the one device the abstract state names, and back:
  orbax, given no target, restored the saved layout."""
  from attnlab.training import sharding

  mesh = sharding.make_mesh((1, 1, 1))
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  ckpt = Checkpointer(str(tmp_path))
  try:
    ckpt.save(1, jax.device_put(_state(1), on_mesh), {"next_batch": 1})
    ckpt.save(2, _state(2), {"next_batch": 2})
    state, _ = ckpt.restore(1, _abstract(_state(0)))
    _assert_restored(state, _state(1))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_mesh),
                            _state(0))
    state, _ = ckpt.restore(2, abstract)
    assert all(x.sharding == on_mesh for x in jax.tree.leaves(state))
  finally:
    ckpt.close()


def test_flat_leaf_names_follow_the_tree_paths():
  """Leaves are stored under names built from their paths (dict keys, list indices,
  attribute names), in order; characters other than [A-Za-z0-9_] become "_"."""
  Moments = collections.namedtuple("Moments", "mu nu")
  tree = {"Wq.kernel": 1, "layers": [2, 3], "opt": Moments(4, 5)}
  assert list(checkpoint.flatten(tree)) == [
      "0000_Wq_kernel", "0001_layers_0", "0002_layers_1", "0003_opt_mu", "0004_opt_nu"]
  assert checkpoint.unflatten(tree, checkpoint.flatten(tree)) == tree


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "int8", "uint8",
                                   "bool"])
def test_a_checksum_changes_with_any_one_element_and_not_with_the_container(dtype):
  """``checksums`` (kept in every checkpoint's meta): one element changed anywhere
  changes the array's checksum; a NumPy array and the same values as a jax array, or as
  a jax array sharded over devices, give the same one."""
  rng = np.random.default_rng(0)
  x = rng.integers(0, 2, (5, 7)).astype(bool) if dtype == "bool" else (
      rng.standard_normal((5, 7)) * 50).astype(jnp.dtype(dtype))
  (name, (kind, base)), = checkpoint.checksums({"x": x}).items()
  assert name == "x" and kind == dtype
  assert checkpoint.checksums({"x": jnp.asarray(x)})["x"] == [dtype, base]
  seen = {base}
  for i in range(x.size):
    y = x.copy().reshape(-1)
    y[i] = ~y[i] if dtype == "bool" else (y[i] + 1 if y[i] + 1 != y[i] else y[i] * 2)
    seen.add(checkpoint.checksums({"x": y.reshape(x.shape)})["x"][1])
  assert len(seen) == x.size + 1  # every change gave another checksum
  if dtype in ("float32", "bfloat16", "float16"):
    # Two sign bits flipped (x[2], x[7] negated), which cancel in a weighted sum of the
    # words (2^31 (2i + 1) + 2^31 (2j + 1) = 0 mod 2^32): the mixed sum sees them.
    y = x.copy().reshape(-1)
    y[[2, 7]] = -y[[2, 7]]
    assert checkpoint.checksums({"x": y.reshape(x.shape)})["x"][1] != base


def _fmix32(h):
  """MurmurHash3's finalizer in plain Python (an implementation independent of the one
  under test)."""
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & 0xFFFFFFFF
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & 0xFFFFFFFF
  return h ^ (h >> 16)


def test_the_checksum_is_the_documented_sum_and_stays_the_same_across_versions():
  """sum_i fmix32(word_i ^ fmix32(i)) mod 2^32, against a plain-Python computation; and the
  numbers pinned: checkpoints keep them, so a later attnlab must compute the same ones
  (another mix would take every older checkpoint for a damaged one)."""
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  y = np.array([1, -2, 3], np.int8)
  words = {"x": x.reshape(-1).view(np.uint32), "y": y.view(np.uint8).astype(np.uint32)}
  want = {k: sum(_fmix32(int(w) ^ _fmix32(i)) for i, w in enumerate(v)) % 2**32
          for k, v in words.items()}
  got = checkpoint.checksums({"x": x, "y": y})
  assert got == {"x": ["float32", want["x"]], "y": ["int8", want["y"]]}
  assert got == {"x": ["float32", 3757635346], "y": ["int8", 1976701332]}
  # An 8-byte element is two words, low first, whether or not jax runs with x64 (without
  # it, jit would have cast a NumPy float64 to float32: 1 + 2**-40 would read as 1).
  z = np.array([1.5, -2.25, 3e300, 1 + 2**-40], np.float64)
  want = sum(_fmix32(int(w) ^ _fmix32(i)) for i, w in enumerate(z.view(np.uint32))) % 2**32
  assert checkpoint.checksums({"z": z}) == {"z": ["float64", want]}
  with jax.enable_x64(True):
    assert checkpoint.checksums({"z": z}) == {"z": ["float64", want]}
    assert checkpoint.checksums({"z": jnp.asarray(z)}) == {"z": ["float64", want]}
  z[3] = 1.0
  assert checkpoint.checksums({"z": z})["z"][1] != want
  assert [_fmix32(v) for v in (0, 1)] == [0, 0x514E28B7]  # MurmurHash3's own values


def test_a_checksum_is_the_same_on_any_mesh(tmp_path):
  """The checksum of an array sharded over 4 devices, row- or column-wise or replicated,
  is the checksum of the same values on one device (a subprocess: the test process has
  one CPU device)."""
  script = tmp_path / "mesh.py"
  script.write_text(
      "import json, jax, numpy as np\n"
      "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
      "from attnlab.training.checkpoint import checksums\n"
      "x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)\n"
      "mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ('a', 'b'))\n"
      "out = [checksums({'x': x})['x']]\n"
      "for spec in (P('a', 'b'), P(('a', 'b')), P(None, 'b'), P()):\n"
      "  out.append(checksums({'x': jax.device_put(x, NamedSharding(mesh, spec))})['x'])\n"
      "print(len(jax.devices()), json.dumps(out))\n")
  import subprocess
  import sys

  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, env=env)
  assert res.returncode == 0, res.stderr[-2000:]
  devices, sums = res.stdout.strip().split(" ", 1)
  sums = json.loads(sums)
  assert devices == "4" and len(sums) == 5 and all(s == sums[0] for s in sums), sums


def test_a_checkpoint_restored_in_another_dtype_is_not_taken_for_a_damaged_one(saved):
  """orbax casts an array saved in one dtype to the dtype it is restored into; the
  checksum of the saved bits cannot be compared then, and is not."""
  abstract = _abstract(_state(0))
  abstract["params"]["big"] = jax.ShapeDtypeStruct((32, 32), jnp.bfloat16,
                                                   sharding=abstract["params"]["big"].sharding)
  ckpt = Checkpointer(str(saved), read_only=True)
  try:
    state, _ = ckpt.restore(2, abstract)
  finally:
    ckpt.close()
  assert state["params"]["big"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(state["params"]["big"],
                                _state(2)["params"]["big"].astype(jnp.bfloat16))


def _save_then_restore_latest(workdir, state, abstract):
  """``state`` saved as step 1 in ``workdir``, then restored (the newest step) as ``abstract``."""
  ckpt = Checkpointer(str(workdir))
  try:
    ckpt.save(1, state, {"next_batch": 10})
  finally:
    ckpt.close()
  ckpt = Checkpointer(str(workdir), read_only=True)
  try:
    step, restored, _ = ckpt.restore_latest(abstract)
  finally:
    ckpt.close()
  assert step == 1
  return restored


def test_a_float16_array_restored_as_float32_is_taken_as_it_is(tmp_path):
  """Only bfloat16 widened to float32 is compared by its saved bits (its upper halves); a
  float16 array restored as float32 has no such bits and is not compared (mutmut: a check
  that took every float32 restore for a widened bfloat16 passed the tests before)."""
  old = _state(1)
  old["params"] = jax.tree.map(lambda x: x.astype(jnp.float16), old["params"])
  abstract = _abstract(old)
  abstract["params"] = _abstract(jax.tree.map(lambda x: x.astype(jnp.float32), old["params"]))
  state = _save_then_restore_latest(tmp_path, old, abstract)
  for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(old["params"]),
                       strict=True):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want.astype(jnp.float32))


def test_a_bfloat16_optimizer_state_restores_widened_to_float32(tmp_path):
  """bfloat16 parameters kept a bfloat16 optimizer state until 2026-12-07 (float32 now:
  optim.in_float32): such a checkpoint restores into the float32 state a resume asks for,
  each value exactly the bfloat16 one saved."""
  old = _state(1)
  old["params"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), old["params"])
  old["opt_state"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), old["opt_state"])
  # A NaN of a GPU's payload (0x7FFF): a cast back to bfloat16 on the CPU makes it 0x7FC0,
  # and a first version of the check took the checkpoint for a damaged one.
  # (Set through NumPy: XLA's scatter on the CPU rewrites it to 0x7FC0 too.)
  mu = np.asarray(old["opt_state"]["mu"]).copy()
  mu.view(np.uint16)[0, 0] = 0x7FFF
  old["opt_state"]["mu"] = jnp.asarray(mu)
  abstract = _abstract(old)
  abstract["opt_state"] = _abstract(jax.tree.map(lambda x: x.astype(jnp.float32),
                                                 old["opt_state"]))
  state = _save_then_restore_latest(tmp_path, old, abstract)
  for got, want in zip(jax.tree.leaves(state["opt_state"]), jax.tree.leaves(old["opt_state"]),
                       strict=True):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want.astype(jnp.float32))
  bits = jax.lax.bitcast_convert_type(state["opt_state"]["mu"], jnp.uint32)
  assert int(bits[0, 0]) == 0x7FFF0000  # the payload, restored as it was saved
  _assert_restored(state["params"], old["params"])
  # Its checksums are compared in the saved dtype: damaged, it is refused as in its own
  # (until 2026-12-07 a widened array was not compared, and a resume took the damage).
  _flip(_largest(str(tmp_path / "checkpoints" / "1"), "opt_state"), 0.3)
  for dtype in (jnp.bfloat16, jnp.float32):
    abstract["opt_state"] = _abstract(jax.tree.map(lambda x, d=dtype: x.astype(d),
                                                   old["opt_state"]))
    ckpt = Checkpointer(str(tmp_path), read_only=True)
    try:
      with pytest.raises(checkpoint.UnreadableCheckpointError) as err:
        ckpt.restore(1, abstract)
    finally:
      ckpt.close()
    assert isinstance(err.value.__cause__, checkpoint.CorruptCheckpointError), dtype
    assert re.search(r"opt_state array \S+ reads other values than were saved",
                     str(err.value)), err.value


def _model_workdir(workdir):
  """A workdir holding the config.gin of a tiny seq2seq model (no checkpoint yet); its
  ``ModelConfig`` and the model built with load_checkpoint's seeds."""
  from flax import nnx

  import attnlab
  from attnlab import config_gin

  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  configs = config_gin.parse([os.path.join(repo, "configs", "seq2seq_reverse.gin")], [
      "ModelConfig.d_model=16", "ModelConfig.d_ff=32", "ModelConfig.num_layers=1",
      "ModelConfig.num_encoder_layers=1"])
  workdir.mkdir()
  (workdir / "config.gin").write_text(config_gin.operative_config(*configs))
  return configs[0], attnlab.build_model(configs[0], rngs=nnx.Rngs(params=0, dropout=1))


def _key_data(x):
  return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def test_load_checkpoint_refuses_a_checkpoint_whose_bytes_changed(tmp_path):
  """``load_checkpoint`` (``attnlab decode``, ``convert --to-hf``) of a named step whose
  weights changed on disk raises, naming the array; it restored the other weights before."""
  from flax import nnx

  import attnlab

  workdir = tmp_path / "w"
  cfg, built = _model_workdir(workdir)
  params = nnx.state(built, nnx.Param)
  ckpt = Checkpointer(str(workdir))
  ckpt.save_params(3, params)
  ckpt.close()
  checkpoint._init_rest.cache_clear()
  model, _ = attnlab.load_checkpoint(str(workdir), 3)  # healthy: loads
  again, _ = attnlab.load_checkpoint(str(workdir), 3)
  # The same model, its non-parameter state from one jitted init compiled once per config
  # (a new jit on every load compiled it again).
  assert checkpoint._init_rest.cache_info().misses == 1
  assert checkpoint._init_rest(cfg)._cache_size() == 1
  for loaded in (model, again):
    for want, got in ((params, nnx.state(loaded, nnx.Param)),
                      (nnx.state(model), nnx.state(loaded))):
      assert jax.tree.structure(want) == jax.tree.structure(got)
      for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(_key_data(g), _key_data(w))
  _flip(_largest(str(workdir / "checkpoints" / "3"), "params"), 0.5)
  with pytest.raises(checkpoint.UnreadableCheckpointError,
                     match=r"checkpoints/3 could not be restored \(CorruptCheckpointError: .*"
                           r"checkpoints/3's params array \w+ reads other values than were "
                           r"saved \(checksum 0x[0-9a-f]{8}, saved 0x[0-9a-f]{8}\)\)"):
    attnlab.load_checkpoint(str(workdir), 3)
  # The newest that reads, when none does: named, not an untrained model.
  with pytest.raises(FileNotFoundError, match=r"no checkpoint in \S+/checkpoints could be read "
                                              r"\(saved steps: \[3\]\)"):
    attnlab.load_checkpoint(str(workdir))


def test_load_checkpoint_takes_the_newest_step_onto_the_first_device_or_the_mesh_given(tmp_path):
  """``load_checkpoint`` without a step reads the newest; without a mesh it places every
  parameter on the first device, even one saved in a mesh's layout (what training saves:
  orbax, given no sharding, restored the saved layout); with a mesh, in the training layout
  on it. The rest of the model (the dropout RNG streams) is what building it with
  ``Rngs(params=0, dropout=1)`` gives, and a reader deletes nothing (a half-saved
  checkpoint may be a live run's save)."""
  from flax import nnx

  import attnlab
  from attnlab.training import sharding

  workdir = tmp_path / "w"
  _, built = _model_workdir(workdir)
  mesh = sharding.make_mesh((1, 1, 1))
  params = nnx.state(built, nnx.Param)
  ckpt = Checkpointer(str(workdir))
  for step, scale in ((3, 1.0), (4, 2.0)):
    scaled = jax.tree.map(lambda x, k=scale: x * k, params)
    ckpt.save_params(step, jax.device_put(scaled, sharding.param_shardings(scaled, mesh)))
  ckpt.close()
  (workdir / "checkpoints" / "5.orbax-checkpoint-tmp" / "params").mkdir(parents=True)
  one_device = jax.sharding.make_single_device_sharding(jax.devices()[0])
  auto = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  for step, scale, on in ((None, 2.0, None), (3, 1.0, mesh), (np.int64(3), 1.0, None),
                          (jnp.int32(3), 1.0, None), (np.array(4), 2.0, None), (4, 2.0, auto)):
    model, _ = attnlab.load_checkpoint(str(workdir), step, mesh=on)
    got = nnx.state(model, nnx.Param)
    want = jax.tree.map(lambda x, k=scale: x * k, params)
    places = [one_device] * len(jax.tree.leaves(got)) if on is None else jax.tree.leaves(
        sharding.param_shardings(got, mesh))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), places, strict=True):
      np.testing.assert_array_equal(g, w)
      assert g.sharding == s, (step, g.sharding)
    rest, want_rest = (nnx.state(m, nnx.Not(nnx.Param)) for m in (model, built))
    assert jax.tree.structure(rest) == jax.tree.structure(want_rest)
    for g, w in zip(jax.tree.leaves(rest), jax.tree.leaves(want_rest), strict=True):
      np.testing.assert_array_equal(_key_data(g), _key_data(w))
  assert _listing(workdir) == ["3", "4", "5.orbax-checkpoint-tmp"]


def test_load_checkpoint_names_what_a_workdir_lacks(tmp_path):
  """No config.gin, no checkpoints folder, an empty one, a step not saved: each its own
  error naming the path (and the saved steps), before any model is built."""
  import attnlab
  from attnlab import config_gin

  workdir = tmp_path / "w"
  workdir.mkdir()
  with pytest.raises(FileNotFoundError) as e:
    attnlab.load_checkpoint(str(workdir))
  assert str(e.value) == f"{workdir}/config.gin does not exist: not a training workdir"
  # something else in its place: named so (until 2026-12-07 "does not exist")
  for make, kind in ((os.mkdir, "a folder"), (os.mkfifo, "a FIFO")):
    make(workdir / "config.gin")
    with pytest.raises(FileNotFoundError) as e:
      attnlab.load_checkpoint(str(workdir))
    assert str(e.value) == (f"{workdir}/config.gin is {kind}, not the file a training workdir "
                            "holds there")
    (os.rmdir if kind == "a folder" else os.remove)(workdir / "config.gin")
  os.symlink(workdir / "gone", workdir / "config.gin")
  with pytest.raises(FileNotFoundError) as e:
    attnlab.load_checkpoint(str(workdir))
  assert str(e.value) == (f"{workdir}/config.gin is a symbolic link to {workdir}/gone, which "
                          "does not exist")
  os.remove(workdir / "config.gin")
  for bad, kind in ((None, "NoneType"), (3, "int"), (b"w", "bytes")):  # posixpath's TypeError
    with pytest.raises(TypeError) as e:  # until 2026-12-07
      attnlab.load_checkpoint(bad)
    assert str(e.value) == f"workdir must be a path (a str or os.PathLike), got {kind}"
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  configs = config_gin.parse([os.path.join(repo, "configs", "seq2seq_reverse.gin")], [])
  (workdir / "config.gin").write_text(config_gin.operative_config(*configs))
  with pytest.raises(FileNotFoundError) as e:
    attnlab.load_checkpoint(str(workdir))
  assert str(e.value) == f"{workdir}/checkpoints does not exist: no checkpoint saved yet"
  (workdir / "checkpoints").write_text("")
  with pytest.raises(FileNotFoundError) as e:
    attnlab.load_checkpoint(str(workdir))
  assert str(e.value) == (f"{workdir}/checkpoints is a file, not the folder a training "
                          "workdir holds there")
  os.remove(workdir / "checkpoints")
  os.mkfifo(workdir / "checkpoints")  # each kind by its name (until 2026-12-07 "neither ...")
  with pytest.raises(FileNotFoundError) as e:
    attnlab.load_checkpoint(str(workdir))
  assert str(e.value) == (f"{workdir}/checkpoints is a FIFO, not the folder a training "
                          "workdir holds there")
  os.remove(workdir / "checkpoints")
  (workdir / "checkpoints").mkdir()
  with pytest.raises(FileNotFoundError) as e:
    attnlab.load_checkpoint(str(workdir), 3)
  assert str(e.value) == f"{workdir}/checkpoints holds no checkpoint"
  ckpt = Checkpointer(str(workdir))
  ckpt.save_params(3, {"w": jnp.zeros(2)})
  ckpt.close()
  for step in (2, 4):
    with pytest.raises(ValueError) as e:
      attnlab.load_checkpoint(str(workdir), step)
    assert str(e.value) == (f"step={step} has no checkpoint in {workdir}/checkpoints; saved "
                            "steps: [3]")
  # Not an integer: "3" read "step=3 has no checkpoint ...; saved steps: [3]", and 3.0 failed
  # reading a folder 3.0 (until 2026-12-06); a mesh shape for a Mesh was an AttributeError.
  for step, kind in (("3", "str"), (3.0, "float"), (True, "bool")):
    with pytest.raises(ValueError) as e:
      attnlab.load_checkpoint(str(workdir), step)
    assert str(e.value) == (f"step={step!r} must be an integer (a saved step) or None, got "
                            f"{kind}")
  wrong_axes = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  for mesh, what in (((1, 1, 1), "tuple (1, 1, 1)"), (wrong_axes, "a Mesh with axes ('x',)")):
    with pytest.raises(ValueError) as e:
      attnlab.load_checkpoint(str(workdir), mesh=mesh)
    assert str(e.value) == ("mesh must be a jax.sharding.Mesh with axes ('data', 'fsdp', "
                            "'tensor') (make one with attnlab.training.sharding.make_mesh(shape)), "
                            f"got {what}")
  # jax.make_mesh's explicit axes: refused by name (passed, then failed inside the restore's
  # checksums, until 2026-12-07); jax.make_mesh's with auto axes loads
  # (test_load_checkpoint_takes_the_newest_step_onto_the_first_device_or_the_mesh_given).
  explicit = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  with pytest.raises(ValueError, match=re.escape(
      "mesh has Explicit axes (Explicit, Explicit, Explicit; jax.make_mesh makes Explicit ones "
      "by default): give one with Auto axes")):
    attnlab.load_checkpoint(str(workdir), mesh=explicit)



def _unraisable(exc, obj=None, tb=None):
  import types
  return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, err_msg=None, object=obj,
                               exc_traceback=exc.__traceback__ if tb is None else tb)


def test_a_failed_library_call_drops_its_own_teardown_reports_and_no_others(monkeypatch):
  """After an orbax save or restore that raised (``_quiet_library_failure``), what its
  leftover work reports is dropped: tensorstore's "Event loop is closed" from
  ``call_soon_threadsafe``, an exception ignored in a coroutine of orbax's, asyncio's
  "exception was never retrieved" for a tensorstore status error, the "never awaited"
  warning of orbax's coroutines that never ran; everything else reaches the hook, the
  logger and the warnings as before. One that returns leaves nothing behind."""
  import asyncio
  import gc
  import sys
  import warnings

  import orbax.checkpoint  # its folder is what the filters know

  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  asyncio_logger = logging.getLogger("asyncio")
  monkeypatch.setattr(asyncio_logger, "filters", [])  # (an earlier failed read's put back)
  monkeypatch.setattr(logging.getLogger("absl"), "filters", [])

  def fresh_process():  # no call running, none failed (a failure of an earlier test's kept)
    monkeypatch.setattr(checkpoint, "_TEARDOWN", {"running": 0, "removes": [], "failed": False})

  fresh_process()
  with checkpoint._quiet_library_failure():
    assert isinstance(sys.unraisablehook, checkpoint._UnraisableFilter)
    assert asyncio_logger.filters == [checkpoint._drop_orbax_task_reports]
  assert sys.unraisablehook == seen.append and asyncio_logger.filters == []
  assert logging.getLogger("absl").filters == []
  asyncio_logger.addFilter(checkpoint._drop_orbax_task_reports)
  with checkpoint._quiet_library_failure():  # already in place (a failed one's): left so
    pass
  assert asyncio_logger.filters == [checkpoint._drop_orbax_task_reports]
  asyncio_logger.removeFilter(checkpoint._drop_orbax_task_reports)
  with checkpoint._quiet_library_failure():  # a hook the caller sets meanwhile stays theirs
    sys.unraisablehook = print
  assert sys.unraisablehook is print and asyncio_logger.filters == []
  sys.unraisablehook = seen.append
  # A failure inside another call (a fallback past a damaged step in read_as_step), or in
  # another thread while one runs: kept past the outer call's return (until 2026-12-07 the
  # outer call took them away). A later call that returns changes nothing.
  for later in (False, True):
    with (checkpoint._quiet_library_failure(), pytest.raises(ValueError),
          checkpoint._quiet_library_failure()):
      raise ValueError("a damaged step")
    if later:
      with checkpoint._quiet_library_failure():
        pass
    assert isinstance(sys.unraisablehook, checkpoint._UnraisableFilter)
    assert asyncio_logger.filters == [checkpoint._drop_orbax_task_reports]
    sys.unraisablehook, asyncio_logger.filters = seen.append, []
    fresh_process()

  namespace = {}
  in_orbax = os.path.join(checkpoint._library_folders()[0], "x.py")
  exec(compile("async def write_fragment():\n  pass\n", in_orbax, "exec"), namespace)
  exec(compile("async def mine():\n  pass\n", "mine.py", "exec"), namespace)
  loop = asyncio.new_event_loop()
  loop.close()
  with pytest.raises(RuntimeError) as closed_loop:
    loop.call_soon_threadsafe(print)
  # as tensorstore's threads report it: no Python frame of the caller
  closed = _unraisable(closed_loop.value, tb=closed_loop.value.__traceback__.tb_next)

  def reported(exc):
    record = asyncio_logger.makeRecord(
        "asyncio", logging.ERROR, __file__, 1, "Future exception was never retrieved\n"
        "future: <Future finished>", (), (type(exc), exc, exc.__traceback__))
    return all(f.filter(record) if hasattr(f, "filter") else f(record)
               for f in asyncio_logger.filters)

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pytest.raises(ValueError, match="disk full"), checkpoint._quiet_library_failure():
      left = namespace["write_fragment"](), namespace["mine"]()
      raise ValueError("disk full")
    with pytest.raises(ValueError, match="again"), checkpoint._quiet_library_failure():
      raise ValueError("again")  # the filter stays one, not one more a failure
    assert sys.unraisablehook.previous == seen.append
    ours = _unraisable(Exception("Encountered error while reading array index"), left[0])
    other_coroutine = _unraisable(Exception("another"), left[1])
    other_closed = _unraisable(RuntimeError("Event loop is closed"))  # no traceback
    other = _unraisable(RuntimeError("something else"))
    # the same two frames, but another error or another message: not the closed loop's
    other_text = _unraisable(RuntimeError("something else"), tb=closed.exc_traceback)
    other_type = _unraisable(ValueError("Event loop is closed"), tb=closed.exc_traceback)
    for u in (closed, ours, other_coroutine, other_closed, other, other_text, other_type):
      sys.unraisablehook(u)
    assert seen == [other_coroutine, other_closed, other, other_text, other_type]
    assert not reported(ValueError('OUT_OF_RANGE: Error writing "x" in OCDBT database'))
    assert reported(ValueError("mine"))
    assert reported(ValueError("mine: OUT_OF_RANGE: a status not at the start"))
    assert reported(RuntimeError("INTERNAL: a status text, not tensorstore's ValueError"))
    # with a traceback: orbax's by its files (any error), not by its text
    exec(compile("def write():\n  raise RuntimeError('cannot schedule new futures')\n",
                 in_orbax, "exec"), namespace)
    for raiser, kept in ((namespace["write"], False), (lambda: exec("raise ValueError("
                                                                    "'OUT_OF_RANGE: x')"), True)):
      try:
        raiser()
      except Exception as e:  # noqa: BLE001 - either kind
        assert reported(e) == kept, (e, kept)

    class Unprintable(Exception):
      def __str__(self):
        raise RuntimeError("no str")

    assert reported(Unprintable())
    record = asyncio_logger.makeRecord("asyncio", logging.ERROR, __file__, 1, Unprintable(),
                                       (), (ValueError, ValueError("OUT_OF_RANGE: x"), None))
    assert checkpoint._drop_orbax_task_reports(record)  # kept, not an error in the filter
    for exc_info in (True, (None, None, None), None):
      record = asyncio_logger.makeRecord("asyncio", logging.ERROR, __file__, 1,
                                         "Task exception was never retrieved", (), None)
      record.exc_info = exc_info
      assert checkpoint._drop_orbax_task_reports(record)
    with monkeypatch.context() as m:  # tensorstore's import blocked (sys.modules entry None)
      m.setitem(sys.modules, "tensorstore", None)
      assert checkpoint._library_folders() == (
          os.path.dirname(os.path.abspath(orbax.checkpoint.__file__)) + os.sep,)
      sys.unraisablehook(other)
    assert seen[-1] is other
    import tensorstore
    assert checkpoint._library_folders()[1] == (
        os.path.dirname(os.path.abspath(tensorstore.__file__)) + os.sep)
    absl = logging.getLogger("absl")
    assert absl.filters == [checkpoint._drop_orbax_error_tracebacks]
    try:
      raise RuntimeError("cannot schedule new futures after shutdown")
    except RuntimeError:
      exc_info = sys.exc_info()
    for path, info, kept in ((in_orbax, exc_info, False), (in_orbax, None, True),
                             ("mine.py", exc_info, True), (None, exc_info, True)):
      record = absl.makeRecord("absl", logging.ERROR, path, 1, "_SignalingThread.run() raised "
                               "an exception", (), info)
      assert checkpoint._drop_orbax_error_tracebacks(record) == kept, (path, info)
    odd = _unraisable(RuntimeError("Event loop is closed"), tb="not a traceback")
    sys.unraisablehook(odd)  # one the filter cannot read: handed on, not an error
    assert seen[-1] is odd
    seen.clear()
    del left, ours, other_coroutine  # collected: orbax's never-started coroutine is quiet
    gc.collect()
    unawaited = [str(w.message) for w in caught if "never awaited" in str(w.message)]
    assert unawaited == ["coroutine 'mine' was never awaited"], unawaited


def test_a_failed_save_waits_for_its_own_orbax_threads_and_no_others():
  """``_join_library_threads``: the orbax threads started by the failed save are waited for,
  a failure their ``join`` raises (orbax's re-raises the thread's error) does not end the
  wait, and an orbax thread alive before the save (another save of the process) is not
  waited for (until 2026-12-07, a review: the first thread's error ended the wait, and any
  orbax thread was waited for, up to 60 s)."""
  import threading
  import time

  stop_other = threading.Event()

  class OrbaxThread(threading.Thread):
    def join(self, timeout=None):
      super().join(timeout)
      if self.name == "fails first":
        raise ValueError("OUT_OF_RANGE: its own write failed")

  OrbaxThread.__module__ = "orbax.checkpoint._src.futures.future"
  other = OrbaxThread(target=stop_other.wait, name="another save's", daemon=True)
  other.start()
  before = set(threading.enumerate())
  fails = OrbaxThread(target=time.sleep, args=(0.2,), name="fails first")
  slow = OrbaxThread(target=time.sleep, args=(1.0,), name="still writing")
  fails.start()
  slow.start()
  t0 = time.monotonic()
  try:
    checkpoint._join_library_threads(before, timeout=20)
    waited = time.monotonic() - t0
    assert not fails.is_alive() and not slow.is_alive() and other.is_alive()
    assert 0.9 < waited < 10, waited
  finally:
    stop_other.set()
    other.join()


def test_the_scan_for_orbax_coroutines_wakes_no_other_object():
  """The failed save's scan of the process's functions asks each object's type, not its
  ``__class__``, which an object may compute (torch's deprecated ``reduce_op`` warned once
  a failed save: FutureWarnings in CI's run of 12fe90a)."""
  import warnings

  class Warns:
    @property
    def __class__(self):
      warnings.warn("__class__ was asked", FutureWarning, stacklevel=2)
      return Warns

  kept = Warns()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    checkpoint._ignore_unawaited_library_coroutines()
  assert [str(w.message) for w in caught] == [] and kept is not None
