"""MXFP4 on the decode loop (`moe.mxfp4_decode`): the repack is lossless, the asm's bit logic (PTX and
AMDGCN, through their Python models) gives every e2m1 code its exact value at every position of the word,
the kernel's selectors are the table's, and the decode tail on it matches the fp32 reference in both its
scale paths (folded into the FMA, and exact per group) and fails when it should."""
import random
from pathlib import Path

import pytest
import torch

import inferbook  # noqa: F401
from inferbook.moe import fused_moe as FM, mxfp4 as MXF, mxfp4_decode as D
from inferbook.numerics import mx as MX


def _word(codes) -> int:
    """A 32-bit word holding eight e2m1 codes at `CODE_BITS`."""
    x = 0
    for i, c in enumerate(codes):
        ps, pe1, pe0, pm = D.CODE_BITS[i]
        x |= ((c >> 3) & 1) << ps | ((c >> 2) & 1) << pe1 | ((c >> 1) & 1) << pe0 | (c & 1) << pm
    return x


def _bf16_bits(v: float) -> int:
    return int(torch.tensor([v]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


# e2m1 code -> value, from numerics.mx (the reference), not from a table of ours
E2M1 = MX.dequantize(MX.MXTensor(torch.arange(16, dtype=torch.uint8).repeat(2).reshape(1, 32),
                                 torch.tensor([[127]], dtype=torch.uint8), "e2m1", 1, 32, "floor"))[0, :16].tolist()


def test_the_codes_fill_the_word_and_the_selectors_follow_the_table():
    assert sorted(b for code in D.CODE_BITS for b in code) == list(range(32))
    for i, (l, h, kind, s) in enumerate(D.CODE_DECODE):
        assert D.PRMT_SEL[i] == l | h << 4 | (4 + l) << 8 | (4 + h) << 12
        assert D.PERM_SEL[i] == l | h << 8 | (4 + l) << 16 | (4 + h) << 24
    # the kernel spells each code's selector, kind and shift out (Triton's constexprs): they are the table's
    kind_code = {"fast": 1, "two-shift": 2}
    src = Path(D.__file__).read_text()
    for i, (l, h, kind, s) in enumerate(D.CODE_DECODE):
        k = 0 if kind == "fast" and s == 0 else kind_code[kind]
        assert f'_fp4_pair_ptx(words, mult, "{D.PRMT_SEL[i]:#06x}", {k}, "{s}")' in src, i
        assert f'_fp4_bits_amd(words, {D.PERM_SEL[i]:#010x}, {k}, "{s}")' in src, i
        assert f"_fp4_value_tl(words, {', '.join(map(str, D.CODE_BITS[i]))})" in src, i


@pytest.mark.parametrize("amd", [False, True], ids=["ptx", "amdgcn"])
def test_asm_models_give_every_code_its_value_at_every_position(amd):
    rng = random.Random(7)
    for i in range(8):
        for c0 in range(16):
            for _ in range(4):   # the other codes of both words random: no bleed between codes
                codes0 = [rng.randrange(16) for _ in range(8)]
                codes1 = [rng.randrange(16) for _ in range(8)]
                codes0[i] = c0
                lo, hi = D.decode_asm_model(_word(codes0), _word(codes1), i, amd=amd)
                assert lo == _bf16_bits(E2M1[c0]), (i, c0)
                assert hi == _bf16_bits(E2M1[codes1[i]]), (i, codes1[i])


def test_folded_scale_is_the_exact_weight_for_every_byte_it_takes():
    # pair_scale's prmt + mad, and the FMA of the code bits by it, in Python
    for b in range(D.FOLD_SCALES[0], D.FOLD_SCALES[1] + 1):
        sw = (b << 8) | 0x11           # byte 1 of the word (the asm's J = 1)
        t = ((sw >> 8) & 0xFF) | ((sw >> 8) & 0xFF) << 16
        mult = (t * 128 + 0x3F003F00) & 0xFFFFFFFF
        assert mult & 0xFFFF == mult >> 16 == _bf16_bits(2.0 ** (b - 1)), b
        for c in range(16):
            bits = D.code_bits_model(_word([c] * 8), 0, 0) & 0xFFFF
            x = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double()
            got = _bf16_bits(float(x * 2.0 ** (b - 1)))
            assert got == _bf16_bits(E2M1[c] * 2.0 ** (b - 127)), (b, c)
            assert E2M1[c] == 0 or abs(E2M1[c] * 2.0 ** (b - 127)) >= 2.0 ** -126   # normal: no subnormal operand


@pytest.mark.parametrize("shape", [(6, 544), (3, 7, 256), (2, 5, 32)], ids=["2d-pad", "3d", "3d-one-group"])
def test_repack_is_lossless(shape):
    g = torch.Generator().manual_seed(len(shape))
    p = MXF.quantize(torch.randn(*shape, generator=g))
    d = D.pack_decode(p)
    u = D.unpack_decode(d)
    assert torch.equal(u.qweight, p.qweight) and torch.equal(u.scales, p.scales) and u.shape == p.shape
    assert torch.equal(D.dequantize_decode(d), MXF.dequantize(p))
    n, k = shape[-2:]
    assert d.nbytes == (shape[0] if len(shape) == 3 else 1) * D.decode_weight_bytes(n, k)
    assert (d.qweight.shape[-2:], d.scales.shape[-3:]) == D.decode_packed_shapes(n, k)
    assert d.fold


def test_scales_outside_the_fold_range_take_the_exact_path():
    p = MXF.quantize(torch.randn(4, 64))
    assert D.pack_decode(p).fold
    for b in (0, 1, 129, 255):
        s = p.scales.clone()
        s[1, 0] = b
        assert not D.pack_decode(MXF.PackedMXFP4(p.qweight, s, p.shape)).fold


def _routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k)
    return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32)


