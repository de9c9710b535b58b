"""Training the draft-acceptance chapter's models, in three separate steps (and processes):

1. `target`  — train a small byte-level target on the three corpora (math, code, qa);
2. `extract` — run the target once over training windows and write its final hidden states to
               safetensors shards on disk (the seed's "hidden-state extraction" node group);
3. `draft`   — train a hidden-state draft from those shards alone, in another process (the seed's
               "draft training" node group). The draft process never runs the target: it loads only
               the target's frozen embedding and LM head.

    python -m inferbook.serving.train all --out data/models      # what made the committed weights

`all` runs step 1 in this process and steps 2 and 3 as subprocesses (`sys.executable -m ...`).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .corpora import SEPARATOR, TASKS, encode, load_corpus
from .draft import DraftConfig, HiddenStateDraft, save_draft
from .model import TinyConfig, TinyDecoder, init_weights, load_weights, save_weights

TARGET_FILE = "dspark-target.safetensors"
DRAFTS = {  # name -> (layers, ffn): the small one is cheap; the large one accepts more per round
    "small": (1, 256),
    "large": (3, 512),
}


def feature_layers_for(n_layers: int) -> str:
    """The target layers a draft reads, EAGLE-3 style: a low, a middle and the last one (1-based)."""
    return ",".join(str(v) for v in sorted({1, max(1, n_layers // 2), n_layers}))


def draft_file(name: str) -> str:
    return f"dspark-draft-{name}.safetensors"


def task_streams(split: str = "train", root: Path | None = None) -> dict[str, torch.Tensor]:
    return {t: torch.tensor(encode(SEPARATOR.join(load_corpus(t, split, root))), dtype=torch.long) for t in TASKS}


def sample_windows(streams: dict[str, torch.Tensor], batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    """[batch, length] windows, tasks in turn (equal share of each corpus), random offsets."""
    rows = []
    tasks = list(streams)
    for i in range(batch):
        s = streams[tasks[i % len(tasks)]]
        start = int(torch.randint(len(s) - length, (1,), generator=g))
        rows.append(s[start:start + length])
    return torch.stack(rows)


def lr_at(step: int, steps: int, lr: float, warmup: int = 30) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train_target(out: Path, *, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn=384, max_seq=256,
                 seq_len=128, batch=16, steps=500, lr=3e-3, seed=0, log=print) -> dict:
    torch.manual_seed(seed)
    # train with a cache as long as the window (attention cost), save with the serving context max_seq:
    # RoPE tables are not saved and agree on the first seq_len positions
    cfg = TinyConfig(vocab=256, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     ffn=ffn, max_seq=seq_len)
    model = init_weights(TinyDecoder(cfg), seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    streams, g = task_streams("train"), torch.Generator().manual_seed(seed)
    pos = torch.arange(seq_len)
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        x = sample_windows(streams, batch, seq_len + 1, g)
        k, v = model.new_cache(batch)
        logits = model(x[:, :-1], pos, k, v)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"target step {step}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    serving = TinyDecoder(TinyConfig(**{**cfg.__dict__, "max_seq": max_seq}))
    serving.load_state_dict(model.state_dict())
    sha = save_weights(serving.eval(), out)
    return {"path": str(out), "sha256": sha, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "seconds": time.perf_counter() - t0, "steps": steps}


@torch.no_grad()
def extract_hidden(target_path: Path, shards: Path, *, windows_per_task=96, seq_len=128, per_shard=64, seed=1,
                   log=print) -> dict:
    """Run the target once over training windows; write `hidden` [N, S, d] (the final normed hidden
    state), `features` [N, S, F x d] (the outputs of `feature_layers_for(n_layers)`, the last normed;
    fp16) and `tokens` [N, S] (int16) shards. This is the only step that runs the target."""
    from safetensors.torch import save_file

    model = load_weights(target_path, "cpu")
    if seq_len > model.cfg.max_seq:
        raise ValueError(f"seq_len={seq_len} exceeds the target's context max_seq={model.cfg.max_seq}")
    streams, g = task_streams("train"), torch.Generator().manual_seed(seed)
    shards.mkdir(parents=True, exist_ok=True)
    x = sample_windows(streams, windows_per_task * len(streams), seq_len, g)
    pos = torch.arange(seq_len)
    files, t0 = [], time.perf_counter()
    for i in range(0, len(x), per_shard):
        chunk = x[i:i + per_shard]
        k, v = model.new_cache(len(chunk))
        h = model.embed(chunk)
        read = [int(v) for v in feature_layers_for(model.cfg.n_layers).split(",")]
        outs = []
        for j, layer in enumerate(model.layers):
            h = layer(h, pos, model.cos, model.sin, k[j], v[j])
            if j + 1 in read[:-1]:
                outs.append(h)
        hidden = model.norm(h)
        features = torch.cat(outs + [hidden], dim=-1)
        path = shards / f"hidden-{i // per_shard:04d}.safetensors"
        save_file({"hidden": hidden.half().contiguous(), "features": features.half().contiguous(),
                   "tokens": chunk.to(torch.int16).contiguous()}, str(path))
        files.append(path.name)
    info = {"target": str(target_path), "windows": len(x), "seq_len": seq_len, "files": files,
            "feature_layers": feature_layers_for(model.cfg.n_layers),
            "seconds": time.perf_counter() - t0}
    (shards / "index.json").write_text(json.dumps(info, indent=1))
    log(f"extracted {len(x)} windows of {seq_len} tokens into {len(files)} shards ({info['seconds']:.1f} s)")
    return info


def load_shards(shards: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    info = json.loads((shards / "index.json").read_text())
    parts = [load_file(str(shards / f)) for f in info["files"]]
    return (torch.cat([p["hidden"] for p in parts]).float(), torch.cat([p["tokens"] for p in parts]).long())


def load_features(shards: Path) -> tuple[torch.Tensor, str]:
    """The shards' multi-layer features [N, S, F x d] and the layers they hold ('1,2,4')."""
    from safetensors.torch import load_file

    info = json.loads((shards / "index.json").read_text())
    parts = [load_file(str(shards / f)) for f in info["files"]]
    return torch.cat([p["features"] for p in parts]).float(), info["feature_layers"]


