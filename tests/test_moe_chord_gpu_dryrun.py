"""The chord-w4a16 GPU branch (decode sweep per layout, prefill per layout, rotated dense sweep)
driven on CPU with the CUDA-graph timer replaced by a plain loop, at tiny shapes: its Python runs
and its records have the names the page reads. The times are interpreter times and mean nothing."""
import inferbook
from inferbook.chapters import chord_w4a16 as ch
from inferbook.measure import benchmark


def test_gpu_branch_dry_run(monkeypatch):
    ctx = inferbook.setup("chord-w4a16", device="cpu", preset="smoke")

    def loop_time(fn, device, *, label, reps, inner=10, uses_triton=True):
        for _ in range(inner):
            fn()
        return benchmark(fn, device, label=label, min_reps=2, warmup=0, min_time_s=0.0), "plain loop (dry run)"

    monkeypatch.setattr(ch, "gpu_time", loop_time)
    monkeypatch.setattr(ch, "_rotation", lambda device, nbytes: 2)
    recs = {r.name: r for r in ch.gpu_timings(ctx, 64, 128, [1], 2, 24, 4, 64, 32, 2, 4, 64, 32, [1, 2])}
    for layout in ("indexed", "grouped_masked", "grouped_contiguous"):
        dec = recs[f"gpu-decode-{layout}"]
        assert [m["m"] for m in dec.measurements if m["name"].startswith("frac_copy")] == [1, 2]
        assert len(dec.get("decode_m1")["samples_s"]) >= 2
        assert recs[f"gpu-prefill-{layout}"].value("fused_moe") > 0
    assert "rotated over 2 copies" in recs["gpu-w4a16-triton"].get("gemm_m1")["how"]
    # the decode kernels: dense (split-K) and the MoE layer on decode-packed experts, at M <= 16
    assert recs["gpu-w4a16-decode"].value("gemm_m1") > 0
    packed = recs["gpu-decode-decode-packed"]
    assert [m["m"] for m in packed.measurements if m["name"].startswith("frac_copy")] == [1, 2]
    # gemlite beside ours: on this CPU its package does not import, and the record says so
    assert recs["gpu-w4a16-beside-gemlite"].notes.startswith("gemlite peer: ")


def test_even_routing_gives_every_expert_m_rows():
    import torch

    from inferbook.moe import routing as R
    for E, k, m in ((48, 8, 1), (48, 8, 5), (6, 4, 3)):
        tw, ids = ch.even_routing(E, k, m, torch.device("cpu"))
        counts = R.tokens_per_expert(ids, E)
        assert int(counts.min()) >= m and int(counts.max()) <= m + 1
        assert all(len(set(row)) == k for row in ids.tolist())
        assert torch.allclose(tw.sum(-1), torch.ones(ids.shape[0]))


def test_m3_gpu_branch_dry_run_times_both_paths_at_each_tile_config(monkeypatch):
    from inferbook.chapters import minimax_m3_moe as m3

    ctx = inferbook.setup("minimax-m3-moe", device="cpu", preset="smoke")

    def loop_time(fn, device, *, label, reps, inner=10, uses_triton=True):
        fn()
        return benchmark(fn, device, label=label, min_reps=2, warmup=0, min_time_s=0.0), "plain loop (dry run)"

    monkeypatch.setattr(m3, "gpu_time", loop_time)
    monkeypatch.setattr(m3, "on_gpu", lambda ctx: True)
    # C = 64, E = 8, k = 2: 16 rows per routed expert, 21.3 per expert with the shared slot -> two configs
    assert len(m3.tile_configs(64, 8, 2)) == 2
    # C = 4: a decode step (at most 16 rows per expert): both paths once, on the decode kernels
    recs = m3.shared_timings(ctx, 64, 32, 8, 2, [4, 64], 2, 2.5)
    tags = {r.get("layer")["tiles"] for r in recs if r.workload["batch"] == 64}
    assert len(tags) == 2 and len(recs) == 6 and m3.DECODE_TAG not in tags
    dec = [r for r in recs if r.workload["batch"] == 4]
    assert [r.name for r in dec] == ["shared-separate-c4-decode", "shared-fused-c4-decode"]
    assert all("decode kernel" in r.notes for r in dec)
    gains = [m for r in recs for m in r.measurements if m["name"] == "gain_vs_separate"]
    assert {g["tiles"] for g in gains} == tags | {m3.DECODE_TAG} and all("sentence" in g for g in gains)
    # the page's measured counterpart of each roofline row is a record this branch makes
    work = m3.roofline_work({"experts": 8, "top_k": 2, "hidden": 64, "inter": 32, "concurrency": "4,64"})
    assert {w["record"] for w in work} <= {r.name for r in recs}
