"""Correctness checks the serving chapters run on fresh random inputs before measuring.

Each returns numbers (errors, tolerances, equalities) for the notebook to assert and show;
the unit tests in `tests/test_serving_*.py` cover the same properties over a matrix.
"""
from __future__ import annotations

import torch

from .config import EngineConfig, draft_slots_for
from .engine import LLMEngine
from .model import TinyDecoder, reference_logits
from .model_runner import ModelRunner
from .sequence import SamplingParams


def _as_double(model: TinyDecoder) -> TinyDecoder:
    m = TinyDecoder(model.cfg).double().eval()
    m.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    return m


@torch.no_grad()
def paged_vs_dense(model: TinyDecoder, prompt_len: int, chunks: int, generator: torch.Generator,
                   block_size: int = 16) -> dict:
    """Logits of a random prompt fed in `chunks` chunks through shuffled KV pages, against one dense
    forward. Error is measured against a float64 forward; the tolerance is twice the dense forward's
    own error in the model's dtype (plus a hair for exact ties)."""
    cfg = model.cfg
    tokens = torch.randint(cfg.vocab, (prompt_len,), generator=generator).tolist()
    nblocks = -(-prompt_len // block_size)
    runner = ModelRunner(model, nblocks + 3, block_size)
    table = torch.randperm(nblocks + 3, generator=generator)[:nblocks].tolist()
    cuts = sorted(torch.randperm(prompt_len - 1, generator=generator)[:chunks - 1].add(1).tolist())
    bounds = [0] + cuts + [prompt_len]
    rows = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        logits, _ = runner.forward(runner.prepare([(tokens[a:b], a, table, True)]))
        rows.append(logits.double().cpu())
    paged = torch.cat(rows)
    t = torch.tensor([tokens], device=runner.device)
    dense = reference_logits(model, t)[0].double().cpu()
    exact = reference_logits(_as_double(model), t.cpu())[0]
    ref_err = float((dense - exact).abs().max())
    err = float((paged - exact).abs().max())
    tol = 2 * ref_err + 1e-6 * float(exact.abs().max())
    return {"chunks": [b - a for a, b in zip(bounds[:-1], bounds[1:])], "error": err, "dense_error": ref_err,
            "tolerance": tol, "finite": bool(torch.isfinite(paged).all()),
            "passed": bool(torch.isfinite(paged).all()) and err <= tol}


def greedy_speculation_matches(model: TinyDecoder, prompts: list[list[int]], max_tokens: int, k: int,
                               drafter=None, budget: int = 512) -> dict:
    """Greedy outputs with speculation (k draft tokens, rejection sampling) against plain greedy."""
    params = SamplingParams(max_tokens=max_tokens)
    plain = LLMEngine(model, EngineConfig(max_num_batched_tokens=budget, max_num_seqs=len(prompts)))
    ref = plain.generate(prompts, params)
    kind = getattr(drafter, "kind", None)
    slots = draft_slots_for(kind, k) if kind else 0
    spec = LLMEngine(model, EngineConfig(max_num_batched_tokens=max(budget, len(prompts) * (k + 1 + slots)),
                                         max_num_seqs=len(prompts), num_spec_tokens=k, draft_slots=slots),
                     drafter=drafter)
    out = spec.generate(prompts, params)
    mismatched = sum(a != b for a, b in zip(out, ref))
    return {"requests": len(prompts), "mismatched_requests": mismatched, "equal": mismatched == 0,
            "mean_acceptance_length": spec.acceptance.mean_acceptance_length(),
            "plain_steps": len(plain.steps), "speculative_steps": len(spec.steps)}
