"""MX quantization: bit-exact Triton vs PyTorch reference, an independent implementation,
hand-computed cases at the format edges, floor vs up, row / column / 2-D, recipes."""
import math

import pytest
import torch

import inferbook  # noqa: F401  (turns the Triton interpreter on where there is no GPU)
from inferbook.numerics import mx, small_op_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread (on a loaded 2-core machine OpenMP waits made these tests ~10x slower)."""
    with small_op_threads("cpu"):
        yield


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------
# A second, independent implementation: float64 frexp for the scale, torch's own float8
# casts for FP8 elements and a nearest-value table search for FP4. Shares no code with mx.py.

FP4_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SPEC = {"e4m3": (448.0, 8, torch.float8_e4m3fn), "e5m2": (57344.0, 15, torch.float8_e5m2), "e2m1": (6.0, 2, None)}


def _indep_scale(amax: float, fmt: str, rule: str) -> int:
    maxn, emax, _ = SPEC[fmt]
    if amax == 0.0:
        return -127
    m, e = math.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1: floor(log2(amax)) = e - 1
    s = e - 1 - emax
    if rule == "up":
        while amax > maxn * 2.0 ** s:
            s += 1
    return max(-127, min(127, s))


def _indep_fp4(y: float) -> int:
    sign = 8 if math.copysign(1.0, y) < 0 else 0
    a = min(abs(y), 6.0)
    best = min(range(8), key=lambda c: (abs(FP4_MAGS[c] - a), c % 2))  # nearest, ties to the even code
    return sign | best


def independent_quantize_rows(x2d: torch.Tensor, fmt: str, block: int, rule: str):
    """Row-wise (1 x block) MX of a 2-D float tensor, element by element."""
    maxn, _, f8 = SPEC[fmt]
    x = x2d.double().cpu()
    M, N = x.shape
    nb = -(-N // block)
    codes = torch.zeros(M, N, dtype=torch.uint8)
    scales = torch.zeros(M, nb, dtype=torch.uint8)
    for i in range(M):
        for b in range(nb):
            vals = x[i, b * block:(b + 1) * block]
            if not torch.isfinite(vals).all():
                scales[i, b] = 255
                codes[i, b * block:(b + 1) * block] = 0x7F if f8 is not None else 0
                continue
            s = _indep_scale(vals.abs().max().item(), fmt, rule)
            scales[i, b] = s + 127
            y = (vals * 2.0 ** -s).float()
            if f8 is not None:
                c = y.clamp(-maxn, maxn).to(f8).view(torch.uint8)
            else:
                c = torch.tensor([_indep_fp4(v) for v in y.tolist()], dtype=torch.uint8)
            codes[i, b * block:(b + 1) * block] = c
    return codes, scales


def _edge_tensor(M=6, N=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N, generator=g) * torch.logspace(-3, 3, N)[None, :]
    x[0, 0] = 460.0        # above E4M3's max normal once scaled by the floor rule
    x[1, :32] = 0.0        # a zero block
    x[2, 3] = float("nan")
    x[3, 40] = -float("inf")
    x[4, 5] = -0.0
    x[4, 6] = 2.0 ** -140  # an fp32 subnormal
    x[5, 33:64] = 2.0 ** -125  # tiny block: the E8M0 scale clamps at 2**-127
    return x


FMTS = ("e4m3", "e5m2", "e2m1")
RULES = ("floor", "up")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FMTS)
def test_reference_matches_independent_implementation(fmt, rule):
    for seed in range(2):
        x = _edge_tensor(seed=seed)
        mxt = mx.quantize_reference(x, fmt, axis=-1, block=32, scale_rounding=rule)
        codes, scales = independent_quantize_rows(x, fmt, 32, rule)
        assert torch.equal(mxt.scales, scales), (mxt.scales, scales)
        assert torch.equal(mxt.elements, codes)


@pytest.mark.parametrize("fmt", FMTS)
def test_exhaustive_bf16_grid_matches_independent(fmt):
    """Every bf16 magnitude from 2**-20 to just under 2**(emax+1), both signs, with the scale pinned
    to 2**0 (each 32-block also holds max_normal, so floor(log2 amax) = emax): saturation,
    every rounding tie and every subnormal of the element format are hit."""
    maxn, emax, f8 = SPEC[fmt]
    vals = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = vals[torch.isfinite(vals) & (vals < 2.0 ** (emax + 1)) & (vals >= 2.0 ** -20)]
    vals = torch.cat([vals, -vals])
    n = vals.numel() // 31 * 31
    x = torch.cat([vals[:n].reshape(-1, 31), torch.full((n // 31, 1), maxn)], dim=1)
    mxt = mx.quantize_reference(x, fmt)
    assert (mxt.scales == 127).all()
    if f8 is not None:
        codes = x.clamp(-maxn, maxn).to(f8).view(torch.uint8)
    else:
        codes = torch.tensor([_indep_fp4(v) for v in x.flatten().tolist()], dtype=torch.uint8).view(x.shape)
    assert torch.equal(mxt.elements, codes)
    assert torch.equal(mx.quantize_triton(x.to(DEV), fmt).elements.cpu(), codes)


LAYOUTS = [
    pytest.param(dict(axis=-1, block=32), id="row-1x32"),
    pytest.param(dict(axis=0, block=32), id="col-32x1"),
    pytest.param(dict(axis=0, block=16), id="col-16x1"),
    pytest.param(dict(block=(32, 32)), id="2d-32x32"),
    pytest.param(dict(block=(128, 128)), id="2d-128x128"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_bit_exact(fmt, rule, layout):
    x = _edge_tensor(M=37, N=70, seed=3)
    x[30:, 60:] *= 1e4
    a = mx.quantize_reference(x, fmt, scale_rounding=rule, **layout)
    b = mx.quantize_triton(x.to(DEV), fmt, scale_rounding=rule, **layout)
    assert torch.equal(a.scales, b.scales.cpu())
    assert torch.equal(a.elements, b.elements.cpu())


@pytest.mark.parametrize("block", [(128, 128), (64, 128), (128, 32)])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_triton_large_tiles_read_in_slabs_stay_bit_exact(fmt, block):
    """The GPU launch's exact constexprs (mx._tile) for tiles above MAX_TILE_ELEMENTS, which the kernel
    reads in row slabs: a block's maximum and its NaN sit in the last slab, partial blocks at the
    edges; the running maximum over slabs must equal the reference's one-shot maximum."""
    sr, sc = block
    nbr, nbc = mx._tile(sr, sc)
    assert nbr * sr * nbc * sc > mx.MAX_TILE_ELEMENTS and nbr == 1, "this case must take the slab path"
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sr * 2 + 5, sc * 2 - 3, generator=g) * torch.logspace(-2, 2, sc * 2 - 3)[None, :]
    x[sr - 3, 2] = 3e4          # the first block's amax, in its last slab
    x[sr + sr - 1, sc + 1] = float("nan")
    x[5, sc] = -0.0
    for rule in RULES:
        a = mx.quantize_reference(x, fmt, block=block, scale_rounding=rule)
        b = mx.quantize_triton(x.to(DEV), fmt, block=block, scale_rounding=rule)
        assert torch.equal(a.scales, b.scales.cpu()) and torch.equal(a.elements, b.elements.cpu())
    assert a.scales[1, 1] == 255


