"""Optional dependencies: checked when a config is read, named with the extra that installs them.

A feature that needs a package attnlab does not always install (a
sentencepiece tokenizer, plots, Hugging Face interop) calls ``require`` where
it is configured, so a missing package stops a run before anything trains,
with one line: ``tokenizer='sentencepiece' needs the sentencepiece package:
pip install 'attnlab[sentencepiece]'``. ``check_data_config`` lists what a
data config needs (the trainer and the train / eval commands call it).
"""

from __future__ import annotations

import importlib

# module -> (pip package, the attnlab extra that installs it; None = a dependency of attnlab)
PACKAGES = {
    "sacrebleu": ("sacrebleu", None),
    "sentencepiece": ("sentencepiece", "sentencepiece"),
    "tokenizers": ("tokenizers", "tokenizers"),
    "transformers": ("transformers", "hf"),
    "safetensors": ("safetensors", "hf"),
    "matplotlib": ("matplotlib", "bench"),
}


class MissingDependencyError(ImportError):
  """An optional package a configured feature needs is not installed (one line)."""


def require(module: str, feature: str):
  """Import ``module`` for ``feature`` (e.g. "tokenizer='sentencepiece'"), or say how to get it.

  Raises:
    MissingDependencyError: naming the feature, the package and the pip command.
  """
  package, extra = PACKAGES[module]
  try:
    return importlib.import_module(module)
  except ImportError:
    how = (f"pip install 'attnlab[{extra}]'" if extra
           else f"pip install {package} (a dependency of attnlab: reinstall it)")
    raise MissingDependencyError(f"{feature} needs the {package} package: {how}") from None


def check_data_config(dcfg) -> None:
  """Fail now, not at the first eval, on a package a ``DataConfig`` will need."""
  if dcfg.tokenizer == "sentencepiece":
    require("sentencepiece", "tokenizer='sentencepiece'")
  if dcfg.tokenizer == "hf_json":
    require("tokenizers", "tokenizer='hf_json'")
  if dcfg.task == "tsv":
    require("sacrebleu", "task='tsv' (BLEU in eval)")
