"""attnlab's version: the one place it is written (pyproject.toml reads it from here, the
package root and ``attnlab --version`` give it). Imports nothing."""

__version__ = "0.1.0"