def training_time_test(draft: HiddenStateDraft, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                       unroll: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """EAGLE-3's training-time test. h [B, S, F x d]: the target's features at positions p - 1 for S
    draft positions p; x [B, S + unroll - 1]: the tokens at positions p, p + 1, ...; positions [B, S].

    Step 0, all S positions at once (causal self-attention): from the features at p - 1 and the
    token x_p. Step j = 1 .. unroll - 1: the chain that started at p continues from its own step j - 1
    output with the token x_{p+j}, attending to the step-0 entries at positions <= p (what the draft's
    cache holds at inference: the accepted prefix) and to its own earlier steps (its drafted
    positions): a causal block, then one diagonal block per earlier step, as EAGLE-3's training mask.
    -> per step (h_next, logits) [B, S, d], [B, S, V]; step j at chain p predicts position p + j."""
    B, S = h.shape[:2]
    causal = torch.ones(S, S, dtype=torch.bool, device=h.device).tril()
    diag = torch.eye(S, dtype=torch.bool, device=h.device)
    past, outs = None, []
    for j in range(unroll):
        mask = None if j == 0 else torch.cat([causal] + [diag] * j, dim=1).expand(B, S, (j + 1) * S)
        h, logits, kv = draft(h, x[:, j:j + S], positions + j, past, mask)
        past = kv if past is None else [(torch.cat([pk, k], 2), torch.cat([pv, v], 2))
                                        for (pk, pv), (k, v) in zip(past, kv)]
        outs.append((h, logits))
    return outs


def draft_loss(draft: HiddenStateDraft, H: torch.Tensor, X: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
               window: int, unroll: int, features: torch.Tensor | None = None) -> torch.Tensor:
    """H [N, S, d] target hidden states, X [N, S] tokens, features [N, S, F x d] (or None: H); window b
    covers row rows[b], positions starts[b] .. starts[b] + window + unroll - 1. Each step of the
    training-time test is scored against the target: KL from the target's next-token distribution
    and smooth-L1 to its final hidden state at the predicted position."""
    S, U = window, unroll
    idx = starts[:, None] + torch.arange(S + U)
    Xw, Hw = X[rows[:, None], idx], H[rows[:, None], idx]
    h = (features if features is not None else H)[rows[:, None], idx][:, :S]
    total = 0.0
    for j, (h_next, logits) in enumerate(training_time_test(draft, h, Xw[:, 1:], idx[:, 1:S + 1], U)):
        target_h = Hw[:, 1 + j:S + 1 + j]
        with torch.no_grad():
            p = F.softmax(F.linear(target_h, draft.lm_head_weight), dim=-1)
        kl = (p * (p.clamp_min(1e-9).log() - F.log_softmax(logits, -1))).sum(-1).mean()
        total = total + kl + F.smooth_l1_loss(h_next, target_h)
    return total / unroll


def train_draft(shards: Path, target_path: Path, out: Path, *, name="small", steps=800, windows=8, window=124,
                lr=2e-3, unroll=3, token_input="eagle3", seed=0, log=print) -> dict:
    torch.manual_seed(seed)
    n_layers, ffn = DRAFTS[name]
    target = load_weights(target_path, "cpu")           # only its embedding and LM head are used
    H, X = load_shards(shards)
    features, layers = load_features(shards)
    window = min(window, H.shape[1] - 1 - unroll)
    tc = target.cfg
    draft = HiddenStateDraft(DraftConfig(d_model=tc.d_model, vocab=tc.vocab, n_layers=n_layers, ffn=ffn,
                                         n_heads=tc.n_heads, n_kv_heads=tc.n_kv_heads, rope_theta=tc.rope_theta,
                                         feature_layers=layers, token_input=token_input), target)
    del target
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        rows = torch.randint(len(H), (windows,), generator=g)
        starts = torch.randint(H.shape[1] - window - unroll + 1, (windows,), generator=g)
        loss = draft_loss(draft, H, X, rows, starts, window, unroll, features)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"draft[{name}] step {step}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    sha = save_draft(draft.eval(), out, extra={"name": name, "steps": steps, "unroll": unroll, "windows": windows,
                                               "window": window, "trained_from": "hidden-state shards"})
    return {"path": str(out), "sha256": sha, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "seconds": time.perf_counter() - t0, "steps": steps, "name": name}


