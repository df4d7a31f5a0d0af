"""A caller's minimal output stream, as some notebook front ends and loggers set for
``sys.stdout``: ``write`` and ``flush`` only (no ``closed``, ``encoding``, ``fileno``)."""

from __future__ import annotations


class MinimalStream:
  """Keeps what is written in ``text`` (a list of the strings, in order)."""

  def __init__(self):
    self.text = []

  def write(self, text):
    self.text.append(text)
    return len(text)

  def flush(self):
    pass
