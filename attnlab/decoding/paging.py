"""The page allocator of the paged KV cache: a free list of page ids, usable inside jit.

``attnlab.nn.kv_cache.PagedKVCache`` holds the pages and a page table
``[B, M]``; which page a sequence gets is a decoding decision, made here:
pages are taken from a stack of free ids as a sequence grows and pushed back
when it finishes (``attnlab.decoding.generate`` calls ``allocate`` before
each forward step and ``free`` after).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from attnlab.config import positive_count


@struct.dataclass
class PageAllocator:
  """A stack of free page ids: ``free_P[:num_free]`` are free.

  Attributes:
    free_P: int32 [P]; entries at and above ``num_free`` are stale.
    num_free: int32 scalar.
    exhausted: bool scalar, set once a request could not be served. The
      request is then not served at all: its tokens have no page and are
      dropped, never written over another sequence's page. ``generate``
      raises when it sees the flag.
  """

  free_P: jax.Array
  num_free: jax.Array
  exhausted: jax.Array

  @classmethod
  def init(cls, num_pages: int):
    """Every page of ``num_pages`` (a positive Python / NumPy int or concrete 0-d integer
    array, not a bool) free: until
    2026-12-07 2.5 gave the free list [1, 0, -1] (page -1 could be handed out), -1 a
    negative count and None a TypeError naming nothing."""
    num_pages = positive_count("num_pages", num_pages)
    # Reversed so that pages are handed out as 0, 1, 2, ... (easier to read).
    return cls(jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32), jnp.int32(num_pages),
               jnp.bool_(False))

  def allocate(self, page_table_BM, lengths_B, num_new_B, page_size: int):
    """Give each sequence the pages that ``num_new_B`` more tokens need.

    Returns:
      (allocator, page_table_BM).
    """
    B, M = page_table_BM.shape
    have_B = -(-lengths_B // page_size)
    need_B = jnp.minimum(-(-(lengths_B + num_new_B) // page_size), M) - have_B
    need_B = jnp.maximum(need_B, 0)
    total = jnp.sum(need_B)
    ok = total <= self.num_free
    first_B = jnp.cumsum(need_B) - need_B  # exclusive prefix sum: rank of the first new page
    j_BM = jnp.arange(M, dtype=jnp.int32)[None, :] - have_B[:, None]
    new_BM = ok & (j_BM >= 0) & (j_BM < need_B[:, None])
    rank_BM = first_B[:, None] + j_BM
    page_BM = self.free_P[jnp.clip(self.num_free - 1 - rank_BM, 0, self.free_P.shape[0] - 1)]
    page_table_BM = jnp.where(new_BM, page_BM, page_table_BM)
    num_free = jnp.where(ok, self.num_free - total, self.num_free)
    return PageAllocator(self.free_P, num_free, self.exhausted | ~ok), page_table_BM

  def free(self, page_table_BM, release_B):
    """Push the pages of the sequences with ``release_B`` back; clear their rows.

    Args:
      page_table_BM: int [B, M], the table the last ``allocate`` / ``free`` returned.
      release_B: bool [B] (checked when traced: an integer mask's ``2 & True`` is 0, which
        cleared a row and pushed none of its pages until 2026-12-07).

    Only pages of the pool ([0, P)) that are not free already are pushed, each once: a
    second free of a row with a stale table (the one from before the first free cleared
    the row) pushes nothing, where until 2026-12-07 it pushed the pages again and two
    sequences could later be handed one page. Not caught: a stale table whose pages were
    handed out again since (they are held, not free), so pass the table ``free`` returned.

    Returns:
      (allocator, page_table_BM).
    """
    release_B = jnp.asarray(release_B)
    if release_B.dtype != jnp.bool_:
      raise ValueError(f"release_B must be a bool array [B] (True: give the row's pages "
                       f"back), got dtype {release_B.dtype}")
    if release_B.shape != page_table_BM.shape[:1]:
      raise ValueError(f"release_B shape {release_B.shape} must be [B] = "
                       f"({page_table_BM.shape[0]},), the rows of page_table_BM")
    P = self.free_P.shape[0]
    pages_E = page_table_BM.reshape(-1)
    e_E = jnp.arange(pages_E.shape[0], dtype=jnp.int32)
    # O(P + B * M) per call, beside a decode step's forward pass: the free pages as a mask,
    # then the first entry of each page among those going back.
    is_free_P = jnp.zeros(P, bool).at[
        jnp.where(jnp.arange(P) < self.num_free, self.free_P, P)].set(True, mode="drop")
    page_E = jnp.clip(pages_E, 0, P - 1)
    back_E = ((release_B[:, None] & (page_table_BM >= 0)).reshape(-1) & (pages_E < P)
              & ~is_free_P[page_E])
    first_P = jnp.full(P, pages_E.shape[0], jnp.int32).at[
        jnp.where(back_E, pages_E, P)].min(e_E, mode="drop")
    back_E = back_E & (first_P[page_E] == e_E)
    slot_E = jnp.where(back_E, self.num_free + jnp.cumsum(back_E) - 1, P)
    free_P = self.free_P.at[slot_E].set(pages_E, mode="drop")
    page_table_BM = jnp.where(release_B[:, None], -1, page_table_BM)
    return (PageAllocator(free_P, self.num_free + jnp.sum(back_E, dtype=jnp.int32),
                          self.exhausted), page_table_BM)
