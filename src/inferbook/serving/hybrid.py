"""A hybrid decoder — attention layers and a gated linear recurrence (state-space-like) — run inside
the serving engine, whose KV blocks carry the recurrent state with them through every tier.

The seed: "hybrid models must save the attention KV *and* the state-space layer's state". A
recurrent layer has no per-token cache to page: its whole past is one state per head. So each KV
block keeps, beside its K and V, the state after the block's last token; restoring a prefix of n
blocks puts n blocks of KV back and continues from block n's state (see the comment below).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from .model import TinyDecoder, apply_rope
from .model_runner import ModelRunner


# ---------------------------------------------------------------------------
# Inside the serving engine: attention layers with paged KV, recurrent layers whose state is
# kept per KV block, so that the device prefix cache and the KV tiers carry both together.
#
# A recurrent layer has no per-token cache; its whole past is one state matrix per head. vLLM's
# prefix caching for Mamba-style layers keeps that state at block boundaries, so a cached block
# stands for "the KV of these tokens and the state after the last of them". Here every KV block
# has a state slot beside it (`HybridRunner.state_blocks`): a forward that processes a request's
# token at position p writes the state after p into the slot of the block holding p, and a
# request continuing at position p reads the state from the block holding p - 1. A full prompt
# block's slot therefore holds the state at its last token; a block reached from the prefix
# cache or restored from a tier brings its state with it, and `kv_offload` copies the state slot
# as part of the block's host row.

class GatedLinearRecurrence(nn.Module):
    """A gated linear recurrence with a matrix state per head (the family of GLA / Mamba-2 / GDN):

        S_t = g_t * S_{t-1} + k_t^T v_t,    o_t = q_t S_t,    g_t = sigmoid(w_g x_t + b + 2) per head.

    State [heads, key_dim, value_dim], float32 (as these layers keep their state). Runs token by
    token, so its numbers do not depend on how a prompt is split into chunks or restored."""

    def __init__(self, d_model: int, heads: int, key_dim: int, value_dim: int):
        super().__init__()
        self.heads, self.key_dim, self.value_dim = heads, key_dim, value_dim
        self.wq = nn.Linear(d_model, heads * key_dim, bias=False)
        self.wk = nn.Linear(d_model, heads * key_dim, bias=False)
        self.wv = nn.Linear(d_model, heads * value_dim, bias=False)
        self.wg = nn.Linear(d_model, heads, bias=False)
        self.decay_bias = nn.Parameter(torch.zeros(heads))
        self.wo = nn.Linear(heads * value_dim, d_model, bias=False)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.key_dim, self.value_dim)

    def run(self, h: torch.Tensor, state: torch.Tensor, keep) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """h [n, d_model] (one request's new tokens, in order); state [H, dk, dv] before the first.
        Returns (output [n, d_model] in h's dtype, {t: state after token t for t in keep})."""
        n = h.shape[0]
        H, dk, dv = self.state_shape
        q = self.wq(h).float().view(n, H, dk) * dk ** -0.5
        k = self.wk(h).float().view(n, H, dk) * dk ** -0.5
        v = self.wv(h).float().view(n, H, dv)
        g = torch.sigmoid(self.wg(h).float() + self.decay_bias.float() + 2.0)       # [n, H]
        out = torch.empty(n, H, dv, dtype=torch.float32, device=h.device)
        kept = {}
        S = state.float()
        for t in range(n):
            S = g[t, :, None, None] * S + k[t, :, :, None] * v[t, :, None, :]
            out[t] = (q[t, :, None, :] @ S)[:, 0, :]
            if t in keep:
                kept[t] = S
        return self.wo(out.reshape(n, H * dv).to(h.dtype)), kept


class HybridDecoder(TinyDecoder):
    """The engine's tiny decoder with the layers in `recurrent_layers` replaced by a
    `GatedLinearRecurrence` (attention removed there; norms and MLPs kept)."""

    def __init__(self, cfg, recurrent_layers=(1,), heads: int = 4, key_dim: int = 64, value_dim: int = 64):
        super().__init__(cfg)
        layers = tuple(sorted(set(int(i) for i in recurrent_layers)))
        if not layers or layers[0] < 0 or layers[-1] >= cfg.n_layers or len(layers) == cfg.n_layers:
            raise UserError(f"recurrent_layers={recurrent_layers!r} must name some, not all, of layers 0..{cfg.n_layers - 1}")
        for name, v in (("heads", heads), ("key_dim", key_dim), ("value_dim", value_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"recurrent {name}={v!r} must be a positive int")
        self.recurrent_layers = layers
        for i in layers:
            self.layers[i].attn = None
            self.layers[i].rec = GatedLinearRecurrence(cfg.d_model, heads, key_dim, value_dim)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.cfg.n_layers) if i not in self.recurrent_layers)

    def state_bytes(self) -> int:
        """Bytes of every recurrent layer's state (float32)."""
        H, dk, dv = self.layers[self.recurrent_layers[0]].rec.state_shape
        return len(self.recurrent_layers) * H * dk * dv * 4

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V of one token over every attention layer."""
        item = (dtype or next(self.parameters()).dtype).itemsize
        return len(self.attention_layers) * 2 * self.cfg.n_kv_heads * self.cfg.head_dim * item

    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """The whole sequence at once, no cache: logits [len(tokens), vocab] float32."""
        from .model_runner import paged_attention

        cfg, T = self.cfg, len(tokens)
        dev = next(self.parameters()).device
        pos = torch.arange(T, device=dev)
        cos, sin = self.cos[pos], self.sin[pos]
        x = self.embed(torch.tensor(tokens, device=dev))
        for i, layer in enumerate(self.layers):
            h = layer.attn_norm(x)
            if layer.attn is None:
                rec = layer.rec
                out, _ = rec.run(h, torch.zeros(rec.state_shape, device=dev), ())
                x = x + out
            else:
                a = layer.attn
                q = apply_rope(a.wq(h).view(T, cfg.n_heads, cfg.head_dim).transpose(0, 1)[None], cos, sin)[0]
                k = apply_rope(a.wk(h).view(T, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1)[None], cos, sin)[0]
                v = a.wv(h).view(T, cfg.n_kv_heads, cfg.head_dim)
                o = paged_attention(q, k.transpose(0, 1), v, pos, pos)
                x = x + a.wo(o.transpose(0, 1).reshape(T, cfg.d_model))
            h = layer.mlp_norm(x)
            x = x + layer.w_down(F.silu(layer.w_gate(h)) * layer.w_up(h))
        return self.lm_head(self.norm(x)).float()


class HybridRunner(ModelRunner):
    """The engine's model runner for a `HybridDecoder`: paged KV for the attention layers only
    (`k_cache`/`v_cache` [attention layers, slots, kv_heads, head_dim]) and a recurrent state slot
    per KV block (`state_blocks` [blocks, recurrent layers, heads, key_dim, value_dim], float32)."""

    def __init__(self, model: HybridDecoder, num_blocks: int, block_size: int):
        self.model, self.block_size = model, block_size
        cfg = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.attn_index = {layer: j for j, layer in enumerate(model.attention_layers)}
        self.rec_index = {layer: j for j, layer in enumerate(model.recurrent_layers)}
        shape = (len(self.attn_index), num_blocks * block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        rec = model.layers[model.recurrent_layers[0]].rec
        self.state_blocks = torch.zeros((num_blocks, len(self.rec_index), *rec.state_shape), dtype=torch.float32,
                                        device=p.device)

    def _recurrent(self, layer, j: int, h: torch.Tensor, batch) -> torch.Tensor:
        """One recurrent layer over every request of the batch, each from the state of the block
        that holds its previous token; states after block ends and after the last token are saved
        in the slots of the blocks that hold those tokens."""
        bs = self.block_size
        out = torch.empty_like(h)
        for start, n, kv_slots, pos in batch.spans:
            p0 = int(pos[0])
            if n != int(pos[-1]) - p0 + 1:
                raise RuntimeError("the hybrid runner needs each request's new tokens at consecutive positions")
            blocks = (kv_slots // bs).tolist()
            state = self.state_blocks[blocks[p0 - 1], j] if p0 > 0 else \
                torch.zeros(layer.rec.state_shape, dtype=torch.float32, device=h.device)
            keep = {t for t in range(n) if (p0 + t + 1) % bs == 0 or t == n - 1}
            o, kept = layer.rec.run(h[start:start + n], state, keep)
            out[start:start + n] = o
            for t, s in kept.items():
                self.state_blocks[blocks[p0 + t], j] = s
        return out

    @torch.no_grad()
    def forward(self, batch):
        """As `ModelRunner.forward`, with recurrent layers in place of attention where the model has them."""
        m = self.model
        cos, sin = m.cos[batch.positions], m.sin[batch.positions]
        x = m.embed(batch.tokens)
        for i, layer in enumerate(m.layers):
            h = layer.attn_norm(x)
            if layer.attn is None:
                x = x + self._recurrent(layer, self.rec_index[i], h, batch)
            else:
                x = x + self.attention(layer.attn, h, batch, cos, sin, self.attn_index[i])
            h = layer.mlp_norm(x)
            x = x + layer.w_down(F.silu(layer.w_gate(h)) * layer.w_up(h))
        hidden = m.norm(x[batch.logit_rows])
        return m.lm_head(hidden).float(), hidden


def hybrid_engine(model: HybridDecoder, config=None):
    """An `LLMEngine` serving a `HybridDecoder` through `HybridRunner`. Speculative decoding is
    refused: a rejected draft token would need the recurrent state rolled back."""
    from .config import EngineConfig
    from .engine import LLMEngine

    config = config or EngineConfig()
    if config.num_spec_tokens:
        raise UserError("speculative decoding is not supported for the hybrid model: rejected draft tokens would need "
                        "the recurrent state rolled back")
    engine = LLMEngine(model, config)
    engine.runner = HybridRunner(model, engine.block_manager.num_blocks, config.block_size)
    engine.device = engine.runner.device
    return engine


def hybrid_restore_check(seed: int, workdir, *, heads: int = 4, key_dim: int = 64, value_dim: int = 64) -> dict:
    """A hybrid engine (attention, recurrent, attention) with a host and a file tier below a device
    pool too small to keep a shared prefix: the prefix's blocks are restored with their state.
    Checks that the restored run's first-token logits equal the whole-sequence reference's (to
    float32 rounding), that its greedy tokens equal a run without any prefix cache, and — the
    negative control — that restoring the KV with the state slots left at zero moves the logits."""
    from pathlib import Path

    from .config import EngineConfig
    from .kv_offload import EngineKVTiers
    from .model import TinyConfig, init_weights
    from .sequence import SamplingParams

    cfg = TinyConfig(vocab=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn=128, max_seq=192)
    model = init_weights(HybridDecoder(cfg, (1,), heads, key_dim, value_dim), seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    prefix = torch.randint(cfg.vocab, (64,), generator=g).tolist()
    filler = torch.randint(cfg.vocab, (120,), generator=g).tolist()
    prompt = prefix + torch.randint(cfg.vocab, (5,), generator=g).tolist()
    params = SamplingParams(max_tokens=8)
    want = hybrid_engine(model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=128)).generate([prompt], params)[0]
    ref_logits = model.reference_logits(prompt)[-1]

    class WithoutState(EngineKVTiers):
        def restore(self, seq, start_block, take_block):
            blocks = super().restore(seq, start_block, take_block)
            for b in blocks:
                self.runner.state_blocks[b].zero_()
            return blocks

    def run(tiers_cls, sub):
        e = hybrid_engine(model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=128, enable_prefix_caching=True,
                                              num_blocks=9))
        t = tiers_cls(e, {"host_capacity_blocks": 4, "file_dir": Path(workdir) / sub, "durable": False})
        try:
            e.generate([prefix + [1]], SamplingParams(max_tokens=1))
            e.generate([filler], SamplingParams(max_tokens=1))      # evicts the prefix from the device pool
            t.flush(30)
            seq = e.add_request(prompt, params)
            first = {}
            forward = e.runner.forward

            def capture(batch):
                out = forward(batch)
                first.setdefault("logits", out[0][-1].clone())
                return out
            e.runner.forward = capture
            while e.has_unfinished():
                e.step()
            return seq, first["logits"], dict(t.stats.restored_blocks)
        finally:
            t.close()

    seq, logits, restored = run(EngineKVTiers, "with")
    seq0, logits0, _ = run(WithoutState, "without")
    err, err0 = float((logits - ref_logits).abs().max()), float((logits0 - ref_logits).abs().max())
    kv_block = model.kv_bytes_per_token(torch.float32) * 16
    return {"restored prompt tokens": seq.num_cached_tokens, "restored from": restored,
            "state bytes (recurrent layer)": model.state_bytes(), "KV bytes per block (attention layers)": kv_block,
            "state / block KV": model.state_bytes() / kv_block,
            "max |logit error| with state": err, "tokens equal with state": seq.output_ids == want,
            "max |logit error| without state": err0, "tokens equal without state": seq0.output_ids == want,
            "passed": sum(restored.values()) >= 3 and seq.output_ids == want and err < 1e-4
            and err0 > 100 * max(err, 1e-6)}
