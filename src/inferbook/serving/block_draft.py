"""A parallel block drafter (DFlash / DSpark style): one forward drafts K tokens.

vllm-project/speculators' `DSparkDraftModel` is a `DFlashDraftModel` plus two heads. The backbone
drafts an *anchored block*: position 0 holds the anchor (the last token the target produced, not yet
in its KV cache) and positions 1..K-1 hold a mask embedding; every block position attends to the
target's features of the context (projected into each draft layer's keys and values) and to every
other block position (no causal mask inside the block), and with `sample_from_anchor` (DSpark's
default) slot i predicts the token at anchor + i + 1 — so one forward yields K drafts.
Then:

- the Markov head (`MarkovHead`, "vanilla"): a low-rank logit bias W2 @ W1[prev] added to slot i
  from the token before it (the anchor for slot 0, the drafted token of slot i-1 after), which is
  why the K picks run in order although the forward does not;
- the confidence head (`ConfidenceHead`): a linear map of [slot hidden; W1[prev]] to one logit, the
  predicted probability that the slot is accepted, trained with binary cross-entropy.

What ours keeps from theirs: the block layout, the heads and their inputs, the target's frozen
embedding and LM head. Where it differs: one or two draft layers of a small width, the target's
*final* hidden state as the only feature (speculators concatenates several target layers and
fuses them with `fc`), a context of the last `window` features kept per request (speculators
trains with `max_anchors` random anchors over whole documents), and greedy picks only. The drafter
adds K - 1 input slots per request to the step (the anchor reuses the bonus token's slot): vLLM's
generic parallel-drafting count (`config.draft_slots_for("parallel", K)`).

The confidence head cuts the block, as DeepSeek's DSpark reference evaluator does
(deepseek-ai/DeepSpec `eval/dspark/draft_ops.py`: `_confident_prefix_length`, `build_dspark_proposal`;
SGLang's `DSparkWorkerV2._confident_prefix` is the same rule): with a threshold t > 0, the block is
cut at the first slot whose sigmoid(confidence) < t, and only the drafts before it go to the target
— anchor + n tokens verified instead of anchor + K ("verify smarter, not longer"); n = 0 leaves a
plain decode step. t = 0 (DeepSpec's default) turns the cut off. speculators trains the head
(BCE, `confidence_head_alpha`) but has no inference path of its own; its metrics call the cumulative
product of the confidences "what dynamic draft-length thresholding consumes".
"""
from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from .draft import SwiGLU, _rotate, check_fits_target, rope_cos_sin
from .model import RMSNorm, TinyDecoder
from .sampler import exponential_race_sample

BLOCK_DRAFT_FORMAT = "dspark-block-v1"


@dataclass(frozen=True)
class BlockDraftConfig:
    d_model: int
    vocab: int
    block: int = 8               # K: drafts per forward (speculators' block_size)
    n_layers: int = 1
    ffn: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    markov_rank: int = 32        # 0: no Markov head (pure DFlash)
    confidence_head: bool = True
    window: int = 64             # context features a block attends to
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if not 1 <= self.block <= 16 or not 1 <= self.n_layers <= 4 or self.window < 1 or self.markov_rank < 0:
            raise UserError(f"block draft config out of range: block={self.block} (1..16), n_layers={self.n_layers} "
                            f"(1..4), window={self.window} (>= 1), markov_rank={self.markov_rank} (>= 0)")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads or (self.d_model // self.n_heads) % 2:
            raise UserError(f"block draft heads n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads} do not fit "
                            f"d_model={self.d_model}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class BlockAttention(nn.Module):
    """Block queries over [context keys/values; block keys/values], grouped KV heads, RoPE."""

    def __init__(self, cfg: BlockDraftConfig):
        super().__init__()
        self.cfg, d, dh = cfg, cfg.d_model, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.n_heads * dh, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * dh, d, bias=False)

    def forward(self, x, ctx, cos_q, sin_q, cos_c, sin_c, mask):
        """x [B, K, d] block; ctx [B, C, d] normed context features; mask [B, K, C + K] bool."""
        cfg, (B, K, _), C = self.cfg, x.shape, ctx.shape[1]
        dh = cfg.head_dim
        q = _rotate(self.q_proj(x).view(B, K, cfg.n_heads, dh).transpose(1, 2), cos_q, sin_q)
        kb = _rotate(self.k_proj(x).view(B, K, cfg.n_kv_heads, dh).transpose(1, 2), cos_q, sin_q)
        vb = self.v_proj(x).view(B, K, cfg.n_kv_heads, dh).transpose(1, 2)
        kc = _rotate(self.k_proj(ctx).view(B, C, cfg.n_kv_heads, dh).transpose(1, 2), cos_c, sin_c)
        vc = self.v_proj(ctx).view(B, C, cfg.n_kv_heads, dh).transpose(1, 2)
        keys, values = torch.cat([kc, kb], 2), torch.cat([vc, vb], 2)
        rep = cfg.n_heads // cfg.n_kv_heads
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(B, K, cfg.n_heads * dh))