@pytest.mark.parametrize("shape", [(37, 70), (33, 129)])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FMTS)
def test_rowcol_one_pass_equals_two_reference_passes(fmt, rule, shape):
    """The one-pass kernel (its GPU tile: 32 rows x mx.ROWCOL_TILE_COLS) writes both copies bit for bit
    as two reference passes would, edge values and partial blocks included."""
    M, N = shape
    x = _edge_tensor(M=M, N=N, seed=5) if N >= 70 else torch.randn(M, N)
    x[M - 1, N - 1] = 3e5      # a last-row, last-column outlier: the column block and row block it sets
    rows, cols = mx.quantize_rowcol_reference(x, fmt, scale_rounding=rule)
    r, c = mx.quantize_rowcol_triton(x.to(DEV), fmt, scale_rounding=rule)
    for want, got in ((rows, r), (cols, c)):
        assert torch.equal(want.scales, got.scales.cpu()) and torch.equal(want.elements, got.elements.cpu())
        assert got.axis == want.axis and got.block == want.block
    assert torch.equal(mx.dequantize(c).cpu().nan_to_num(), mx.dequantize(cols).nan_to_num())


def test_rowcol_warps_per_target():
    # fp32 x on sm_80 takes 8 warps (4 spilled 136 B there), elsewhere 4; 16-bit x 2 on NVIDIA; AMD 4 waves on small grids
    from inferbook.device import building_for

    for target, dtype, warps in (("sm_80", torch.float32, 8), ("sm_80", torch.bfloat16, 2), ("sm_90", torch.bfloat16, 2),
                                 ("sm_90", torch.float32, 4), ("gfx942", torch.float32, 4), ("gfx942", torch.bfloat16, 4)):
        with building_for(target):
            (la,) = mx.quantize_rowcol_launches((67, 133), dtype)
        assert la.kwargs.get("num_warps", 4) == warps, (target, dtype)
    # CDNA, 16-bit x on a grid of at least CDNA_ONE_WAVE_MIN_PROGRAMS programs: one wave; fp32 keeps 4
    for target in ("gfx942", "gfx950"):
        for dtype, warps in ((torch.bfloat16, 1), (torch.float16, 1), (torch.float32, 4)):
            with building_for(target):
                (la,) = mx.quantize_rowcol_launches((8192, 8192), dtype)
            assert la.grid[0] * la.grid[1] >= mx.CDNA_ONE_WAVE_MIN_PROGRAMS
            assert la.kwargs.get("num_warps", 4) == warps, (target, dtype)


