"""The ``attnlab`` dispatcher (attnlab/cli.py): usage, unknown commands, exit codes,
the one-line error of a ``CommandError``, and ``attnlab --help`` without JAX."""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import io
import os
import subprocess
import sys
import threading
import types

import pytest

from attnlab import cli
from attnlab.commands import CommandError
from tests.streams import MinimalStream

USAGE_HEAD = ("usage: attnlab COMMAND [flags]   (attnlab COMMAND --help for its flags; "
              "attnlab --version)")


def _usage_lines(text):
  lines = text.rstrip("\n").split("\n")
  assert lines[:2] == [USAGE_HEAD, ""]
  return lines[2:]


@pytest.mark.parametrize("argv, code", [([], 2), (["--help"], 0), (["-h"], 0)])
def test_usage_lists_every_command_with_its_help_in_one_column(argv, code, capsys):
  """``--help`` prints the usage to stdout, exit 0; no command at all is an error: to
  stderr, exit 2 (until 2026-12-04 on stdout, where a pipe took it for output)."""
  assert cli.main(argv) == code
  out = capsys.readouterr()
  text, other = (out.out, out.err) if code == 0 else (out.err, out.out)
  assert other == ""
  rows = _usage_lines(text)
  assert [row.split()[0] for row in rows] == list(cli.COMMANDS)
  helps = [help_ for _, help_ in cli.COMMANDS.values()]
  starts = {row.index(help_) for row, help_ in zip(rows, helps, strict=True)}
  assert len(starts) == 1  # every help text starts in the same column
  longest = max(map(len, cli.COMMANDS))
  assert starts == {2 + longest + 2}


def test_an_unknown_command_is_named_with_the_usage_exit_2(capsys):
  assert cli.main(["trian", "--workdir", "w"]) == 2
  out = capsys.readouterr()
  assert out.out == ""
  first, *rest = out.err.rstrip("\n").split("\n")
  assert first == "attnlab: unknown command 'trian'"
  assert [row.split()[0] for row in _usage_lines("\n".join(rest))] == list(cli.COMMANDS)


@pytest.fixture
def fake_command(monkeypatch):
  """A command "fake" whose ``main`` does what the test sets in ``behave``."""
  module = types.ModuleType("attnlab.commands.fake")
  calls = []

  def main(argv):
    calls.append(argv)
    return module.behave(argv)

  module.main = main
  monkeypatch.setitem(sys.modules, "attnlab.commands.fake", module)
  monkeypatch.setitem(cli.COMMANDS, "fake", ("fake", "a test command"))
  return module, calls


@pytest.mark.parametrize("returned, code", [(None, 0), (0, 0), (3, 3), (True, 1)])
def test_the_command_gets_the_rest_of_argv_and_its_return_is_the_exit_code(
    fake_command, returned, code):
  module, calls = fake_command
  module.behave = lambda argv: returned
  assert cli.main(["fake", "--x", "1", "fake"]) == code
  assert calls == [["--x", "1", "fake"]]


def test_without_argv_it_reads_the_process_arguments(fake_command, monkeypatch):
  module, calls = fake_command
  module.behave = lambda argv: 5
  monkeypatch.setattr(sys, "argv", ["/venv/bin/attnlab", "fake", "--steps", "3"])
  assert cli.main() == 5
  assert calls == [["--steps", "3"]]


def test_a_command_error_is_one_line_on_stderr_exit_2(fake_command, capsys):
  module, _ = fake_command

  def fail(argv):
    raise CommandError("--steps=-1 must be a positive integer")

  module.behave = fail
  assert cli.main(["fake"]) == 2
  out = capsys.readouterr()
  assert (out.out, out.err) == ("", "attnlab fake: error: --steps=-1 must be a positive integer\n")


def test_other_exceptions_are_not_swallowed(fake_command):
  module, _ = fake_command

  def crash(argv):
    raise RuntimeError("a bug, with its traceback")

  module.behave = crash
  with pytest.raises(RuntimeError, match="a bug"):
    cli.main(["fake"])


def test_a_real_command_error_goes_through_the_dispatcher(capsys):
  assert cli.main(["kv-size", "--layers", "0", "--seq", "6", "--kv_heads", "3",
                   "--head_dim", "8"]) == 2
  assert capsys.readouterr().err == (
      "attnlab kv-size: error: --layers=0 must be a positive integer\n")


KV_SIZE = ["kv-size", "--layers", "2", "--seq", "8", "--kv_heads", "1", "--head_dim", "4"]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FailingStdout(io.StringIO):
  """A stdout whose ``write`` or ``flush`` (``fails``) raises ``error``; ``fileno`` as given
  (None: it has none, as a StringIO)."""

  def __init__(self, fails, error, fd=None):
    super().__init__()
    self.fails, self.error, self.fd = fails, error, fd

  def write(self, text):
    if self.fails == "write":
      raise self.error
    return super().write(text)

  def flush(self):
    if self.fails == "flush":
      raise self.error

  def fileno(self):
    if self.fd is None:
      raise io.UnsupportedOperation("fileno")
    return self.fd


@pytest.mark.parametrize("fails", ["write", "flush"])
@pytest.mark.parametrize("argv", [KV_SIZE, ["kv-size", "--help"], ["--help"], ["-h"],
                                  ["--help", "kv-size"], ["--version"]],
                         ids=["kv-size", "kv-size --help", "--help", "-h", "--help kv-size",
                              "--version"])
