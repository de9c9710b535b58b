"""A draft that reads the target's hidden states (EAGLE / DSpark style), and its drafter.

The draft never sees the context itself: the target's hidden states already summarise it.
Given the target's features at position t and the next token x_{t+1}, it predicts the target's
*next* final hidden state h_{t+1}; the target's own LM head turns that into logits for x_{t+2}.
To propose k tokens it feeds its predicted hidden state back in (feature-level autoregression).

As EAGLE-3 and Speculators' drafts do, the first step can read several target layers
(`DraftConfig.feature_layers`, e.g. '1,2,4': a low, a middle and the last layer, the last one
normed): each is RMS-normed and the concatenation is fused to d (`fuse`); later steps read the
draft's own output instead. With no `feature_layers` it reads the final hidden state only.
Unlike EAGLE-3 the draft has no attention and no KV cache of its own: its blocks are residual
SwiGLU MLPs, so each position sees only the features handed to it, not the earlier positions.

The target's embedding and LM head are shared and frozen, so the draft file holds only the
draft's own layers: `feature_norms` + `fuse` (multi-layer drafts), `fc` ([h; e(x)] -> d) and up to
5 residual SwiGLU blocks.

Shapes: h [n, F*d] (first step, F target layers) or [n, d] (later steps), float32; x [n] int64 ->
(h_next [n, d], logits [n, vocab]).
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from .model import RMSNorm, TinyDecoder
from .sampler import exponential_race_sample

MAX_DRAFT_LAYERS = 5


@dataclass(frozen=True)
class DraftConfig:
    d_model: int
    vocab: int
    n_layers: int = 1
    ffn: int = 256
    norm_eps: float = 1e-6
    # target layers whose outputs the first draft step reads, 1-based, comma-separated; the last is the
    # target's final (normed) hidden state. "" : only the final hidden state (one layer).
    feature_layers: str = ""

    def __post_init__(self):
        if not 1 <= self.n_layers <= MAX_DRAFT_LAYERS:
            raise UserError(f"draft n_layers={self.n_layers} not allowed; use 1 to {MAX_DRAFT_LAYERS}")
        if self.feature_layers:
            try:
                layers = [int(v) for v in self.feature_layers.split(",")]
            except ValueError:
                layers = []
            if not layers or min(layers) < 1 or layers != sorted(set(layers)):
                raise UserError(f"draft feature_layers={self.feature_layers!r} must be increasing layer numbers "
                                "from 1, comma-separated (e.g. '1,2,4')")

    @property
    def layers_read(self) -> tuple[int, ...]:
        """The target layers read (1-based), () meaning the final hidden state only."""
        return tuple(int(v) for v in self.feature_layers.split(",")) if self.feature_layers else ()

    @property
    def n_features(self) -> int:
        return max(1, len(self.layers_read))

    def n_params(self) -> int:
        d, f = self.d_model, self.n_features
        fuse = (f * d * d + f * d) if f > 1 else 0
        return fuse + 2 * d * d + self.n_layers * (3 * d * self.ffn + d) + d


class DraftBlock(nn.Module):
    def __init__(self, d: int, ffn: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(d, eps)
        self.w_gate = nn.Linear(d, ffn, bias=False)
        self.w_up = nn.Linear(d, ffn, bias=False)
        self.w_down = nn.Linear(ffn, d, bias=False)

    def forward(self, z):
        h = self.norm(z)
        return z + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class HiddenStateDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, target: TinyDecoder):
        super().__init__()
        if target.cfg.d_model != cfg.d_model or target.cfg.vocab != cfg.vocab:
            raise UserError(f"draft (d={cfg.d_model}, vocab={cfg.vocab}) does not fit the target "
                            f"(d={target.cfg.d_model}, vocab={target.cfg.vocab})")
        self.cfg = cfg
        if cfg.layers_read and cfg.layers_read[-1] != target.cfg.n_layers:
            raise UserError(f"draft feature_layers={cfg.feature_layers!r} must end with the target's last layer "
                            f"({target.cfg.n_layers})")
        if cfg.n_features > 1:   # EAGLE-3: low, middle and final target features, each normed, fused to d
            self.feature_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(cfg.n_features))
            self.fuse = nn.Linear(cfg.n_features * cfg.d_model, cfg.d_model, bias=False)
        self.fc = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.blocks = nn.ModuleList(DraftBlock(cfg.d_model, cfg.ffn, cfg.norm_eps) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # shared with the target, frozen, not saved with the draft
        self.register_buffer("embed_weight", target.embed.weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head_weight", target.lm_head.weight.detach().clone(), persistent=False)

    def forward(self, h, x):
        """h: the target's features [n, n_features * d] (first step) or the draft's own previous
        output [n, d] (later steps, as in EAGLE-3); x [n] int64 -> (h_next [n, d], logits [n, V])."""
        d = self.cfg.d_model
        if self.cfg.n_features > 1 and h.shape[-1] == self.cfg.n_features * d:
            parts = h.view(*h.shape[:-1], self.cfg.n_features, d).unbind(-2)
            h = self.fuse(torch.cat([norm(p) for norm, p in zip(self.feature_norms, parts)], dim=-1))
        z = self.fc(torch.cat([h, F.embedding(x, self.embed_weight)], dim=-1))
        for block in self.blocks:
            z = block(z)
        h_next = self.norm(z)
        return h_next, F.linear(h_next, self.lm_head_weight).float()


def save_draft(draft: HiddenStateDraft, path: str | Path, extra: dict | None = None) -> str:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    meta = {k: str(v) for k, v in asdict(draft.cfg).items()} | {k: str(v) for k, v in (extra or {}).items()}
    save_file(state, str(path), metadata=meta)
    from ..record import tensors_revision

    return tensors_revision(state)  # of the tensors, not the file: its header order may vary


def load_draft(path: str | Path, target: TinyDecoder) -> HiddenStateDraft:
    """The draft from its safetensors file, loaded strictly: missing, renamed, extra or wrongly
    shaped tensors are refused with their names (a partly loaded draft would keep random layers
    while its metadata still says how many steps it was trained)."""
    from safetensors import safe_open

    from .weights import config_from_metadata, load_strict

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise UserError(f"draft model file {path} does not exist") from None
    except Exception as e:
        raise UserError(f"draft model file {path} cannot be read as safetensors: {e}") from None
    cfg = config_from_metadata(DraftConfig, meta, path, "draft model", required=("d_model", "vocab", "n_layers", "ffn"))
    p = next(target.parameters())
    draft = HiddenStateDraft(cfg, target)
    load_strict(draft, path, "draft model")
    return draft.to(device=p.device, dtype=torch.float32).eval()


def draft_metadata(path: str | Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


class HiddenStateDrafter:
    """Engine drafter: k proposals from the draft, fed by each request's last target hidden state.

    temperature 0: greedy proposals, deterministic, so their probabilities are one-hot.
    temperature > 0: each proposal is sampled from the draft's softmax at that temperature, and that
    softmax is what verification receives as q (speculative *sampling*). Either way rejection sampling
    keeps the output distributed as the target's."""

    name = "hidden-state draft"

    def __init__(self, draft: HiddenStateDraft, temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise UserError(f"draft temperature={temperature!r} must be >= 0")
        self.draft, self.vocab, self.temperature = draft, draft.cfg.vocab, temperature
        self.seed = seed
        # which target layers the engine must hand over as `draft_hidden` (None: the final one)
        self.feature_layers = draft.cfg.layers_read or None
        self.generator: torch.Generator | None = None   # on the draft's device, made at first use

    def _generator(self, device) -> torch.Generator:
        if self.generator is None or self.generator.device != torch.device(device):
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    @torch.no_grad()
    def propose(self, seqs, k: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (draft tokens [n, k] int64, draft probabilities [n, k, V], or None when greedy: one-hot).

        Everything stays on the draft's device: no `.cpu()`, `.item()` or host-side sampling per
        position, so on a GPU the k positions are queued without a host sync. Sampling draws an
        exact categorical sample as argmax(p / E), E ~ Exp(1) i.i.d. (the exponential race, as
        vLLM's sampler does), from a generator on the same device."""
        h = torch.stack([s.draft_hidden for s in seqs]).float()
        x = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long).to(h.device, non_blocking=True)
        tokens, probs = [], []
        gen = self._generator(h.device) if self.temperature > 0 else None
        for _ in range(k):
            h, logits = self.draft(h, x)
            if self.temperature == 0:
                x = logits.argmax(-1)
            else:
                p = torch.softmax(logits / self.temperature, dim=-1)
                x = exponential_race_sample(p, gen)
                probs.append(p)
            tokens.append(x)
        toks = torch.stack(tokens, dim=1).to(device)
        return toks, (torch.stack(probs, dim=1).to(device) if probs else None)