def test_rowcol_one_pass_bf16_strided_and_bytes():
    base = (torch.randn(40, 300, generator=torch.Generator().manual_seed(2)) * 30).bfloat16()
    x = base[:, ::2]
    rows, cols = mx.quantize_rowcol_reference(x.float(), "e4m3")
    r, c = mx.quantize_rowcol_triton(x.to(DEV), "e4m3")
    assert torch.equal(rows.elements, r.elements.cpu()) and torch.equal(cols.scales, c.scales.cpu())
    assert torch.equal(cols.elements, c.elements.cpu()) and torch.equal(rows.scales, r.scales.cpu())
    one, two = mx.rowcol_bytes(4096, 4096, passes=1), mx.rowcol_bytes(4096, 4096, passes=2)
    assert two - one == 4096 * 4096 * 2
    with pytest.raises(ValueError, match="2-D"):
        mx.quantize_rowcol_triton(torch.zeros(4, 4, 4))


@pytest.mark.parametrize("case", ["non-contiguous", "transposed", "bf16", "fp16", "3d-middle-axis", "1d",
                                  "empty", "single"])
def test_triton_shapes_and_strides(case):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(24, 100, generator=g) * 5
    kw = dict(axis=-1)
    if case == "non-contiguous":
        x = base[:, ::3]
    elif case == "transposed":
        x, kw = base.T, dict(axis=0)
    elif case == "bf16":
        x = base.bfloat16()
    elif case == "fp16":
        x = base.half()
    elif case == "3d-middle-axis":
        x, kw = base.reshape(4, 6, 100)[:, :, :33], dict(axis=1, block=2)
    elif case == "1d":
        x = base.flatten()[:77]
    elif case == "empty":
        x = base[:0]
    else:
        x = base[:1, :1]
    a = mx.quantize_reference(x, "e4m3", **kw)
    b = mx.quantize_triton(x.to(DEV), "e4m3", **kw)
    assert a.elements.shape == x.shape
    assert torch.equal(a.elements, b.elements.cpu()) and torch.equal(a.scales, b.scales.cpu())
    if x.numel():
        ref = mx.quantize_reference(x.contiguous().float(), "e4m3", **kw)
        assert torch.equal(ref.elements, a.elements)


