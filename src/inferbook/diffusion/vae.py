"""A causal video VAE decoder in the style of public video VAEs (Wan 2.1's decoder, simplified).

    latent [B, z, T, h, w] -> conv_in -> mid (res, attention + feed-forward, res)
        -> stages of residual blocks with 2x spatial (and 2x temporal) upsampling
        -> norm -> SiLU -> conv_out -> video [B, 3, 1 + 4 (T - 1), 8 h, 8 w]   (with 3 upsamplings)

- Causal 3D convolution: time is padded with k_t - 1 *past* frames only, so frame t never sees t + 1.
- Norms: channel RMSNorm (per pixel, over C) or GroupNorm(32) (over C/32 x T x H x W), chosen per decoder.
- Residual block: norm -> SiLU -> conv -> norm -> SiLU -> conv, plus the shortcut. The block returns its
  two summands *unsummed* (`Pending`): the next operation adds them, fused with its own norm when the
  backend is 'fused' (one pass writes y = a + b and the next conv's padded input).
- The mid block's attention and feed-forward use the linear interface with RMSNorm / SwiGLU / residual
  parameters (`Ops.linear`); a decoder quantized by `quantize_decoder_int8()` uses INT8 attention.

Weights are random, drawn from a seed (no checkpoints can be downloaded here); init keeps activations
O(1) through the depth. Backends: `decoder(z, ops=Ops('eager'|'fused'))`, and torch.compile of the eager
forward (`compiled_decoder`).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fused import NORMS, Norm, Ops


@dataclass(frozen=True)
class VAEConfig:
    z_dim: int = 16
    channels: tuple = (384, 384, 192, 96)   # width of each stage, bottleneck first
    temporal_up: tuple = (True, True, False)  # temporal 2x at each of the len(channels)-1 upsamplings
    res_blocks: int = 1                     # residual blocks per stage
    norm: str = "rms"                       # 'rms' or 'group'
    groups: int = 32
    attention: bool = True
    ffn_mult: int = 2
    eps: float = 1e-6

    def __post_init__(self):
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if len(self.temporal_up) != len(self.channels) - 1:
            raise ValueError(f"temporal_up needs {len(self.channels) - 1} entries (one per upsampling), "
                             f"got {len(self.temporal_up)}")
        if any(c <= 0 for c in self.channels) or self.z_dim <= 0 or self.res_blocks < 1:
            raise ValueError(f"channels, z_dim and res_blocks must be positive, got {self.channels}, "
                             f"{self.z_dim}, {self.res_blocks}")
        if self.norm == "group" and any(c % self.groups for c in self.channels):
            raise ValueError(f"GroupNorm({self.groups}) needs every stage width divisible by {self.groups}, "
                             f"got {self.channels}")

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.channels) - 1)

    def output_shape(self, latent_shape) -> tuple:
        B, _, T, h, w = latent_shape
        for up in self.temporal_up:
            if up:
                T = 2 * T - 1
        return (B, 3, T, h * self.spatial_factor, w * self.spatial_factor)


class Pending:
    """A residual sum a + b not yet computed: the consumer adds it, fused with its norm if it can."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor | None = None):
        self.a, self.b = a, b

    def value(self) -> torch.Tensor:
        return self.a if self.b is None else self.a + self.b


def _as_pending(x) -> Pending:
    return x if isinstance(x, Pending) else Pending(x)


class ChannelNorm(nn.Module):
    def __init__(self, kind: str, C: int, eps: float, groups: int):
        super().__init__()
        self.kind, self.eps, self.groups = kind, eps, groups
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C))

    def spec(self) -> Norm:
        return Norm(self.kind, self.weight, self.bias, self.eps, self.groups)


class CausalConv3d(nn.Module):
    """Conv3d over an input that the caller has already padded: `pad` = (past frames, rows, columns)."""

    def __init__(self, cin: int, cout: int, k=(3, 3, 3)):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, *k))
        self.bias = nn.Parameter(torch.zeros(cout))
        self.pad = (k[0] - 1, k[1] // 2, k[2] // 2)

    def forward_padded(self, xp: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.conv3d(xp, self.weight, self.bias)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        pt, ph, pw = self.pad
        return self.forward_padded(F.pad(x, (pw, pw, ph, ph, pt, 0)), ops)


def norm_silu_pad(ops: Ops, x, norm: ChannelNorm, pad) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, padded): y is the materialized input (needed for a shortcut), padded the conv's input."""
    p = _as_pending(x)
    if p.b is None:
        return p.a, ops.norm_silu_pad(p.a, norm.spec(), pad)
    return ops.add_norm_silu_pad(p.a, p.b, norm.spec(), pad)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, cfg: VAEConfig):
        super().__init__()
        self.norm1 = ChannelNorm(cfg.norm, cin, cfg.eps, cfg.groups)
        self.conv1 = CausalConv3d(cin, cout)
        self.norm2 = ChannelNorm(cfg.norm, cout, cfg.eps, cfg.groups)
        self.conv2 = CausalConv3d(cout, cout)
        self.shortcut = CausalConv3d(cin, cout, (1, 1, 1)) if cin != cout else None

    def forward(self, x, ops: Ops) -> Pending:
        y, hp = norm_silu_pad(ops, x, self.norm1, self.conv1.pad)
        h = self.conv1.forward_padded(hp, ops)
        _, hp = norm_silu_pad(ops, h, self.norm2, self.conv2.pad)
        h = self.conv2.forward_padded(hp, ops)
        short = y if self.shortcut is None else self.shortcut.forward_padded(y, ops)
        return Pending(h, short)