class BlockLayer(nn.Module):
    def __init__(self, cfg: BlockDraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.context_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn)

    def forward(self, z, ctx, rope, mask):
        z = z + self.self_attn(self.input_layernorm(z), self.context_norm(ctx), *rope, mask)
        return z + self.mlp(self.post_attention_layernorm(z))


class MarkovHead(nn.Module):
    """speculators' vanilla Markov head: bias = W2(W1[prev token]), rank `markov_rank`."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        nn.init.zeros_(self.markov_w2.weight)   # starts as pure DFlash

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [...] int64 -> (bias [..., V], W1 embedding [..., r])."""
        e = self.markov_w1(prev)
        return self.markov_w2(e), e


class BlockDraft(nn.Module):
    def __init__(self, cfg: BlockDraftConfig, target: TinyDecoder):
        super().__init__()
        check_fits_target(cfg, target, "block draft")
        self.cfg = cfg
        d = cfg.d_model
        self.fc = nn.Linear(d, d, bias=False)                     # target features -> draft context
        self.mask_embedding = nn.Parameter(torch.zeros(d))        # the mask query (no mask id in our vocab)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.markov = MarkovHead(cfg.vocab, cfg.markov_rank) if cfg.markov_rank else None
        if cfg.confidence_head:
            self.confidence = nn.Linear(d + cfg.markov_rank, 1)
        self.register_buffer("embed_weight", target.embed.weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head_weight", target.lm_head.weight.detach().clone(), persistent=False)

    def backbone(self, ctx_feats, ctx_pos, ctx_valid, anchor, anchor_pos):
        """ctx_feats [B, C, d] target features (feature j: the target's hidden state after ctx_pos[:, j]);
        ctx_valid [B, C] bool; anchor [B] int64 at anchor_pos [B] -> (hidden [B, K, d] normed,
        logits [B, K, V] float32 before the Markov bias). Slot i predicts the token at anchor_pos + i + 1."""
        cfg, B = self.cfg, anchor.shape[0]
        K = cfg.block
        x = self.mask_embedding.expand(B, K, -1).clone()
        x[:, 0] = F.embedding(anchor, self.embed_weight)
        qpos = anchor_pos[:, None] + torch.arange(K, device=anchor.device)
        cq, sq = rope_cos_sin(qpos, cfg.head_dim, cfg.rope_theta)
        cc, sc = rope_cos_sin(ctx_pos, cfg.head_dim, cfg.rope_theta)
        mask = torch.cat([ctx_valid[:, None, :].expand(B, K, -1),
                          torch.ones(B, K, K, dtype=torch.bool, device=anchor.device)], dim=-1)
        ctx = self.fc(ctx_feats)
        z = x
        for layer in self.layers:
            z = layer(z, ctx, (cq, sq, cc, sc), mask)
        h = self.norm(z)
        return h, F.linear(h, self.lm_head_weight).float()

    def heads(self, h, logits, prev):
        """Markov bias and confidence for slots whose previous tokens are `prev` [B, K'] ->
        (biased logits [B, K', V], confidence logits [B, K'] or None)."""
        e = None
        if self.markov is not None:
            bias, e = self.markov(prev)
            logits = logits + bias.float()
        conf = None
        if self.cfg.confidence_head:
            feats = h if e is None else torch.cat([h, e.to(h.dtype)], dim=-1)
            conf = self.confidence(feats).squeeze(-1)
        return logits, conf

    @torch.no_grad()
    def draft(self, ctx_feats, ctx_pos, ctx_valid, anchor, anchor_pos, temperature: float = 0.0, generator=None):
        """One forward, then K picks in order (each slot's Markov bias needs the previous pick):
        greedy, or sampled from softmax(logits / temperature) by the exponential race ->
        (tokens [B, K] int64, acceptance probabilities [B, K] float32 or None, draft probabilities
        [B, K, V] float32 or None when greedy)."""
        h, logits = self.backbone(ctx_feats, ctx_pos, ctx_valid, anchor, anchor_pos)
        prev, tokens, confs, probs = anchor, [], [], []
        for i in range(self.cfg.block):
            lg, conf = self.heads(h[:, i:i + 1], logits[:, i:i + 1], prev[:, None])
            if temperature > 0:
                q = torch.softmax(lg[:, 0] / temperature, dim=-1)
                probs.append(q)
                prev = exponential_race_sample(q, generator)
            else:
                prev = lg[:, 0].argmax(-1)
            tokens.append(prev)
            if conf is not None:
                confs.append(torch.sigmoid(conf[:, 0].float()))
        return (torch.stack(tokens, 1), torch.stack(confs, 1) if confs else None,
                torch.stack(probs, 1) if probs else None)


def save_block_draft(draft: BlockDraft, path: str | Path, extra: dict | None = None) -> str:
    """Save the draft's own weights (not the shared embedding / LM head) with its config -> sha256."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": BLOCK_DRAFT_FORMAT, "config": json.dumps(asdict(draft.cfg))}
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    save_file({k: v.detach().float().contiguous() for k, v in draft.state_dict().items()}, str(path), metadata=meta)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_block_draft(path: str | Path, target: TinyDecoder) -> BlockDraft:
    """Strict load: the file's format and config must match, every tensor present, none extra."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != BLOCK_DRAFT_FORMAT:
        raise UserError(f"{path} is not a block draft (format {meta.get('format')!r}, expected {BLOCK_DRAFT_FORMAT!r})")
    cfg = BlockDraftConfig(**json.loads(meta["config"]))
    draft = BlockDraft(cfg, target)
    draft.load_state_dict(load_file(str(path)), strict=True)
    return draft.to(target.embed.weight.device).eval()


def confident_prefix_length(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """confidence [B, K] probabilities (sigmoid of the head) -> drafts kept per row [B] int64: the index
    of the first slot below `threshold`, K where none is; threshold <= 0 keeps every slot (DeepSpec's
    `_confident_prefix_length`, batched as SGLang's `_confident_prefix`)."""
    B, K = confidence.shape
    if threshold <= 0:
        return torch.full((B,), K, dtype=torch.long, device=confidence.device)
    keep = (confidence >= threshold).long()
    return keep.cumprod(dim=1).sum(dim=1)


class BlockDrafter:
    """Engine drafter around a `BlockDraft`: per request it keeps the target's features of the last
    `window` positions (`seq.draft_hidden_rows` of each step), and drafts every request's block in
    one batched forward. temperature 0: greedy proposals, one-hot (probabilities None); > 0: each
    slot sampled from the draft's softmax at that temperature, which verification receives as q.
    `confidence_threshold` > 0 cuts each row's block at its first slot under the threshold
    (`confident_prefix_length`): `propose` then returns the kept lengths as a third element, and the
    engine verifies only those drafts. The slots stay reserved (the scheduler charged K - 1)."""

    name = "DSpark-style parallel block draft"
    kind = "parallel"             # config.draft_slots_for: K - 1 slots per request

    def __init__(self, draft: BlockDraft, temperature: float = 0.0, seed: int = 0, confidence_threshold: float = 0.0):
        if temperature < 0:
            raise UserError(f"draft temperature={temperature!r} must be >= 0")
        t = confidence_threshold
        if not (t == t and 0 <= t <= 1):
            raise UserError(f"confidence_threshold={t!r} must be a number in [0, 1] (0: no cut)")
        if t > 0 and not draft.cfg.confidence_head:
            raise UserError("confidence_threshold > 0 needs a draft with a confidence head")
        self.confidence_threshold = float(t)
        self.lengths_log: list[list[int]] = []     # the kept lengths of every propose call (the cut's record)
        self.draft, self.vocab, self.temperature, self.seed = draft, draft.cfg.vocab, temperature, seed
        self.generator: torch.Generator | None = None
        self.feature_layers = None     # the target's final hidden state
        self.contexts: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}   # seq id -> (seq, feats, end)
        self.last_confidence: torch.Tensor | None = None

    def _context(self, seq) -> tuple[torch.Tensor, int]:
        """The request's features [c, d] for positions end - c .. end - 1 (end = len(token_ids) - 1)."""
        rows = seq.draft_hidden_rows if seq.draft_hidden_rows is not None else seq.draft_hidden[None]
        end = len(seq.token_ids) - 1            # the anchor's position; features cover positions before it
        key = seq.seq_id
        entry = self.contexts.get(key)
        if entry is not None and entry[0]() is seq and entry[2] == end - rows.shape[0]:
            feats = torch.cat([entry[1], rows.float()], 0)
        else:                                   # first round (or a gap): only what this step handed over
            feats = rows.float()
        feats = feats[-self.draft.cfg.window:]
        self.contexts[key] = (weakref.ref(seq), feats, end)
        return feats, end

    def _forget_finished(self) -> None:
        for key in [k for k, (ref, _, _) in self.contexts.items() if ref() is None or ref().finish_s is not None]:
            del self.contexts[key]

    @torch.no_grad()
    def propose(self, seqs, k: int, device):
        """-> (tokens [B, K], draft probabilities [B, K, V] or None) or, with a confidence threshold,
        (tokens, probabilities, kept lengths [B] int64)."""
        if k != self.draft.cfg.block:
            raise UserError(f"the block draft drafts {self.draft.cfg.block} tokens per forward; the engine asked for k={k}")
        self._forget_finished()
        dev = self.draft.embed_weight.device
        ctxs = [self._context(s) for s in seqs]
        C = max(f.shape[0] for f, _ in ctxs)
        feats = torch.zeros(len(seqs), C, self.draft.cfg.d_model, device=dev)
        pos = torch.zeros(len(seqs), C, dtype=torch.long)
        valid = torch.zeros(len(seqs), C, dtype=torch.bool)
        for i, (f, end) in enumerate(ctxs):
            c = f.shape[0]
            feats[i, C - c:] = f.to(dev)
            pos[i, C - c:] = torch.arange(end - c, end)
            valid[i, C - c:] = True
        anchor = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long)
        anchor_pos = torch.tensor([end for _, end in ctxs], dtype=torch.long)
        gen = None
        if self.temperature > 0:
            if self.generator is None or self.generator.device != torch.device(dev):
                self.generator = torch.Generator(device=dev).manual_seed(self.seed)
            gen = self.generator
        toks, conf, probs = self.draft.draft(feats.to(self.draft.embed_weight.dtype), pos.to(dev), valid.to(dev),
                                             anchor.to(dev), anchor_pos.to(dev), self.temperature, gen)
        self.last_confidence = conf
        probs = None if probs is None else probs.to(device)
        if self.confidence_threshold <= 0:
            return toks.to(device), probs
        lengths = confident_prefix_length(conf, self.confidence_threshold)
        self.lengths_log.append(lengths.tolist())
        return toks.to(device), probs, lengths