def test_a_stdout_that_cannot_be_written_is_one_line_on_stderr_exit_1(
    argv, fails, monkeypatch, capsys, tmp_path):
  """A full disk (or an I/O error) under stdout: the print's error (an unbuffered stdout),
  the flush's (a buffered one: ``main`` flushes before it returns) or argparse's help's
  (which argparse hides) is one line naming stdout, exit 1 (until 2026-12-07 a traceback,
  or at the interpreter's exit "Exception ignored", exit 120; ``--help``: exit 0). The
  caller's stdout is put back, its descriptor untouched: only the process's own stdout
  goes to /dev/null after the line (this one's a file of the test's)."""
  kept = tmp_path / "kept.txt"
  with open(kept, "w") as f:
    stdout = _FailingStdout(fails, ENOSPC, fd=f.fileno())
    monkeypatch.setattr(sys, "stdout", stdout)
    assert cli.main(argv) == 1
    assert sys.stdout is stdout
    os.write(f.fileno(), b"still the file's")
  assert kept.read_text() == "still the file's"
  who = "attnlab kv-size" if argv[0] == "kv-size" else "attnlab"
  assert capsys.readouterr().err == (
      f"{who}: error: cannot write to standard output: [Errno 28] No space left on device\n")


def test_a_closed_pipe_at_the_last_flush_is_quiet_exit_141(monkeypatch, capsys):
  """stdout's reader gone before a buffered print reached it: ``main``'s flush meets the
  closed pipe; quiet, exit 141, as when the print does (until 2026-12-07 "Exception ignored"
  at the interpreter's exit, exit 120, where the command did not flush)."""
  monkeypatch.setattr(sys, "stdout", _FailingStdout("flush", BrokenPipeError(errno.EPIPE,
                                                                             "Broken pipe")))
  assert cli.main(KV_SIZE) == 141
  assert capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["None", "closed stream", "closed descriptor"])
def test_a_closed_stdout_is_one_line_and_the_command_does_not_run(
    how, fake_command, monkeypatch, capsys):
  """``attnlab ... >&-``: Python starts with ``sys.stdout`` None; a stream closed, or over
  a closed descriptor, in the process. One line, exit 1, before the command runs (until
  2026-12-07 decode and eval ran, then an AttributeError traceback; kv-size exit 0, nothing
  said)."""
  module, calls = fake_command
  module.behave = lambda argv: 0
  if how == "None":
    stdout = None
  elif how == "closed stream":
    stdout = io.StringIO()
    stdout.close()
  else:
    read, write = os.pipe()
    os.close(read)
    os.close(write)
    stdout = _FailingStdout(None, None, fd=write)
  monkeypatch.setattr(sys, "stdout", stdout)
  assert cli.main(["fake", "--x"]) == 1
  assert calls == [] and sys.stdout is stdout
  assert capsys.readouterr().err == (
      "attnlab fake: error: standard output is closed; nothing was run\n")


