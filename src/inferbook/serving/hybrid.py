"""A toy hybrid model — one attention layer and one recurrent (state-space-like) layer — whose
prefix cache stores the recurrent state together with the attention KV.

The seed: "hybrid models must save the attention KV *and* the state-space layer's state". A
recurrent layer has no per-token cache to page: its whole past is one state vector. So a block's
host row holds the block's K and V *and* the state after the block's last token; restoring a
prefix of n blocks puts n blocks of KV back and continues from block n's state.

The model runs one token at a time (`step`), so a prompt's numbers do not depend on how it was
split: a restored prefix followed by the rest must give the same bits as the whole prompt.

Shapes: k_cache/v_cache [max_seq, heads, head_dim]; state [d_state]; everything float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from .kv_tiers import BlockLayout, TieredKVStore, namespace, prefix_keys
from .model import TinyDecoder, apply_rope
from .model_runner import ModelRunner


@dataclass(frozen=True)
class HybridConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 2
    head_dim: int = 16
    d_state: int = 48
    max_seq: int = 256


class HybridToy(nn.Module):
    """embed -> causal attention (residual) -> gated linear recurrence (residual) -> logits.

    Recurrence: state_t = a * state_{t-1} + (1 - a) * tanh(W_in x_t), a = sigmoid(decay) per channel;
    the layer adds W_out state_t to the residual stream."""

    def __init__(self, cfg: HybridConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) / shape[-1] ** 0.5)

        d, hd = cfg.d_model, cfg.n_heads * cfg.head_dim
        self.embed = nn.Parameter(torch.randn(cfg.vocab, d, generator=g))
        self.wq, self.wk, self.wv, self.wo = w(hd, d), w(hd, d), w(hd, d), w(d, hd)
        self.w_in, self.w_out = w(cfg.d_state, d), w(d, cfg.d_state)
        self.decay = nn.Parameter(torch.randn(cfg.d_state, generator=g) + 2.0)
        self.lm_head = w(cfg.vocab, d)

    def new_state(self):
        c = self.cfg
        return (torch.zeros(c.max_seq, c.n_heads, c.head_dim), torch.zeros(c.max_seq, c.n_heads, c.head_dim),
                torch.zeros(c.d_state))

    @torch.no_grad()
    def step(self, token: int, pos: int, k_cache, v_cache, state):
        """One token at position `pos`: writes k/v at pos, returns (logits [vocab], new state)."""
        c = self.cfg
        x = self.embed[token]
        q = (self.wq @ x).view(c.n_heads, c.head_dim)
        k_cache[pos] = (self.wk @ x).view(c.n_heads, c.head_dim)
        v_cache[pos] = (self.wv @ x).view(c.n_heads, c.head_dim)
        keys, values = k_cache[:pos + 1].transpose(0, 1), v_cache[:pos + 1].transpose(0, 1)   # [H, pos+1, hd]
        att = torch.softmax((keys @ q[:, :, None])[..., 0] / c.head_dim ** 0.5, dim=-1)      # [H, pos+1]
        x = x + self.wo @ (att[:, None, :] @ values)[:, 0].reshape(-1)
        a = torch.sigmoid(self.decay)
        state = a * state + (1 - a) * torch.tanh(self.w_in @ x)
        x = x + self.w_out @ state
        return self.lm_head @ F.layer_norm(x, (c.d_model,)), state


def hybrid_layout(cfg: HybridConfig, block_size: int) -> BlockLayout:
    """One block's row: its K and V, and the recurrent state after its last token."""
    kv = (block_size, cfg.n_heads, cfg.head_dim)
    return BlockLayout((("k", torch.float32, kv), ("v", torch.float32, kv), ("state", torch.float32, (cfg.d_state,))))