def _one_block(vals, fmt="e4m3", rule="floor"):
    x = torch.zeros(1, 32)
    x[0, :len(vals)] = torch.tensor(vals, dtype=torch.float32)
    m = mx.quantize_reference(x, fmt, scale_rounding=rule)
    return int(m.scales[0, 0]), m.elements[0, :len(vals)].tolist(), mx.dequantize(m)[0, :len(vals)].tolist()


def test_hand_computed_e4m3():
    # amax 448 = 1.75 * 2**8: both rules give s = 0, 448 is the max normal code 0x7E.
    assert _one_block([448.0, 1.0], rule="floor")[:2] == (127, [0x7E, 0x38])
    assert _one_block([448.0, 1.0], rule="up")[:2] == (127, [0x7E, 0x38])
    # amax 460 = 1.797 * 2**8: floor keeps s = 0 and saturates 460 -> 448;
    # up moves to s = 1: 230 rounds to 224 = 1.75 * 2**7 (code (7+7)<<3 | 6 = 0x76).
    s, codes, deq = _one_block([460.0], rule="floor")
    assert (s, codes, deq) == (127, [0x7E], [448.0])
    s, codes, deq = _one_block([460.0], rule="up")
    assert (s, codes, deq) == (128, [0x76], [448.0])
    # 512 = 2**9: s = 1 under both; 256 is code (8+7)<<3 = 0x78.
    assert _one_block([512.0])[:2] == (128, [0x78])
    # Subnormals: amax 1 -> s = -8 (1 -> 256, code 0x78); 2**-17 * 2**8 = 2**-9 is the smallest
    # subnormal (code 1); 2**-18 -> 2**-10 ties 0|1 -> even (0); 3 * 2**-18 -> 1.5 units -> even (2).
    s, codes, deq = _one_block([1.0, 2.0 ** -17, 2.0 ** -18, 3 * 2.0 ** -18])
    assert s == 127 - 8 and codes == [0x78, 0x01, 0x00, 0x02]
    assert deq == [1.0, 2.0 ** -17, 0.0, 2.0 ** -16]
    # Sign of zero is kept.
    assert _one_block([1.0, -0.0])[1] == [0x78, 0x80]


def test_hand_computed_zero_nan_inf_and_clamps():
    s, codes, deq = _one_block([0.0, -0.0])
    assert s == 0 and codes == [0, 0x80] and deq == [0.0, 0.0]
    for bad in (float("nan"), float("inf"), -float("inf")):
        s, codes, deq = _one_block([1.0, bad])
        assert s == 255 and codes == [0x7F, 0x7F] and all(math.isnan(v) for v in deq)
        s, codes, deq = _one_block([1.0, bad], fmt="e2m1")
        assert s == 255 and codes == [0, 0] and all(math.isnan(v) for v in deq)
    # Tiny block: floor(log2 2**-125) - 8 = -133 clamps to -127 (byte 0); 2**-125 * 2**127 = 4.
    s, codes, deq = _one_block([2.0 ** -125])
    assert s == 0 and codes == [(2 + 7) << 3] and deq == [2.0 ** -125]
    # Huge block: fp32 max with E2M1 and round-up: s = 127 - 2 + 1 = 126 (byte 253), 3.99.. -> 4 (code 6).
    s, codes, _ = _one_block([torch.finfo(torch.float32).max], fmt="e2m1", rule="up")
    assert s == 253 and codes == [6]


