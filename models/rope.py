"""Rotary position embeddings (Su et al., RoFormer): the inverse frequencies with the four scalings
a spec names (none, llama3, linear, yarn), YaRN's attention factor, and the rotation itself.
Hugging Face's rope entries are read and written in models/hf_llama.py.
"""
from __future__ import annotations

import math

import jax.numpy as jnp


def rope_frequencies(cfg, dim: int | None = None):
    """The rotary inverse frequencies [K/2] of `dim` rotated channels (default: head_dim): theta^(-2i/K)
    (Su et al., RoFormer); with rope_scaling=llama3, Llama 3.1's long-context rescaling: wavelengths
    2 pi / f longer than original_max_len / low_freq_factor are divided by `rope_factor`, shorter than
    original_max_len / high_freq_factor kept, and those between interpolated with
    s = (original_max_len / wavelength - low) / (high - low): f' = (1 - s) f / factor + s f; with
    rope_scaling=linear (position interpolation, Chen et al. 2023), every f / `rope_factor`; with
    rope_scaling=yarn (YaRN, Peng et al. 2023, as transformers computes it), channel i's r = i - lo over
    hi - lo clipped to [0, 1] gives f' = r f / factor + (1 - r) f, where lo (floored) and hi (ceiled)
    are the channels d(b) = K ln(original_max_len / (2 pi b)) / (2 ln theta) of b = beta_fast, beta_slow."""
    K = dim or cfg.head_dim
    inv_freq = cfg.rope_theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    if cfg.rope_scaling == "none":
        return inv_freq
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "yarn":
        turns = lambda b: K * math.log(cfg.rope_original_max_len / (b * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        lo, hi = max(math.floor(turns(cfg.rope_beta_fast)), 0), min(math.ceil(turns(cfg.rope_beta_slow)), K - 1)
        ramp = jnp.clip((jnp.arange(K // 2, dtype=jnp.float32) - lo) / ((hi - lo) if hi != lo else 0.001), 0, 1)
        return inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)
    low, high, factor = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
    wavelength = 2 * jnp.pi / inv_freq
    smooth = (cfg.rope_original_max_len / wavelength - low) / (high - low)
    scaled = jnp.where(wavelength > cfg.rope_original_max_len / low, inv_freq / factor, inv_freq)
    medium = (wavelength >= cfg.rope_original_max_len / high) & (wavelength <= cfg.rope_original_max_len / low)
    return jnp.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature m = 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg) -> float:
    """What rope scaling multiplies cos and sin by (so rotated q . k by its square): 1 but under yarn,
    m(rope_mscale) / m(rope_mscale_all_dim) when both are given, else m(1) (`yarn_mscale`)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def rotary(x_BxLxNxK, inv_freq_K2, positions=None, scale: float = 1.0):
    """Rotate channel pairs (i, i + K/2) by position x inv_freq[i] (`rope_frequencies`), times `scale`
    (`rope_attention_factor`). `positions`: each stored position's place in the sequence, [L] or per
    row [B, L] (None: 0..L-1)."""
    L = x_BxLxNxK.shape[1]
    positions = jnp.arange(L) if positions is None else jnp.asarray(positions)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq_K2  # [L, K/2] or [B, L, K/2]
    cos, sin = scale * jnp.cos(angle)[..., None, :], scale * jnp.sin(angle)[..., None, :]
    x1, x2 = jnp.split(x_BxLxNxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxK.dtype)
