"""attnlab/extras.py: an optional package is asked for only by the feature that needs it,
and a missing one is named with the feature and the pip command, in one line."""

from __future__ import annotations

import re
import sys

import pytest

from attnlab import extras
from attnlab.config import TASKS, TOKENIZERS, DataConfig

OPTIONAL = ("sentencepiece", "tokenizers", "sacrebleu")


def _block(monkeypatch, *modules):
  for module in modules:
    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` raises ImportError


@pytest.mark.parametrize("settings, message", [
    (dict(tokenizer="sentencepiece", tokenizer_model="sp.model"),
     "tokenizer='sentencepiece' needs the sentencepiece package: "
     "pip install 'attnlab[sentencepiece]'"),
    (dict(tokenizer="hf_json", tokenizer_model="tokenizer.json", bos_id=1, eos_id=2),
     "tokenizer='hf_json' needs the tokenizers package: pip install 'attnlab[tokenizers]'"),
    (dict(task="tsv", paths=("a.tsv", "b.tsv")),
     "task='tsv' (BLEU in eval) needs the sacrebleu package: "
     "pip install sacrebleu (a dependency of attnlab: reinstall it)"),
])
def test_each_feature_names_its_missing_package(monkeypatch, settings, message):
  _block(monkeypatch, *OPTIONAL)
  with pytest.raises(extras.MissingDependencyError, match="^" + re.escape(message) + "$"):
    extras.check_data_config(DataConfig(**settings))


@pytest.mark.parametrize("task", [t for t in TASKS if t != "tsv"])
def test_nothing_optional_is_asked_for_by_a_config_that_does_not_need_it(monkeypatch, task):
  _block(monkeypatch, *OPTIONAL)
  extras.check_data_config(DataConfig(task=task))  # the byte tokenizer


def test_a_config_asks_only_for_its_own_package(monkeypatch):
  """Each feature's package alone missing: only the config that uses it fails."""
  configs = {
      "sentencepiece": DataConfig(tokenizer="sentencepiece", tokenizer_model="sp.model"),
      "tokenizers": DataConfig(tokenizer="hf_json", tokenizer_model="t.json", bos_id=1,
                               eos_id=2),
      "sacrebleu": DataConfig(task="tsv", paths=("a.tsv", "b.tsv")),
  }
  assert set(TOKENIZERS) == {"byte", "sentencepiece", "hf_json"}
  for missing in OPTIONAL:
    with monkeypatch.context() as m:
      _block(m, missing)
      for module, dcfg in configs.items():
        if module == missing:
          with pytest.raises(extras.MissingDependencyError, match=f"the {missing} package"):
            extras.check_data_config(dcfg)
        else:
          extras.check_data_config(dcfg)


def test_require_returns_the_module_and_is_an_import_error():
  import json

  extras.PACKAGES["json"] = ("json", None)
  try:
    assert extras.require("json", "a test") is json
  finally:
    del extras.PACKAGES["json"]
  assert issubclass(extras.MissingDependencyError, ImportError)


def test_require_of_an_extra_names_it_and_drops_the_import_traceback(monkeypatch):
  _block(monkeypatch, "matplotlib")
  with pytest.raises(extras.MissingDependencyError) as info:
    extras.require("matplotlib", "attnlab ablate --report's figures")
  assert str(info.value) == ("attnlab ablate --report's figures needs the matplotlib "
                             "package: pip install 'attnlab[bench]'")
  assert info.value.__cause__ is None and info.value.__suppress_context__
