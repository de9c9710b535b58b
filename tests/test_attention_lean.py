"""The stream-K (Lean-Attention-like) decode kernel: the plan covers every tile once, in order;
the kernel matches the fp32 definition within FlashAttention's rule; its cuts — and bits — move
with the whole batch, while the fixed-split path's do not."""
import pytest
import torch

import inferbook  # noqa: F401  (Triton interpreter on CPU)
from inferbook.attention import decode, lean
from inferbook.errors import UserError

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_plan_covers_every_tile_once_in_order():
    lens = [70, 0, 33, 200, 1]
    plan = lean.plan_lean(lens, 2, ctas=5)
    per_unit = {}
    for p, b, h, lo, hi in plan["pieces"]:
        assert lo < hi
        per_unit.setdefault((h, b), []).append((lo, hi, p))
    for h in range(2):
        for b, n in enumerate(lens):
            got = per_unit.get((h, b), [])
            want_tiles = -(-n // lean.BLOCK_N)
            assert sum(hi - lo for lo, hi, _ in got) == want_tiles
            assert [lo for lo, _, _ in got] == sorted(lo for lo, _, _ in got)
            assert [p for *_, p in got] == sorted(p for *_, p in got)   # host program first
    loads = [0] * plan["ctas"]
    for p, _, _, lo, hi in plan["pieces"]:
        loads[p] += hi - lo
    assert max(loads) - min(loads) <= 1 and sum(loads) == plan["total_tiles"]
    with pytest.raises(UserError, match="ctas"):
        lean.plan_lean(lens, 1, ctas=0)


def test_cuts_depend_on_the_rest_of_the_batch():
    alone = lean.cuts_of(lean.plan_lean([250], 1, ctas=4), 0)
    with_others = lean.cuts_of(lean.plan_lean([100, 250], 1, ctas=4), 1)
    first = lean.cuts_of(lean.plan_lean([250, 100], 1, ctas=4), 0)
    assert len({tuple(alone), tuple(with_others), tuple(first)}) > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_within_flashattention_rule(dtype):
    g = torch.Generator().manual_seed(3)
    B, H, Hk, D, S = 4, 4, 2, 40, 100
    q = torch.randn(B, H, D, generator=g).to(dtype).to(DEV)
    k = torch.randn(B, S, Hk, D, generator=g).to(dtype).to(DEV)
    v = torch.randn(B, S, Hk, D, generator=g).to(dtype).to(DEV)
    lens = torch.tensor([S, 0, 1, 37], dtype=torch.int32, device=DEV)
    ref = decode.decode_attention_reference(q, k, v, lens).float()
    low = decode.decode_attention_reference(q, k, v, lens, compute_dtype=dtype).float()
    floor = 2 * float(((ref + 0.3 - 0.3) - ref).abs().max())
    tol = 2 * float((low - ref).abs().max()) + floor
    for ctas in (1, 3, 7):
        out = lean.lean_decode_attention(q, k, v, lens, ctas=ctas)
        assert not out.isnan().any()
        assert float((out.float() - ref).abs().max()) <= tol
        assert (out[1] == 0).all()     # seqlen 0: zeros
    # the check can fail: a wrong scale is outside the tolerance
    bad = lean.lean_decode_attention(q, k, v, lens, ctas=3, scale=1.1 / D ** 0.5)
    assert float((bad.float() - ref).abs().max()) > tol


def test_stream_k_bits_move_with_batch_and_position_fixed_split_do_not():
    rows = lean.position_sweep(batch_sizes=(1, 3), heads=2, kv_heads=1, head_dim=32, max_seqlen=160,
                               target_len=150, dtype=torch.bfloat16, device=DEV, split_size=64, ctas=4)
    patterns = {}
    for r in rows:
        patterns.setdefault(r["kernel"], set()).add(r["bits"])
        assert not r["nan"]
    assert len(patterns["fixed split"]) == 1
    assert len(patterns["lean (stream-K)"]) > 1
