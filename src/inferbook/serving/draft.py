"""A draft that reads the target's hidden states (EAGLE / DSpark style), and its drafter.

The draft never sees the context itself: the target's last hidden state already summarises it.
Given the target's final hidden state h_t (after its last RMSNorm) and the next token x_{t+1},
it predicts the target's *next* hidden state h_{t+1}; the target's own LM head turns that into
logits for x_{t+2}. To propose k tokens it feeds its predicted hidden state back in (feature-level
autoregression). The target's embedding and LM head are shared and frozen, so the draft file holds
only the draft's own layers: `fc` ([h; e(x)] -> d) and up to 5 residual SwiGLU blocks.

Shapes: h [n, d] (float32), x [n] int64 -> (h_next [n, d], logits [n, vocab]).
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

MAX_DRAFT_LAYERS = 5


@dataclass(frozen=True)
class DraftConfig:
    d_model: int
    vocab: int
    n_layers: int = 1
    ffn: int = 256
    norm_eps: float = 1e-6

    def __post_init__(self):
        if not 1 <= self.n_layers <= MAX_DRAFT_LAYERS:
            raise UserError(f"draft n_layers={self.n_layers} not allowed; use 1 to {MAX_DRAFT_LAYERS}")

    def n_params(self) -> int:
        d = self.d_model
        return 2 * d * d + self.n_layers * (3 * d * self.ffn + d) + d


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
        self.fc = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.blocks = nn.ModuleList(DraftBlock(cfg.d_model, cfg.ffn, cfg.norm_eps) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # shared with the target, frozen, not saved with the draft
        self.register_buffer("embed_weight", target.embed.weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head_weight", target.lm_head.weight.detach().clone(), persistent=False)

    def forward(self, h, x):
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
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    fields = DraftConfig.__dataclass_fields__
    cfg = DraftConfig(**{k: (float(v) if fields[k].type == "float" else int(v)) for k, v in meta.items() if k in fields})
    p = next(target.parameters())
    draft = HiddenStateDraft(cfg, target)
    draft.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()}, strict=False)
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
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def propose(self, seqs, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.stack([s.draft_hidden for s in seqs]).float()
        x = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long, device=h.device)
        tokens, probs = [], []
        for _ in range(k):
            h, logits = self.draft(h, x)
            if self.temperature == 0:
                x = logits.argmax(-1)
                probs.append(F.one_hot(x, self.vocab).float())
            else:
                p = torch.softmax(logits / self.temperature, dim=-1)
                x = torch.multinomial(p.cpu(), 1, generator=self.generator).squeeze(-1).to(h.device)
                probs.append(p)
            tokens.append(x)
        return torch.stack(tokens, dim=1).to(device), torch.stack(probs, dim=1).to(device)
