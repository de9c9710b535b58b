"""The W4A16 decode kernel (M <= 16): its offline repack, the inline asm's bit logic (through a
Python model: the interpreter runs the pure-tl path), split-K with both reductions, GPU tiles in the
interpreter, against the fp32 reference with a tolerance set by PyTorch's own BF16 error."""
import os
import subprocess
import sys

import pytest
import torch

import inferbook  # noqa: F401  (turns the Triton interpreter on first)
from inferbook.moe import w4a16 as W
from inferbook.moe.fused_moe import within_tolerance


def _case(n, k, group, layout="indexed", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = W.quantize(torch.randn(n, k, generator=g) * 0.05, group, layout=layout)
    return q, W.pack_decode(q)


def _x(m, k, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("layout", W.LAYOUTS)
@pytest.mark.parametrize("n, k, group", [(73, 288, 32), (40, 384, 128), (16, 512, 64)],
                         ids=["odd-n-k-tail", "group128-tail", "group64-two-runs"])
def test_repack_round_trip(layout, n, k, group):
    q, d = _case(n, k, group, layout)
    vals, s = W.unpack(q)
    dv, ds = W.unpack_decode(d)
    assert torch.equal(dv, vals[0]) and torch.equal(ds, s[0])
    assert d.qweight.shape == (d.k_padded // 8, n) and d.k_padded % W.RUN == 0


def test_word_holds_one_group_per_nibble():
    # word j of a run holds K offset 32 i + j in nibble i: nibble i of the 32 words is group i
    k = torch.arange(256)
    q = W.PackedW4(W._pack_nibbles_int32(((k % 16) - 8).to(torch.int8)[None]),
                   torch.ones(1, 8, dtype=torch.bfloat16), (1, 256), 32, "indexed")
    d = W.pack_decode(q)
    words = d.qweight[:, 0].to(torch.int64) & 0xFFFFFFFF
    for i in range(8):
        nib = (words >> (4 * i)) & 0xF
        assert torch.equal(nib - 8, ((32 * i + torch.arange(32)) % 16) - 8)


def _bf16_bits(v):
    return int(torch.tensor(float(v), dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF


@pytest.mark.parametrize("i", range(8))
def test_inline_asm_bit_logic(i):
    # the asm's prmt / shr / lop3 model gives bf16 (128 + u) of nibble i for both words of the pair
    g = torch.Generator().manual_seed(i)
    for w0, w1 in torch.randint(0, 2**32, (64, 2), generator=g, dtype=torch.int64).tolist():
        reg = W.nibble_asm_model(w0, w1, i)
        u0, u1 = (w0 >> (4 * i)) & 0xF, (w1 >> (4 * i)) & 0xF
        assert reg & 0xFFFF == _bf16_bits(128 + u0) and reg >> 16 == _bf16_bits(128 + u1)


@pytest.mark.parametrize("i", range(8))
def test_amdgcn_asm_bit_logic(i):
    # the AMDGCN path (v_perm_b32 / v_lshrrev_b32 / v_and_or_b32) gives bf16 (128 + u) of nibble i for both words
    g = torch.Generator().manual_seed(100 + i)
    for w0, w1 in [(0x76543210, 0xFEDCBA98), (0xFFFFFFFF, 0), *torch.randint(0, 2**32, (64, 2), generator=g,
                                                                              dtype=torch.int64).tolist()]:
        reg = W.nibble_perm_model(w0, w1, i)
        u0, u1 = (w0 >> (4 * i)) & 0xF, (w1 >> (4 * i)) & 0xF
        assert reg & 0xFFFF == _bf16_bits(128 + u0) and reg >> 16 == _bf16_bits(128 + u1)


def test_amdgcn_asm_is_what_the_model_checks(monkeypatch):
    # the kernel's selectors are the model's, in nibble order; its operands are the model's (w1 high, w0 low)
    import inspect
    src = inspect.getsource(W.nibble_bf16.fn)
    amd = src[src.index("ASM == 2"):src.index("else:   # bf16 bits")]
    (base, step), = __import__("re").findall(r"_nibble_pairs_amd\(words, (0x[0-9A-F]+) \+ (0x[0-9A-F]+) \* \(I // 2\)", amd)
    assert [int(base, 16) + int(step, 16) * (i // 2) for i in range(8)] == [W.NIBBLE_PERM[i // 2] for i in range(8)]
    asm = inspect.getsource(W._nibble_pairs_amd.fn)
    assert asm.count("v_perm_b32 $0, $2, $1, $3") == 2 and asm.count("v_and_or_b32 $0, $0, $5, $7") == 2
    monkeypatch.setattr(W, "NIBBLE_PERM", (0x0C040C00, 0x0C040C00, 0x0C060C02, 0x0C070C03))  # planted: byte 1 never read
    assert W.nibble_perm_model(0x76543210, 0xFEDCBA98, 2) & 0xFFFF != _bf16_bits(128 + 2)


@pytest.mark.parametrize("b", range(4))
def test_amdgcn_byte_asm_bit_logic(b):
    # the CDNA loop's dequantize: one v_perm_b32 for byte b of both words, then both of its nibbles
    g = torch.Generator().manual_seed(200 + b)
    for w0, w1 in [(0x76543210, 0xFEDCBA98), (0xFFFFFFFF, 0), (0, 0xFFFFFFFF),
                   *torch.randint(0, 2**32, (64, 2), generator=g, dtype=torch.int64).tolist()]:
        regs = W.nibble_byte_perm_model(w0, w1, b)
        for reg, i in zip(regs, (2 * b, 2 * b + 1)):
            u0, u1 = (w0 >> (4 * i)) & 0xF, (w1 >> (4 * i)) & 0xF
            assert reg & 0xFFFF == _bf16_bits(128 + u0) and reg >> 16 == _bf16_bits(128 + u1), (b, i)


def test_amdgcn_scale_fma_is_one_fused_multiply_add():
    # `_fma_amd`: v_fma_f32 D, S0, S1, S2 is S0 * S1 + S2 rounded once (CDNA3 ISA): $1 the MMA's part, $2 the
    # column scale, $3 the accumulator, as `group_dot` passes them; one element an asm (no pairing to copy into)
    import inspect
    src = inspect.getsource(W._fma_amd.fn)
    assert '"v_fma_f32 $0, $1, $2, $3", "=v,v,v,v", [x, y, z]' in src and "pack=1" in src
    gd = inspect.getsource(W.group_dot.fn)
    assert "_fma_amd(part, tl.broadcast_to(s[None, :], part.shape), acc)" in gd and "acc + part * s[None, :]" in gd


def test_amdgcn_byte_asm_is_what_the_model_checks():
    # the asm's instructions, operands and order are the model's: outputs $0 $1, words $2 (w0) $3 (w1), selector
    # $4, mask $6, magic $8 (pack=2: two registers an operand); the shift reads the permuted register before
    # its mask. The same instructions with the mask first lose the odd nibble, which the bit test would catch
    import inspect
    import re
    src = inspect.getsource(W._nibble_byte_amd.fn)
    text = "".join(re.findall(r'"([^"]*)"', src[src.index("inline_asm_elementwise"):src.index('"=&v')]))
    assert [t.strip() for t in text.split("\\n")] == ["v_perm_b32 $0, $3, $2, $4", "v_lshrrev_b32 $1, 4, $0",
                                                     "v_and_or_b32 $0, $0, $6, $8", "v_and_or_b32 $1, $1, $6, $8"]
    assert '"=&v,=&v,v,v,v,v,v,v,v,v", [words, sel, mask, magic]' in src and "pack=2" in src
    sel = inspect.getsource(W.nibble_byte_bf16.fn)
    (base, step), = re.findall(r"_nibble_byte_amd\(words, (0x[0-9A-F]+) \+ (0x[0-9A-F]+) \* B\)", sel)
    assert [int(base, 16) + int(step, 16) * b for b in range(4)] == list(W.NIBBLE_PERM)
    w0, w1 = 0x76543210, 0xFEDCBA98
    t = W._v_perm_b32(w0, w1, W.NIBBLE_PERM[1])
    masked_first = (((t & 0x000F000F) | 0x43004300) >> 4) & 0x000F000F | 0x43004300   # planted order
    assert masked_first & 0xFFFF != _bf16_bits(128 + 3) and W.nibble_byte_perm_model(w0, w1, 1)[1] & 0xFFFF == _bf16_bits(128 + 3)


def test_inline_asm_model_can_fail(monkeypatch):
    monkeypatch.setattr(W, "NIBBLE_PRMT", (0x4400, 0x4400, 0x6622, 0x7733))   # planted: byte 1 never read
    w0, w1 = 0x76543210, 0xFEDCBA98
    reg = W.nibble_asm_model(w0, w1, 2)
    assert reg & 0xFFFF != _bf16_bits(128 + 2)


# M 1, 2, 3, 7, 16; N odd; K with a tail run; both split-K reductions
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "atomic"])
def test_decode_matches_fp32_reference(m, deterministic):
    q, d = _case(73, 544, 32)
    x = _x(m, 544)
    out = W.decode_linear(x, d, deterministic=deterministic)
    assert out.shape == (m, 73) and out.dtype == torch.bfloat16
    err, tol, ok = within_tolerance(out, W.decode_reference(x, d), W.linear_torch(x, q))
    assert ok, (err, tol)


@pytest.mark.parametrize("layout", W.LAYOUTS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_decode_every_layout_and_group(layout, group):
    q, d = _case(40, 384, group, layout, seed=group)
    x = _x(3, 384)
    err, tol, ok = within_tolerance(W.decode_linear(x, d), W.decode_reference(x, d), W.linear_torch(x, q))
    assert ok, (err, tol)


def test_decode_gpu_tiles_in_the_interpreter():
    # the GPU's exact tile constexprs run here too: K 1024 is 4 runs, too few for a 128-column CTA of its own
    # split, so the short-CTA rule's 64 columns, 2 warps, 4 splits of one run and a 4-stage pipeline
    q, d = _case(200, 1024, 32)
    cfg = W.decode_config(1, 200, 1024)
    assert (cfg["BLOCK_N"], cfg["num_warps"], cfg["SPLIT_K"], cfg["num_stages"]) == (64, 2, 4, 4)
    x = _x(1, 1024)
    err, tol, ok = within_tolerance(W.decode_linear(x, d, block="gpu"), W.decode_reference(x, d), W.linear_torch(x, q))
    assert ok, (err, tol)


@pytest.mark.parametrize("m", [1, 5])
def test_decode_gpu_tiles_whole_column_blocks(m):
    # N a multiple of BLOCK_N 128 (EVEN_N): a run's scales are one [64, 8] int32 load (`run_scales`) -- the path
    # of the 128-column CTAs (chord's N 4096, K 7168); K 768 = 3 runs over a split of 3
    q, d = _case(256, 768, 32, seed=m)
    cfg = dict(BLOCK_M=16, BLOCK_N=128, SPLIT_K=3, num_warps=4, num_stages=3)
    x = _x(m, 768)
    err, tol, ok = within_tolerance(W.decode_linear(x, d, block=cfg), W.decode_reference(x, d), W.linear_torch(x, q))
    assert ok, (err, tol)


def test_decode_short_ctas_take_narrow_columns():
    # MiniMax-M3's shared MLP on sm_90: down (N 6144, K 1536: 6 runs) would be 6 splits of one run at 128
    # columns (2 CTAs an SM, the busiest SM a third chain); it takes 64 columns of 2 warps, 4 uneven splits
    # (96 x 4 CTAs, about 2.9 an SM); gate/up (N 3072, K 6144: 24 runs) 8 splits of 3 runs at 64 columns.
    # Shapes whose CTAs run 4 or more runs keep 128 columns (chord's N 4096, K 7168: 7 splits of 4 runs)
    from inferbook import device
    with device.building_for("sm_90"):
        down, gate_up, chord = (W.decode_config(1, 6144, 1536), W.decode_config(1, 3072, 6144),
                                W.decode_config(1, 4096, 7168))
    assert (down["BLOCK_N"], down["num_warps"], down["SPLIT_K"], down["num_stages"]) == (64, 2, 4, 4)
    assert (gate_up["BLOCK_N"], gate_up["SPLIT_K"]) == (64, 8)
    assert (chord["BLOCK_N"], chord["num_warps"], chord["SPLIT_K"]) == (128, 4, 7)


def test_decode_nan_never_passes():
    # one NaN scale in the weights the kernel reads (the reference reads the clean ones): the output's NaN fails
    q, d = _case(256, 512, 32)
    s = d.scales.clone()
    s[1, 8, 3, 1] = float("nan")   # run 1, column 17, group 3 of the run
    bad = W.DecodeW4(d.qweight, s, d.shape, d.group_size)
    x = _x(1, 512)
    out = W.decode_linear(x, bad, block="gpu")
    assert torch.isnan(out.float()).any()
    _, _, ok = within_tolerance(out, W.decode_reference(x, d), W.linear_torch(x, q))
    assert not ok


def test_decode_config_fills_the_sms():
    # N 4096, K 7168 at M = 1: 32 column blocks x split-K: every one of 132 SMs gets a CTA and most get two
    # (about 2 CTAs of 4 warps per SM), each split whole runs
    cfg = W.decode_config(1, 4096, 7168)
    ctas = -(-4096 // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
    assert 1.5 * W.H200_SMS <= ctas <= 2 * W.H200_SMS
    assert cfg["SPLIT_K"] <= 7168 // W.RUN and (7168 // W.RUN) % cfg["SPLIT_K"] == 0


def test_decode_sm100_config_uneven_split():
    # B200 (sm_100, 148 SMs): 64-column CTAs of 2 warps, 6 splits of the 28 runs at N 4096, K 7168 (4 or 5
    # runs each, 384 CTAs <= 3 per SM); the other NVIDIA targets keep 128 columns and whole equal splits
    from inferbook import device
    with device.building_for("sm_100"):           # M 16 (at M <= 8 it swaps: the test above)
        cfg = W.decode_config(16, 4096, 7168)
    assert (cfg["BLOCK_N"], cfg["num_warps"], cfg["SPLIT_K"]) == (64, 2, 6) and 28 % 6 and 64 * 6 <= 3 * 148
    with device.building_for("sm_90"):
        assert W.decode_config(1, 4096, 7168)["SPLIT_K"] == 7


@pytest.mark.parametrize("m, n, k", [(16, 3072, 6144), (16, 6144, 1536)])
def test_decode_sm100_short_ctas_take_equal_splits_and_a_deeper_pipeline(m, n, k):
    # MiniMax-M3's shared MLP on B200: 2.6 CTAs per SM would leave each CTA fewer than 4 runs; instead equal
    # splits (every CTA the same runs), more than one and at most two CTAs per SM, 4 stages (M 16: at
    # M <= 8 B200 swaps instead)
    from inferbook import device
    with device.building_for("sm_100"):
        cfg = W.decode_config(m, n, k)
    assert "SWAP_AB" not in cfg
    runs, ctas = k // W.RUN, (n // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
    assert runs % cfg["SPLIT_K"] == 0 and 148 < ctas <= 2 * 148 and cfg["num_stages"] == 4
    with device.building_for("sm_100"):            # chord-w4a16's N 4096, K 7168: 4 or 5 runs a CTA, 3 stages
        assert W.decode_config(16, 4096, 7168)["num_stages"] == 3


@pytest.mark.parametrize("n, k, split", [(6144, 1536, 6), (3072, 6144, 12), (4096, 7168, 9)],
                         ids=["minimax-down", "minimax-gate-up", "chord"])
def test_decode_sm100_swaps_ab_at_m_up_to_8(n, k, split):
    # B200 at M <= 8: the weights become the MMA's A operand (BLOCK_M 8), 64 columns of one warp, split K so
    # about 4 one-warp CTAs sit on each of 148 SMs (one a scheduler); at M 16 and on the other targets no swap
    from inferbook import device
    with device.building_for("sm_100"):
        for m in (1, 8):
            cfg = W.decode_config(m, n, k)
            assert cfg == dict(BLOCK_M=8, BLOCK_N=64, SPLIT_K=split, num_warps=1, num_stages=3, SWAP_AB=True)
            assert abs(n // 64 * split / 148 - 4) < 0.5
        assert "SWAP_AB" not in W.decode_config(16, n, k)
        la = W.decode_launches(1, n, k)[0]
    assert la.kernel is W.w4a16_decode_swapped_kernel and "swap-AB" in la.name and "SWAP_AB" not in la.kwargs
    for target in ("sm_80", "sm_90", "gfx942", "gfx950"):
        with device.building_for(target):
            assert "SWAP_AB" not in W.decode_config(1, n, k)


SWAPPED = dict(BLOCK_M=8, BLOCK_N=64, SPLIT_K=2, num_warps=1, num_stages=3, SWAP_AB=True)


# the swapped kernel's matrix: M 1..8 (BLOCK_M 8), N odd (a masked column block), K with a tail run, both
# split-K reductions; then every group size on an even N, and the same split unswapped for comparison
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8])
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "atomic"])
def test_decode_swapped_matches_fp32_reference(m, deterministic):
    q, d = _case(73, 544, 32, seed=m)
    x = _x(m, 544)
    out = W.decode_linear(x, d, block=SWAPPED, deterministic=deterministic)
    assert out.shape == (m, 73) and out.dtype == torch.bfloat16
    err, tol, ok = within_tolerance(out, W.decode_reference(x, d), W.linear_torch(x, q))
    assert ok, (err, tol)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_decode_swapped_every_group_whole_column_blocks(group):
    q, d = _case(128, 768, group, seed=group)
    x = _x(5, 768)
    ref, pt = W.decode_reference(x, d), W.linear_torch(x, q)
    for cfg in (dict(SWAPPED, SPLIT_K=3), dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=3, num_warps=2, num_stages=3)):
        err, tol, ok = within_tolerance(W.decode_linear(x, d, block=cfg), ref, pt)
        assert ok, (cfg, err, tol)


def test_decode_swapped_nan_never_passes_and_can_fail():
    q, d = _case(128, 512, 32)
    x = _x(4, 512)
    ref, pt = W.decode_reference(x, d), W.linear_torch(x, q)
    s = d.scales.clone()
    s[1, 40, 5, 0] = float("nan")                 # run 1, column 80, group 5 of the run
    out = W.decode_linear(x, W.DecodeW4(d.qweight, s, d.shape, d.group_size), block=SWAPPED)
    assert torch.isnan(out.float()).any() and not within_tolerance(out, ref, pt)[2]
    bad = W.DecodeW4(torch.roll(d.qweight, 1, dims=1), d.scales, d.shape, d.group_size)   # words one column over
    assert not within_tolerance(W.decode_linear(x, bad, block=SWAPPED), ref, pt)[2]


# The CDNA loop (`decode_run`'s CDNA_LOOP, the AMD configs): nibbles a byte at a time and a scale word a column.
# The interpreter runs its structure with the pure-tl dequantize (the asm is checked through its model above)
CDNA = dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=2, num_warps=2, num_stages=1, CDNA_LOOP=True)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "atomic"])
def test_decode_cdna_loop_matches_fp32_reference(m, deterministic):
    q, d = _case(73, 544, 32, seed=m)               # N odd: masked columns and scale words; K with a tail run
    x = _x(m, 544)
    out = W.decode_linear(x, d, block=CDNA, deterministic=deterministic)
    err, tol, ok = within_tolerance(out, W.decode_reference(x, d), W.linear_torch(x, q))
    assert ok, (err, tol)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_decode_cdna_loop_every_group_whole_column_blocks(group):
    q, d = _case(128, 768, group, seed=group)
    x = _x(3, 768)
    err, tol, ok = within_tolerance(W.decode_linear(x, d, block=dict(CDNA, SPLIT_K=3)), W.decode_reference(x, d),
                                    W.linear_torch(x, q))
    assert ok, (err, tol)