BLOCK_DRAFT_FILE = "dspark-block-draft.safetensors"


def block_draft_loss(draft, H: torch.Tensor, X: torch.Tensor, rows: torch.Tensor, anchors: torch.Tensor,
                     gamma: float = 4.0, conf_alpha: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The parallel draft's loss at anchored blocks, as speculators' DSpark trains it: H [N, S, d]
    the target's final hidden states, X [N, S] tokens; block b anchors at position anchors[b] of row
    rows[b], its context the features of the `window` positions before. Slot i predicts the token at
    anchor + i + 1: KL from the target's distribution there (softmax of the LM head at H[anchor + i]),
    weighted exp(-i / gamma) (`fixed-exp-decay`); the Markov head sees the true previous token
    (teacher forcing); the confidence head is scored by binary cross-entropy against whether the
    draft's argmax matches the target's at every slot up to i (how far the block would be accepted)."""
    cfg = draft.cfg
    K, W = cfg.block, cfg.window
    B = rows.shape[0]
    ctx_idx = anchors[:, None] - W + torch.arange(W)                          # [B, W] positions < anchor
    valid = ctx_idx >= 0
    ci = ctx_idx.clamp_min(0)
    feats = H[rows[:, None], ci]
    blk = anchors[:, None] + torch.arange(K)                                  # anchor .. anchor + K - 1
    tokens = X[rows[:, None], blk]                                            # slot i's previous token
    hidden, logits = draft.backbone(feats, ci, valid, tokens[:, 0], anchors)
    logits, conf = draft.heads(hidden, logits, tokens)
    with torch.no_grad():
        p = F.softmax(F.linear(H[rows[:, None], blk], draft.lm_head_weight), dim=-1)   # [B, K, V]
    kl = (p * (p.clamp_min(1e-9).log() - F.log_softmax(logits, -1))).sum(-1)            # [B, K]
    wts = torch.exp(-torch.arange(K, dtype=torch.float32) / gamma)
    loss = (kl * wts).sum(-1).mean() / wts.sum()
    match = (logits.argmax(-1) == p.argmax(-1)).float().cumprod(-1)          # accepted up to slot i (greedy)
    stats = {"kl": float(kl.mean()), "match_rate": float(match.mean())}
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf.float(), match)
        loss = loss + conf_alpha * bce
        stats["bce"] = float(bce)
    return loss, stats


def train_block_draft(shards: Path, target_path: Path, out: Path, *, steps=400, batch=32, block=8, n_layers=1,
                      ffn=256, markov_rank=32, window=48, lr=2e-3, seed=0, log=print) -> dict:
    """Train the DSpark-style parallel draft (`block_draft.BlockDraft`) from the hidden-state shards
    alone (the target's embedding and LM head are its only other inputs)."""
    from .block_draft import BlockDraft, BlockDraftConfig, save_block_draft

    torch.manual_seed(seed)
    target = load_weights(target_path, "cpu")
    H, X = load_shards(shards)
    tc = target.cfg
    draft = BlockDraft(BlockDraftConfig(d_model=tc.d_model, vocab=tc.vocab, block=block, n_layers=n_layers, ffn=ffn,
                                        n_heads=tc.n_heads, n_kv_heads=tc.n_kv_heads, markov_rank=markov_rank,
                                        window=window, rope_theta=tc.rope_theta), target)
    del target
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    t0, losses, stats = time.perf_counter(), [], {}
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        rows = torch.randint(len(H), (batch,), generator=g)
        anchors = torch.randint(1, H.shape[1] - block, (batch,), generator=g)
        loss, stats = block_draft_loss(draft, H, X, rows, anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"block draft step {step}/{steps} loss {loss.item():.3f} match {stats['match_rate']:.2f} "
                f"({time.perf_counter() - t0:.0f} s)")
    seconds = time.perf_counter() - t0
    sha = save_block_draft(draft.eval(), out, extra={"name": "block", "steps": steps, "batch": batch,
                                                     "trained_from": "hidden-state shards", "seconds": round(seconds)})
    return {"path": str(out), "sha256": sha, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "seconds": seconds, "steps": steps, **stats}


def run_all(out: Path, shards: Path, *, target_steps=500, draft_steps=800, windows_per_task=96, threads=1,
            log=print) -> dict:
    """Step 1 here; steps 2 and 3 each in a fresh Python process, talking only through files."""
    out.mkdir(parents=True, exist_ok=True)
    target_path = out / TARGET_FILE
    report = {"target": train_target(target_path, steps=target_steps, log=log)}
    base = [sys.executable, "-m", "inferbook.serving.train"]
    subprocess.run(base + ["extract", "--target", str(target_path), "--shards", str(shards),
                           "--windows-per-task", str(windows_per_task), "--threads", str(threads)], check=True)
    for name in DRAFTS:
        subprocess.run(base + ["draft", "--target", str(target_path), "--shards", str(shards), "--name", name,
                               "--out", str(out / draft_file(name)), "--steps", str(draft_steps),
                               "--threads", str(threads)], check=True)
    subprocess.run(base + ["block", "--target", str(target_path), "--shards", str(shards),
                           "--out", str(out / BLOCK_DRAFT_FILE), "--threads", str(threads)], check=True)
    report["shards"] = str(shards)
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m inferbook.serving.train", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--shards", type=Path, default=Path("_build/dspark-shards"))
    a.add_argument("--target-steps", type=int, default=500)
    a.add_argument("--draft-steps", type=int, default=800)
    a.add_argument("--windows-per-task", type=int, default=96)
    t = sub.add_parser("target")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=500)
    e = sub.add_parser("extract")
    e.add_argument("--target", type=Path, required=True)
    e.add_argument("--shards", type=Path, required=True)
    e.add_argument("--windows-per-task", type=int, default=96)
    e.add_argument("--seq-len", type=int, default=128)
    d = sub.add_parser("draft")
    d.add_argument("--target", type=Path, required=True)
    d.add_argument("--shards", type=Path, required=True)
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--name", choices=tuple(DRAFTS), default="small")
    d.add_argument("--steps", type=int, default=800)
    d.add_argument("--windows", type=int, default=8, help="training windows per step")
    d.add_argument("--window", type=int, default=124, help="draft positions per window (at most seq_len - 1 - unroll)")
    d.add_argument("--token-input", choices=("eagle3", "eagle1"), default="eagle3")
    d.add_argument("--lr", type=float, default=2e-3)
    b = sub.add_parser("block", help="train the DSpark-style parallel block draft from the shards")
    b.add_argument("--target", type=Path, required=True)
    b.add_argument("--shards", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--steps", type=int, default=400)
    b.add_argument("--batch", type=int, default=32, help="anchored blocks per step")
    for p in (a, t, e, d, b):
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cmd == "all":
        print(json.dumps(run_all(args.out, args.shards, target_steps=args.target_steps, draft_steps=args.draft_steps,
                                 windows_per_task=args.windows_per_task, threads=args.threads), indent=1))
    elif args.cmd == "target":
        print(json.dumps(train_target(args.out, steps=args.steps), indent=1))
    elif args.cmd == "extract":
        extract_hidden(args.target, args.shards, windows_per_task=args.windows_per_task, seq_len=args.seq_len)
    elif args.cmd == "block":
        print(json.dumps(train_block_draft(args.shards, args.target, args.out, steps=args.steps, batch=args.batch),
                         indent=1))
    else:
        print(json.dumps(train_draft(args.shards, args.target, args.out, name=args.name, steps=args.steps,
                                     windows=args.windows, window=args.window, token_input=args.token_input, lr=args.lr), indent=1))


if __name__ == "__main__":
    main()
