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