def test_decode_cdna_loop_nan_never_passes_and_can_fail():
    q, d = _case(128, 512, 32)
    x = _x(2, 512)
    ref, pt = W.decode_reference(x, d), W.linear_torch(x, q)
    s = d.scales.clone()
    s[1, 40, 5, 1] = float("nan")                 # run 1, column 81 (the odd half of its word), group 5
    out = W.decode_linear(x, W.DecodeW4(d.qweight, s, d.shape, d.group_size), block=CDNA)
    assert torch.isnan(out[:, 81].float()).all() and not torch.isnan(out[:, 80].float()).any()
    assert not within_tolerance(out, ref, pt)[2]
    halves = W.DecodeW4(d.qweight, d.scales.flip(-1), d.shape, d.group_size)    # planted: each word's halves swapped
    assert not within_tolerance(W.decode_linear(x, halves, block=CDNA), ref, pt)[2]


@pytest.mark.parametrize("block_n, waves", [(64, 2), (32, 1), (64, 1)])
def test_moe_decode_cdna_loop(block_n, waves):
    # the CDNA loop at the old 2-wave tile and at MI300X's 1-wave tiles (gate/up 32 columns, down 64)
    from inferbook.moe import fused_moe as FM
    w13, w2, x, tw, ids = _moe(4, 256, 64, 3, 2)
    out = FM.fused_moe_decode(x, W.pack_decode(w13), W.pack_decode(w2), tw, ids,
                              block=dict(BLOCK_M=16, BLOCK_N=block_n, num_warps=waves, num_stages=1, CDNA_LOOP=True))
    err, tol, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                       FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert ok, (err, tol)


