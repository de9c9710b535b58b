"""A draft that reads the target's hidden states (EAGLE-3 / DSpark style), and its drafter.

Given the target's features at position t-1 and the token x_t, the draft predicts the target's
final hidden state at t; the target's own LM head turns that into logits for x_{t+1}. To propose k
tokens it feeds its predicted hidden state back in (feature-level autoregression).

As EAGLE-3 and Speculators' drafts do, the draft reads several target layers
(`DraftConfig.feature_layers`, e.g. '1,2,4': a low, a middle and the last layer, the last one
normed): each is RMS-normed and the concatenation is fused to d (`fuse`, EAGLE-3's `fc`); drafted
positions read the draft's own output instead. With no `feature_layers` it reads the final hidden
state only.

Each draft layer is a Llama-style decoder layer with its own causal self-attention over the draft's
own positions (RoPE, grouped KV heads) and a SwiGLU MLP. With `token_input="eagle3"` (the default)
the first layer is EAGLE-3's: its q/k/v projections read [input_norm(e(x_t)); hidden_norm(h)] (2d
wide) and its residual is h; with "eagle1" (EAGLE-1/2's input) fc([e(x_t); h]) -> d starts the
residual stream and every layer is a plain Llama layer. The draft
keeps its own KV cache per request (`DraftKVCache`): entries for the positions whose features came
from the target (the accepted prefix), to which each round appends its drafted positions; before
the next round the cache is cut back to the accepted prefix and the newly accepted positions are
entered again from the target's features — as EAGLE-3's `stable_kv` and vLLM's EAGLE proposer do.
Unlike theirs, the cache starts at the prompt's last position (the engine hands over the target's
features only for the rows it computes logits for), and it is a tensor per request inside the
drafter, dropped when the request finishes, not pages in the engine's KV pool.

The target's embedding and LM head are shared and frozen, so the draft file holds only the draft's
own layers: `feature_norms` + `fuse` (multi-layer drafts), `fc` ("eagle1" only) and up to 5
decoder layers + `norm`.
"""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from .model import RMSNorm, TinyDecoder
from .sampler import exponential_race_sample

MAX_DRAFT_LAYERS = 5
# written into every draft file's metadata; the earlier drafts (MLP blocks, no attention) carry none
DRAFT_FORMAT = "eagle3-attention-v1"


