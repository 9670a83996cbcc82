"""Packed documents and sliding windows: which keys a query sees.

A training window of L tokens is cut from a stream of documents, each followed by the tokenizer's
EOS (meshtrain/data/prepare.py appends it). With `data.document_mask` the attention of every backend
is masked at document boundaries: a token after an EOS starts a new document, so position i's
segment id is the number of EOS tokens before it (`documents`, a cumulative sum on the device: the
data pipeline is unchanged), and with `data.restart_positions` the rotary position of a token is
its offset in its document. The loss is unchanged (the EOS still predicts the next document's
first token, conditioned on its own document only).

Query i sees key j (true positions) iff j <= i (causal), i - window < j when `window` > 0
(sliding-window attention, Mistral / Gemma: Hugging Face's `sliding_window_overlay`,
transformers/masking_utils.py, keeps `kv_idx > q_idx - sliding_window`) and both carry the same
segment id (`visible`). Every query sees itself, so no softmax row is empty.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshtrain.core.errors import UserError


class Documents(NamedTuple):
    """Per token, in the model's storage order: `segments` [B, L] (int32, the document index inside
    the window) and `positions` [B, L] (the offset inside the document; None: the rotary
    embeddings keep the window's positions)."""
    segments: jax.Array
    positions: jax.Array | None


class Packing(NamedTuple):
    """How a training window is split into documents: at `eos_id`; `restart_positions`: rotary
    positions restart at 0 in each document."""
    eos_id: int
    restart_positions: bool = True

    def documents(self, inputs_BxL, sequence_order=None) -> Documents:
        """The `Documents` of the inputs [B, L] (true order), stored in `sequence_order`."""
        eos_BxL = (inputs_BxL == self.eos_id).astype(jnp.int32)
        segments = jnp.cumsum(eos_BxL, axis=1) - eos_BxL  # EOS tokens strictly before each position
        positions = None
        if self.restart_positions:
            index_L = jnp.arange(inputs_BxL.shape[1])
            last_eos = jax.lax.cummax(jnp.where(eos_BxL > 0, index_L, -1), axis=1)  # at or before i
            start = jnp.concatenate([jnp.zeros_like(last_eos[:, :1]), last_eos[:, :-1] + 1], axis=1)
            positions = index_L - start
        if sequence_order is not None:
            segments = segments[:, sequence_order]
            positions = None if positions is None else positions[:, sequence_order]
        return Documents(segments, positions)


def packing_of(dcfg, tokenizer_eos: int | None) -> Packing | None:
    """The Packing `dcfg` (the DataConfig) asks for, None without `data.document_mask`; the EOS id is
    `data.eos_id` where set, else the tokenizer's."""
    if not dcfg.document_mask:
        return None
    eos = dcfg.eos_id if dcfg.eos_id >= 0 else tokenizer_eos
    if eos is None:
        raise UserError("data.document_mask=true needs an EOS id and the tokenizer has none (the byte "
                        "tokenizer ends documents with a newline); set data.eos_id (e.g. 10 for bytes)")
    return Packing(int(eos), dcfg.restart_positions)


def visible(q_pos, k_pos, window: int = 0, q_seg=None, k_seg=None):
    """Whether a query at true position q_pos sees the key at k_pos (broadcasting): causal, within
    `window` (0: unlimited) and, given segment ids, in the same document."""
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    if q_seg is not None:
        mask &= q_seg == k_seg
    return mask


def block_reaches(q_first, k_last, window: int):
    """Whether any query of a block starting at q_first sees a key of one ending at k_last within
    `window` (0: always): the closest pair is q_first, k_last."""
    return True if not window else q_first - k_last < window
