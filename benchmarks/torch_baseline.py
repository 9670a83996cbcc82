"""The same Llama-style model and training step written plainly in PyTorch, as the baseline beside
`benchmarks/gpu.py`: fp32 master weights with bf16 autocast, `torch.compile` of forward + loss,
`scaled_dot_product_attention` (FlashAttention backend on CUDA), fused AdamW with global-norm
clipping, no activation checkpointing, full [B, L, V] logits. Shapes come from the meshtrain config,
FLOPs per token from meshtrain's formula (metrics.flops_per_token), so MFU compares like with like.
JAX is never imported here (it would take the GPU's memory).
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.core.metrics import flops_per_token, peak_flops


def rotary(x_BxLxNxK, cos_LxK2, sin_LxK2):
    """Rotate channel pairs (i, i + K/2), as models/base.py does."""
    x1, x2 = x_BxLxNxK.float().chunk(2, dim=-1)
    cos, sin = cos_LxK2[None, :, None, :], sin_LxK2[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x_BxLxNxK)


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        D, self.H, self.G, self.K, Fw = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
        self.attn_norm, self.mlp_norm = nn.RMSNorm(D, eps=m.norm_eps), nn.RMSNorm(D, eps=m.norm_eps)
        self.wq = nn.Linear(D, self.H * self.K, bias=False)
        self.wk = nn.Linear(D, self.G * self.K, bias=False)
        self.wv = nn.Linear(D, self.G * self.K, bias=False)
        self.wo = nn.Linear(self.H * self.K, D, bias=False)
        self.w_gate, self.w_up = nn.Linear(D, Fw, bias=False), nn.Linear(D, Fw, bias=False)
        self.w_down = nn.Linear(Fw, D, bias=False)

    def forward(self, x_BxLxD, cos, sin):
        B, L, _ = x_BxLxD.shape
        h = self.attn_norm(x_BxLxD)
        q = rotary(self.wq(h).view(B, L, self.H, self.K), cos, sin)
        k = rotary(self.wk(h).view(B, L, self.G, self.K), cos, sin)
        v = self.wv(h).view(B, L, self.G, self.K)
        k, v = (t.repeat_interleave(self.H // self.G, dim=2) for t in (k, v))
        ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x_BxLxD = x_BxLxD + self.wo(ctx.transpose(1, 2).reshape(B, L, self.H * self.K))
        h = self.mlp_norm(x_BxLxD)
        return x_BxLxD + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        self.embedding = nn.Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.num_layers))
        self.final_norm = nn.RMSNorm(m.d_model, eps=m.norm_eps)
        self.lm_head = None if m.tie_embeddings else nn.Linear(m.d_model, m.vocab_size, bias=False)
        nn.init.normal_(self.embedding.weight, std=0.02)  # as models/base.py: a tied head starts near ln V

    def forward(self, tokens_BxL):
        L, K = tokens_BxL.shape[1], self.m.head_dim
        inv_freq = self.m.rope_theta ** (-torch.arange(0, K, 2, device=tokens_BxL.device, dtype=torch.float32) / K)
        angle = torch.arange(L, device=tokens_BxL.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = angle.cos(), angle.sin()
        x = self.embedding(tokens_BxL)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.final_norm(x)
        return x @ self.embedding.weight.T if self.lm_head is None else self.lm_head(x)


def measure(cfg, steps: int) -> dict:
    m, t, o = cfg.model.resolved(), cfg.train, cfg.optim
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(t.seed)
    model = Llama(m).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                            weight_decay=o.weight_decay, fused=cuda)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.parallel.precision == "bf16")

    @torch.compile
    def loss_fn(tokens_BxL1):
        with autocast:
            logits = model(tokens_BxL1[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens_BxL1[:, 1:].flatten())

    def step(tokens):
        loss = loss_fn(tokens)
        loss.backward()
        if o.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens = torch.randint(0, m.vocab_size, (t.batch_size, t.seq_len + 1), device=device)
    # on CUDA: FlashAttention or an error, never a silent fallback to the math kernel
    flash = torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]) if cuda else nullcontext()
    with flash:
        started = time.perf_counter()
        step(tokens)
        sync()
        compile_s = time.perf_counter() - started
        step(tokens)
        sync()
        started = time.perf_counter()
        for _ in range(steps):
            loss = step(tokens)
        sync()
    step_s = (time.perf_counter() - started) / steps
    params = sum(p.numel() for p in model.parameters())
    matmul_params = params if m.tie_embeddings else params - model.embedding.weight.numel()
    per_token = flops_per_token(matmul_params, m.num_layers, m.num_heads * m.head_dim, t.seq_len)
    tokens_per_s = t.batch_size * t.seq_len / step_s
    kind = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_flops(kind)
    return {"device": kind, "step_ms": step_s * 1e3, "tokens_per_s": tokens_per_s,
            "tflops": tokens_per_s * per_token / 1e12, "mfu": tokens_per_s * per_token / peak if peak else None,
            "temp_gb": None, "args_gb": None,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "loss": float(loss), "compile_s": compile_s, "params_m": params / 1e6}