class HybridPrefixCache:
    """Greedy generation with a tiered prefix cache over (KV, state) rows of `hybrid_layout`."""

    def __init__(self, model: HybridToy, block_size: int, *, model_id: str = "hybrid-toy", **store_kwargs):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise UserError(f"block_size={block_size!r} must be a positive int")
        self.model, self.block_size = model, block_size
        self.layout = hybrid_layout(model.cfg, block_size)
        self.ns = namespace(model_id, block_size, torch.float32, self.layout)
        self.store = TieredKVStore(self.layout, self.ns, **store_kwargs)
        self.last_prompt_logits = None     # logits at the last prompt token of the latest call

    def generate(self, prompt: list[int], max_tokens: int, *, use_cache: bool = True, restore_state: bool = True):
        """-> (output tokens, restored prompt tokens). `restore_state=False` restores the KV but starts
        the recurrence from zeros: the negative control showing why the state must be stored."""
        m, bs = self.model, self.block_size
        if not prompt or len(prompt) + max_tokens > m.cfg.max_seq:
            raise UserError(f"prompt of {len(prompt)} tokens + {max_tokens} new must be 1..{m.cfg.max_seq} tokens")
        k_cache, v_cache, state = m.new_state()
        full = (len(prompt) - 1) // bs            # the last prompt token is always computed (its logits)
        keys = prefix_keys(prompt[:full * bs], bs, self.ns)
        start = 0
        if use_cache:
            got = self.store.fetch(keys)
            try:
                for i, row in enumerate(got.rows):
                    v = self.layout.views(row)
                    k_cache[i * bs:(i + 1) * bs] = v["k"]
                    v_cache[i * bs:(i + 1) * bs] = v["v"]
                    if restore_state:
                        state = v["state"].clone()
                start = len(got.rows) * bs
            finally:
                got.release()
        boundary_states = {}
        logits = None
        for pos in range(start, len(prompt)):
            logits, state = m.step(prompt[pos], pos, k_cache, v_cache, state)
            if (pos + 1) % bs == 0 and (pos + 1) // bs <= full:
                boundary_states[(pos + 1) // bs - 1] = state.clone()
        if use_cache:   # offload the prompt's new full blocks, each with its boundary state
            for i in range(start // bs, full):
                slot = self.store.reserve(keys[i])
                if slot is None:
                    continue
                v = self.layout.views(self.store.host.row(slot))
                v["k"].copy_(k_cache[i * bs:(i + 1) * bs])
                v["v"].copy_(v_cache[i * bs:(i + 1) * bs])
                v["state"].copy_(boundary_states[i])
                self.store.commit([(keys[i], slot)])
        self.last_prompt_logits = logits.clone()
        out = []
        pos = len(prompt)
        for _ in range(max_tokens):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if len(out) == max_tokens:
                break
            logits, state = m.step(tok, pos, k_cache, v_cache, state)
            pos += 1
        return out, start

    def close(self):
        self.store.close()


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
# cache or restored from a tier brings its state with it, and `kv_tiers` copies the state slot
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
        from .model_runner import paged_attention, write_pool

        m, cfg = self.model, self.model.cfg
        T = batch.tokens.shape[0]
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = m.cos[batch.positions], m.sin[batch.positions]
        x = m.embed(batch.tokens)
        for i, layer in enumerate(m.layers):
            h = layer.attn_norm(x)
            if layer.attn is None:
                x = x + self._recurrent(layer, self.rec_index[i], h, batch)
            else:
                a, j = layer.attn, self.attn_index[i]
                q = apply_rope(a.wq(h).view(T, H, D).transpose(0, 1)[None], cos, sin)[0]
                k = apply_rope(a.wk(h).view(T, Hkv, D).transpose(0, 1)[None], cos, sin)[0]
                v = a.wv(h).view(T, Hkv, D)
                write_pool(self.k_cache[j], batch.slots, k.transpose(0, 1))
                write_pool(self.v_cache[j], batch.slots, v)
                out = torch.empty(H, T, D, dtype=x.dtype, device=x.device)
                for start, n, kv_slots, pos in batch.spans:
                    out[:, start:start + n] = paged_attention(q[:, start:start + n], self.k_cache[j], self.v_cache[j],
                                                              kv_slots, pos)
                x = x + a.wo(out.transpose(0, 1).reshape(T, cfg.d_model))
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
    from .kv_tiers import EngineKVTiers
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
