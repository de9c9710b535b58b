"""CUDA Graph replay and retained gradients (Transformer Engine 2.19, fix #2937).

A captured graph writes into the same static buffers on every replay, parameter gradients
included. The TE fix keeps a later replay from overwriting gradients retained from an earlier
one. `retained_gradient_check` captures forward + backward of a small MLP, replays it on two
different batches and checks: (1) gradients retained (copied out) after replay A still equal
eager gradients of batch A after replay B; (2) replay B's gradients equal eager B; and it reports
(3) whether a *reference* kept to replay A's gradient (no copy) was overwritten: the hazard the
fix is about, which any framework that retains gradients across replays must handle.
"""
from __future__ import annotations

import torch


class NeedsCuda(RuntimeError):
    """The check needs a CUDA device (CUDA Graphs do not exist on CPU)."""


def retained_gradient_check(device: torch.device, *, width: int = 256, batch: int = 64, seed: int = 0) -> dict:
    if device.type != "cuda":
        raise NeedsCuda("CUDA Graph replay needs a CUDA device; on CPU this check is skipped, not passed")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 8)).to(device)
    params = list(model.parameters())
    x_a, x_b = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    y = torch.randn(batch, 8, device=device)

    def eager_grads(x):
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        return [p.grad.detach().clone() for p in params]

    ref_a, ref_b = eager_grads(x_a), eager_grads(x_b)
    static_x = x_a.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(static_x), y).backward()
    torch.cuda.current_stream(device).wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.nn.functional.mse_loss(model(static_x), y).backward()

    static_x.copy_(x_a)
    graph.replay()
    torch.cuda.synchronize(device)
    kept_refs = [p.grad for p in params]                       # references: alias the static buffers
    kept_copies = [p.grad.detach().clone() for p in params]    # copies: what retaining must mean
    static_x.copy_(x_b)
    graph.replay()
    torch.cuda.synchronize(device)

    def close(a, b):
        return all(torch.allclose(u, v, rtol=1e-4, atol=1e-6) for u, v in zip(a, b))

    return {
        "retained_copies_equal_eager_A": close(kept_copies, ref_a),
        "replay_B_equals_eager_B": close([p.grad for p in params], ref_b),
        "reference_to_A_overwritten_by_B": close(kept_refs, ref_b) and not close(ref_a, ref_b),
        "params": sum(p.numel() for p in params),
    }