def int8_quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8: w ~= q * scale, q int8 [N, K], scale fp32 [N, 1]."""
    scale = w.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.clamp(torch.round(w.float() / scale), -127, 127).to(torch.int8), scale


def int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Single-head attention with Q and K quantized per token to INT8, scores from the integer product.

    q, k, v [N, L, D]. The integer product is exact in fp32 while D * 127^2 < 2^24 (D <= 1040); beyond
    that it is computed in float64 (or torch._int_mm on a GPU build that has it)."""
    qi, qs = int8_quantize_rows(q)
    ki, ks = int8_quantize_rows(k)
    D = q.shape[-1]
    acc_dtype = torch.float32 if D * 127 * 127 < 2 ** 24 else torch.float64
    s = torch.matmul(qi.to(acc_dtype), ki.to(acc_dtype).transpose(-1, -2)).float()
    s = s * qs * ks.transpose(-1, -2) / math.sqrt(D)
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v)


class AttentionFFN(nn.Module):
    """Per-frame spatial self-attention (single head, as in Wan's decoder) and a SwiGLU feed-forward,
    both through the linear interface with RMSNorm / SwiGLU / residual parameters."""

    def __init__(self, C: int, cfg: VAEConfig):
        super().__init__()
        self.C, self.eps = C, cfg.eps
        F_ = cfg.ffn_mult * C
        self.norm_attn = nn.Parameter(torch.ones(C))
        self.w_qkv = nn.Parameter(torch.empty(3 * C, C))
        self.w_o = nn.Parameter(torch.empty(C, C))
        self.norm_ffn = nn.Parameter(torch.ones(C))
        self.w_up = nn.Parameter(torch.empty(2 * F_, C))   # rows :F gate, F: up
        self.w_down = nn.Parameter(torch.empty(C, F_))
        self.quantization = "none"

    def forward(self, x, ops: Ops) -> torch.Tensor:
        x = _as_pending(x).value()
        B, C, T, H, W = x.shape
        tok = x.permute(0, 2, 3, 4, 1).reshape(B * T, H * W, C)
        if self.quantization == "int8":
            w_qkv = self.w_qkv_q.to(x.dtype) * self.w_qkv_s.to(x.dtype)
            w_o = self.w_o_q.to(x.dtype) * self.w_o_s.to(x.dtype)
        else:
            w_qkv, w_o = self.w_qkv, self.w_o
        qkv = ops.linear(tok, w_qkv, norm_weight=self.norm_attn, eps=self.eps, name="attn.qkv")
        q, k, v = qkv.split(C, dim=-1)
        if self.quantization == "int8":
            ops.log.note("attention", "int8 Q/K (per-token scales)", "decoder quantized by quantize_decoder_int8()",
                         {"q": tuple(q.shape)}, x.dtype)
            o = int8_attention(q, k, v)
        else:
            ops.log.note("attention", "torch sdpa", "decoder not quantized: attention keeps the activation dtype",
                         {"q": tuple(q.shape)}, x.dtype)
            o = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)).squeeze(1)
        tok = ops.linear(o, w_o, residual=tok, name="attn.out")
        h = ops.linear(tok, self.w_up, norm_weight=self.norm_ffn, eps=self.eps, swiglu=True, name="ffn.up")
        tok = ops.linear(h, self.w_down, residual=tok, name="ffn.down")
        return tok.reshape(B, T, H, W, C).permute(0, 4, 1, 2, 3).contiguous()


