"""Turning logits into tokens: greedy (temperature 0) or temperature sampling with a seed.

Greedy is the argmax; its "probabilities" are the one-hot of the argmax, which is what
speculative verification needs so that greedy speculation reproduces greedy decoding.
"""
from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (fp32); temperature 0 gives the argmax one-hot."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [n, V] -> tokens [n] int64."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = probs_from_logits(logits, temperature)
    return torch.multinomial(probs.cpu() if generator is not None and generator.device.type == "cpu" else probs,
                             1, generator=generator).squeeze(-1).to(logits.device)


def exponential_race_sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [n, V] -> tokens [n] int64, one exact categorical draw per row: argmax(p / E) with
    E ~ Exp(1) i.i.d. (the 'exponential race'; vLLM's sampler uses it). Runs where `probs` lives,
    with `generator` on the same device, so a GPU caller needs no host sync."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / race).argmax(-1)