def test_an_os_error_that_is_not_stdouts_goes_on_unchanged(fake_command, monkeypatch, capsys):
  """A full disk under a file the command writes (a checkpoint, a report) has the same
  errno as under stdout; only the error of stdout's own write or flush is taken for stdout's:
  this one reaches the caller as it was raised, even after stdout's own write failed and was
  caught, and nothing is said for it."""
  module, _ = fake_command
  raised = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/checkpoint")

  def fail(argv):
    with contextlib.suppress(OSError):
      print("a line")
    raise raised

  module.behave = fail
  for stdout in (io.StringIO(), _FailingStdout("write", ENOSPC)):
    monkeypatch.setattr(sys, "stdout", stdout)
    with pytest.raises(OSError) as e:
      cli.main(["fake"])
    assert e.value is raised and sys.stdout is stdout
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_on_a_full_device_is_one_line_in_a_real_process():
  """``attnlab kv-size ... > /dev/full`` with Python's usual buffered stdout: the result
  fails at the flush; one line, exit 1, no traceback, and no "Exception ignored" at the
  interpreter's exit (stdout goes to /dev/null after the line)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
  env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
  with open("/dev/full", "w") as full:
    proc = subprocess.run([sys.executable, "-m", "attnlab.cli", *KV_SIZE], stdout=full,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=120)
  assert (proc.returncode, proc.stderr) == (1, (
      "attnlab kv-size: error: cannot write to standard output: [Errno 28] No space left on "
      "device\n"))


def test_every_command_module_has_a_main():
  for name, (module, help_) in cli.COMMANDS.items():
    assert callable(importlib.import_module(f"attnlab.commands.{module}").main), name
    assert help_ and "\n" not in help_


# What each command cannot run without: argparse names the missing required flags in order.
REQUIRED = {
    "train": "--workdir",
    "eval": "--workdir",
    "decode": "--workdir",  # then one of --prompt / --prompts_file
    "kv-size": "--layers, --seq, --kv_heads, --head_dim",
    "ablate": "--out",
    "convert-heads": "--from, --to, --num_kv_heads, --method",
    "convert": "--workdir",  # then one of --from-hf / --to-hf
}
# The one-of-two flags, given all else.
ONE_OF = {
    "decode": (["--workdir", "w"], "--prompt --prompts_file"),
    "convert": (["--workdir", "w"], "--from-hf --to-hf"),
}


def test_each_commands_help_is_its_own_and_names_its_required_flags(capsys):
  assert set(REQUIRED) == set(cli.COMMANDS)
  for name in cli.COMMANDS:
    with pytest.raises(SystemExit) as exit_:
      cli.main([name, "--help"])
    assert exit_.value.code == 0, name
    text = capsys.readouterr().out
    assert text.startswith(f"usage: attnlab {name} "), text[:80]
    for flag in REQUIRED[name].split(", ") + list(ONE_OF.get(name, ([], ""))[1].split()):
      assert f"  {flag} " in text, (name, flag)
    # The commands that take gin bindings say how (their --help never did until 2026-12-04).
    takes_bindings = name in ("train", "ablate", "convert-heads")
    flat = " ".join(text.split())
    assert ("--gin.NAME=VALUE or --gin.NAME VALUE" in flat) == takes_bindings, name
    # and what the bindings come after: a flag the command has (convert-heads has no
    # --gin_file: its help named one until 2026-12-06)
    if takes_bindings:
      after = ("the source run's config.gin" if name == "convert-heads"
               else "the --gin_file files")
      assert f"They come after {after}." in flat and (("--gin_file" in flat)
                                                      == (name != "convert-heads")), name
    if name == "train":  # an installed attnlab's configs by name (said in README alone
      # until 2026-12-07)
      assert "a name that is no file, e.g. lm_stdlib_tiny.gin or models/llama_tiny.gin, is " \
             "attnlab's built-in config of that name" in flat


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_a_command_without_its_required_flags_names_them_exit_2(name, capsys):
  assert cli.main([name]) == 2
  assert capsys.readouterr().err == (
      f"attnlab {name}: error: the following arguments are required: {REQUIRED[name]}\n")
  if name in ONE_OF:
    argv, flags = ONE_OF[name]
    assert cli.main([name, *argv]) == 2
    assert capsys.readouterr().err == (
        f"attnlab {name}: error: one of the arguments {flags} is required\n")


def test_the_console_script_is_the_dispatchers_wrapper_that_dies_by_sigint():
  """pyproject.toml's ``attnlab`` script is ``cli.console_main`` (``cli.main`` until
  2026-12-07, which killed a notebook's kernel on Ctrl-C; test_commands.py runs both). Read
  from pyproject.toml: an installed script is the one of its install (an editable install
  made before 2026-12-07 runs ``cli.main`` until ``pip install -e .`` again)."""
  import pathlib
  import tomllib

  pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
  scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
  assert scripts == {"attnlab": "attnlab.cli:console_main"}
  module, function = scripts["attnlab"].split(":")
  assert getattr(importlib.import_module(module), function) is cli.console_main


def _last_line_in_a_fresh_python(code: str) -> str:
  """The last line ``code`` prints in a new interpreter (nothing of attnlab loaded yet)."""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout
  return out.strip().splitlines()[-1]


def test_help_and_an_unknown_command_do_not_load_jax():
  """``attnlab --help`` imports only the package root, cli.py and CommandError: the
  package root's entry points are lazy (importing it eagerly took ~2.5 s of JAX)."""
  code = ("import sys\nfrom attnlab import cli\n"
          "assert cli.main(['--help']) == 0 and cli.main(['nope']) == 2\n"
          "assert cli.main(['--version']) == 0\n"
          "heavy = sorted(m for m in ('jax', 'flax', 'gin', 'numpy', 'orbax')\n"
          "               if m in sys.modules)\n"
          "print('loaded:', heavy)\n")
  assert _last_line_in_a_fresh_python(code) == "loaded: []"


def test_kv_size_runs_without_loading_jax():
  """``attnlab kv-size`` is arithmetic: it answers without starting JAX (the shared command
  helpers import it only where a command points its compilation cache)."""
  code = ("import sys\nfrom attnlab import cli\n"
          "assert cli.main(['kv-size', '--layers', '2', '--seq', '8', '--kv_heads', '1',\n"
          "                 '--head_dim', '4']) == 0\n"
          "print('jax loaded:', 'jax' in sys.modules)\n")
  assert _last_line_in_a_fresh_python(code) == "jax loaded: False"


def test_the_package_root_loads_each_entry_point_on_first_use():
  code = ("import sys, attnlab\n"
          "assert 'jax' not in sys.modules\n"
          "from attnlab import ModelConfig, build_model, generate, attention\n"
          "from attnlab.config import ModelConfig as M\n"
          "from attnlab.nn.transformer import build_model as b\n"
          "assert ModelConfig is M and build_model is b\n"
          "assert set(attnlab.__all__) <= set(dir(attnlab))\n"
          "from attnlab.training.checkpoint import load_checkpoint\n"
          "from attnlab.decoding.batching import generate_requests\n"
          "assert attnlab.load_checkpoint is load_checkpoint\n"
          "assert attnlab.generate_requests is generate_requests\n"
          "try:\n  attnlab.nope\nexcept AttributeError as e:\n  print(e)\n")
  assert _last_line_in_a_fresh_python(code) == "module 'attnlab' has no attribute 'nope'"


def test_the_package_roots_three_lists_of_names_agree():
  """``__all__``, the lazy table and the TYPE_CHECKING imports name the same entry points,
  each from the same module."""
  import ast
  import pathlib

  import attnlab

  tree = ast.parse(pathlib.Path(attnlab.__file__).read_text())
  guarded = next(node for node in tree.body if isinstance(node, ast.If)
                 and getattr(node.test, "id", None) == "TYPE_CHECKING")
  seen = {alias.name: imp.module for imp in guarded.body for alias in imp.names}
  assert seen == attnlab._LAZY
  assert sorted(attnlab.__all__) == sorted(attnlab._LAZY)