# E, k, T, H, I: H a multiple of the column block or not, I a multiple of 256 or not (the pad), several row
# blocks of one expert, T*k < E
TAIL = [(8, 2, 5, 96, 288), (16, 4, 1, 64, 256), (4, 2, 20, 130, 64)]


@pytest.mark.parametrize("E, k, T, Hd, Id", TAIL, ids=[f"E{E}-k{k}-T{T}-H{h}-I{i}" for E, k, T, h, i in TAIL])
@pytest.mark.parametrize("block", [None, "gpu"], ids=["interp-tiles", "gpu-tiles"])
def test_decode_tail_mxfp4_matches_reference_both_scale_paths(E, k, T, Hd, Id, block):
    g = torch.Generator().manual_seed(E * T + Id)
    p = MXF.quantize(torch.randn(E, Hd, Id, generator=g) * 0.1)
    d = D.pack_decode(p)
    assert d.fold
    exact = D.DecodeMXFP4(d.qweight, d.scales, d.shape, fold=False)
    tw, ids = _routing(T, E, k, T + k)
    act = torch.randn(T * k, Id, generator=g).bfloat16()
    ref = FM.moe_tail_reference(act, p, tw, ids)
    assert torch.equal(ref, FM.moe_tail_reference(act, d, tw, ids))
    pt = FM.moe_tail_torch(act, p, tw, ids)
    for w in (d, exact):
        fused, n, _ = FM.moe_tail(act, w, tw, ids, fused=True, kernel="decode", block=block)
        sep32, _, _ = FM.moe_tail(act, w, tw, ids, fused=False, inter_dtype=torch.float32, kernel="decode", block=block)
        assert n == 3
        err, tol, ok = FM.within_tolerance(fused, ref, pt)
        assert ok, (w.fold, err, tol)
        ok, worst = FM.reorder_bound(fused, sep32, act, p, tw, ids)
        assert ok, (w.fold, worst)


