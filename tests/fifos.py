"""A FIFO test that fails rather than hangs. Opening a FIFO for reading waits for a writer,
and a reader inside a library that holds the GIL (tokenizers, sentencepiece) stops every
Python thread with it, so the watchdog is a process of its own: past its deadline it opens
the FIFO for writing and closes it again (the blocked reader reads an empty file, and the
test goes on to fail), and the test names the wait. A path that is no FIFO (a regular file,
which a case puts there) is left alone, and the watchdog ends when the test's process does."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

_WATCHDOG = """
import os, stat, sys, time
fifo, seconds, parent = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
time.sleep(seconds)
while os.getppid() == parent:  # until killed, or the test's process is gone (a CI kill)
  try:
    if stat.S_ISFIFO(os.stat(fifo).st_mode):  # a regular file is never waited on: left alone
      os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody reads it now
      print("released", flush=True)  # (a reader after the first is let go too)
  except OSError:
    pass
  time.sleep(0.2)
"""


@contextlib.contextmanager
def released_after(seconds: float, fifo: str):
  """Run the body with a watchdog on ``fifo``: an AssertionError at the end if anything in
  the body had to be let go by it, having waited ``seconds`` on the FIFO."""
  watchdog = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, fifo,
                               str(seconds), str(os.getpid())], stdout=subprocess.PIPE,
                              text=True)
  try:
    yield
  finally:
    watchdog.kill()
    if watchdog.communicate()[0]:
      raise AssertionError(f"the code under test waited {seconds} s on the FIFO {fifo}, "
                           "until the watchdog opened it for writing")