def test_hand_computed_e2m1_and_e5m2():
    # amax 6 -> s = 0. 5 ties 4|6 -> even code 6 (4.0); 2.5 ties 2|3 -> code 4 (2.0);
    # 0.25 ties 0|0.5 -> 0; 0.75 ties 0.5|1 -> code 2 (1.0); -1.25 ties 1|1.5 -> code 2 | sign.
    s, codes, deq = _one_block([6.0, 5.0, 2.5, 0.25, 0.75, -1.25], fmt="e2m1")
    assert s == 127 and codes == [7, 6, 4, 0, 2, 10] and deq == [6.0, 4.0, 2.0, 0.0, 1.0, -1.0]
    # 7 = 1.75 * 2**2 > 6: floor saturates to 6, up takes s = 1 and 3.5 ties 3|4 -> 4 (code 6) -> 8.
    assert _one_block([7.0], fmt="e2m1", rule="floor")[1:] == ([7], [6.0])
    assert _one_block([7.0], fmt="e2m1", rule="up") == (128, [6], [8.0])
    # E5M2: 2 * 57344 -> s = 1 and max normal code 0x7B.
    assert _one_block([114688.0], fmt="e5m2")[:2] == (128, [0x7B])


@pytest.mark.parametrize("fmt", FMTS)
def test_floor_and_up_differ_exactly_where_they_should(fmt):
    """Scales differ by one iff amax's mantissa exceeds the max normal's; floor saturates only there."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 100
    f = mx.FORMATS[fmt]
    lo = mx.quantize_reference(x, fmt, scale_rounding="floor")
    hi = mx.quantize_reference(x, fmt, scale_rounding="up")
    amax = x.abs().reshape(64, 8, 32).amax(-1)
    over = (amax.view(torch.int32) & 0x7FFFFF) > f.max_mant
    diff = hi.scales.int() - lo.scales.int()
    assert torch.equal(diff, over.int())
    assert over.any() and (~over).any()  # both kinds of block occur: the test can fail
    # The round-up rule never saturates: every dequantized value is within half a quantum.
    err = (mx.dequantize(hi) - x).abs()
    assert torch.isfinite(err).all()
    sat_lo = (mx.dequantize(lo).abs() == f.max_normal * 2.0 ** (lo.scales.float() - 127).repeat_interleave(32, 1)) & \
        (x.abs() > f.max_normal * 2.0 ** (lo.scales.float() - 127).repeat_interleave(32, 1))
    assert not (sat_lo.reshape(64, 8, 32).any(-1) & ~over).any()


@pytest.mark.parametrize("fmt", FMTS)
def test_up_rule_equals_te_reciprocal_form(fmt):
    """TE's round-up scale is float_to_e8m0(amax * (1/max_normal)) in fp32, exponent rounded up.
    Ours is integer arithmetic on amax's bits: equal for every fp32 amax in [max/2, 4 max) (stride 5
    here, plus every value within 64 ulp of each power-of-two boundary), which covers every normal
    amax since both forms commute with power-of-two scaling."""
    f = mx.FORMATS[fmt]
    lo = torch.tensor(f.max_normal / 2).view(torch.int32).item()
    hi = torch.tensor(f.max_normal * 4).view(torch.int32).item()
    bits = torch.arange(lo, hi, 5, dtype=torch.int32)
    edges = torch.tensor([f.max_normal * 2.0 ** j for j in (-1, 0, 1, 2)]).view(torch.int32)
    bits = torch.cat([bits, (edges[:, None] + torch.arange(-64, 65, dtype=torch.int32)[None, :]).flatten()])
    amax = bits.view(torch.float32)
    ours = mx._scale_exponent_torch(amax, f, True) + 127
    d = (amax * torch.tensor(1.0 / f.max_normal, dtype=torch.float32)).view(torch.int32)
    te = ((d >> 23) & 0xFF) + ((d & 0x7FFFFF) != 0).int()
    assert torch.equal(ours, te)


def test_row_col_and_2d_relations():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 160, generator=g)
    col = mx.quantize_reference(w, "e4m3", axis=0)
    rowT = mx.quantize_reference(w.T.contiguous(), "e4m3", axis=-1)
    assert torch.equal(col.elements, rowT.elements.T) and torch.equal(col.scales, rowT.scales.T)
    row = mx.quantize_reference(w, "e4m3", axis=-1)
    assert not torch.equal(row.elements, col.elements)  # directions are different quantizations
    # 2-D tiles: W and W.T share one quantization.
    q2 = mx.quantize_reference(w, "e4m3", block=(32, 32))
    q2t = mx.quantize_reference(w.T.contiguous(), "e4m3", block=(32, 32))
    assert torch.equal(q2.elements, q2t.elements.T) and torch.equal(q2.scales, q2t.scales.T)
    assert torch.equal(mx.dequantize(q2), mx.dequantize(q2t).T)
    # A 2-D tile's scale is the max over its 1x32 row blocks' scales.
    assert torch.equal(q2.scales, row.scales.reshape(3, 32, 5).amax(1))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_error_bound(fmt):
    """Non-saturated elements are within half a quantum of the input (the up rule never saturates)."""
    f = mx.FORMATS[fmt]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 128, generator=g) * 3
    m = mx.quantize_reference(x, fmt, scale_rounding="up")
    scale = torch.ldexp(torch.ones(m.scales.shape), m.scales.int() - 127).repeat_interleave(32, 1)
    y = x / scale
    e = torch.floor(torch.log2(y.abs().clamp(min=2.0 ** f.emin)))
    half_q = 0.5 * 2.0 ** (e - f.mbits) * scale
    assert ((mx.dequantize(m) - x).abs() <= half_q * (1 + 1e-6)).all()


def test_bad_input_is_a_clear_error():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="unknown element format 'e3m3'"):
        mx.quantize(x, "e3m3")
    with pytest.raises(ValueError, match="scale_rounding 'nearest'"):
        mx.quantize(x, "e4m3", scale_rounding="nearest")
    with pytest.raises(ValueError, match="block 24"):
        mx.quantize(x, "e4m3", block=24)
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        mx.quantize(x, "e4m3", axis=2)
    with pytest.raises(ValueError, match="needs a 2-D tensor"):
        mx.quantize(x[None], "e4m3", block=(32, 32))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        mx.quantize(x.double(), "e4m3")
    with pytest.raises(ValueError, match="unknown backend"):
        mx.quantize(x, "e4m3", backend="cuda")
    with pytest.raises(ValueError, match="emulated_linear needs"):
        mx.emulated_linear(x, torch.randn(8, 32), mx.recipes()["mxfp8"])


# ---------------------------------------------------------------------------
# Recipes and the emulated linear layer

def test_emulated_linear_shapes_and_errors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g, requires_grad=True)
    w = (torch.randn(48, 96, generator=g) * 0.1).requires_grad_(True)
    dy = torch.randn(64, 48, generator=g)
    ref_dx, ref_dw = dy.double() @ w.detach().double(), dy.double().T @ x.detach().double()
    errs = {}
    for name, recipe in mx.recipes().items():
        y = mx.emulated_linear(x, w, recipe, backend="torch")
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        assert y.shape == (64, 48) and dx.shape == x.shape and dw.shape == w.shape
        assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
        errs[name] = (mx.sqnr_db(ref_dx, dx), mx.sqnr_db(ref_dw, dw))
    assert errs["bf16"][0] > 40 and errs["bf16"][1] > 40
    for name in ("mxfp8", "mxfp8-2d-weight", "mxfp8-up"):
        assert 20 < errs[name][0] < errs["bf16"][0] and 20 < errs[name][1] < errs["bf16"][1], (name, errs)
    # E5M2 gradients lose a mantissa bit against E4M3: about 6 dB less SQNR in dgrad.
    assert errs["mxfp8-e5m2-grad"][0] < errs["mxfp8"][0] - 3


def test_recipe_backends_agree_and_2d_weight_is_shared():
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(40, 64, generator=g), torch.randn(72, 64, generator=g), torch.randn(40, 72, generator=g)
    r = mx.recipes()["mxfp8-2d-weight"]
    assert r.shares_weight() and not mx.recipes()["mxfp8"].shares_weight()
    wr = r.q("weight", "row")(w, axis=1, backend="torch")
    wc = r.q("weight", "col")(w, axis=0, backend="torch")
    assert torch.equal(wr, wc)
    rows_t = mx.gemm_errors(r, x, w, dy, backend="torch")
    rows_k = mx.gemm_errors(r, x.to(DEV), w.to(DEV), dy.to(DEV), backend="triton")
    assert [a["sqnr_db"] for a in rows_t][:6] == [b["sqnr_db"] for b in rows_k][:6]
    costs = {(c["gemm"], c["operand"]): c for c in mx.step_costs(r, 40, 64, 72)}
    assert costs[("dgrad", "weight (col-wise)")]["transpose"]
    plain = {(c["gemm"], c["operand"]): c for c in mx.step_costs(mx.recipes()["mxfp8"], 40, 64, 72)}
    assert plain[("dgrad", "weight (col-wise)")]["quantize_pass"]
    assert sum(c["quantize_pass"] for c in plain.values()) == 6
    assert sum(c["quantize_pass"] for c in costs.values()) == 5


def test_quantize_warps_and_tiles_per_target():
    # NVIDIA: 2 warps (a thread holds twice the elements: fewer threads cross a block's reduction), column-wise
    # 32x1 tiles 128 columns wide; AMD 4 waves on small grids (16-bit x on large ones: one, below)
    from inferbook.device import building_for

    x = torch.zeros(64, 256)
    for target, warps in (("sm_80", 2), ("sm_90", 2), ("sm_100", 2), ("gfx942", 4), ("gfx950", 4)):
        with building_for(target):
            la = mx._quantize_launch(x, x.to(torch.uint8), torch.zeros(2, 256, dtype=torch.uint8), 32, 1, "e4m3", "floor")
        assert la.kwargs["num_warps"] == warps and la.kwargs["NBC"] == 128 and la.grid == (2, 2), target
    # CDNA, 16-bit x: one wave where the grid holds CDNA_ONE_WAVE_MIN_PROGRAMS programs, 4 below it
    from inferbook.compiled import meta

    for rows, warps in ((8192, 1), (64, 4)):
        x = meta((rows, 8192), torch.bfloat16)
        with building_for("gfx942"):
            la = mx._quantize_launch(x, meta((rows, 8192), torch.uint8), meta((rows, 256), torch.uint8), 1, 32, "e4m3",
                                     "floor")
        assert (la.grid[0] * la.grid[1] >= mx.CDNA_ONE_WAVE_MIN_PROGRAMS) == (warps == 1)
        assert la.kwargs["num_warps"] == warps, rows


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_magnitude_key_blocks_of_zeros_denormals_and_a_nan(fmt):
    # the kernel's block max is an integer max of |x|'s bits: -0.0, fp32 denormals (the largest is the block's
    # amax), a block holding only -inf among zeros and one holding a NaN beside normals, bit-exact with the
    # reference, on 2 warps' tiles
    from inferbook.device import building_for

    x = torch.zeros(4, 64)
    x[0, :32] = -0.0
    x[1, :32] = torch.tensor([1e-40, -3e-39, 2e-45, 1.1754942e-38] * 8)
    x[2, 5] = -float("inf")
    x[3, :32] = torch.linspace(-5, 7, 32)
    x[3, 40] = float("nan")
    ref = mx.quantize_reference(x, fmt, axis=-1)
    with building_for("sm_90"):
        got = mx.quantize_triton(x, fmt, axis=-1)
    assert torch.equal(got.scales, ref.scales) and torch.equal(got.elements, ref.elements)


@pytest.mark.parametrize("fmt,dt", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_reference_codes_are_the_hardware_cast_of_the_clamped_value(fmt, dt):
    # what the GPU encoder (HW 1/2: cvt.rn.satfinite, round to nearest even) computes -- the block-scaled value
    # clamped to +-max_normal, cast to the fp8 format -- is the reference's code for every finite block: here
    # PyTorch's RNE cast stands in for the instruction, on random values over 40 binades, every code and every
    # halfway point between neighbours (the interpreter cannot run that path: `device.fp8_cast_needs_emulation`)
    g = torch.Generator().manual_seed(3)
    f = mx.FORMATS[fmt]
    grid = torch.arange(256, dtype=torch.uint8).view(dt).float()
    grid = grid[torch.isfinite(grid)].unique()
    halves = (grid[1:] + grid[:-1]) / 2
    rnd = torch.randn(64 * 512, generator=g) * torch.exp2(torch.randint(-30, 10, (64 * 512,), generator=g).float())
    x = torch.cat([rnd, grid, halves, -halves])
    x = torch.cat([x, torch.zeros(-x.numel() % 32)]).reshape(-1, 32)
    x[:, 0] = f.max_normal      # each block's amax at max_normal: s = 0, the grid and halfway points as they are
    x[-64:, 0] = 0.0
    ref = mx.quantize_reference(x, fmt, axis=-1)
    s = ref.scales.to(torch.int32) - 127                         # [rows, 1]
    y = x * torch.exp2(-s.float())
    hw = y.clamp(-f.max_normal, f.max_normal).to(dt).view(torch.uint8)
    assert torch.equal(hw, ref.elements)


def test_hw_cast_is_taken_where_the_target_converts_in_hardware():
    from inferbook.device import building_for

    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert mx.hw_cast("e4m3", cpu) == 0 and mx.hw_cast("e4m3", meta) == 0      # no target: the integer encoding
    for target, want in (("sm_80", (0, 0)), ("sm_90", (1, 2)), ("sm_100", (1, 2)), ("gfx942", (0, 0)), ("gfx950", (0, 0))):
        with building_for(target):
            # interpreted CPU tensors always emulate; a launch built on meta tensors (to compile) takes the target's
            assert (mx.hw_cast("e4m3", cpu), mx.hw_cast("e5m2", cpu), mx.hw_cast("e2m1", cpu)) == (0, 0, 0), target
            assert (mx.hw_cast("e4m3", meta), mx.hw_cast("e5m2", meta), mx.hw_cast("e2m1", meta)) == (*want, 0), target


def test_compiled_encoder_uses_the_rn_conversion(tmp_path):
    # the committed compile table's quantize launches: HW 1 on sm_90/sm_100 (the PTX's cvt.rn.satfinite.e4m3x2),
    # 0 on sm_80 and CDNA
    from inferbook import compiled

    rows = [r for r in compiled.load_table("te-mxfp8-recipes")["rows"] if r["launch"].startswith(("quantize-speed e4m3", "rowcol"))]
    for r in rows:
        assert r["constexprs"]["HW"] == (1 if r["target"] in ("sm_90", "sm_100") else 0), (r["launch"], r["target"])
    src = """
import sys, re, torch
from inferbook import compiled
from inferbook.numerics import mx
from inferbook.device import building_for
with building_for(sys.argv[1]):
    (la,) = mx.quantize_launches((256, 256), torch.bfloat16, "e4m3", axis=-1)
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
driver.set_active(compiled._AOTDriver(GPUTarget("cuda", int(sys.argv[1][3:]), 32)))
ck = la.kernel.run(*[compiled._stand_in(a) for a in la.args], grid=(1,), warmup=True, **la.kwargs)
print(sorted(set(re.findall(r"cvt[.][a-z0-9.]*e4m3[a-z0-9.]*", ck.asm["ptx"]))))
"""
    import os, subprocess, sys
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "TRITON_CACHE_DIR": str(tmp_path)}
    for target, want in (("sm_90", "['cvt.rn.satfinite.e4m3x2.f32']"), ("sm_80", "[]")):
        r = subprocess.run([sys.executable, "-c", src, target], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-1500:]
        assert r.stdout.strip().splitlines()[-1] == want, (target, r.stdout)