@pytest.mark.parametrize("target, chord, gate_up, down", [
    ("gfx942", (64, 1, 14), (64, 1, 24), (32, 1, 6)),
    ("gfx950", (64, 1, 14), (64, 1, 24), (64, 1, 6))])
def test_decode_cdna_configs(target, chord, gate_up, down):
    # CDNA: the CDNA loop unpipelined on one-wave CTAs, about 2 runs a CTA (one where the runs are few); MI300X
    # narrows a grid of fewer than 2 CTAs a CU (MiniMax-M3's down: 96 x 6 = 576 < 608) to 32 columns. The MoE
    # decode takes its own tiles
    # (chord's EP8 rank: 48 experts, I 2048)
    from inferbook import device
    from inferbook.moe import fused_moe as FM
    with device.building_for(target):
        cfgs = [W.decode_config(m, n, k) for m in (1, 16) for n, k in ((4096, 7168), (3072, 6144), (6144, 1536))]
        moe = [FM.moe_decode_config(False, gated, n=2048, experts=48) for gated in (True, False)]
        ep = [FM.moe_decode_config(False, True, n=1536, experts=e, k=6144) for e in (1, 9, 17, 33)]
        no_k = FM.moe_decode_config(False, True, n=1536, experts=9)
    assert [(c["BLOCK_N"], c["num_warps"], c["SPLIT_K"]) for c in cfgs] == [chord, gate_up, down] * 2
    assert all(c["num_stages"] == 1 and c["CDNA_LOOP"] for c in cfgs + moe)
    assert [(c["BLOCK_N"], c["num_warps"]) for c in moe] == [FM.MOE_DECODE_CDNA["gfx950" if target == "gfx950" else "hip"][k]
                                                              for k in ("gated", "down")]
    # a gate/up grid of few experts (MiniMax-M3's EP ranks, I 1536, H 6144: 24 runs) splits K in 2, then 4, until it
    # has waves enough a CU, its tiles kept; one expert (24 CTAs, under half the CUs) is left as it is, and so is a
    # shape given without its K
    assert [c.get("SPLITS", 1) for c in ep] == [1, 4, 2, 1] and "SPLITS" not in no_k
    assert all((c["BLOCK_N"], c["num_warps"]) == (moe[0]["BLOCK_N"], moe[0]["num_warps"]) for c in ep)
    with device.building_for(target):                               # never more splits than runs (K 512: 2)
        assert FM.moe_decode_config(False, True, n=1536, experts=9, k=512)["SPLITS"] == 2
    with device.building_for("sm_90"):
        assert "CDNA_LOOP" not in W.decode_config(1, 4096, 7168) and "CDNA_LOOP" not in FM.moe_decode_config(False, True)
        assert all("SPLITS" not in FM.moe_decode_config(False, True, n=1536, experts=e, k=6144) for e in (1, 9, 17, 33))


