"""Backend selection by per-rank shapes (MiniMax M3 chapter) and the seed's records."""
import pytest

import inferbook
from inferbook.moe import backends as B
from inferbook.record import compare, comparability


def test_selection_table_tp_1_2_4_8():
    cfg = B.MINIMAX_M3_LIKE
    got = {tp: B.select_backends(cfg, tp) for tp in (1, 2, 4, 8)}
    assert [got[tp]["local"]["kv_heads"] for tp in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert got[8]["local"]["kv_replicas"] == 2
    assert got[4]["attention"].startswith("aiter-sparse") and got[8]["attention"].startswith("aiter-sparse")
    assert got[2]["attention"] == got[1]["attention"] == "triton-fallback"
    assert "aiter-sparse" in got[2]["refused"][0] and got[4]["refused"] == []
    assert [got[tp]["local"]["moe_inter"] for tp in (1, 2, 4, 8)] == [1536, 768, 384, 192]
    assert len(B.selection_table(cfg)) == 4


@pytest.mark.parametrize("tp, match", [(0, "positive int"), (3, "divide"), (True, "positive int"), (128, "divide")])
def test_bad_tp_is_a_clear_error(tp, match):
    with pytest.raises(ValueError, match=match):
        B.select_backends(B.MINIMAX_M3_LIKE, tp)


def test_seed_records_compare_and_refuse(results_env):
    from inferbook.chapters import minimax_m3_moe as m3_chapter

    ctx = inferbook.setup("minimax-m3-moe", device="cpu", preset="smoke")
    recs = {r.name: r for r in m3_chapter.seed_records(ctx)}
    assert all(r.source.startswith("quoted:") for r in recs.values())
    cmp = compare(recs["seed-mxfp8-before"], recs["seed-mxfp8-after"])
    thr = next(r for r in cmp.rows if r["metric"] == "throughput")
    assert thr["b/a"] == pytest.approx(342.4 / 109.1)
    pd = comparability(recs["seed-mxfp8-after"], recs["seed-pd"])
    assert any("unit of 'throughput'" in r for r in pd) and any("topology" in r for r in pd)
    mx = comparability(recs["seed-mxfp8-after"], recs["seed-mxfp4-later"])
    assert any("quantization" in r for r in mx) and any("tp 4 vs 2" in r for r in mx)
    # backend records of TP2 and TP4 are refused: topology and the selected attention backend differ
    tp = {r.name: r for r in m3_chapter.backend_records(ctx, [2, 4])}
    reasons = comparability(tp["tp2"], tp["tp4"])
    assert any("backend for 'attention'" in r for r in reasons)
