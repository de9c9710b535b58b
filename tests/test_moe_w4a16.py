"""W4A16 formats and the dense GEMM: error bound per group, packing specs, wrong-layout errors,
compressed-tensors round trip, and the Triton kernel (interpreter on CPU) against fp32."""
import pytest
import torch

import inferbook  # noqa: F401  (turns the Triton interpreter on first)
from inferbook.moe import w4a16 as W
from inferbook.moe.fused_moe import within_tolerance


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.05


@pytest.mark.parametrize("shape", [(72, 96), (3, 40, 64), (1, 33, 32)], ids=["2d", "3d", "odd-n"])
@pytest.mark.parametrize("layout", W.LAYOUTS)
def test_error_bound_per_group(shape, layout):
    w = _weights(shape, 1)
    w[..., 0, :32] = 0.0            # an all-zero group: scale 0, values 0
    w[..., 1, 5] = 40.0             # an outlier: its group's scale grows, the bound still holds
    q = W.quantize(w, layout=layout)
    vals, s = W.unpack(q)
    assert vals.dtype == torch.int8 and int(vals.min()) >= -8 and int(vals.max()) <= 7
    deq = W.dequantize(q, torch.float32).reshape(vals.shape)
    err = (deq - w.reshape(vals.shape)).abs().reshape(*vals.shape[:-1], -1, 32).amax(-1)
    bound = s.float() / 2
    assert (err <= bound).all(), float((err - bound).max())
    assert float(deq.reshape(w.shape)[..., 0, :32].abs().max()) == 0.0
    assert W.dequantize(q).dtype == torch.bfloat16


def test_storage_is_4_5_bits_per_weight():
    q = W.quantize(_weights((64, 256), 2))
    assert q.nbytes * 8 / (64 * 256) == pytest.approx(4.5)
    assert W.weight_bytes(64, 256, "w4a16") == q.nbytes
    assert W.weight_bytes(64, 256, "bf16") / q.nbytes == pytest.approx(16 / 4.5)


def test_packing_specs_differ_and_convert_exactly():
    q = W.quantize(_weights((2, 48, 64), 3), layout="indexed")
    shapes = {}
    for layout in W.LAYOUTS:
        p = W.to_layout(q, layout)
        shapes[layout] = (tuple(p.qweight.shape), p.qweight.dtype, tuple(p.scales.shape))
        assert p.layout == layout and p.qweight.is_contiguous()
        for a, b in zip(W.unpack(p), W.unpack(q)):
            assert torch.equal(a, b)
        assert torch.equal(W.unpack(W.to_layout(p, "indexed"))[0], W.unpack(q)[0])
    assert shapes["indexed"] == ((2, 48, 8), torch.int32, (2, 48, 2))
    assert shapes["grouped_contiguous"] == ((2, 8, 48), torch.int32, (2, 2, 48))
    assert shapes["grouped_masked"] == ((2, 3, 8, 16), torch.int32, (2, 48, 2))


def test_three_layouts_are_different_bytes():
    # same values, three arrangements: no layout's buffer equals another's, even reshaped
    q = W.quantize(_weights((2, 48, 64), 3), layout="indexed")
    raw = {lay: W.to_layout(q, lay).qweight.flatten() for lay in W.LAYOUTS}
    assert all(r.numel() == raw["indexed"].numel() for r in raw.values())   # N = 48: no panel padding
    for a in W.LAYOUTS:
        for b in W.LAYOUTS:
            if a < b:
                assert not torch.equal(raw[a], raw[b]), (a, b)
                assert (raw[a] != raw[b]).float().mean() > 0.5, (a, b)


