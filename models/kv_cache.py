"""Decoding with a KV cache: attention of new queries over a cache of T positions, and writing
each row's new keys and values at its own position (models/base.py `Block.decode` and
`LanguageModel.decode` run them; meshtrain/generate.py drives them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cached_attention(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, positions_BxL, window: int | None = None,
                     scale: float | None = None):
    """Attention of L queries per row over a KV cache of T positions: each query sees the cache
    positions <= its own (`positions_BxL`), so what lies beyond a row's end is never read; with
    `window`, only the last `window` of them (sliding-window attention, Beltagy et al. 2020).
    fp32 scores and softmax, grouped-query, as `meshtrain.ops.attention.xla_attention`; scores x
    `scale` (default K^-1/2)."""
    pos_Bx1xLx1, cache_T = positions_BxL[:, None, :, None], jnp.arange(k_BxTxGxK.shape[1])
    mask_Bx1xLxT = cache_T <= pos_Bx1xLx1
    if window is not None:
        mask_Bx1xLxT &= cache_T > pos_Bx1xLx1 - window
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, mask=mask_Bx1xLxT, scale=scale)


def write_rows(cache_BxTx_, new_BxLx_, start_B):
    """The cache with each row's L new entries written at its own start position."""
    put = lambda c_Tx_, n_Lx_, s: jax.lax.dynamic_update_slice_in_dim(c_Tx_, n_Lx_, s, 0)
    return jax.vmap(put)(cache_BxTx_, new_BxLx_.astype(cache_BxTx_.dtype), start_B)
