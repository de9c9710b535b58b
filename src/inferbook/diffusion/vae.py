"""The H3 video VAE's shape, and a causal convolutional decoder built from the same blocks.

ComfyUI's `comfy/ldm/minimax/vae.py` (MiniMax-H3) is a **3D causal CNN encoder** and a **ViT3D decoder**:

    video [B, 3, T, H, W] -> H3Encoder: conv_in -> levels of ResnetBlock3D (+ Downsample3D) -> norm_out -> conv_out
        -> moments [B, 2z, T', H/16, W/16]                       (the fused norm + SiLU + pad convs live here)
    latent [B, z, T', h, w] -> ViT3DDecoder: one token per latent pixel (+ register tokens) -> transformer
        blocks (RMSNorm-prologue linears, per-head RMSNorm + RoPE on q/k, SwiGLU FFN, scaled residuals)
        -> LayerNorm -> linear to patch_t x p x p pixels -> video [B, 3, patch_t T', p h, p w]

- CausalConv3d (ComfyUI's): reflect padding in space, `kt - 1` zero frames in front in time (none for a
  single frame, where the conv drops its zero taps instead), the pre-norm + SiLU + padding done by one
  `Ops.norm_silu_pad` pass (NDHWC out), and the residual added in the conv's epilogue.
- Norm: TemporalIsolatedGroupNorm (GroupNorm(32) whose statistics are one frame's), or a per-pixel channel
  RMSNorm for the small toy decoders whose widths are not multiples of 32.
- The ViT decoder's linears go through `Ops.linear` (ComfyUI's `linear_input_act`); `quantize_decoder_int8`
  returns a copy whose linears are W8A8 INT8 matmuls and whose attention scores are an INT8 matmul.

`VideoVAEDecoder` is a causal *convolutional* decoder (Wan 2.1's layout, simplified) made of the same
CausalConv3d / ResnetBlock3D: the tiled-decode chapter and the workflow toys use it because its cost and
memory grow with the tile like a conv decoder's. It is not H3's decoder.

Weights are random, drawn from a seed (no checkpoints can be downloaded here); init keeps activations
O(1) through the depth.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError
from .fused import NORMS, Norm, Ops, triton_usable
from .int8 import (INT8_GEMM, INT8_KERNELS, int8_attention_eager, int8_attention_triton, int8_linear_eager,
                   int8_linear_triton, int_mm, quantize_rows)


# ---------------------------------------------------------------------------------------------------
# Blocks shared by the encoder and the conv decoder (ComfyUI's CausalConv3d, ResnetBlock3D, Downsample3D).

class ChannelNorm(nn.Module):
    def __init__(self, kind: str, C: int, eps: float, groups: int):
        super().__init__()
        self.kind, self.eps, self.groups = kind, eps, groups
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C))

    def spec(self) -> Norm:
        return Norm(self.kind, self.weight, self.bias, self.eps, self.groups)


class CausalConv3d(nn.Module):
    """ComfyUI's CausalConv3d: `padding` (pt, ph, pw) means reflect (pw, pw, ph, ph) in space and 2*pt zero
    frames in front; `forward(x, ops, pre_norm=, spatial_pad=, residual=)` folds the norm + SiLU + padding
    into one pass and the residual into the conv's epilogue."""

    def __init__(self, cin: int, cout: int, k=(3, 3, 3), stride=1, padding=None):
        super().__init__()
        k = (k,) * 3 if isinstance(k, int) else tuple(k)
        self.kernel = k
        self.weight = nn.Parameter(torch.empty(cout, cin, *k))
        self.bias = nn.Parameter(torch.zeros(cout))
        self.stride = stride
        self.causal_padding = tuple(padding) if padding is not None else (k[0] // 2, k[1] // 2, k[2] // 2)

    def forward(self, x: torch.Tensor, ops: Ops, pre_norm: ChannelNorm | None = None, spatial_pad=None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        pt, ph, pw = self.causal_padding
        sp = tuple(spatial_pad) if spatial_pad is not None else (pw, pw, ph, ph)
        T = x.shape[2]
        front = 0 if T == 1 else 2 * pt
        pad = (*sp, front)
        if pre_norm is not None or any(pad):  # the 1x1 shortcut has nothing to fold
            x = ops.norm_silu_pad(x, pre_norm.spec() if pre_norm is not None else None, pad,
                                  silu=pre_norm is not None)
        w = self.weight
        if T == 1 and pt:
            w = w[:, :, -1:]  # single frame: the front taps would only see zeros ('causal_zero')
        return ops.conv3d(x, w, self.bias, self.stride, residual)


class ResBlock(nn.Module):
    """ComfyUI's ResnetBlock3D: conv1(norm1 -> SiLU -> pad), conv2(norm2 -> SiLU -> pad) + shortcut, the
    shortcut added in conv2's epilogue."""

    def __init__(self, cin: int, cout: int, norm: str, eps: float = 1e-6, groups: int = 32):
        super().__init__()
        self.norm1 = ChannelNorm(norm, cin, eps, groups)
        self.conv1 = CausalConv3d(cin, cout)
        self.norm2 = ChannelNorm(norm, cout, eps, groups)
        self.conv2 = CausalConv3d(cout, cout)
        self.shortcut = CausalConv3d(cin, cout, (1, 1, 1)) if cin != cout else None

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        h = self.conv1(x, ops, pre_norm=self.norm1)
        short = x if self.shortcut is None else self.shortcut(x, ops)
        return self.conv2(h, ops, pre_norm=self.norm2, residual=short)


class Downsample3D(nn.Module):
    """ComfyUI's Downsample3D: a 3x3x3 conv with stride (time, space, space); for a spatial stride 2 the
    reflect padding is one column right and one row below only."""

    def __init__(self, cin: int, cout: int, time_stride: int, space_stride: int):
        super().__init__()
        self.space_stride = space_stride
        self.conv = CausalConv3d(cin, cout, 3, stride=(time_stride, space_stride, space_stride), padding=(1, 0, 0))

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return self.conv(x, ops, spatial_pad=(0, 1, 0, 1) if self.space_stride == 2 else None)


# ---------------------------------------------------------------------------------------------------
# The H3 encoder (EncoderFCN3D) and ViT3D decoder.

@dataclass(frozen=True)
class H3Config:
    """The H3 VAE's shape at a chosen width. ComfyUI's: ch 128, ch_mult (1, 2, 2, 4, 4, 8), 2 res blocks,
    space_down (2, 2, 2, 2, 1, 1), time_down (1, 2, 2, 1, 1, 1), z 24 (48 moments); decoder 36 layers,
    32 heads x 64, FFN x4, 4 register tokens, RoPE on 3/4 of each head, patch 16 x 16 x 4."""

    in_channels: int = 3
    ch: int = 32
    ch_mult: tuple = (1, 2, 2, 4)
    num_res_blocks: int = 1
    space_down: tuple = (2, 2, 2, 2)
    time_down: tuple = (1, 2, 2, 1)
    z_dim: int = 24
    norm: str = "group"
    groups: int = 32
    heads: int = 4
    dim_head: int = 32
    layers: int = 2
    ffn_mult: int = 4
    register_tokens: int = 4
    rope_dim_ratio: float = 0.75
    rope_theta: float = 100.0
    eps: float = 1e-5
    norm_eps: float = 1e-6

    def __post_init__(self):
        _check_choice("norm", self.norm, NORMS)
        n = len(self.ch_mult)
        if len(self.space_down) != n or len(self.time_down) != n:
            raise UserError(f"space_down and time_down need {n} entries (one per level), got "
                            f"{self.space_down}, {self.time_down}")
        widths = [self.ch * m for m in self.ch_mult]
        if self.norm == "group" and any(c % self.groups for c in widths):
            raise UserError(f"GroupNorm({self.groups}) needs every level width divisible by {self.groups}, got {widths}")
        if self.dim_head % 2 or int(self.dim_head * self.rope_dim_ratio) % 6:
            raise UserError(f"dim_head {self.dim_head} x rope_dim_ratio {self.rope_dim_ratio} must split into "
                            "3 axes of (cos, sin) pairs")

    @property
    def widths(self) -> list[int]:
        return [self.ch * m for m in self.ch_mult]

    @property
    def patch(self) -> int:
        return math.prod(self.space_down)

    @property
    def patch_t(self) -> int:
        return math.prod(self.time_down)

    @property
    def dim(self) -> int:
        return self.heads * self.dim_head


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise UserError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


class H3Encoder(nn.Module):
    """EncoderFCN3D: where the fused norm + SiLU + pad convolutions are. video -> moments [B, 2z, T', h, w]."""

    def __init__(self, cfg: H3Config):
        super().__init__()
        self.cfg = cfg
        w = cfg.widths
        self.conv_in = CausalConv3d(cfg.in_channels, w[0])
        self.levels = nn.ModuleList()
        cin = w[0]
        for i, c in enumerate(w):
            lvl = nn.Module()
            lvl.blocks = nn.ModuleList()
            for _ in range(cfg.num_res_blocks):
                lvl.blocks.append(ResBlock(cin, c, cfg.norm, cfg.norm_eps, cfg.groups))
                cin = c
            lvl.down = (Downsample3D(c, c, cfg.time_down[i], cfg.space_down[i])
                        if cfg.space_down[i] * cfg.time_down[i] > 1 else None)
            self.levels.append(lvl)
        self.norm_out = ChannelNorm(cfg.norm, w[-1], cfg.norm_eps, cfg.groups)
        self.conv_out = CausalConv3d(w[-1], 2 * cfg.z_dim)

    def forward(self, x: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
        ops = ops if ops is not None else Ops("eager")
        if x.dim() != 5 or x.shape[1] != self.cfg.in_channels:
            raise UserError(f"video must be [B, {self.cfg.in_channels}, T, H, W], got {tuple(x.shape)}")
        h = self.conv_in(x, ops)
        for lvl in self.levels:
            for blk in lvl.blocks:
                h = blk(h, ops)
            if lvl.down is not None:
                h = lvl.down(h, ops)
        return self.conv_out(h, ops, pre_norm=self.norm_out)

    def output_shape(self, video_shape) -> tuple:
        B, _, T, H, W = video_shape
        for ts, ss in zip(self.cfg.time_down, self.cfg.space_down):
            if ts == 2 and T > 1:
                T = (T - 1) // 2 + 1
            if ss == 2:
                H, W = (H - 2) // 2 + 1, (W - 2) // 2 + 1
        return (B, 2 * self.cfg.z_dim, T, H, W)


def token_ids(T: int, H: int, W: int, device, dtype=torch.float32, full=None, offset=(0, 0, 0)) -> torch.Tensor:
    """ComfyUI's create_token_ids: each axis' coordinates (i + 0.5) / n mapped to [-1, 1]; [T*H*W, 3]. A tile
    or chunk passes the whole grid `full` (T, H, W) and its `offset`, so its tokens keep the positions they have
    in the untiled decode (ComfyUI #15548: local [-1, 1] per tile textured every tile alike)."""
    full = (T, H, W) if full is None else full
    axes = [2.0 * (torch.arange(o + 0.5, o + n, device=device, dtype=torch.float32)[:n] / f) - 1.0
            for n, f, o in zip((T, H, W), full, offset)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3).to(dtype)


def rope_angles(ids: torch.Tensor, rot_dim: int, theta: float) -> torch.Tensor:
    """RotaryEmbeddingND: angles [S, rot_dim / 2] = 2 pi * coord_axis * inv_freq, the three axes' pairs
    concatenated (inv_freq = theta^-arange(0, 1, 6 / rot_dim))."""
    inv = 1.0 / theta ** torch.arange(0, 1, 2 * 3 / rot_dim, dtype=torch.float32, device=ids.device)
    return (2.0 * math.pi * ids.float()[:, :, None] * inv[None, None, :]).flatten(1)


# The INT8 path lives in `int8.py`; these names stay for the chapters and tests that import them from here.
int8_quantize_rows = quantize_rows
int8_linear = int8_linear_eager


class ViTBlock(nn.Module):
    """TransformerBlock: x + s1 * Attn(RMSNorm(x)), then + s2 * FFN(RMSNorm(x)), each through `Ops.linear`."""

    def __init__(self, cfg: H3Config):
        super().__init__()
        d, F_ = cfg.dim, cfg.ffn_mult * cfg.dim
        self.cfg = cfg
        self.norm1 = nn.Parameter(torch.ones(d))
        self.to_qkv = nn.Parameter(torch.empty(3 * d, d))
        self.qkv_bias = nn.Parameter(torch.zeros(3 * d))
        self.to_out = nn.Parameter(torch.empty(d, d))
        self.out_bias = nn.Parameter(torch.zeros(d))
        self.scale1 = nn.Parameter(torch.empty(d))
        self.norm2 = nn.Parameter(torch.ones(d))
        self.w1 = nn.Parameter(torch.empty(2 * F_, d))     # rows :F gate, F: up
        self.w1_bias = nn.Parameter(torch.zeros(2 * F_))
        self.w2 = nn.Parameter(torch.empty(d, F_))
        self.w2_bias = nn.Parameter(torch.zeros(d))
        self.scale2 = nn.Parameter(torch.empty(d))
        self.quantization = "none"

    def _linear(self, ops: Ops, x, name, **kw):
        return ops.linear(x, getattr(self, name), name=name, **kw)

    def _int8_linear(self, ops: Ops, x, name, bias, *, act="none", norm_weight=None, residual=None,
                     residual_scale=None):
        """ComfyUI's `linear_input_act` on an INT8 weight: the input activation (RMSNorm or SwiGLU) and the
        per-token quantization before the INT8 GEMM, the scales, bias and addcmul after it. The Triton kernels
        under Ops('fused') where Triton runs, else the PyTorch reference with `torch._int_mm`."""
        use_triton = ops.backend == "fused" and triton_usable(x)[0]
        fn = int8_linear_triton if use_triton else int8_linear_eager
        y, how = fn(x, getattr(self, f"{name}_q"), getattr(self, f"{name}_s"), bias, act=act, norm_weight=norm_weight,
                    eps=self.cfg.eps, residual=residual, residual_scale=residual_scale)
        ops.log.note(f"{name}[int8]", f"W8A8 ({act} in, {'addcmul' if residual is not None else 'plain'} out): {how}",
                     "model quantized by quantize_decoder_int8()", {"x": tuple(x.shape)}, x.dtype)
        return y

    def forward(self, x: torch.Tensor, angles: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.quantization == "int8":
            return self._forward_int8(x, angles, ops)
        B, S, d = x.shape
        cfg = self.cfg
        qkv = self._linear(ops, x, "to_qkv", bias=self.qkv_bias, norm_weight=self.norm1, eps=cfg.eps)
        qkv = qkv.view(B, S, cfg.heads, 3 * cfg.dim_head)
        q, k, v = torch.chunk(qkv, 3, dim=-1)
        q, k = ops.rms_rope(q, k, angles, cfg.eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        ops.log.note("attention", "torch sdpa", "model not quantized: attention keeps the activation dtype",
                     {"q": tuple(q.shape)}, x.dtype)
        o = F.scaled_dot_product_attention(q, k, v)
        o = torch.nan_to_num(o.transpose(1, 2).reshape(B, S, d))
        x = self._linear(ops, o, "to_out", bias=self.out_bias, residual=x, residual_scale=self.scale1)
        h = self._linear(ops, x, "w1", bias=self.w1_bias, norm_weight=self.norm2, eps=cfg.eps, swiglu=True)
        return self._linear(ops, h, "w2", bias=self.w2_bias, residual=x, residual_scale=self.scale2)

    def _forward_int8(self, x: torch.Tensor, angles: torch.Tensor, ops: Ops) -> torch.Tensor:
        """ComfyUI's INT8 block: all four linears INT8 (w1 returns [gate | up]; SwiGLU is w2's input
        activation, as `linear_input_act(w2, h, "swiglu", ...)`), and INT8 attention on [B, S, H, D] with no
        transposes around it."""
        B, S, d = x.shape
        cfg = self.cfg
        qkv = self._int8_linear(ops, x, "to_qkv", self.qkv_bias, act="rms_norm", norm_weight=self.norm1)
        q, k, v = torch.chunk(qkv.view(B, S, cfg.heads, 3 * cfg.dim_head), 3, dim=-1)
        q, k = ops.rms_rope(q, k, angles, cfg.eps)
        use_triton = ops.backend == "fused" and triton_usable(x)[0]
        o, how = (int8_attention_triton if use_triton else int8_attention_eager)(q, k, v)
        ops.log.note("attention", f"int8 QK^T, per-token scales: {how}", "model quantized by quantize_decoder_int8()",
                     {"q": tuple(q.shape)}, x.dtype)
        o = torch.nan_to_num(o.reshape(B, S, d))
        x = self._int8_linear(ops, o, "to_out", self.out_bias, residual=x, residual_scale=self.scale1)
        h = self._int8_linear(ops, x, "w1", self.w1_bias, act="rms_norm", norm_weight=self.norm2)
        return self._int8_linear(ops, h, "w2", self.w2_bias, act="swiglu", residual=x, residual_scale=self.scale2)


class ViT3DDecoder(nn.Module):
    """H3's decoder: latent [B, z, T, h, w] -> video [B, 3, patch_t T, p h, p w] (values roughly in [-1, 1])."""

    def __init__(self, cfg: H3Config):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.x_embedder = nn.Parameter(torch.empty(d, cfg.z_dim))
        self.x_bias = nn.Parameter(torch.zeros(d))
        self.register = nn.Parameter(torch.empty(1, cfg.register_tokens, d))
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.layers))
        self.norm_out = nn.LayerNorm(d, eps=cfg.eps)
        self.proj_out = nn.Parameter(torch.empty(3 * cfg.patch_t * cfg.patch ** 2, d))
        self.proj_bias = nn.Parameter(torch.zeros(3 * cfg.patch_t * cfg.patch ** 2))

    @property
    def quantization(self) -> str:
        return "int8 (W8A8 qkv/out/w1/w2 linears, INT8 QK^T)" if self.blocks[0].quantization == "int8" else "none"

    def forward(self, z: torch.Tensor, ops: Ops | None = None, *, full=None, offset=(0, 0, 0)) -> torch.Tensor:
        """`full` / `offset`: the whole latent grid (T, h, w) and this piece's place in it (tiled decodes)."""
        ops = ops if ops is not None else Ops("eager")
        cfg = self.cfg
        if z.dim() != 5 or z.shape[1] != cfg.z_dim:
            raise UserError(f"latent must be [B, {cfg.z_dim}, T, h, w], got {tuple(z.shape)}")
        B, _, T, h, w = z.shape
        tok = ops.linear(z.flatten(2).transpose(1, 2), self.x_embedder, self.x_bias, name="x_embedder")
        n = tok.shape[1]
        tok = torch.cat([tok, self.register.to(tok.dtype).expand(B, -1, -1), torch.zeros_like(tok[:, :1])], dim=1)
        ids = torch.cat([token_ids(T, h, w, z.device, full=full, offset=offset),
                         torch.zeros(cfg.register_tokens + 1, 3, device=z.device)])
        angles = rope_angles(ids, int(cfg.dim_head * cfg.rope_dim_ratio), cfg.rope_theta)
        for blk in self.blocks:
            tok = blk(tok, angles, ops)
        out = F.linear(self.norm_out(tok), self.proj_out, self.proj_bias)[:, :n]
        p, pt = cfg.patch, cfg.patch_t
        out = out.view(B, T, h, w, 3, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(B, 3, T * pt, h * p, w * p)


def _init_params(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif "scale" in name.rsplit(".", 1)[-1]:   # residual scales (layer scale)
                p.copy_(0.5 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1 or name.endswith("register"):   # norm gains, register tokens
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                gain = 0.5 if any(k in name for k in ("conv2", "to_out", "w2", "w_o", "w_down")) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / math.sqrt(fan_in))


def init_h3(cfg: H3Config, seed: int, *, device="cpu", dtype=torch.float32) -> tuple[H3Encoder, ViT3DDecoder]:
    enc, dec = H3Encoder(cfg), ViT3DDecoder(cfg)
    _init_params(enc, seed)
    _init_params(dec, seed + 1)
    mk = lambda m: m.to(device=device, dtype=dtype).eval().requires_grad_(False)  # noqa: E731
    return mk(enc), mk(dec)


def int8_ops_report(log, *, attention: bool = False) -> dict:
    """From a BackendLog of a quantized decoder's run: {op: backend} of every INT8 linear (and the attention
    with `attention=True`), and whether each of them reported an INT8 kernel (`int8.INT8_KERNELS`) and nothing
    else. A float fallback inside `int_mm` reports its own label, so an INT8 path that silently ran in float
    fails here; so does the eager attention, which is a reference, not a kernel."""
    ops = {op: e["backend"] for op, e in log.ops.items() if op.endswith("[int8]") or
           (attention and op == "attention" and e["backend"].startswith("int8"))}
    ran = bool(ops) and all(" + " not in b and b.rsplit(": ", 1)[-1] in INT8_KERNELS for b in ops.values())
    return {"ops": ops, "all_int8_gemm": ran}


def quantize_decoder_int8(decoder: ViT3DDecoder) -> ViT3DDecoder:
    """A copy of the ViT decoder whose four linears per block are W8A8 INT8 and whose scores are an INT8 matmul
    (ComfyUI: `int8_attention` only when `to_qkv.weight` is already a quantized tensor). The only way to
    get INT8 attention: a float model never switches precision on its own. The original is unchanged."""
    if not isinstance(decoder, ViT3DDecoder):
        raise UserError(f"quantize_decoder_int8 needs a ViT3DDecoder, got {type(decoder).__name__}")
    if decoder.blocks[0].quantization == "int8":
        raise UserError("decoder is already INT8-quantized")
    q = copy.deepcopy(decoder)
    for blk in q.blocks:
        for name in ("to_qkv", "to_out", "w1", "w2"):
            w = getattr(blk, name)
            qi, s = int8_quantize_rows(w.data)
            blk.register_buffer(f"{name}_q", qi)
            blk.register_buffer(f"{name}_s", s.view(-1).float())
            delattr(blk, name)
            setattr(blk, name, None)
        blk.quantization = "int8"
    return q


# ---------------------------------------------------------------------------------------------------
# The causal conv decoder (Wan-style layout) for the tiled decode and the workflow toys.

@dataclass(frozen=True)
class VAEConfig:
    z_dim: int = 16
    channels: tuple = (384, 384, 192, 96)   # width of each stage, bottleneck first
    temporal_up: tuple = (True, True, False)  # temporal 2x at each of the len(channels)-1 upsamplings
    res_blocks: int = 1                     # residual blocks per stage
    norm: str = "rms"                       # 'rms' or 'group' (per-frame GroupNorm)
    groups: int = 32
    attention: bool = True
    ffn_mult: int = 2
    eps: float = 1e-6

    def __post_init__(self):
        if self.norm not in NORMS:
            raise UserError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if len(self.temporal_up) != len(self.channels) - 1:
            raise UserError(f"temporal_up needs {len(self.channels) - 1} entries (one per upsampling), "
                            f"got {len(self.temporal_up)}")
        if any(c <= 0 for c in self.channels) or self.z_dim <= 0 or self.res_blocks < 1:
            raise UserError(f"channels, z_dim and res_blocks must be positive, got {self.channels}, "
                            f"{self.z_dim}, {self.res_blocks}")
        if self.norm == "group" and any(c % self.groups for c in self.channels):
            raise UserError(f"GroupNorm({self.groups}) needs every stage width divisible by {self.groups}, "
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

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        B, C, T, H, W = x.shape
        tok = x.permute(0, 2, 3, 4, 1).reshape(B * T, H * W, C)
        qkv = ops.linear(tok, self.w_qkv, norm_weight=self.norm_attn, eps=self.eps, name="attn.qkv")
        q, k, v = qkv.split(C, dim=-1)
        o = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)).squeeze(1)
        tok = ops.linear(o, self.w_o, residual=tok, name="attn.out")
        h = ops.linear(tok, self.w_up, norm_weight=self.norm_ffn, eps=self.eps, swiglu=True, name="ffn.up")
        tok = ops.linear(h, self.w_down, residual=tok, name="ffn.down")
        return tok.reshape(B, T, H, W, C).permute(0, 4, 1, 2, 3)


class Upsample(nn.Module):
    """2x nearest in space then a (1,3,3) conv; with `temporal`, a causal (3,1,1) conv to 2C channels
    whose halves become frames 2t and 2t+1, the first frame dropped (T -> 2T - 1, as in Wan)."""

    def __init__(self, C: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.time_conv = CausalConv3d(C, 2 * C, (3, 1, 1)) if temporal else None
        self.conv = CausalConv3d(C, C, (1, 3, 3))

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.temporal:
            B, C, T, H, W = x.shape
            t = self.time_conv(x, ops).reshape(B, 2, C, T, H, W)
            x = t.permute(0, 2, 3, 1, 4, 5).reshape(B, C, 2 * T, H, W)[:, :, 1:]
        x = F.interpolate(x, scale_factor=(1, 2, 2), mode="nearest")
        return self.conv(x, ops)


class VideoVAEDecoder(nn.Module):
    """A causal conv decoder: latent [B, z, T, h, w] -> video [B, 3, 1 + 4 (T - 1), 8 h, 8 w] (3 upsamplings)."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg
        ch = cfg.channels
        self.conv_in = CausalConv3d(cfg.z_dim, ch[0])
        self.mid1 = ResBlock(ch[0], ch[0], cfg.norm, cfg.eps, cfg.groups)
        self.mid_attn = AttentionFFN(ch[0], cfg) if cfg.attention else None
        self.mid2 = ResBlock(ch[0], ch[0], cfg.norm, cfg.eps, cfg.groups)
        blocks = []
        cin = ch[0]
        for i, c in enumerate(ch):
            for _ in range(cfg.res_blocks):
                blocks.append(ResBlock(cin, c, cfg.norm, cfg.eps, cfg.groups))
                cin = c
            if i < len(ch) - 1:
                blocks.append(Upsample(c, cfg.temporal_up[i]))
        self.blocks = nn.ModuleList(blocks)
        self.norm_out = ChannelNorm(cfg.norm, ch[-1], cfg.eps, cfg.groups)
        self.conv_out = CausalConv3d(ch[-1], 3)

    def forward(self, z: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
        """z [B, z_dim, T, h, w] -> video [B, 3, T', 8h, 8w] in z.dtype (values roughly in [-1, 1])."""
        ops = ops if ops is not None else Ops("eager")
        if z.dim() != 5 or z.shape[1] != self.cfg.z_dim:
            raise UserError(f"latent must be [B, {self.cfg.z_dim}, T, h, w], got {tuple(z.shape)}")
        x = self.conv_in(z, ops)
        x = self.mid1(x, ops)
        if self.mid_attn is not None:
            x = self.mid_attn(x, ops)
        x = self.mid2(x, ops)
        for blk in self.blocks:
            x = blk(x, ops)
        return self.conv_out(x, ops, pre_norm=self.norm_out)


def init_decoder(cfg: VAEConfig, seed: int, *, device="cpu", dtype=torch.float32) -> VideoVAEDecoder:
    """Random weights from `seed`, scaled so activations stay O(1) through the depth."""
    dec = VideoVAEDecoder(cfg)
    _init_params(dec, seed)
    return dec.to(device=device, dtype=dtype).eval().requires_grad_(False)


def compiled(model: nn.Module):
    """torch.compile of the eager forward (the 'compile' backend); compiled once per shape."""
    return torch.compile(lambda x: model(x, Ops("eager", log=_NullLog())), dynamic=False)


compiled_decoder = compiled


class _NullLog:
    """Compiled graphs must not call back into Python logging; the backend is recorded by the caller."""

    def note(self, *a, **k):
        pass


def make_latent(cfg, shape, seed: int, *, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """A fresh random latent [B, z_dim, T, h, w] (standard normal, as a denoiser's output roughly is)."""
    if len(shape) != 4:
        raise UserError(f"latent shape must be (B, T, h, w), got {shape!r}")
    g = torch.Generator().manual_seed(seed)
    B, T, h, w = shape
    return torch.randn(B, cfg.z_dim, T, h, w, generator=g).to(device=device, dtype=dtype)


def make_video(cfg: H3Config, shape, seed: int, *, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """A fresh random 'video' [B, 3, T, H, W]: smooth noise in [-1, 1] (an encoder's input)."""
    B, T, H, W = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, cfg.in_channels, T, max(1, H // 4), max(1, W // 4), generator=g)
    x = F.interpolate(x, size=(T, H, W), mode="trilinear", align_corners=False)
    return torch.tanh(x + 0.1 * torch.randn(B, cfg.in_channels, T, H, W, generator=g)).to(device=device, dtype=dtype)


def fp64_reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The same model in float64 on the CPU (eager): the yardstick for every backend's error."""
    ref = copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
    with torch.no_grad():
        return ref(x.detach().to("cpu", torch.float64), Ops("eager"))


decoder_fp64_reference = fp64_reference
