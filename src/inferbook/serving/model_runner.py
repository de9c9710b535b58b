"""One forward over a continuous batch, with the KV cache in pages.

The model's weights are the tiny decoder's (`model.TinyDecoder`: RoPE, RMSNorm, SwiGLU,
grouped-query attention); only the KV cache differs. Here it is one flat pool per layer,
`[num_blocks * block_size, kv_heads, head_dim]`, addressed by slot (see `block_manager`).
All tokens of the step — prefill chunks, decode tokens, draft tokens to verify — are
concatenated into one `[T]` batch: projections and MLPs run once over all T; attention runs
per request over that request's pages, causal by position.

`Batch.logit_rows` picks which rows need logits (the last row of a finishing prefill, every
row of a verification), so a long prefill chunk does not pay for `T x vocab` logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import TinyDecoder, apply_rope


@dataclass
class Batch:
    tokens: torch.Tensor        # [T] int64
    positions: torch.Tensor     # [T] int64
    slots: torch.Tensor         # [T] int64: where each token's K/V is written
    spans: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # per request: (row start, rows, kv slots [ctx], positions [rows])
    logit_rows: torch.Tensor    # [R] int64 rows of T whose logits are returned


class ModelRunner:
    def __init__(self, model: TinyDecoder, num_blocks: int, block_size: int):
        self.model, self.block_size = model, block_size
        cfg = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        shape = (cfg.n_layers, num_blocks * block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        # target layers (1-based) whose outputs a multi-layer draft reads (EAGLE-3); None: final hidden only
        self.feature_layers: tuple[int, ...] | None = None

    def prepare(self, items: list[tuple[list[int], int, list[int], bool]]) -> Batch:
        """items: (tokens, start position, block table, wants logits for every row (else last row only)).

        Returns the flattened batch; `logit_rows` lists, per item in order, its last row or all rows.
        """
        bs, dev = self.block_size, self.device
        tokens, positions, slots, spans, rows = [], [], [], [], []
        row = 0
        for toks, start, table, all_rows in items:
            n = len(toks)
            table_t = torch.tensor(table, dtype=torch.long)
            pos = torch.arange(start + n, dtype=torch.long)
            kv_slots = table_t[pos // bs] * bs + pos % bs        # [start + n]: every position it attends to
            tokens.extend(toks)
            positions.append(pos[start:])
            slots.append(kv_slots[start:])
            spans.append((row, n, kv_slots.to(dev), pos[start:].to(dev)))
            rows.extend(range(row, row + n) if all_rows else [row + n - 1])
            row += n
        return Batch(tokens=torch.tensor(tokens, dtype=torch.long, device=dev),
                     positions=torch.cat(positions).to(dev), slots=torch.cat(slots).to(dev), spans=spans,
                     logit_rows=torch.tensor(rows, dtype=torch.long, device=dev))

    @torch.no_grad()
    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [R, vocab] fp32, draft features [R, d_model x layers read]) for `batch.logit_rows`:
        the final (normed) hidden state, or with `feature_layers` set, the outputs of those layers
        (the last one normed, as the final hidden state) concatenated."""
        m = self.model
        cos, sin = m.cos[batch.positions], m.sin[batch.positions]
        x = m.embed(batch.tokens)                                        # [T, d]
        features = []
        for i, layer in enumerate(m.layers):
            x = x + self.attention(layer.attn, layer.attn_norm(x), batch, cos, sin, i)
            h = layer.mlp_norm(x)
            x = x + layer.w_down(F.silu(layer.w_gate(h)) * layer.w_up(h))
            if self.feature_layers and i + 1 in self.feature_layers[:-1]:
                features.append(x[batch.logit_rows])
        hidden = m.norm(x[batch.logit_rows])
        logits = m.lm_head(hidden).float()
        return logits, (torch.cat(features + [hidden], dim=-1) if self.feature_layers else hidden)


    def attention(self, a, h: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor, j: int) -> torch.Tensor:
        """One attention layer over the batch: h [T, d] (normed) -> the projected output [T, d]. Writes the
        batch's K and V into pool `j` (k_cache[j], v_cache[j]) at its slots, then attends span by span.
        `a.wq`, `a.wk`, `a.wv`, `a.wo` are the projections (the layer's `nn.Linear`s, or a TP rank's
        shards): the head counts are what they project to (H query, Hkv KV heads of head_dim D), so the
        output is the full [T, d] or, for a rank's heads, its partial sum."""
        D = self.model.cfg.head_dim
        q = apply_rope(a.wq(h).unflatten(-1, (-1, D)).transpose(0, 1)[None], cos, sin)[0]     # [H, T, D]
        k = apply_rope(a.wk(h).unflatten(-1, (-1, D)).transpose(0, 1)[None], cos, sin)[0]     # [Hkv, T, D]
        v = a.wv(h).unflatten(-1, (-1, D))                                                     # [T, Hkv, D]
        write_pool(self.k_cache[j], batch.slots, k.transpose(0, 1))
        write_pool(self.v_cache[j], batch.slots, v)
        out = torch.empty_like(q)
        for start, n, kv_slots, pos in batch.spans:
            out[:, start:start + n] = paged_attention(q[:, start:start + n], self.k_cache[j], self.v_cache[j],
                                                      kv_slots, pos)
        return a.wo(out.transpose(0, 1).flatten(1))