def test_decode_tail_mxfp4_exact_path_keeps_tiny_and_nan_scales():
    # E8M0 0 is 2**-127 (an fp32 subnormal) and 255 NaN: the exact path keeps both, as numerics.mx does
    E, Hd, Id, T, k = 2, 64, 64, 3, 1
    p = MXF.quantize(torch.randn(E, Hd, Id))
    s = p.scales.clone()
    s[:, 5, 1] = 0        # column 5, group 1: 2**-127
    s[:, 9, 0] = 255      # column 9, group 0: NaN
    p = MXF.PackedMXFP4(p.qweight, s, p.shape)
    d = D.pack_decode(p)
    assert not d.fold
    tw, ids = torch.ones(T, k), torch.zeros(T, k, dtype=torch.int32)
    act = torch.randn(T * k, Id).bfloat16()
    out, _, _ = FM.moe_tail(act, d, tw, ids, fused=True, kernel="decode")
    ref = FM.moe_tail_reference(act, p, tw, ids)
    assert torch.isnan(out[:, 9]).all() and torch.isnan(ref[:, 9]).all()
    keep = torch.ones(Hd, dtype=torch.bool)
    keep[9] = False
    err, tol, ok = FM.within_tolerance(out[:, keep], ref[:, keep], FM.moe_tail_torch(act, p, tw, ids)[:, keep])
    assert ok, (err, tol)


def test_decode_tail_mxfp4_can_fail():
    E, k, T, Hd, Id = 8, 2, 6, 64, 256
    p = MXF.quantize(torch.randn(E, Hd, Id) * 0.1)
    d = D.pack_decode(p)
    tw, ids = _routing(T, E, k, 3)
    act = torch.randn(T * k, Id).bfloat16()
    ref, pt = FM.moe_tail_reference(act, p, tw, ids), FM.moe_tail_torch(act, p, tw, ids)
    assert FM.within_tolerance(FM.moe_tail(act, d, tw, ids, fused=True, kernel="decode")[0], ref, pt)[2]
    # two codes of every word swapped (the table the kernel reads is not the one the words were packed by)
    bits = list(D.CODE_BITS)
    bits[1], bits[2] = bits[2], bits[1]
    old = D.CODE_BITS
    try:
        D.CODE_BITS = tuple(bits)
        bad = D.pack_decode(p)
    finally:
        D.CODE_BITS = old
    assert not FM.within_tolerance(FM.moe_tail(act, bad, tw, ids, fused=True, kernel="decode")[0], ref, pt)[2]
    # one group's scale byte off by one (the fold path's scale reaches the weights)
    s = d.scales.clone()
    s[..., 3] += 1
    off = D.DecodeMXFP4(d.qweight, s, d.shape)
    assert not FM.within_tolerance(FM.moe_tail(act, off, tw, ids, fused=True, kernel="decode")[0], ref, pt)[2]
    with pytest.raises(ValueError, match="decode-packed"):
        FM.moe_tail(act, p, tw, ids, fused=True, kernel="decode")
    with pytest.raises(ValueError, match="PackedMXFP4"):
        D.pack_decode(torch.randn(4, 32))