@dataclass(frozen=True)
class DraftConfig:
    d_model: int
    vocab: int
    n_layers: int = 1
    ffn: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # how the token enters: "eagle3" (the first layer attends from [norm(e(x)); norm(h)], residual h) or
    # "eagle1" (fc([e(x); h]) -> d starts the residual stream, then plain Llama layers)
    token_input: str = "eagle3"
    # target layers whose outputs the first draft step reads, 1-based, comma-separated; the last is the
    # target's final (normed) hidden state. "" : only the final hidden state (one layer).
    feature_layers: str = ""

    def __post_init__(self):
        from .model import check_model_sizes

        check_model_sizes(self, ("d_model", "vocab", "n_layers", "ffn", "n_heads", "n_kv_heads"))
        if not 1 <= self.n_layers <= MAX_DRAFT_LAYERS:
            raise UserError(f"draft n_layers={self.n_layers} not allowed; use 1 to {MAX_DRAFT_LAYERS}")
        if (self.n_heads < 1 or self.n_kv_heads < 1 or self.d_model % self.n_heads or self.n_heads % self.n_kv_heads
                or (self.d_model // self.n_heads) % 2):
            raise UserError(f"draft heads n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads} do not fit "
                            f"d_model={self.d_model} (n_heads must divide d_model into an even head size, and "
                            "n_kv_heads must divide n_heads)")
        if self.token_input not in ("eagle3", "eagle1"):
            raise UserError(f"draft token_input={self.token_input!r}: use 'eagle3' or 'eagle1'")
        if self.feature_layers:
            try:
                layers = [int(v) for v in self.feature_layers.split(",")]
            except ValueError:
                layers = []
            if not layers or min(layers) < 1 or layers != sorted(set(layers)):
                raise UserError(f"draft feature_layers={self.feature_layers!r} must be increasing layer numbers "
                                "from 1, comma-separated (e.g. '1,2,4')")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def layers_read(self) -> tuple[int, ...]:
        """The target layers read (1-based), () meaning the final hidden state only."""
        return tuple(int(v) for v in self.feature_layers.split(",")) if self.feature_layers else ()

    @property
    def n_features(self) -> int:
        return max(1, len(self.layers_read))

    def n_params(self) -> int:
        d, f, dh = self.d_model, self.n_features, self.head_dim
        fuse = (f * d * d + f * d) if f > 1 else 0

        def layer(d_in: int, norms: int) -> int:
            attn = d_in * dh * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * dh * d
            return attn + 3 * d * self.ffn + norms * d

        if self.token_input == "eagle1":
            return fuse + 2 * d * d + self.n_layers * layer(d, 2) + d
        return fuse + layer(2 * d, 3) + (self.n_layers - 1) * layer(d, 2) + d


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] int64 -> cos, sin [B, 1, T, head_dim/2] float32 (the target's frequencies)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv
    return freqs.cos()[:, None], freqs.sin()[:, None]


def _rotate(x, cos, sin):
    """x [B, H, T, D]: rotates (even, odd) pairs in float32 and returns x's dtype, as the target's
    `apply_rope` (a bf16 query must stay bf16 beside its bf16 values; the gpu preset's dry run caught it)."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


class DraftAttention(nn.Module):
    """Causal self-attention over the draft's own positions, with grouped KV heads and RoPE."""

    def __init__(self, d_in: int, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        dh = cfg.head_dim
        self.q_proj = nn.Linear(d_in, cfg.n_heads * dh, bias=False)
        self.k_proj = nn.Linear(d_in, cfg.n_kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d_in, cfg.n_kv_heads * dh, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * dh, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, past, mask):
        """x [B, T, d_in]; cos/sin [B, 1, T, dh/2]; past: (K, V) [B, Hkv, P, dh] (keys rotated) or None;
        mask [B, T, P + T] bool (True: may attend) or None (all of past, causal among the T new).
        -> (out [B, T, d], (k, v) [B, Hkv, T, dh] of the T new positions)."""
        cfg, (B, T, _) = self.cfg, x.shape
        q = _rotate(self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2), cos, sin)
        k = _rotate(self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        rep = cfg.n_heads // cfg.n_kv_heads
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        if mask is None:    # key j visible to query i iff j <= P + i
            mask = torch.ones(T, keys.shape[2], dtype=torch.bool, device=x.device).tril(keys.shape[2] - T)
        else:
            mask = mask[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim)), (k, v)


class SwiGLU(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """A Llama decoder layer (pre-norm attention, then SwiGLU). The first layer is EAGLE-3's: attention
    reads [input_layernorm(e(x)); hidden_norm(h)] (2d wide) and the residual stream starts at h."""

    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        d = cfg.d_model
        self.first = first
        self.input_layernorm = RMSNorm(d, cfg.norm_eps)
        if first:
            self.hidden_norm = RMSNorm(d, cfg.norm_eps)
        self.self_attn = DraftAttention(2 * d if first else d, cfg)
        self.post_attention_layernorm = RMSNorm(d, cfg.norm_eps)
        self.mlp = SwiGLU(d, cfg.ffn)

    def forward(self, z, emb, cos, sin, past, mask):
        if self.first:
            a_in = torch.cat([self.input_layernorm(emb), self.hidden_norm(z)], dim=-1)
        else:
            a_in = self.input_layernorm(z)
        a, kv = self.self_attn(a_in, cos, sin, past, mask)
        z = z + a
        return z + self.mlp(self.post_attention_layernorm(z)), kv


def check_fits_target(cfg, target: TinyDecoder, what: str) -> None:
    """A draft reads the target's features and shares its embedding and LM head: d_model and vocab must match."""
    if target.cfg.d_model != cfg.d_model or target.cfg.vocab != cfg.vocab:
        raise UserError(f"{what} (d={cfg.d_model}, vocab={cfg.vocab}) does not fit the target "
                        f"(d={target.cfg.d_model}, vocab={target.cfg.vocab})")


class HiddenStateDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, target: TinyDecoder):
        super().__init__()
        check_fits_target(cfg, target, "draft")
        self.cfg = cfg
        if cfg.layers_read and cfg.layers_read[-1] != target.cfg.n_layers:
            raise UserError(f"draft feature_layers={cfg.feature_layers!r} must end with the target's last layer "
                            f"({target.cfg.n_layers})")
        if cfg.n_features > 1:   # EAGLE-3: low, middle and final target features, each normed, fused to d
            self.feature_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(cfg.n_features))
            self.fuse = nn.Linear(cfg.n_features * cfg.d_model, cfg.d_model, bias=False)
        eagle3 = cfg.token_input == "eagle3"
        if not eagle3:
            self.fc = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(DraftLayer(cfg, first=eagle3 and i == 0) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # shared with the target, frozen, not saved with the draft
        self.register_buffer("embed_weight", target.embed.weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head_weight", target.lm_head.weight.detach().clone(), persistent=False)

    def forward(self, h, x, positions, past=None, mask=None):
        """h [B, T, n_features * d]: the target's features at the positions before (first entries), or
        [B, T, d]: the draft's own previous output (drafted positions, as in EAGLE-3); x [B, T] int64 the
        tokens at `positions` [B, T] int64; past: per layer (K, V) [B, Hkv, P, dh] or None; mask
        [B, T, P + T] bool or None (causal). -> (h_next [B, T, d], logits [B, T, V] float32,
        per layer (k, v) [B, Hkv, T, dh] for the T positions, to be kept in the draft's KV cache)."""
        d = self.cfg.d_model
        if self.cfg.n_features > 1 and h.shape[-1] == self.cfg.n_features * d:
            parts = h.unflatten(-1, (self.cfg.n_features, d)).unbind(-2)
            h = self.fuse(torch.cat([norm(p) for norm, p in zip(self.feature_norms, parts)], dim=-1))
        emb = F.embedding(x, self.embed_weight)
        if self.cfg.token_input == "eagle1":
            h = self.fc(torch.cat([emb, h], dim=-1))
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        z, new_kv = h, []
        for i, layer in enumerate(self.layers):
            z, kv = layer(z, emb, cos, sin, None if past is None else past[i], mask)
            new_kv.append(kv)
        h_next = self.norm(z)
        return h_next, F.linear(h_next, self.lm_head_weight).float(), new_kv


DRAFT_KIND = "draft"
DRAFT_CONFIG_FIELDS = ("d_model", "vocab", "n_layers", "ffn", "n_heads", "n_kv_heads")


def save_draft(draft: HiddenStateDraft, path: str | Path, extra: dict | None = None) -> str:
    """Save atomically with kind, role, config, digest and `draft_format` in the metadata
    (`weights.save_model_file`); returns `record.tensors_revision` of the tensors."""
    from .weights import save_model_file

    return save_model_file(path, draft.state_dict(), draft.cfg, kind=DRAFT_KIND,
                           extra={"draft_format": DRAFT_FORMAT, **(extra or {})})


def load_draft(path: str | Path, target: TinyDecoder, rebuild: str | None = None) -> HiddenStateDraft:
    """The draft from its safetensors file, loaded strictly: missing, renamed, extra, wrongly shaped
    or non-finite tensors, an impossible config, another kind or role, or tensors that do not match
    the digest are refused with their names (a partly loaded draft would keep random layers while its
    metadata still says how many steps it was trained). A draft of the earlier format (MLP blocks
    without attention) is refused by name; a missing file names `rebuild`."""
    from .weights import load_model_file, model_config, open_model_file, refuse_format

    meta, names = open_model_file(path, kind=DRAFT_KIND, rebuild=rebuild)
    refuse_format(meta, names, path, "draft model", key="draft_format", expected=DRAFT_FORMAT,
                  old_markers=("fc.weight", "blocks."),
                  old_what="an MLP-only draft without attention (retrain it: data/models/README.md)")
    cfg = model_config(DraftConfig, meta, path, kind=DRAFT_KIND, required=DRAFT_CONFIG_FIELDS)
    p = next(target.parameters())
    draft = HiddenStateDraft(cfg, target)
    load_model_file(draft, path, meta, kind=DRAFT_KIND)
    return draft.to(device=p.device, dtype=torch.float32).eval()


def draft_metadata(path: str | Path) -> dict:
    from .weights import open_model_file

    return open_model_file(path, kind=DRAFT_KIND)[0]


class DraftKVCache:
    """One request's draft KV cache: per draft layer (K, V) [Hkv, T, dh] for positions start .. start+T-1."""

    def __init__(self, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        self.start, self.kv = start, kv

    @property
    def end(self) -> int:
        """The first position not held."""
        return self.start + self.kv[0][0].shape[1]

    def __len__(self) -> int:
        return self.kv[0][0].shape[1]

    def truncate(self, end: int) -> None:
        """Roll back: keep only the entries of positions before `end`."""
        keep = max(0, end - self.start)
        self.kv = [(k[:, :keep], v[:, :keep]) for k, v in self.kv]


class HiddenStateDrafter:
    """Engine drafter: k proposals per request from the draft, which keeps its own KV cache per request.

    Each round, per request: the cache is rolled back to the accepted prefix (the drafted entries of
    the last round are dropped), the positions accepted since — one per token the target produced,
    each paired with the target's features at the position before (`seq.draft_hidden_rows`, else
    `seq.draft_hidden` alone) — are entered in one causal pass, and the k - 1 further positions are
    drafted one at a time from the draft's own output, each written to the cache too.

    temperature 0: greedy proposals, deterministic, so their probabilities are one-hot.
    temperature > 0: each proposal is sampled from the draft's softmax at that temperature, and that
    softmax is what verification receives as q (speculative *sampling*). Either way rejection sampling
    keeps the output distributed as the target's."""

    name = "hidden-state draft"
    kind = "eagle"            # a chain: config.draft_slots_for gives 0 extra input slots

    def __init__(self, draft: HiddenStateDraft, temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise UserError(f"draft temperature={temperature!r} must be >= 0")
        self.draft, self.vocab, self.temperature = draft, draft.cfg.vocab, temperature
        self.seed = seed
        # which target layers the engine must hand over as `draft_hidden` (None: the final one)
        self.feature_layers = draft.cfg.layers_read or None
        self.generator: torch.Generator | None = None   # on the draft's device, made at first use
        self.caches: dict[int, tuple[weakref.ref, DraftKVCache]] = {}   # request key -> (request, its cache)

    def _generator(self, device) -> torch.Generator:
        if self.generator is None or self.generator.device != torch.device(device):
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    @staticmethod
    def _key(seq) -> int:
        return getattr(seq, "seq_id", None) if getattr(seq, "seq_id", None) is not None else id(seq)

    def _forget_finished(self) -> None:
        """Drop the caches of requests that finished or no longer exist."""
        for key in [k for k, (ref, _) in self.caches.items()
                    if ref() is None or getattr(ref(), "finish_s", None) is not None]:
            del self.caches[key]

    def cache_for(self, seq, first: int) -> DraftKVCache | None:
        """The request's cache rolled back to the positions before `first`, or None (no cache, or one
        that misses positions before `first`: a step went by without drafting, so start again)."""
        entry = self.caches.get(self._key(seq))
        if entry is None or entry[0]() is not seq:
            return None
        cache = entry[1]
        cache.truncate(first)   # roll back: drop last round's drafted (and any rejected) positions
        if cache.end < first:
            del self.caches[self._key(seq)]
            return None
        return cache

    def _pick(self, logits, gen, probs: list):
        if self.temperature == 0:
            return logits.argmax(-1)
        p = torch.softmax(logits / self.temperature, dim=-1)
        probs.append(p)
        return exponential_race_sample(p, gen)

    @torch.no_grad()
    def propose(self, seqs, k: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (draft tokens [n, k] int64, draft probabilities [n, k, V], or None when greedy: one-hot).

        Everything stays on the draft's device: no `.cpu()`, `.item()` or host-side sampling per
        position (the host builds only index and mask tensors from token counts it already has), so
        on a GPU the k positions are queued without a host sync. Sampling draws an exact categorical
        sample as argmax(p / E), E ~ Exp(1) i.i.d. (the exponential race, as vLLM's sampler does),
        from a generator on the same device."""
        draft = self.draft
        dev = draft.embed_weight.device
        cfg = draft.cfg
        self._forget_finished()
        n = len(seqs)
        feats, toks, firsts, caches = [], [], [], []
        for s in seqs:
            rows = getattr(s, "draft_hidden_rows", None)
            rows = s.draft_hidden[None] if rows is None else rows
            first = len(s.token_ids) - rows.shape[0]   # rows[j]: the target's features at position first + j - 1
            feats.append(rows)
            toks.append(s.token_ids[first:])
            firsts.append(first)
            caches.append(self.cache_for(s, first))
        ms = [len(t) for t in toks]
        cs = [0 if c is None else len(c) for c in caches]
        M, C = max(ms), max(cs)
        h = torch.nn.utils.rnn.pad_sequence([f.float() for f in feats], batch_first=True).to(dev)
        x = torch.tensor([t + [0] * (M - len(t)) for t in toks], dtype=torch.long).to(dev, non_blocking=True)
        pos = (torch.tensor(firsts)[:, None] + torch.arange(M)).to(dev, non_blocking=True)
        hkv, dh = cfg.n_kv_heads, cfg.head_dim
        past = []
        for layer in range(cfg.n_layers):
            kv = []
            for which in (0, 1):
                buf = torch.zeros(n, hkv, C, dh, device=dev)
                for i, c in enumerate(caches):
                    if c is not None and cs[i]:
                        buf[i, :, :cs[i]] = c.kv[layer][which]
                kv.append(buf)
            past.append(tuple(kv))
        # [n, M, C + M]: the cached positions, then causal among the new ones (padded rows see themselves)
        c_len, m_len = torch.tensor(cs)[:, None, None], torch.tensor(ms)[:, None, None]
        qi, kj = torch.arange(M)[None, :, None], torch.arange(C + M)[None, None, :]
        new_j = kj - C
        mask = (kj < c_len) | ((kj >= C) & (new_j <= qi) & ((new_j < m_len) | (new_j == qi)))
        h_all, logits_all, new_kv = draft(h, x, pos, past, mask.to(dev, non_blocking=True))
        keys = [(torch.cat([pk, k_], 2), torch.cat([pv, v_], 2)) for (pk, pv), (k_, v_) in zip(past, new_kv)]
        rows = torch.arange(n, device=dev)
        last = torch.tensor([m - 1 for m in ms]).to(dev, non_blocking=True)
        h_last, logits = h_all[rows, last][:, None], logits_all[rows, last]
        # what a drafted position may see: the real cache entries, the new entries, then drafted ones
        seen = ((kj < c_len) | ((kj >= C) & (new_j < m_len)))[:, :1].to(dev, non_blocking=True)   # [n, 1, C + M]
        gen = self._generator(dev) if self.temperature > 0 else None
        tokens, probs = [], []
        x_next = self._pick(logits, gen, probs)
        tokens.append(x_next)
        step_pos = torch.tensor([f + m for f, m in zip(firsts, ms)])[:, None].to(dev, non_blocking=True)
        for j in range(1, k):
            step_mask = torch.cat([seen, torch.ones(n, 1, j, dtype=torch.bool, device=dev)], dim=-1)
            h_last, lg, kv = draft(h_last, x_next[:, None], step_pos + (j - 1), keys, step_mask)
            keys = [(torch.cat([pk, k_], 2), torch.cat([pv, v_], 2)) for (pk, pv), (k_, v_) in zip(keys, kv)]
            x_next = self._pick(lg[:, 0], gen, probs)
            tokens.append(x_next)
        # keep, per request: its cached entries, the new accepted ones and this round's drafted ones
        # (the next round rolls the drafted ones back before entering what was accepted)
        for i, s in enumerate(seqs):
            kv_i = [tuple(torch.cat([t[i, :, :cs[i]], t[i, :, C:C + ms[i]], t[i, :, C + M:]], dim=1) for t in pair)
                    for pair in keys]
            self.caches[self._key(s)] = (weakref.ref(s), DraftKVCache(firsts[i] - cs[i], kv_i))
        toks_out = torch.stack(tokens, dim=1).to(device)
        return toks_out, (torch.stack(probs, dim=1).to(device) if probs else None)