class Upsample(nn.Module):
    """2x nearest in space then a (1,3,3) conv; with `temporal`, a causal (3,1,1) conv to 2C channels
    whose halves become frames 2t and 2t+1, the first frame dropped (T -> 2T - 1, as in Wan)."""

    def __init__(self, C: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.time_conv = CausalConv3d(C, 2 * C, (3, 1, 1)) if temporal else None
        self.conv = CausalConv3d(C, C, (1, 3, 3))

    def forward(self, x, ops: Ops) -> torch.Tensor:
        x = _as_pending(x).value()
        if self.temporal:
            B, C, T, H, W = x.shape
            t = self.time_conv(x, ops).view(B, 2, C, T, H, W)
            x = t.permute(0, 2, 3, 1, 4, 5).reshape(B, C, 2 * T, H, W)[:, :, 1:]
        x = F.interpolate(x, scale_factor=(1, 2, 2), mode="nearest")
        return self.conv(x, ops)


class VideoVAEDecoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg
        ch = cfg.channels
        self.conv_in = CausalConv3d(cfg.z_dim, ch[0])
        self.mid1 = ResBlock(ch[0], ch[0], cfg)
        self.mid_attn = AttentionFFN(ch[0], cfg) if cfg.attention else None
        self.mid2 = ResBlock(ch[0], ch[0], cfg)
        blocks = []
        cin = ch[0]
        for i, c in enumerate(ch):
            for _ in range(cfg.res_blocks):
                blocks.append(ResBlock(cin, c, cfg))
                cin = c
            if i < len(ch) - 1:
                blocks.append(Upsample(c, cfg.temporal_up[i]))
        self.blocks = nn.ModuleList(blocks)
        self.norm_out = ChannelNorm(cfg.norm, ch[-1], cfg.eps, cfg.groups)
        self.conv_out = CausalConv3d(ch[-1], 3)

    @property
    def quantization(self) -> str:
        return "int8 attention (per-row weights, per-token Q/K)" if (
            self.mid_attn is not None and self.mid_attn.quantization == "int8") else "none"

    def forward(self, z: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
        """z [B, z_dim, T, h, w] -> video [B, 3, T', 8h, 8w] in z.dtype (values roughly in [-1, 1])."""
        ops = ops if ops is not None else Ops("eager")
        if z.dim() != 5 or z.shape[1] != self.cfg.z_dim:
            raise ValueError(f"latent must be [B, {self.cfg.z_dim}, T, h, w], got {tuple(z.shape)}")
        x = self.conv_in(z, ops)
        x = self.mid1(x, ops)
        if self.mid_attn is not None:
            x = self.mid_attn(x, ops)
        x = self.mid2(x, ops)
        for blk in self.blocks:
            x = blk(x, ops)
        _, hp = norm_silu_pad(ops, x, self.norm_out, self.conv_out.pad)
        return self.conv_out.forward_padded(hp, ops)


def init_decoder(cfg: VAEConfig, seed: int, *, device="cpu", dtype=torch.float32) -> VideoVAEDecoder:
    """Random weights from `seed`, scaled so activations stay O(1) through the depth."""
    g = torch.Generator().manual_seed(seed)
    dec = VideoVAEDecoder(cfg)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # norm gains
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                gain = 0.5 if ("conv2" in name or "w_o" in name or "w_down" in name) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    return dec.to(device=device, dtype=dtype).eval().requires_grad_(False)


def quantize_decoder_int8(decoder: VideoVAEDecoder) -> VideoVAEDecoder:
    """A copy of `decoder` whose attention runs in INT8 (weights per row, Q/K per token).

    The only way to get INT8 attention: a decoder in bf16/fp32 never switches precision on its own.
    The original is left unchanged."""
    if not isinstance(decoder, VideoVAEDecoder):
        raise ValueError(f"quantize_decoder_int8 needs a VideoVAEDecoder, got {type(decoder).__name__}")
    if decoder.mid_attn is None:
        raise ValueError("this decoder has no attention block (cfg.attention=False): nothing to quantize")
    if decoder.mid_attn.quantization == "int8":
        raise ValueError("decoder is already INT8-quantized")
    q = copy.deepcopy(decoder)
    a = q.mid_attn
    for name in ("w_qkv", "w_o"):
        w = getattr(a, name)
        qi, s = int8_quantize_rows(w.data)
        a.register_buffer(f"{name}_q", qi)
        a.register_buffer(f"{name}_s", s.to(w.dtype))
        delattr(a, name)
        setattr(a, name, None)
    a.quantization = "int8"
    return q


def compiled_decoder(decoder: VideoVAEDecoder):
    """torch.compile of the eager forward (the 'compile' backend); compiled once per shape."""
    compiled = torch.compile(lambda z: decoder(z, Ops("eager", log=_NullLog())), dynamic=False)
    return compiled


class _NullLog:
    """Compiled graphs must not call back into Python logging; the backend is recorded by the caller."""

    def note(self, *a, **k):
        pass


def make_latent(cfg: VAEConfig, shape, seed: int, *, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """A fresh random latent [B, z_dim, T, h, w] (standard normal, as a denoiser's output roughly is)."""
    if len(shape) != 4:
        raise ValueError(f"latent shape must be (B, T, h, w), got {shape!r}")
    g = torch.Generator().manual_seed(seed)
    B, T, h, w = shape
    return torch.randn(B, cfg.z_dim, T, h, w, generator=g).to(device=device, dtype=dtype)


def decoder_fp64_reference(decoder: VideoVAEDecoder, z: torch.Tensor) -> torch.Tensor:
    """The same decoder in float64 on the CPU (eager): the yardstick for every backend's error."""
    ref = copy.deepcopy(decoder).to(device="cpu", dtype=torch.float64)
    with torch.no_grad():
        return ref(z.detach().to("cpu", torch.float64), Ops("eager"))