def test_grouped_words_are_in_fragment_order():
    # decode by hand, from the spec's words: word j of a 32-run holds K offsets 8a + 2j + b in field 4b + a
    w = _weights((20, 64), 4)                      # N = 20: the masked spec pads to 32 rows
    vals, _ = W.quantize_values(w)
    gc = W.quantize(w, layout="grouped_contiguous")
    gm = W.quantize(w, layout="grouped_masked")
    assert tuple(gm.qweight.shape) == (2, 8, 16)
    for n, kw in ((0, 0), (3, 5), (19, 7)):
        r, j = divmod(kw, 4)
        for word in (gc.qweight[kw, n].item(), gm.qweight[n // 16, kw, n % 16].item()):
            word &= 0xFFFFFFFF
            fields = [((word >> (4 * f)) & 0xF) - 8 for f in range(8)]
            expect = [int(vals[n, 32 * r + 8 * (f % 4) + 2 * j + f // 4]) for f in range(8)]
            assert fields == expect
    # fields f and f + 4 are the consecutive pair (k, k + 1) of one BF16x2 fragment register
    assert [int(W.FRAGMENT_ORDER[f + 4] - W.FRAGMENT_ORDER[f]) for f in range(4)] == [1] * 4


@pytest.mark.parametrize("src, dst", [("indexed", "grouped_masked"), ("grouped_masked", "grouped_contiguous"),
                                      ("indexed", "grouped_contiguous")])
def test_another_layouts_buffer_reads_wrong_numbers(src, dst):
    # what the LayoutError protects against: the bytes of one spec through another spec's kernel
    q = W.quantize(_weights((64, 128), 13), layout=src)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    forged = W.reinterpret(q, dst)
    err, tol, ok = within_tolerance(W.linear(x, forged), W.linear_reference(x, q), W.linear_torch(x, q))
    assert not ok and err > 10 * tol
    with pytest.raises(W.LayoutError):
        W.linear(x, q, layout=dst)


def test_load_profile_picks_the_packing():
    E, H, I = 2, 64, 32
    w13 = W.quantize(_weights((E, 2 * I, H), 14))
    w2 = W.quantize(_weights((E, H, I), 15))
    tensors = W.export_moe_compressed_tensors(w13, w2, "m")
    for profile, spec in W.LOAD_PROFILES.items():
        a13, a2 = W.load_moe_experts(tensors, "m", E, profile)
        assert a13.layout == a2.layout == spec["layout"]
        assert torch.equal(W.unpack(a13)[0], W.unpack(w13)[0])
    with pytest.raises(ValueError, match="unknown load profile"):
        W.load_moe_experts(tensors, "m", E, "sm100-tcgen05")


@pytest.mark.parametrize("layout", W.LAYOUTS)
def test_k_not_a_multiple_of_32(layout):
    # group 16, K = 48: the grouped specs pad K to whole 32-runs with zeros; every kernel still exact
    w = _weights((2, 40, 48), 16)
    q = W.quantize(w, group_size=16, layout=layout)
    ref_vals, _ = W.quantize_values(w, 16)
    assert torch.equal(W.unpack(q)[0], ref_vals)
    if layout != "indexed":
        assert W.padded_k(48, layout) == 64 and q.qweight.numel() * 8 == 2 * 64 * (40 if layout == "grouped_contiguous" else 48)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2)).bfloat16()
    q2 = W.expert(q, 1)
    err, tol, ok = within_tolerance(W.linear(x, q2, block=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)),
                                    W.linear_reference(x, q2), W.linear_torch(x, q2))
    assert ok, (err, tol)


def test_indexed_words_follow_the_spec():
    # value i of a word sits in bits 4i..4i+3 with a +8 offset: decode by hand, not with our unpacker
    w = _weights((4, 32), 4)
    q = W.quantize(w, layout="indexed")
    vals, _ = W.quantize_values(w)
    word = q.qweight[1, 2].item() & 0xFFFFFFFF
    assert [((word >> (4 * i)) & 0xF) - 8 for i in range(8)] == vals[1, 16:24].tolist()


@pytest.mark.parametrize("bad, match", [
    (lambda: W.quantize(torch.randn(8, 40)), "multiple of group_size"),
    (lambda: W.quantize(torch.randn(8)), r"\[N, K\] or \[E, N, K\]"),
    (lambda: W.quantize(torch.randint(0, 3, (8, 32))), "floating point"),
    (lambda: W.quantize(torch.full((8, 32), float("nan"))), "NaN or Inf"),
    (lambda: W.quantize(torch.randn(8, 32), group_size=12), "multiple of 8"),
    (lambda: W.quantize(torch.randn(8, 32), layout="marlin"), "unknown W4A16 layout 'marlin'"),
    (lambda: W.linear(torch.randn(4, 32), W.quantize(torch.randn(8, 32))), "bfloat16"),
    (lambda: W.linear(torch.randn(4, 64).bfloat16(), W.quantize(torch.randn(8, 32))), "K = 32"),
])
def test_bad_input_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_wrong_layout_is_refused():
    q = W.quantize(_weights((2, 32, 64), 5), layout="grouped_masked")
    with pytest.raises(W.LayoutError, match="packed as 'grouped_masked'.*to_layout"):
        q.require("indexed", "the indexed kernel")


# M odd, N odd, K a few groups; non-contiguous activations; every layout through the same kernel
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("layout", W.LAYOUTS)
def test_linear_matches_fp32_reference(m, layout):
    q = W.quantize(_weights((73, 96), 6), layout=layout)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, 2 * 96, generator=g).bfloat16()[:, ::2]   # stride 2 along K
    assert not x.is_contiguous()
    out = W.linear(x, q)
    assert out.shape == (m, 73) and out.dtype == torch.bfloat16
    err, tol, ok = within_tolerance(out, W.linear_reference(x, q), W.linear_torch(x, q))
    assert ok, (err, tol)
    # Same rounding points as fp32-accumulated BF16: bit-equal to it.
    assert torch.equal(out, (x.float() @ W.dequantize(q).float().T).bfloat16())


def test_linear_empty_and_batched_shapes():
    q = W.quantize(_weights((40, 64), 8))
    assert W.linear(torch.empty(0, 64, dtype=torch.bfloat16), q).shape == (0, 40)
    x = torch.randn(2, 3, 64).bfloat16()
    assert torch.equal(W.linear(x, q), W.linear(x.reshape(6, 64), q).reshape(2, 3, 40))


def test_linear_can_fail():
    # a corrupted scale must be caught by the same tolerance the chapter uses
    q = W.quantize(_weights((40, 64), 9))
    x = torch.randn(5, 64).bfloat16()
    bad = W.PackedW4(q.qweight, q.scales * 1.02, q.shape, q.group_size, q.layout)
    _, _, ok = within_tolerance(W.linear(x, bad), W.linear_reference(x, q), W.linear_torch(x, q))
    assert not ok


def test_compressed_tensors_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    E, H, I = 3, 64, 32
    w13 = W.quantize(_weights((E, 2 * I, H), 10), layout="grouped_contiguous")
    w2 = W.quantize(_weights((E, H, I), 11), layout="grouped_masked")
    tensors = W.export_moe_compressed_tensors(w13, w2, "model.layers.1.mlp")
    assert tensors["model.layers.1.mlp.experts.2.up_proj.weight_packed"].shape == (I, H // 8)
    assert tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale"].shape == (I, H // 32)
    assert tensors["model.layers.1.mlp.experts.0.down_proj.weight_shape"].tolist() == [H, I]
    path = tmp_path / "experts.safetensors"
    save_file(tensors, str(path))
    for layout in W.LAYOUTS:
        a13, a2 = W.import_moe_compressed_tensors(load_file(str(path)), "model.layers.1.mlp", E, layout)
        assert a13.layout == a2.layout == layout
        for x, y in ((a13, w13), (a2, w2)):
            for u, v in zip(W.unpack(x), W.unpack(y)):
                assert torch.equal(u, v)
    # the gate rows of expert 1 decode, by the spec, to the first I rows of w13[1]
    packed = tensors["model.layers.1.mlp.experts.1.gate_proj.weight_packed"]
    nib = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], -1).reshape(I, H) - 8
    assert torch.equal(nib.to(torch.int8), W.unpack(w13)[0][1, :I])
    assert W.compressed_tensors_config()["config_groups"]["group_0"]["weights"]["group_size"] == 32


def test_compressed_tensors_import_checks_shapes():
    t = W.export_compressed_tensors(W.quantize(_weights((8, 64), 12)), "p")
    t["p.weight_shape"] = torch.tensor([8, 128])
    with pytest.raises(ValueError, match="weight_packed must be int32"):
        W.import_compressed_tensors(t, "p")
    with pytest.raises(ValueError, match="missing"):
        W.import_compressed_tensors({}, "p")


def test_packing_map_is_read_back_from_the_pack_functions():
    from inferbook.chapters.chord_w4a16 import packing_map

    maps = {layout: dict(packing_map(layout)) for layout in W.LAYOUTS}
    assert maps["indexed"][0] == [f"n0 k{k}" for k in range(8)]      # compressed-tensors: 8 consecutive K
    assert maps["indexed"][16][0] == "n2 k0"                          # K=64: 8 words a row
    for layout in ("grouped_contiguous", "grouped_masked"):
        assert sorted(int(s.split("k")[1]) for s in maps[layout][0]) == [0, 1, 8, 9, 16, 17, 24, 25]
    assert maps["grouped_contiguous"][16] != maps["grouped_masked"][16]  # N-major vs 16-row panels
