"""Dependencies run one way: a static (ast) scan of every module of attnlab/.

Layers, bottom to top: config (with its gin I/O, config_gin.py) -> ops -> nn
-> decoding (and data, beside it) -> training / convert -> commands -> the
package root and cli.py. A module may import its own layer and the layers
below, never one above; only the config I/O and the commands import gin;
nothing inside the package imports the package root (the curated API); and
no function-level or ``try:`` import of an attnlab module (a lazy import is
for an optional heavy dependency, never for one of our own modules).

The scan accepts the command modules both where they are now
(training/commands.py, decoding/commands.py, training/gin_config.py) and in
their ``attnlab/commands/`` package and ``attnlab/config_gin.py``; a few
exceptions for the old paths (below) are listed by module, and lapse when
those modules move.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "attnlab"

LAYERS = ("config", "ops", "nn", "decoding", "training", "commands", "top")
# Top-level packages / modules of attnlab and their layer.
PACKAGE_LAYER = {
    "config": "config", "config_gin": "config", "extras": "config", "version": "config",
    "ops": "ops", "nn": "nn",
    "decoding": "decoding", "data": "decoding", "training": "training", "convert": "training",
    "commands": "commands", "cli": "top",
}
# Old homes of the command modules (before the attnlab/commands/ package).
OLD_COMMANDS = {"attnlab.training.commands", "attnlab.decoding.commands"}
OLD_CONFIG_IO = {"attnlab.training.gin_config"}
GIN_ALLOWED = {"attnlab.config_gin", *OLD_CONFIG_IO, *OLD_COMMANDS}
# What the old command modules do that their attnlab/commands/ successors must not:
# they import CommandError from cli.py, the package root, and attnlab modules
# inside functions. Each entry lapses when its module moves.
OLD_PATH_EXCEPTIONS = {
    "attnlab.training.commands": {"imports cli", "lazy imports"},
    "attnlab.decoding.commands": {"imports cli", "lazy imports", "imports the package root"},
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def layer(module: str) -> str:
  """The layer of an attnlab module name."""
  if module == "attnlab":
    return "top"
  if module in OLD_COMMANDS:
    return "commands"
  if module in OLD_CONFIG_IO:
    return "config"
  top = module.split(".")[1]
  if top not in PACKAGE_LAYER:
    raise AssertionError(f"{module}: attnlab.{top} has no layer; add it to PACKAGE_LAYER")
  return PACKAGE_LAYER[top]


def _resolve(module: str, node: ast.ImportFrom) -> str:
  """The absolute module an ImportFrom names (relative imports resolved)."""
  if not node.level:
    return node.module or ""
  is_package = MODULES[module].name == "__init__.py"
  base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
  return ".".join(base + ([node.module] if node.module else []))


def imports(module: str):
  """(imported name, line, at module level, inside try) for every import of ``module``.

  ``from attnlab.x import y`` yields ``attnlab.x.y`` when that is a module,
  else ``attnlab.x``; ``from attnlab import y`` of a non-module yields the
  package root ``attnlab``.
  """
  tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
  out = []

  def visit(node, top_level: bool, in_try: bool):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.Import):
        out.extend((a.name, child.lineno, top_level, in_try) for a in child.names)
      elif isinstance(child, ast.ImportFrom):
        base = _resolve(module, child)
        for a in child.names:
          sub = f"{base}.{a.name}"
          out.append((sub if sub in MODULES else base, child.lineno, top_level, in_try))
      elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
        # Class bodies run at import time, but an import there is as hidden as a lazy one.
        visit(child, False, in_try)
      elif isinstance(child, ast.Try):
        visit(child, top_level, True)
      else:
        visit(child, top_level, in_try)

  visit(tree, True, False)
  return out


def _ours(name: str) -> bool:
  return name == "attnlab" or name.startswith("attnlab.")


def violations(module: str) -> list[str]:
  """What is wrong with the imports of one module (empty when it follows the rules)."""
  allowed = OLD_PATH_EXCEPTIONS.get(module, set())
  own = LAYERS.index(layer(module))
  found = []
  for name, line, top_level, in_try in imports(module):
    where = f"{module}:{line}"
    if name == "gin" or name.startswith("gin."):
      if module not in GIN_ALLOWED and layer(module) != "commands":
        found.append(f"{where} imports gin outside the config I/O and the commands")
      continue
    if not _ours(name):
      continue
    if name == "attnlab" and module != "attnlab":
      if "imports the package root" not in allowed:
        found.append(f"{where} imports the package root `attnlab` (the curated API)")
      continue
    if in_try:
      found.append(f"{where} imports {name} inside try: (our own modules are always there)")
    elif not top_level and "lazy imports" not in allowed:
      found.append(f"{where} imports {name} inside a function or class (no lazy imports of "
                   "our own modules)")
    if name == "attnlab.cli" and "imports cli" in allowed:
      continue
    if LAYERS.index(layer(name)) > own:
      found.append(f"{where} ({layer(module)}) imports {name} ({layer(name)}), a layer above")
  return found


def test_every_module_has_a_layer():
  for module in MODULES:
    assert layer(module) in LAYERS


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module):
  assert violations(module) == []


def _scan_source(tmp_path, monkeypatch, module, source):
  """violations() of ``source`` placed at ``module`` (a throwaway copy of the map)."""
  path = tmp_path / (module.replace(".", "/") + ".py")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(source)
  monkeypatch.setitem(MODULES, module, path)
  return violations(module)


@pytest.mark.parametrize("module,source,message", [
    ("attnlab.nn.fake", "from attnlab.decoding import generate\n", "a layer above"),
    ("attnlab.ops.fake", "import attnlab.nn.layers\n", "a layer above"),
    ("attnlab.config", "from attnlab.ops.dispatch import attention\n", "a layer above"),
    ("attnlab.training.fake", "from attnlab.commands import train\n", "a layer above"),
    ("attnlab.nn.fake", "import gin\n", "imports gin"),
    ("attnlab.decoding.fake", "import attnlab\n", "package root"),
    ("attnlab.decoding.fake", "from attnlab import ModelConfig\n", "package root"),
    ("attnlab.nn.fake", "def f():\n  from attnlab.nn import layers\n", "inside a function"),
    ("attnlab.nn.fake", "try:\n  from attnlab.ops import masks\nexcept ImportError:\n  pass\n",
     "inside try"),
])
def test_the_scan_catches(tmp_path, monkeypatch, module, source, message):
  """Each rule, broken on purpose in a throwaway module, is reported."""
  found = _scan_source(tmp_path, monkeypatch, module, source)
  assert any(message in f for f in found), found


@pytest.mark.parametrize("module,source", [
    ("attnlab.decoding.fake", "from attnlab.nn.kv_cache import init_cache\n"),
    ("attnlab.commands.fake", "import gin\nfrom attnlab.training import trainer\n"),
    ("attnlab.config_gin", "import gin\nfrom attnlab.config import ModelConfig\n"),
    ("attnlab.nn.fake", "def f():\n  import matplotlib\n"),
])
def test_the_scan_allows(tmp_path, monkeypatch, module, source):
  assert _scan_source(tmp_path, monkeypatch, module, source) == []
