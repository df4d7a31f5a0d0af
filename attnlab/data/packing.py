"""Packing documents into fixed-length rows with segment ids and positions.

Documents are concatenated into one stream (``[bos] doc [eos]`` each) and
the stream is cut into rows of T inputs and T next-token targets. A row may
hold the tail of one document and the head of the next: ``segment_ids`` tell
the model not to attend across them, ``positions`` restart at every document
start, and the loss mask drops the one target that crosses a boundary.
"""

from __future__ import annotations

import numpy as np


def concat_documents(docs: list[np.ndarray], bos_id: int, eos_id: int):
  """One stream of tokens and the document id (1, 2, ...) of every token.

  Returns:
    tokens_Y, doc_ids_Y: int32 arrays of the same length.
  """
  lengths = [len(d) + 2 for d in docs]
  tokens_Y = np.empty(sum(lengths), np.int32)
  doc_ids_Y = np.repeat(np.arange(1, len(docs) + 1, dtype=np.int32), lengths)
  at = 0
  for doc, n in zip(docs, lengths):
    tokens_Y[at] = bos_id
    tokens_Y[at + 1:at + n - 1] = doc
    tokens_Y[at + n - 1] = eos_id
    at += n
  return tokens_Y, doc_ids_Y


def segment_positions(segment_ids_BT: np.ndarray) -> np.ndarray:
  """Position of each token within its run of equal segment ids (0-based)."""
  B, T = segment_ids_BT.shape
  idx_BT = np.broadcast_to(np.arange(T), (B, T))
  starts_BT = np.ones((B, T), bool)
  starts_BT[:, 1:] = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
  # Index of the latest segment start at or before each token.
  start_idx_BT = np.maximum.accumulate(np.where(starts_BT, idx_BT, 0), axis=1)
  return (idx_BT - start_idx_BT).astype(np.int32)


def packed_rows(tokens_Y, doc_ids_Y, rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """Rows ``rows`` of the stream cut into T + 1 windows (overlapping by one).

  Returns a batch dict: tokens_BT, targets_BT, segment_ids_BT (the input
  token's document), positions_BT (restarting per document) and loss_mask_BT
  (1 where the target belongs to the input's document).
  """
  starts_B1 = (np.asarray(rows) * seq_len)[:, None]
  idx_BT = starts_B1 + np.arange(seq_len)[None, :]
  seg_BT = doc_ids_Y[idx_BT]
  # Renumber per row from 1: ids stay small and 0 stays "padding".
  seg_BT = (seg_BT - seg_BT[:, :1] + 1).astype(np.int32)
  return dict(
      tokens_BT=tokens_Y[idx_BT],
      targets_BT=tokens_Y[idx_BT + 1],
      segment_ids_BT=seg_BT,
      positions_BT=segment_positions(seg_BT),
      loss_mask_BT=(doc_ids_Y[idx_BT] == doc_ids_Y[idx_BT + 1]).astype(np.float32),
  )


def num_rows(stream_len: int, seq_len: int) -> int:
  """Full rows of T inputs (plus one target past the end) in a stream."""
  return max(0, (stream_len - 1) // seq_len)
