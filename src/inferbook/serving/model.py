"""A tiny decoder-only transformer a reader can hold in their head.

RoPE, RMSNorm, SwiGLU, grouped-query attention, and a dense KV cache with static shapes
(so `torch.compile` traces prefill and decode once). Weights are saved and loaded with
safetensors only. Two attention backends — `sdpa` (PyTorch's fused attention) and `math`
(explicit softmax) — and an optional INT8 weight-only quantization exist so that records
can show the backend and quantization that actually ran.

Shapes: tokens [B, S] int64; logits [B, S, vocab]; KV cache [layers, B, kv_heads, max_seq, head_dim].
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..device import synchronize
from ..errors import UserError

ATTENTION_BACKENDS = ("sdpa", "math")


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 176
    max_seq: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        check_model_sizes(self, ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn", "max_seq"))
        if self.d_model % self.n_heads:
            raise UserError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise UserError(f"head dim d_model/n_heads = {self.d_model}/{self.n_heads} = {self.head_dim} must be even "
                            "(RoPE rotates pairs of dimensions)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_params(self) -> int:
        d, f, kv = self.d_model, self.ffn, self.n_kv_heads * self.head_dim
        per_layer = d * d * 2 + d * kv * 2 + 3 * d * f + 2 * d
        return self.vocab * d * 2 + self.n_layers * per_layer + d


def check_model_sizes(cfg, sizes: tuple[str, ...]) -> None:
    """A model config's sizes are ints >= 1 and its rope_theta and norm_eps finite and > 0, else
    one UserError naming the field (zero heads would divide by zero, a NaN eps poisons every norm)."""
    import math

    for k in sizes:
        v = getattr(cfg, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"model config {k}={v!r} must be an int >= 1")
    for k in ("rope_theta", "norm_eps"):
        v = getattr(cfg, k, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise UserError(f"model config {k}={v!r} must be a finite number > 0")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(cfg: TinyConfig, device, dtype=torch.float32):
    """cos, sin: [max_seq, head_dim/2] for rotary embeddings."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim))
    t = torch.arange(cfg.max_seq, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: [B, H, S, D]; cos/sin: [S, D/2]. Rotates (even, odd) pairs in float32."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    c, s = cos[None, None], sin[None, None]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Int8Linear(nn.Module):
    """Weight-only INT8 linear: per-output-channel symmetric scales, dequantized on the fly."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0
        self.register_buffer("qweight", torch.round(w / scale).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def forward(self, x):
        return F.linear(x, self.qweight.to(x.dtype) * self.scale)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig, backend: str):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        kv = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, positions, cos, sin, k_cache, v_cache):
        """x [B, S, d]; positions [S] int64; k_cache/v_cache [B, Hkv, T, D] updated in place."""
        cfg = self.cfg
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos[positions], sin[positions]), apply_rope(k, cos[positions], sin[positions])
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        rep = cfg.n_heads // cfg.n_kv_heads
        keys = k_cache.repeat_interleave(rep, dim=1)
        values = v_cache.repeat_interleave(rep, dim=1)
        # Static-shape causal mask over the whole cache: key j visible to query i iff j <= pos_i.
        key_pos = torch.arange(k_cache.shape[2], device=x.device)
        mask = key_pos[None, :] <= positions[:, None]  # [S, T]
        if self.backend == "sdpa":
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        else:
            scores = (q.float() @ keys.float().transpose(-1, -2)) / cfg.head_dim ** 0.5
            scores = scores.masked_fill(~mask, float("-inf"))
            out = (scores.softmax(-1) @ values.float()).to(q.dtype)
        return self.wo(out.transpose(1, 2).reshape(B, S, cfg.d_model))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig, backend: str):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, backend)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.w_down = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x, positions, cos, sin, k_cache, v_cache):
        x = x + self.attn(self.attn_norm(x), positions, cos, sin, k_cache, v_cache)
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class TinyDecoder(nn.Module):
    def __init__(self, cfg: TinyConfig, attention: str = "sdpa"):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {attention!r} unknown; choose one of {ATTENTION_BACKENDS}")
        self.cfg, self.attention = cfg, attention
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def quantization(self) -> str:
        return "int8 weight-only (per-channel)" if any(isinstance(m, Int8Linear) for m in self.modules()) \
            else f"none ({next(self.parameters()).dtype})".replace("torch.", "")

    def new_cache(self, batch: int):
        cfg, p = self.cfg, next(self.parameters())
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
        return torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device)

    def forward(self, tokens, positions, k_cache, v_cache):
        """tokens [B, S], positions [S] -> logits [B, S, vocab] (fp32). Writes the KV cache."""
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.cos, self.sin, k_cache[i], v_cache[i])
        return self.lm_head(self.norm(x)).float()


def init_weights(model: TinyDecoder, seed: int) -> TinyDecoder:
    """Deterministic random weights (no checkpoints can be downloaded here)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return model


def quantize_int8_(model: TinyDecoder) -> TinyDecoder:
    """Replace every projection (not embeddings) with an INT8 weight-only linear, in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model


TARGET_KIND = "target"
TARGET_CONFIG_FIELDS = ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn", "max_seq")


def save_weights(model: TinyDecoder, path: str | Path) -> str:
    """Save with safetensors (atomically; kind, role, config and digest in the metadata:
    `weights.save_model_file`); returns the 'model revision': `record.tensors_revision` of the weights."""
    from .weights import save_model_file

    return save_model_file(path, model.state_dict(), model.cfg, kind=TARGET_KIND)


def load_weights(path: str | Path, device, dtype=torch.float32, attention: str = "sdpa",
                 rebuild: str | None = None) -> TinyDecoder:
    """Build the model from a safetensors file's config metadata and load its weights strictly:
    a file with missing, renamed, extra, wrongly shaped or non-finite tensors, an impossible config,
    another kind or role, or tensors that do not match its digest is refused by name. A missing
    file names `rebuild`, the command that makes it."""
    from .weights import load_model_file, model_config, open_model_file

    meta, _ = open_model_file(path, kind=TARGET_KIND, rebuild=rebuild)
    cfg = model_config(TinyConfig, meta, path, kind=TARGET_KIND, required=TARGET_CONFIG_FIELDS)
    model = TinyDecoder(cfg, attention)
    load_model_file(model, path, meta, kind=TARGET_KIND)
    return model.to(device=device, dtype=dtype).eval()


@dataclass
class GenerationTimes:
    ttft_s: float
    decode_s: float
    total_s: float


@torch.no_grad()
def generate(step_prefill, step_decode, model: TinyDecoder, prompt, new_tokens: int):
    """Greedy generation. `step_prefill`/`step_decode` are the (possibly compiled) forwards.

    prompt [B, S] -> (tokens [B, new_tokens], GenerationTimes). TTFT covers prefill and the
    first sampled token; decode covers the remaining new_tokens - 1 steps.
    """
    device = prompt.device
    B, S = prompt.shape
    if S + new_tokens > model.cfg.max_seq:
        raise ValueError(f"prompt ({S}) + new tokens ({new_tokens}) exceed max_seq={model.cfg.max_seq}")
    k_cache, v_cache = model.new_cache(B)
    out = torch.empty(B, new_tokens, dtype=torch.long, device=device)
    synchronize(device)
    t0 = time.perf_counter()
    logits = step_prefill(prompt, torch.arange(S, device=device), k_cache, v_cache)
    out[:, 0] = logits[:, -1].argmax(-1)
    synchronize(device)
    t1 = time.perf_counter()
    for i in range(1, new_tokens):
        pos = torch.tensor([S + i - 1], device=device)
        logits = step_decode(out[:, i - 1:i], pos, k_cache, v_cache)
        out[:, i] = logits[:, -1].argmax(-1)
    synchronize(device)
    t2 = time.perf_counter()
    return out, GenerationTimes(ttft_s=t1 - t0, decode_s=t2 - t1, total_s=t2 - t0)


@torch.no_grad()
def reference_logits(model: TinyDecoder, tokens):
    """Logits of every position from one full forward (no incremental cache): the check for decode."""
    k, v = model.new_cache(tokens.shape[0])
    return model(tokens, torch.arange(tokens.shape[1], device=tokens.device), k, v)