def test_decode_block_m_must_hold_the_rows():
    q, d = _case(64, 256, 32)
    with pytest.raises(ValueError, match="BLOCK_M 8 holds fewer than the 9 rows"):
        W.decode_linear(_x(9, 256), d, block=SWAPPED)


@pytest.mark.parametrize("m", [12, 2], ids=["plain", "swap-AB"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_decode_uneven_split_in_the_interpreter(m, deterministic):
    # 7 runs over 5 splits (1, 1, 2, 1, 2 runs) at the GPU tiles, both reductions: every run summed once.
    # M 12: the plain kernel; M 2: sm_100 swaps (7 runs leave 5 splits short), the same split forced on it
    from inferbook import device
    q, d = _case(256, 7 * 256, 32, seed=3)
    with device.building_for("sm_100"):
        cfg = W.decode_config(m, 256, 7 * 256, sms=8)       # 4 column blocks of 64, 2.6 CTAs on 8 SMs
    assert bool(cfg.get("SWAP_AB")) == (m <= W.SWAP_MAX_M)
    cfg["SPLIT_K"] = 5 if m <= W.SWAP_MAX_M else cfg["SPLIT_K"]
    assert cfg["SPLIT_K"] == 5 and 7 % 5
    x = _x(m, 7 * 256)
    out = W.decode_linear(x, d, block=cfg, deterministic=deterministic)
    err, tol, ok = within_tolerance(out, W.decode_reference(x, d), W.linear_torch(x, q))
    assert ok, (err, tol)


def test_decode_can_fail():
    # a planted bug -- the words shifted by one column -- is caught by the same tolerance
    q, d = _case(40, 512, 32)
    bad = W.DecodeW4(torch.roll(d.qweight, 1, dims=1), d.scales, d.shape, d.group_size)
    x = _x(2, 512)
    _, _, ok = within_tolerance(W.decode_linear(x, bad), W.decode_reference(x, d), W.linear_torch(x, q))
    assert not ok


def test_decode_bad_input():
    q, d = _case(16, 256, 32)
    with pytest.raises(ValueError, match="DecodeW4"):
        W.decode_linear(_x(1, 256), q)
    with pytest.raises(ValueError, match="at most 16 rows"):
        W.decode_linear(_x(17, 256), d)
    with pytest.raises(ValueError, match="multiple of 32"):
        W.pack_decode(W.quantize(torch.randn(16, 256), 16))
    with pytest.raises(ValueError, match="bfloat16"):
        W.decode_linear(torch.randn(1, 256), d)


# ---------------------------------------------------------------------------
# The MoE layer on the decode kernel (masked rows, at most 16 per expert)

def _moe(E, H, I, T, k, layout="indexed", seed=3):
    from inferbook.moe import fused_moe as FM  # noqa: F401
    g = torch.Generator().manual_seed(seed)
    w13 = W.quantize(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, layout=layout)
    w2 = W.quantize(torch.randn(E, H, I, generator=g) / I ** 0.5, layout=layout)
    x = torch.randn(T, H, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g)
    logits[:, 0] = -1e4                           # expert 0 gets no rows: its programs load nothing
    tw, ids = logits.softmax(-1).topk(k)
    return w13, w2, x, tw / tw.sum(-1, keepdim=True), ids.to(torch.int32)


@pytest.mark.parametrize("tokens", [1, 3, 16], ids=["T1", "T3", "T16"])
def test_moe_decode_matches_fp32_reference(tokens):
    from inferbook.moe import fused_moe as FM
    w13, w2, x, tw, ids = _moe(4, 256, 64, tokens, 2)
    out = FM.fused_moe_decode(x, W.pack_decode(w13), W.pack_decode(w2), tw, ids)
    assert out.shape == (tokens, 256) and out.dtype == torch.bfloat16
    err, tol, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                       FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert ok, (err, tol)


def test_moe_decode_from_every_layout_and_its_refusals():
    from inferbook.moe import fused_moe as FM
    w13, w2, x, tw, ids = _moe(4, 256, 64, 3, 2, layout="grouped_masked")
    d13, d2 = W.pack_decode(w13), W.pack_decode(w2)
    ref = FM.fused_moe_reference(x, w13, w2, tw, ids)
    err, tol, ok = FM.within_tolerance(FM.fused_moe_decode(x, d13, d2, tw, ids, block="gpu"), ref,
                                       FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert ok, (err, tol)
    # planted bug: gate and up halves swapped in the repacked table -> caught
    bad = W.DecodeW4(torch.roll(d13.qweight, 64, dims=-1), torch.roll(d13.scales, 32, dims=-3), d13.shape, 32)
    _, _, ok = FM.within_tolerance(FM.fused_moe_decode(x, bad, d2, tw, ids), ref, FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert not ok
    with pytest.raises(ValueError, match="DecodeW4"):
        FM.fused_moe_decode(x, w13, d2, tw, ids)
    big_ids = torch.ones((17, 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        FM.fused_moe_decode(torch.zeros(17, 256, dtype=torch.bfloat16), d13, d2, torch.ones(17, 1), big_ids)


def test_tl_dequantize_is_exact_bf16_bits():
    # the pure-tl path (AMD, the interpreter): nibble I of each word as the bf16 bits 0x4300 | u, which are
    # 128 + u exactly (u 0..15 in the low mantissa bits of 128's exponent); every nibble, every value
    import triton
    import triton.language as tl

    @triton.jit
    def nib(w_ptr, o_ptr, I: tl.constexpr):
        offs = tl.arange(0, 32)[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(o_ptr + offs, W.nibble_bf16(tl.load(w_ptr + offs), I, False))

    g = torch.Generator().manual_seed(7)
    words = torch.randint(-2**31, 2**31, (32, 16), generator=g, dtype=torch.int64).to(torch.int32)
    words[0, :] = torch.tensor([sum(v << (4 * i) for i in range(8)) for v in range(16)], dtype=torch.int64).to(torch.int32)
    for i in range(8):
        out = torch.empty(32, 16, dtype=torch.bfloat16)
        nib[(1,)](words, out, i)
        u = (words.to(torch.int64) >> (4 * i)) & 0xF
        assert torch.equal(out.float(), (128 + u).float()), i


def test_dequantize_path_follows_the_target(monkeypatch):
    # inline PTX (prmt/lop3, ASM 1) for NVIDIA targets; inline AMDGCN (v_perm_b32/v_and_or_b32, ASM 2) for AMD
    # (inspect's building_for, or a ROCm GPU); the pure-tl path (ASM 0) in the interpreter
    from inferbook import device
    from inferbook.moe import fused_moe as FM
    monkeypatch.setattr(W, "dot_needs_fp32", lambda d: False)      # what a GPU passes
    for target, asm in (("sm_90", 1), ("sm_100", 1), ("gfx942", 2), ("gfx950", 2)):
        with device.building_for(target):
            (dense,) = W.decode_launches(1, 256, 512)
            moe = [la for la in FM.fused_moe_decode_launches(4, 2, 4, 256, 64, max_m=2) if la.kernel is FM.moe_decode_kernel]
        assert dense.kwargs["ASM"] == asm and all(la.kwargs["ASM"] == asm for la in moe), target


def test_moe_decode_narrow_columns_where_the_last_round_is_far_from_full():
    # an EP8 rank of MiniMax-M3 on B200 (9 local experts, I 1536): 24 x 9 = 216 CTAs of 64 columns on 148 SMs
    # leave the busiest SM two where the average is 1.46; 32 columns of 2 warps (432 CTAs) fill the rounds.
    # The fused-slot MoE (65 experts) keeps 64; the down launch (no rule) keeps 128 (CDNA: its own rule, below)
    from inferbook import device
    from inferbook.moe import fused_moe as FM
    shape = dict(n=1536, experts=9)
    with device.building_for("sm_100"):
        assert [FM.moe_decode_config(False, True, **shape)[k] for k in ("BLOCK_N", "num_warps")] == [32, 2]
        assert FM.moe_decode_config(False, True, n=1536, experts=65)["BLOCK_N"] == 64
        assert FM.moe_decode_config(False, False)["BLOCK_N"] == 128
    with device.building_for("sm_90"):
        assert FM.moe_decode_config(False, True, **shape)["BLOCK_N"] == 64       # 216 CTAs on 132 SMs
        assert FM.moe_decode_config(False, True, n=1536, experts=17)["BLOCK_N"] == 32


@pytest.mark.parametrize("tokens", [1, 5])
def test_moe_decode_32_column_tiles(tokens):
    # the 32-column gated tiles the rule above picks, in the interpreter (2 column blocks of I 64)
    from inferbook.moe import fused_moe as FM
    w13, w2, x, tw, ids = _moe(4, 256, 64, tokens, 2)
    out = FM.fused_moe_decode(x, W.pack_decode(w13), W.pack_decode(w2), tw, ids, block=dict(BLOCK_M=16, BLOCK_N=32))
    err, tol, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                       FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert ok, (err, tol)



@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("cdna", [False, True], ids=["nvidia-loop", "cdna-loop"])
def test_moe_decode_split_k_matches_fp32_reference(splits, cdna, monkeypatch):
    # split-K in the MoE decode kernel: H 768 is 3 runs (4 splits: one split without a run), I 64 one run (the
    # down launch's later splits have none); expert 0 has no rows (its splits count nothing); the arrival counts
    # are zero again after each launch
    from inferbook.moe import fused_moe as FM
    made = []
    real = FM.decode_split_buffers
    monkeypatch.setattr(FM, "decode_split_buffers", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    w13, w2, x, tw, ids = _moe(4, 768, 64, 5, 2)
    block = dict(BLOCK_M=16, BLOCK_N=32, SPLITS=splits, **(dict(num_warps=2, num_stages=1, CDNA_LOOP=True) if cdna else {}))
    d13, d2 = W.pack_decode(w13), W.pack_decode(w2)
    out = FM.fused_moe_decode(x, d13, d2, tw, ids, block=block)
    ref, pt = FM.fused_moe_reference(x, w13, w2, tw, ids), FM.fused_moe_torch(x, w13, w2, tw, ids)
    err, tol, ok = FM.within_tolerance(out, ref, pt)
    assert ok, (err, tol)
    assert [p.shape for p, _ in made] == [(splits, 4 * 5, 128), (splits, 4 * 5, 768)]
    assert all(int(lock.abs().sum()) == 0 and lock.shape in ((4, 2), (4, 24)) for _, lock in made)
    # a second call: the same bits (partials summed in split order), its counts views of the one zeroed
    # workspace the first call grew (no zero fill a call), zero again after
    ws = FM._lock_workspace(x.device, 1).data_ptr()
    assert torch.equal(FM.fused_moe_decode(x, d13, d2, tw, ids, block=block), out)
    assert [lock.data_ptr() for _, lock in made[2:]] == [ws, ws] and all(int(lock.abs().sum()) == 0 for _, lock in made)
    # planted: arrival counts left at 1 by an earlier launch, so a split reduces before the last one has
    # stored its partials (they read as zeros) -> caught
    def stale(*a, **kw):               # a copy: the workspace itself stays zero for the launches after
        part, lock = real(*a, **kw)
        return part.zero_(), torch.ones_like(lock)
    monkeypatch.setattr(FM, "decode_split_buffers", stale)
    assert not FM.within_tolerance(FM.fused_moe_decode(x, d13, d2, tw, ids, block=block), ref, pt)[2]


def test_moe_decode_split_k_nan_never_passes():
    from inferbook.moe import fused_moe as FM
    w13, w2, x, tw, ids = _moe(4, 768, 64, 3, 2)
    x[1, 700] = float("nan")                                       # in the last split's runs
    out = FM.fused_moe_decode(x, W.pack_decode(w13), W.pack_decode(w2), tw, ids, block=dict(BLOCK_M=16, BLOCK_N=32, SPLITS=3))
    assert torch.isnan(out[1].float()).all() and not torch.isnan(out[[0, 2]].float()).any()
    assert not FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids), FM.fused_moe_torch(x, w13, w2, tw, ids))[2]


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_100", "gfx942", "gfx950"])
def test_decode_check_paths_share_one_config(target):
    # minimax's decode check is bitwise: the fused slot (65 experts) against the routed experts (64) plus the
    # shared one as its own MoE (1), all on moe_decode_kernel with one config; the shape rule must not split them
    from inferbook import device
    from inferbook.moe import fused_moe as FM
    with device.building_for(target):
        cfgs = [FM.moe_decode_config(False, True, n=1536, experts=e, k=6144) for e in (65, 64, 1)]
    assert cfgs[0] == cfgs[1] == cfgs[2]


AMD_SPLIT_LISTING = """
import sys
from inferbook import compiled
from inferbook.device import building_for
from inferbook.moe import fused_moe as FM
with building_for(sys.argv[1]):
    gate_up = FM.fused_moe_decode_launches(12, 1, 9, 6144, 1536, max_m=12)[0]
assert " split" in gate_up.name, gate_up.name
sys.stdout.write(compiled.amdgcn(gate_up, sys.argv[1]))
"""


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_amd_split_k_publishes_every_waves_partials(target, tmp_path):
    # the last-arrival reduction on CDNA: each wave's partial stores are acknowledged (s_waitcnt vmcnt(0)) before
    # the CTA barrier, the count is a release atomic (L2 written back first) and the arrival's reads come after
    # an acquire (L2 invalidated). Without the wait only the atomic's own wave would have waited for its stores
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "TRITON_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", AMD_SPLIT_LISTING, target], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    # "; wave barrier": the barrier of a one-wave workgroup (nothing to wait for but the wave itself)
    ins = [ln.strip() if ln.strip() == "; wave barrier" else ln.split(";")[0].strip() for ln in r.stdout.splitlines()]
    ins = [s for s in ins if s and not s.startswith((".", "//")) and not s.endswith(":")]
    at = next(i for i, s in enumerate(ins) if s.startswith("global_atomic_add"))
    last_store = max(i for i, s in enumerate(ins[:at]) if s.startswith(("buffer_store", "global_store")))
    barriers = [i for i in range(last_store + 1, at) if ins[i] in ("s_barrier", "; wave barrier")]
    assert barriers, ins[last_store:at + 1]
    assert "s_waitcnt vmcnt(0)" in ins[last_store + 1:barriers[-1]], ins[last_store:barriers[-1] + 1]
    assert any(s.startswith("buffer_wbl2") for s in ins[barriers[-1]:at]), ins[barriers[-1]:at + 1]
    assert any(s.startswith("buffer_inv") for s in ins[at:at + 4]), ins[at:at + 4]


def test_committed_split_rows_pay_the_last_arrival():
    # the compile table's MoE split-K rows carry their acq_rel count (machine.sync_atomics from the IR), so the
    # cost model's latency chain pays its round trip and the partials' reads; the unsplit rows carry none
    from inferbook import compiled

    rows = [r for r in compiled.load_table("minimax-m3-moe")["rows"] if r.get("kernel") == "moe_decode_kernel"]
    split = [r for r in rows if " split" in r["launch"]]
    assert split and all(r["sync_atomics"] == 1 for r in split)
    assert all(r["sync_atomics"] == 0 for r in rows if " split" not in r["launch"])
    r = split[0]
    card = compiled.TARGET_CARD[r["target"]]
    with_it, without = compiled.predict(r, card), compiled.predict({**r, "sync_atomics": 0}, card)
    lat = compiled.cost.LATENCY_NS["amd"] * 1e-9
    assert with_it["bounds"]["latency"] == pytest.approx(without["bounds"]["latency"] + 2 * lat)