def test_attribute_chains_into_the_subpackages_work_after_a_bare_import():
  """``import attnlab`` then ``attnlab.ops.pallas.flash.flash_attention`` (DESIGN.md's
  spelling), ``attnlab.config.DecodeConfig``, ``attnlab.nn.kv_cache.init_cache``: as when
  the package root imported the models eagerly."""
  code = ("import sys, attnlab\n"
          "assert 'jax' not in sys.modules\n"
          "chained = attnlab.ops.pallas.flash.flash_attention\n"
          "assert callable(attnlab.nn.kv_cache.init_cache)\n"
          "assert attnlab.config.DecodeConfig().max_new_tokens > 0\n"
          "from attnlab.ops.pallas.flash import flash_attention\n"
          "assert chained is flash_attention\n"
          "assert sorted(attnlab._SUBMODULES) == sorted(\n"
          "    p.stem for p in __import__('pathlib').Path(attnlab.__file__).parent.iterdir()\n"
          "    if (p.suffix == '.py' and p.stem != '__init__') or (p / '__init__.py').exists())\n"
          "print('ok')\n")
  assert _last_line_in_a_fresh_python(code) == "ok"


def test_check_can_make_follows_links_to_folders_and_names_what_stops_it(tmp_path, monkeypatch):
  """The commands' output-folder check (``--workdir``, ``--out``, ``--compilation_cache``):
  a path at or under a symbolic link to a folder can be made; one under a file, a link to
  nothing or a folder it cannot write is refused, naming the flag, the path and why.
  (test_convert_command.py runs the refusals through ``attnlab convert``.)"""
  from attnlab.commands._common import check_can_make

  (tmp_path / "folder").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "folder")
  (tmp_path / "dangling").symlink_to(tmp_path / "gone")
  (tmp_path / "file").write_text("")
  for path in ("link", "link/new/deeper", "folder/new", "new"):
    check_can_make("--workdir", str(tmp_path / path))
  # An empty path (the working directory to os.path.abspath, nothing to os.makedirs): a
  # traceback after every other check until 2026-12-06.
  with pytest.raises(CommandError) as e:
    check_can_make("--workdir", "")
  assert str(e.value) == "--workdir is empty: give a directory"
  # Only whitespace: a folder named " " was made (until 2026-12-06).
  with pytest.raises(CommandError) as e:
    check_can_make("--workdir", " ")
  assert str(e.value) == "--workdir ' ' is only whitespace: give a directory"
  # --compilation_cache "" was "no cache" without a word; eval / decode --workdir "" read the
  # working directory's config.gin, naming no flag (until 2026-12-06).
  from attnlab.commands._common import check_workdir_given, use_compilation_cache

  for path in ("", "  "):
    with pytest.raises(CommandError) as e:
      use_compilation_cache(path)
    assert str(e.value) == f"--compilation_cache {path!r} is empty: give a directory"
    with pytest.raises(CommandError) as e:
      check_workdir_given(path)
    assert str(e.value) == f"--workdir {path!r} is empty: give a training workdir"
    with pytest.raises(CommandError) as e:
      check_workdir_given(path, "--from")
    assert str(e.value) == f"--from {path!r} is empty: give a training workdir"
  why = {"file/new": "file is a file",
         "dangling/new": f"dangling is a symbolic link to {tmp_path}/gone, which does not exist"}
  for path, reason in why.items():
    with pytest.raises(CommandError) as e:
      check_can_make("--out", str(tmp_path / path))
    reason = reason.replace(reason.split()[0], str(tmp_path / reason.split()[0]), 1)
    assert str(e.value) == f"--out {tmp_path / path}: cannot make this directory ({reason})"
  # Names the file system cannot hold (until 2026-12-07 `attnlab train` checked nothing of
  # them and ended in an OSError traceback, ENAMETOOLONG, making the workdir): a name over
  # NAME_MAX bytes (UTF-8: 128 "é" are 256 bytes), a path over PATH_MAX.
  name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
  for name in ("a" * (name_max + 1), "é" * (name_max // 2 + 1)):
    with pytest.raises(CommandError) as e:
      check_can_make("--workdir", str(tmp_path / name / "run"))
    size = len(name.encode())
    assert str(e.value) == (f"--workdir {tmp_path / name / 'run'}: cannot make this directory "
                            f"(its name {name[:16]!r}... is {size} bytes, more than the "
                            f"{name_max} a name may have in {tmp_path})")
  check_can_make("--workdir", str(tmp_path / ("a" * name_max) / "run"))  # at the limit: taken
  def path_of(length):  # a path under tmp_path of exactly ``length`` bytes
    path = str(tmp_path)
    while length - len(path) > 202:
      path += "/" + "d" * 200
    return path + "/" + "d" * (length - len(path) - 1)

  path_max = os.pathconf(tmp_path, "PC_PATH_MAX")  # counts the terminating NUL
  for length in (path_max + 300, path_max):
    path = path_of(length)
    with pytest.raises(CommandError) as e:
      check_can_make("--out", path)
    assert str(e.value) == (f"--out {path}: cannot make this directory (its path is "
                            f"{length} bytes, more than the {path_max - 1} a path may have)")
  check_can_make("--out", path_of(path_max - 1))  # at the limit: taken
  # Where the file system does not say (pathconf fails), POSIX's usual 255 and 4096.
  with monkeypatch.context() as patch:
    patch.setattr("os.pathconf", lambda *a: (_ for _ in ()).throw(OSError("not here")))
    for name in ("a" * 256, "a" * 255):
      try:
        check_can_make("--workdir", str(tmp_path / name))
        refused = None
      except CommandError as e:
        refused = str(e)
      assert (refused is None) == (len(name) == 255), refused
      assert refused is None or "more than the 255 a name may have" in refused
    with pytest.raises(CommandError, match="more than the 4095 a path may have"):
      check_can_make("--out", path_of(4096))
    check_can_make("--out", path_of(4095))
  # Not writable (as root every folder is, so os.access is a stand-in): it asks for write and
  # search permission on the nearest existing folder.
  asked = []
  monkeypatch.setattr("os.access", lambda at, mode: asked.append((at, mode)) and False)
  with pytest.raises(CommandError) as e:
    check_can_make("--workdir", str(tmp_path / "folder" / "a" / "b"))
  assert asked == [(str(tmp_path / "folder"), os.W_OK | os.X_OK)]
  assert str(e.value) == (f"--workdir {tmp_path}/folder/a/b: cannot make this directory "
                          f"({tmp_path}/folder is not writable)")


def test_each_commands_log_lines_go_to_the_stderr_of_the_moment_and_leave_nothing_behind():
  """A command run in-process writes its log lines to the ``sys.stderr`` current as they are
  logged (``contextlib.redirect_stderr`` here; a notebook cell's, pytest's capsys), attnlab's
  from INFO up, the libraries' from WARNING up, and attnlab's level is put back when it
  returns or raises; its handler stays (one), writing to the stderr of the moment, so that
  absl's ``basicConfig`` at a library call between commands (a ``load_checkpoint``) does not
  take the next command's lines to its stream (a review found that in the first version,
  which took the handler away). Until 2026-12-07 the first command's
  ``logging.basicConfig`` kept the stderr of that moment: the second command's lines went to
  the first one's, and attnlab's INFO lines stayed on. Where the caller configured logging
  (``force=True`` past attnlab's handler), its handler writes them, as before. In a fresh
  interpreter: pytest's own handlers sit on the root logger."""
  code = ("import contextlib, io, logging, sys, types\nfrom attnlab import cli\n"
          "from attnlab.commands import CommandError\n"
          "from attnlab.commands._common import log_attnlab_info\n"
          "module = types.ModuleType('attnlab.commands.fake')\n"
          "def main(argv):\n"
          "  log_attnlab_info()\n"
          "  log_attnlab_info()  # a second call changes nothing\n"
          "  for name in ('attnlab.fake', 'orbax.fake'):\n"
          "    logging.getLogger(name).info('%s info %s', name, argv[0])\n"
          "    logging.getLogger(name).warning('%s warning %s', name, argv[0])\n"
          "  if argv[1:]:\n    raise CommandError('bad')\n"
          "  return 0\n"
          "module.main = main\nsys.modules['attnlab.commands.fake'] = module\n"
          "cli.COMMANDS['fake'] = ('fake', 'a test command')\n"
          "def state():\n"
          "  return (logging.getLogger('attnlab').level, logging.root.level,\n"
          "          len(logging.root.handlers))\n"
          "seen = [state()]\n"
          "for argv in (['1'], ['2'], ['3', 'fail']):\n"
          "  err = io.StringIO()\n"
          "  with contextlib.redirect_stderr(err):\n"
          "    rc = cli.main(['fake', *argv])\n"
          "  seen += [rc, err.getvalue(), state()]\n"
          "import absl.logging\n"  # a library call between commands: absl logs (orbax's way)
          "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
          "  absl.logging.warning('a library line')\n"
          "seen += [err.getvalue(), state()]\n"
          "user = io.StringIO()\n"
          "logging.basicConfig(stream=user, format='user: %(message)s', force=True)\n"
          "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
          "  cli.main(['fake', '4'])\n"
          "seen += [err.getvalue(), user.getvalue(), state()]\n"
          "print(repr(seen))\n")
  lines = lambda i: (f"attnlab.fake info {i}\nattnlab.fake warning {i}\n"  # noqa: E731
                     f"orbax.fake warning {i}\n")
  import logging

  assert eval(_last_line_in_a_fresh_python(code)) == [
      (logging.NOTSET, logging.WARNING, 0),
      0, lines(1), (logging.NOTSET, logging.WARNING, 1),
      0, lines(2), (logging.NOTSET, logging.WARNING, 1),
      2, lines(3) + "attnlab fake: error: bad\n", (logging.NOTSET, logging.WARNING, 1),
      "a library line\n", (logging.NOTSET, logging.WARNING, 1),
      "", "".join(f"user: {line}\n" for line in lines(4).splitlines()),
      (logging.NOTSET, logging.WARNING, 1)]


def test_each_command_warns_about_a_saved_config_as_a_fresh_process_does(tmp_path, warned):
  """A config.gin's field its run did not read is warned about once per command, not once
  per process: until 2026-12-07 a second command of a process (a notebook's) printed none."""
  (tmp_path / "config.gin").write_text("DataConfig.min_len = 5\n")
  argv = ["convert-heads", "--from", str(tmp_path), "--to", str(tmp_path / "out"),
          "--num_kv_heads", "1", "--method", "mean", "--gin.TrainConfig.steps=3"]
  for _ in range(2):
    assert cli.main(argv) == 2  # the source has no checkpoint: after the config is read
  assert warned() == [f"{tmp_path}/config.gin sets DataConfig.min_len = 5, which task='lm' "
                      "with tokenizer='byte' does not read (attnlab before 2026-12-06 took "
                      "and ignored it): read as the default"] * 2


def test_a_reader_gone_that_poll_cannot_see_is_still_quiet_exit_141(monkeypatch, capsys):
  """stdout a socket whose reader has gone: poll shows no POLLERR there (a socket's reader
  gone is POLLHUP, or nothing once it shut its side down), yet the BrokenPipeError is
  stdout's own write's: quiet, exit 141 (a traceback until 2026-12-07, and from ``--help``
  too, which exited 0 before main flushed)."""
  monkeypatch.setattr(cli, "_stdout_broken", lambda: False)
  for fails in ("write", "flush"):
    for argv in (KV_SIZE, ["kv-size", "--help"]):
      monkeypatch.setattr(sys, "stdout", _FailingStdout(fails, BrokenPipeError(
          errno.EPIPE, "Broken pipe")))
      assert cli.main(argv) == 141, (fails, argv)
      assert capsys.readouterr().err == ""


def test_a_commands_own_status_is_kept_when_its_last_flush_fails(fake_command, monkeypatch,
                                                                   capsys):
  """``train`` stopped by a signal prints its line and returns 75 (resumable); a stdout that
  fails at the flush after it is the line on stderr, and 75 stays (1 until 2026-12-07's
  review: a script resuming on 75 would not have)."""
  module, _ = fake_command

  def stopped(argv):
    print("{}")
    return 75

  module.behave = stopped
  monkeypatch.setattr(sys, "stdout", _FailingStdout("flush", ENOSPC))
  assert cli.main(["fake"]) == 75
  assert capsys.readouterr().err == (
      "attnlab fake: error: cannot write to standard output: [Errno 28] No space left on "
      "device\n")


@pytest.mark.parametrize("argv, err", [
    ([], cli.usage() + "\n"),
    (["nope"], f"attnlab: unknown command 'nope'\n{cli.usage()}\n")])
def test_a_closed_stdout_does_not_hide_what_goes_to_stderr(argv, err, monkeypatch, capsys):
  """No command, or an unknown one: its lines go to stderr, exit 2, stdout closed or not."""
  monkeypatch.setattr(sys, "stdout", None)
  assert cli.main(argv) == 2
  assert capsys.readouterr().err == err


def _first_ends_while_the_second_runs(module, start=lambda which: None,
                                      after_first=lambda: None) -> dict:
  """``attnlab fake first`` and ``attnlab fake second`` in two threads, the first ending
  while the second runs: each command calls ``start(which)`` as it begins, the second
  ``after_first()`` once the first has returned. Their exit codes."""
  first_in, second_in, first_out = (threading.Event() for _ in range(3))

  def behave(argv):
    start(argv[0])
    if argv == ["first"]:
      first_in.set()
      assert second_in.wait(60)
    else:
      second_in.set()
      assert first_out.wait(60)
      after_first()
    return 0

  module.behave = behave
  codes = {}

  def run(which):
    codes[which] = cli.main(["fake", which])
    if which == "first":
      first_out.set()

  first = threading.Thread(target=run, args=("first",))
  first.start()
  assert first_in.wait(60)
  second = threading.Thread(target=run, args=("second",))
  second.start()
  first.join(60)
  second.join(60)
  return codes


def test_commands_running_at_once_in_threads_put_the_callers_stdout_back(
    fake_command, monkeypatch):
  """Two ``main`` calls in threads, the first returning while the second runs (a ``train``
  and an ``eval`` in a notebook): the caller's stdout is back after both, whatever the order
  (until 2026-12-07's review the second left the first's wrapper as ``sys.stdout`` for
  good), and a call still running prints through the watched stdout."""
  module, _ = fake_command
  stdout = io.StringIO()
  monkeypatch.setattr(sys, "stdout", stdout)

  def after_first():
    assert isinstance(sys.stdout, cli._WatchedStdout)  # still watched for this call

  codes = _first_ends_while_the_second_runs(module, start=print, after_first=after_first)
  assert codes == {"first": 0, "second": 0}
  assert sys.stdout is stdout
  assert sorted(stdout.getvalue().split()) == ["first", "second"]


def test_the_watched_stdout_can_be_copied_while_a_command_runs(fake_command):
  """``copy.copy(sys.stdout)`` in a command (a library's) made a RecursionError: the copy's
  ``__getattr__`` looked for its ``stream``, not yet set, through itself."""
  import copy

  module, _ = fake_command
  module.behave = lambda argv: copy.copy(sys.stdout).stream is sys.stdout.stream and 7
  assert cli.main(["fake"]) == 7


def test_commands_running_at_once_in_threads_keep_attnlabs_log_level_until_the_last_ends(
    fake_command):
  """Two commands in threads (a ``train`` and an ``eval`` in a notebook), the first ending
  while the second runs: the second's INFO lines (progress, checkpoints) are still logged,
  and attnlab's level is the caller's again after both (until 2026-12-07 the first to end
  put the level back, and the second's INFO lines were lost from then on)."""
  import logging

  from attnlab.commands._common import log_attnlab_info

  module, _ = fake_command
  attnlab_logger = logging.getLogger("attnlab")
  before = attnlab_logger.level
  seen = []
  codes = _first_ends_while_the_second_runs(
      module, start=lambda which: log_attnlab_info(),
      after_first=lambda: seen.append(attnlab_logger.getEffectiveLevel()))
  assert codes == {"first": 0, "second": 0}
  assert seen == [logging.INFO]
  assert attnlab_logger.level == before


def test_commands_starting_at_once_in_threads_add_one_log_handler(monkeypatch):
  """Two commands starting at once (threads) under a root logger without handlers: one
  handler is added, not one each (each of the process's later lines was printed twice: the
  check and the add were not under one lock until 2026-12-07's review). The making of the
  handler is slowed so that both threads are inside ``log_attnlab_info`` at once."""
  import logging
  import time

  from attnlab.commands import _common

  monkeypatch.setattr(logging.root, "handlers", [])
  init = _common._StderrHandler.__init__

  def slow_init(self):
    time.sleep(0.2)
    init(self)

  monkeypatch.setattr(_common._StderrHandler, "__init__", slow_init)
  barrier = threading.Barrier(2)

  def command():
    barrier.wait(60)
    _common.log_attnlab_info()
    _common.restore_logging()

  threads = [threading.Thread(target=command) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert [type(h).__name__ for h in logging.root.handlers] == ["_StderrHandler"]


@pytest.mark.parametrize("outer_sets", [("log", "cache"), ("log",), ("cache",)])
def test_a_command_run_inside_another_leaves_the_outer_ones_log_level_and_cache(
    outer_sets, fake_command, tmp_path):
  """A command that runs ``attnlab.cli.main`` itself (a user's): the inner command's end
  leaves attnlab's log level and the compilation cache folder to the outer one, which puts
  them back when it ends (until 2026-12-07's review the inner end put both back under the
  outer command: its INFO lines were lost from then on). Each is the outer's where it set
  that one alone too."""
  import logging

  import jax

  from attnlab.commands import _common

  module, _ = fake_command
  attnlab_logger = logging.getLogger("attnlab")
  level, cache = attnlab_logger.level, jax.config.jax_compilation_cache_dir
  folder = str(tmp_path / "c")
  seen = []

  def outer(argv):
    if "log" in outer_sets:
      _common.log_attnlab_info()
    if "cache" in outer_sets:
      _common.use_compilation_cache(folder)
    assert cli.main(KV_SIZE) == 0
    seen.append((attnlab_logger.level, jax.config.jax_compilation_cache_dir))
    return 0

  module.behave = outer
  assert cli.main(["fake"]) == 0
  assert seen == [(logging.INFO if "log" in outer_sets else level,
                   folder if "cache" in outer_sets else cache)]
  assert (attnlab_logger.level, jax.config.jax_compilation_cache_dir) == (level, cache)


def test_a_result_line_that_cannot_be_written_keeps_the_commands_status(fake_command,
                                                                        monkeypatch, capsys):
  """``train`` stopped by a signal prints its result line and returns 75; where stdout takes
  no line at the print itself (unbuffered: PYTHONUNBUFFERED, ``python -u``), the line on
  stderr and 75 (1 until 2026-12-07's review; at the flush it was kept already)."""
  from attnlab.commands import print_result

  module, _ = fake_command
  module.behave = lambda argv: print_result("{}", 75)
  monkeypatch.setattr(sys, "stdout", _FailingStdout("write", ENOSPC))
  assert cli.main(["fake"]) == 75
  assert capsys.readouterr().err == (
      "attnlab fake: error: cannot write to standard output: [Errno 28] No space left on "
      "device\n")
  module.behave = lambda argv: print_result("{}", 0)  # a finished run: stdout's failure, 1
  assert cli.main(["fake"]) == 1


@pytest.mark.parametrize("how", ["print", "writelines"])
def test_a_commands_own_write_that_fails_is_one_line_exit_1(how, fake_command, monkeypatch,
                                                           capsys):
  """A command's own ``print`` (not ``print_result``, whose error carries the command's
  status) or ``sys.stdout.writelines`` on a full disk: the line, exit 1."""
  module, _ = fake_command
  module.behave = lambda argv: (print("a line") if how == "print"
                                else sys.stdout.writelines(["a line\n"]))
  monkeypatch.setattr(sys, "stdout", _FailingStdout("write", ENOSPC))
  monkeypatch.setattr(_FailingStdout, "writelines", _FailingStdout.write)
  assert cli.main(["fake"]) == 1
  assert capsys.readouterr().err == (
      "attnlab fake: error: cannot write to standard output: [Errno 28] No space left on "
      "device\n")


def test_a_command_sees_its_stdouts_own_attributes(fake_command, monkeypatch, tmp_path):
  """While a command runs, ``sys.stdout`` is the watched one; what it does not override
  (``fileno``, ``isatty``, ``encoding``, ``name``: what a progress bar or a pager asks) is
  the caller's stream's, and its ``writelines`` writes the lines."""
  module, _ = fake_command
  seen = []

  def look(argv):
    seen.append((sys.stdout is not stream, sys.stdout.fileno(), sys.stdout.isatty(),
                 sys.stdout.encoding, sys.stdout.name))
    sys.stdout.writelines(["x\n", "é\n"])

  module.behave = look
  with open(tmp_path / "out.txt", "w", encoding="latin-1") as stream, \
       monkeypatch.context() as patch:
    patch.setattr(sys, "stdout", stream)
    assert cli.main(["fake"]) == 0
    assert seen == [(True, stream.fileno(), False, "latin-1", str(tmp_path / "out.txt"))]
  assert (tmp_path / "out.txt").read_bytes() == "x\né\n".encode("latin-1")


def test_a_stdout_without_a_closed_attribute_is_written(fake_command, monkeypatch):
  """A caller's minimal stream (``write`` and ``flush`` only, as some notebook front ends
  and loggers set): not taken for a closed one."""
  module, _ = fake_command
  stream = MinimalStream()
  module.behave = lambda argv: print("ran")
  monkeypatch.setattr(sys, "stdout", stream)
  assert cli.main(["fake"]) == 0
  assert "".join(stream.text) == "ran\n"


def _command_raises_a_broken_pipe(fake_command) -> BrokenPipeError:
  """The fake command raises a BrokenPipeError of its own (not stdout's write's): that one."""
  module, _ = fake_command
  raised = BrokenPipeError(errno.EPIPE, "Broken pipe")

  def fail(argv):
    raise raised

  module.behave = fail
  return raised


@pytest.mark.parametrize("reader_gone", [False, True])
def test_a_broken_pipe_of_another_pipe_is_the_commands_own_unless_stdouts_reader_is_gone(
    reader_gone, fake_command, monkeypatch, capsys):
  """A BrokenPipeError that stdout's write did not raise (a subprocess's pipe, a socket the
  command writes): where stdout is a pipe whose reader is there, it is the command's own
  error and reaches the caller; where stdout's reader has gone too (poll says so), the
  command stops quietly, 141, as ``attnlab decode ... | head -1`` does."""
  raised = _command_raises_a_broken_pipe(fake_command)
  read, write = os.pipe()
  try:
    if reader_gone:
      os.close(read)
    with open(write, "w", closefd=False) as stream, monkeypatch.context() as patch:
      patch.setattr(sys, "stdout", stream)
      if reader_gone:
        assert cli.main(["fake"]) == 141
      else:
        with pytest.raises(BrokenPipeError) as e:
          cli.main(["fake"])
        assert e.value is raised
  finally:
    os.close(write)
    if not reader_gone:
      os.close(read)
  assert capsys.readouterr().err == ""


def test_the_first_command_of_a_process_puts_back_what_it_set(tmp_path):
  """The first command of a fresh interpreter loads ``commands._common`` itself (nothing had:
  ``cli`` does not import it); attnlab's log level and the compilation cache folder it set
  are put back at its end, as for any later command."""
  code = ("import logging, sys, types\nimport jax\nfrom attnlab import cli\n"
          "assert 'attnlab.commands._common' not in sys.modules\n"
          "module = types.ModuleType('attnlab.commands.fake')\n"
          "def main(argv):\n"
          "  from attnlab.commands import _common\n"
          "  _common.log_attnlab_info()\n"
          "  _common.use_compilation_cache(argv[0])\n"
          "  seen.append((logging.getLogger('attnlab').level,\n"
          "               jax.config.jax_compilation_cache_dir))\n"
          "  return 0\n"
          "module.main = main\nsys.modules['attnlab.commands.fake'] = module\n"
          "cli.COMMANDS['fake'] = ('fake', 'a test command')\n"
          "seen = [(logging.getLogger('attnlab').level, jax.config.jax_compilation_cache_dir)]\n"
          f"seen.append(cli.main(['fake', {str(tmp_path / 'cache')!r}]))\n"
          "seen.append((logging.getLogger('attnlab').level,\n"
          "             jax.config.jax_compilation_cache_dir))\n"
          "print(repr(seen))\n")
  import logging

  before, during, rc, after = eval(_last_line_in_a_fresh_python(code))
  assert (during, rc) == ((logging.INFO, str(tmp_path / "cache")), 0)
  assert after == before and before[0] == logging.NOTSET


def test_a_pipe_without_a_reader_under_a_buffered_stdout_is_quiet_in_a_real_process():
  """``attnlab kv-size ... | true``: the reader is gone before the result is flushed. Exit
  141, nothing on stderr; the process's stdout goes to /dev/null, so the interpreter's own
  last flush of what stayed in the buffer does not print "Exception ignored ... BrokenPipe"
  (and exit 120) after ``main`` returned."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
  env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
  read, write = os.pipe()
  os.close(read)
  try:
    proc = subprocess.run([sys.executable, "-m", "attnlab.cli", *KV_SIZE], stdout=write,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=120)
  finally:
    os.close(write)
  assert (proc.returncode, proc.stderr) == (141, "")


def test_stdout_to_devnull_lets_its_own_failure_go(monkeypatch):
  """After stdout's failure was said, ``_to_devnull`` points the process's stdout at
  /dev/null; where that cannot be done (no descriptor left: EMFILE), the line and the exit
  status stand, and nothing more is raised."""
  def emfile(*args):
    raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

  monkeypatch.setattr(cli.os, "open", emfile)
  assert cli._to_devnull(sys.__stdout__) is None


def test_a_full_pipe_does_not_hold_up_another_pipes_broken_pipe(fake_command, monkeypatch):
  """Telling a BrokenPipeError of another pipe from stdout's asks poll without waiting:
  stdout a pipe that is full (its reader slow, not gone) does not hold the command's own
  error back until the reader reads (a watchdog reads the pipe after 60 s, so a wait fails
  the test instead of hanging it)."""
  import fcntl

  raised = _command_raises_a_broken_pipe(fake_command)
  read, write = os.pipe()
  flags = fcntl.fcntl(write, fcntl.F_GETFL)
  fcntl.fcntl(write, fcntl.F_SETFL, flags | os.O_NONBLOCK)
  with contextlib.suppress(BlockingIOError):
    while True:
      os.write(write, b"x" * 65536)
  fcntl.fcntl(write, fcntl.F_SETFL, flags)
  drained, done = [], threading.Event()

  def watchdog():
    if not done.wait(60):
      drained.append(os.read(read, 1 << 20))

  thread = threading.Thread(target=watchdog, daemon=True)
  thread.start()
  try:
    with open(write, "w", closefd=False) as stream, monkeypatch.context() as patch:
      patch.setattr(sys, "stdout", stream)
      with pytest.raises(BrokenPipeError) as e:
        cli.main(["fake"])
    assert e.value is raised
  finally:
    done.set()
    thread.join()
    os.close(read)
    os.close(write)
  assert drained == []


def test_the_version_is_one_number_for_the_package_the_command_and_the_metadata(capsys):
  """``attnlab.__version__`` (attnlab/version.py, which pyproject.toml reads), what
  ``attnlab --version`` prints, and the installed distribution's version are one string."""
  import attnlab
  from attnlab import version

  assert attnlab.__version__ == version.__version__
  assert "__version__" in dir(attnlab)
  assert cli.main(["--version"]) == 0
  assert capsys.readouterr() == (f"attnlab {attnlab.__version__}\n", "")
  assert importlib.metadata.version("attnlab") == attnlab.__version__
  assert cli.main(["--version", "extra"]) == 0  # the rest is ignored, as --help's
  assert capsys.readouterr().out == f"attnlab {attnlab.__version__}\n"
