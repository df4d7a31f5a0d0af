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

    Returns:
      (allocator, page_table_BM).
    """
    P = self.free_P.shape[0]
    pages_E = page_table_BM.reshape(-1)
    back_E = (release_B[:, None] & (page_table_BM >= 0)).reshape(-1)
    slot_E = jnp.where(back_E, self.num_free + jnp.cumsum(back_E) - 1, P)
    free_P = self.free_P.at[slot_E].set(pages_E, mode="drop")
    page_table_BM = jnp.where(release_B[:, None], -1, page_table_BM)
    return (PageAllocator(free_P, self.num_free + jnp.sum(back_E, dtype=jnp.int32),
                          self.exhausted), page_table_BM)