def test_decode_tail_fp4_config_per_target():
    from inferbook.device import building_for

    for t in ("sm_80", "sm_90", "sm_100"):
        with building_for(t):
            cfg = FM.decode_tail_config(False, programs=10 ** 6, fp4=True)
        # 2 stages (the tiles' loads issued before the loop, none waiting on another), 1 on sm_100
        stages = 1 if t == "sm_100" else 2
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]) == (16, 64, 1, stages), t
    with building_for("gfx942"):
        # CDNA: W4A16's tile and rule, less W4A16's scalar scale FMAs (FMA_AMD; the folded MXFP4 loop has no scale FMA)
        w4 = FM.decode_tail_config(False, programs=3584)
        assert w4.pop("FMA_AMD") and FM.decode_tail_config(False, programs=3584, fp4=True) == w4
        # the exact-scale loop: W4A16's tile, and no FMA_AMD either (it compiled to more instructions with it)
        assert FM.decode_tail_config(False, programs=3584, fp4=True, fold=False) == w4
    for t in ("sm_80", "sm_90", "sm_100"):
        with building_for(t):   # the exact loop on two warps (one spilled its per-group scales), not swapped as W4A16 is
            assert FM.decode_tail_config(False, programs=10 ** 6, fp4=True, fold=False) == \
                dict(BLOCK_M=16, BLOCK_N=64, num_warps=2, num_stages=1 if t == "sm_100" else 2), t
    las = FM.moe_tail_launches(1, 16, 896, 3584, 256, "mxfp4", fused=True, kernel="decode")
    assert las[0].kernel is FM.moe_decode_tail_kernel and las[0].kwargs["FP4"] and las[0].kwargs["FOLD"]
    assert las[0].dram_bytes > 16 * D.decode_weight_bytes(3584, 256)
    # fold=False: the exact-scale path, on W4A16's two-warp tile (the compile table's "compile check" row)
    (exact,) = FM.moe_tail_launches(1, 16, 896, 3584, 256, "mxfp4", fused=True, kernel="decode", fold=False)
    assert exact.kwargs["FP4"] and not exact.kwargs["FOLD"] and exact.kwargs["num_warps"] == 2
    assert exact.dram_bytes == las[0].dram_bytes and exact.grid == las[0].grid


_LAYOUT_PROBE = r"""
import re
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from inferbook import compiled as C
from inferbook.moe import fused_moe as FM
la = FM.moe_tail_launches(8, 16, 64, 256, 256, "mxfp4", fused=True, kernel="decode")[0]
driver.set_active(C._AOTDriver(GPUTarget("cuda", 90, 32)))
ck = la.kernel.run(*[C._stand_in(a) for a in la.args], grid=(1,), warmup=True, **la.kwargs)
ops = [l for l in ck.asm["ttgir"].splitlines() if "elementwise_inline_asm" in l and "fma.rn.bf16x2" in l]
print(len(ops), sum("dot_op<{opIdx = 1" in l and "kWidth = 2" in l for l in ops))
"""


def test_fold_asm_runs_in_the_mma_operand_layout():
    # _fp4_scaled_pair_ptx reads one column's scale from $3 for both halves of its pair: right only where
    # Triton hands the asm two K rows of one column, the B operand's layout (dot_op opIdx 1, kWidth 2)
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    env.setdefault("TRITON_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "triton-aot"))
    r = subprocess.run([sys.executable, "-c", _LAYOUT_PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    n, in_operand = map(int, r.stdout.split()[-2:])
    assert n == 8 and in_operand == n


def test_exact_path_takes_the_w4a16_tile_on_a_gpu(monkeypatch):
    # one warp (the folded loop's tile) spills 1.8 KB on sm_90 with the exact path's per-group fp32 scales
    from inferbook.device import building_for

    ran = []
    monkeypatch.setattr(FM, "_run", lambda la: ran.append(la))
    p = MXF.quantize(torch.randn(4, 64, 256) * 0.1)
    d = D.pack_decode(p)
    exact = D.DecodeMXFP4(d.qweight, d.scales, d.shape, fold=False)
    tw, ids = _routing(3, 4, 2, 1)
    act = torch.randn(6, 256).bfloat16()
    with building_for("sm_90"):
        for w, warps in ((d, 1), (exact, 2)):
            ran.clear()
            FM.moe_tail(act, w, tw, ids, fused=True, kernel="decode", block="gpu")
            (la,) = [x for x in ran if x.kernel is FM.moe_decode_tail_kernel]
            assert (la.kwargs["FOLD"], la.kwargs["num_warps"]) == (w.fold, warps)
