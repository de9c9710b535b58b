"""Grouped GEMM checker (TE 2.19 #3475) and the CUDA Graph retained-gradient check (#2937)."""
import pytest
import torch

import inferbook  # noqa: F401  (Triton interpreter on CPU)
from inferbook.numerics import graphs, grouped, small_op_threads

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with small_op_threads("cpu"):
        yield


def test_triton_grouped_gemm_passes_and_the_checker_catches_a_fault():
    ok = grouped.check_grouped_gemm(grouped.grouped_gemm_triton, n_groups=3, max_rows=40, shapes=((33, 70),),
                                    device=DEV)
    assert ok and all(r["passed"] for r in ok), [r for r in ok if not r["passed"]]
    patterns = {r["group_sizes"] for r in ok}
    assert "0 0 40" in patterns and "1 1 1" in patterns  # empty and single-row groups are in the matrix
    bad = grouped.check_grouped_gemm(grouped.broken_grouped_gemm, n_groups=3, max_rows=40, shapes=((33, 70),),
                                     device=DEV)
    assert not any(r["passed"] for r in bad)
    # NaN-prefilled output: the skipped rows are caught as non-finite, not as a small error
    assert all(r["max_rel_err"] != r["max_rel_err"] for r in bad)


def test_grouped_gemm_matches_reference_on_odd_shape_and_bf16():
    g = torch.Generator().manual_seed(0)
    sizes = [5, 0, 37, 1]
    x = torch.randn(sum(sizes), 19, generator=g)
    w = torch.randn(4, 23, 19, generator=g)
    ref = grouped.grouped_gemm_reference(x, w, sizes)
    got = grouped.grouped_gemm_triton(x.to(DEV), w.to(DEV), sizes).cpu()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    got_bf = grouped.grouped_gemm_triton(x.bfloat16().to(DEV), w.bfloat16().to(DEV), sizes).cpu().float()
    ref_bf = grouped.grouped_gemm_reference(x.bfloat16(), w.bfloat16(), sizes).float()
    exact = grouped.grouped_gemm_reference(x.bfloat16().double(), w.bfloat16().double(), sizes)
    assert (got_bf.double() - exact).abs().max() <= 2 * (ref_bf.double() - exact).abs().max() + 1e-6


def test_bad_input_is_a_clear_error():
    x, w = torch.randn(10, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped.grouped_gemm_reference(x, w, [3, 3])
    with pytest.raises(ValueError, match="grouped GEMM needs"):
        grouped.grouped_gemm_triton(x, torch.randn(2, 4, 9), [5, 5])


def test_cuda_graph_retained_gradients():
    if DEV.type != "cuda":
        with pytest.raises(graphs.NeedsCuda):
            graphs.retained_gradient_check(DEV)
        pytest.skip("CUDA Graph replay needs a CUDA device: skipped on CPU (not passed)")
    out = graphs.retained_gradient_check(DEV)
    assert out["retained_copies_equal_eager_A"] and out["replay_B_equals_eager_B"]


def test_chapter_knobs_reject_bad_values_before_work():
    from inferbook.chapters import gdn_backward_check as gdn_chapter, te_mxfp8_recipes as mx_chapter

    with pytest.raises(ValueError, match="unknown recipe"):
        mx_chapter.selected_recipes("mxfp8,fp6")
    assert list(mx_chapter.selected_recipes("bf16, mxfp8")) == ["bf16", "mxfp8"]
    with pytest.raises(ValueError, match="head_dims must be comma-separated positive ints"):
        gdn_chapter.parse_ints("head_dims", "32,x")
    with pytest.raises(ValueError, match="not allowed"):
        gdn_chapter.parse_choices("gates", "random,positive", ("random", "zero"))