def write_pool(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """pool[slot] = x for each slot. pool: one layer's [slots, Hkv, D] (flat), or its
    [blocks, block_size, Hkv, D] strided view of a cross-layer block tensor
    (`kv_offload.block_copy.use_cross_layer_blocks`), where slot = block * block_size + offset."""
    if pool.dim() == 3:
        pool.index_copy_(0, slots, x)
    else:
        bs = pool.shape[1]
        pool[slots // bs, slots % bs] = x


def read_pool(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool[slots] -> [len(slots), Hkv, D], for either pool form of `write_pool`."""
    if pool.dim() == 3:
        return pool[slots]
    bs = pool.shape[1]
    return pool[slots // bs, slots % bs]


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_slots: torch.Tensor,
                    q_pos: torch.Tensor) -> torch.Tensor:
    """Causal attention of one request's queries over its pages.

    q [H, n, D]; k_pool/v_pool [slots, Hkv, D] or [blocks, block_size, Hkv, D] (see `write_pool`);
    kv_slots [ctx] (slot of positions 0..ctx-1); q_pos [n] positions of the queries. Key j is
    visible to query i iff j <= q_pos[i].
    """
    H, n, D = q.shape
    keys = read_pool(k_pool, kv_slots).transpose(0, 1)      # [Hkv, ctx, D]
    values = read_pool(v_pool, kv_slots).transpose(0, 1)
    rep = H // keys.shape[0]
    keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    mask = None
    if n > 1:
        mask = torch.arange(kv_slots.shape[0], device=q.device)[None, :] <= q_pos[:, None]   # [n, ctx]
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)[0]


def observed_paged_kernels(cfg, dtype, device, *, prefill_len: int, context_len: int, k: int = 0) -> dict:
    """The SDPA kernel `paged_attention` runs, observed (`sdpa.sdpa_record`) on its own call shapes:
    a prefill chunk (prefill_len queries over as many keys, boolean causal mask), a verification
    (1 + k queries over context_len keys, mask) when k > 0, and a plain decode (1 query, no mask).
    -> {case: sdpa_record dict}."""
    from ..sdpa import sdpa_record

    g = torch.Generator().manual_seed(0)
    H, D = cfg.n_heads, cfg.head_dim
    cases = {"prefill": (prefill_len, prefill_len), "decode": (1, context_len)}
    if k:
        cases["verify"] = (1 + k, context_len)
    out = {}
    for name, (n, ctx) in cases.items():
        q = torch.randn(1, H, n, D, generator=g).to(device=device, dtype=dtype)
        kv = torch.randn(1, H, ctx, D, generator=g).to(device=device, dtype=dtype)
        q_pos = torch.arange(ctx - n, ctx, device=device)
        mask = (torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]) if n > 1 else None
        out[name] = sdpa_record(q, kv, kv, attn_mask=mask)
    return out


def paged_kernels_label(observed: dict) -> str:
    """'paged sdpa, one call per request: flash (prefill), flash (decode), flash (verify)'."""
    return "paged sdpa, one call per request: " + ", ".join(f"{r['kernel']} ({c})" for c, r in observed.items())
