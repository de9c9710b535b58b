"""The model behind `inferbook budgets --preset gpu`: each part priced from the dry run's counts (per
phase where a chapter's records grow by different knobs), Triton compiles counted at the gpu shapes and
warmed ahead, and the command failing when a prediction exceeds its budget or the run its total."""
import json

import pytest

from inferbook import budgets, cli, rehearsal


def _counts(slug, **kw):
    c = {"slug": slug, "params": rehearsal.rehearsal_params(slug), "cpu_s": 1.0, "torch_calls": 0, "kernel_calls": 0,
         "view_calls": 0, "metadata_calls": 0, "scalar_reads": 0, "triton_launches": 0, "triton_specialisations": 0,
         "compiled_graphs": 0, "checks_failed": [], "python_cpu_s": 0.0, "phases": []}
    return {**c, **kw}


def test_rehearsal_keeps_the_gpu_branches_at_smoke_sizes():
    p = rehearsal.rehearsal_params("upgrade-record")
    assert p["dtype"] == "bfloat16" and p["d_model"] == 64          # gpu dtype, smoke width
    p = rehearsal.rehearsal_params("attention-test-matrix")
    assert "paged-128" in p["kv"] and p["head_dims"] == "64,96"      # named branches kept, a size list shrunk
    assert "1023x1024" not in p["shapes"]                            # sizes under names are sizes


def test_count_scale_multiplies_the_count_knobs():
    gpu = {"reps": 20, "sizes": "1,2,4,8", "n": (1, 2), "names": "a,b,c"}
    small = {"reps": 2, "sizes": "1,2", "n": (3,), "names": "a"}
    knobs = (("reps", "value"), ("sizes", "len"), ("n", "sum"), ("names", "len"))
    assert budgets.count_scale("x", gpu, small, knobs) == pytest.approx(10 * 2 * 1 * 3)
    assert budgets.count_scale("x", gpu, gpu, knobs) == 1.0
    assert budgets.count_scale("x", {"v": "2,3,4"}, {"v": "1,1,2"}, (("v", "prod", 2),)) == pytest.approx(12 ** 2)


def test_host_part_prices_each_kind_of_step(monkeypatch):
    monkeypatch.setattr(budgets, "gpu_compiles", lambda slug: (0, frozenset(), 0))
    phase = {"kernel_calls": 1000, "view_calls": 100, "scalar_reads": 10, "triton_launches": 0}
    c = _counts("upgrade-record", kernel_calls=1000, view_calls=100, scalar_reads=10, metadata_calls=50,
                python_cpu_s=0.5, phases=[["(before the first record)", "eager", phase]])
    p = budgets.predict("upgrade-record", c, budget_s=15)
    u = budgets.HOST_S
    g, sm = (rehearsal.chapter_module("upgrade-record").PRESETS[k] for k in ("gpu", "smoke"))
    # reps: whole generate runs here
    scale = (g["new_tokens"] / sm["new_tokens"]) * (g["reps"] / sm["reps"]) * (g["n_layers"] / sm["n_layers"])
    assert p.scale == pytest.approx(scale)
    o = budgets.COUNTING_OVERHEAD_S   # the counting's own cost, out of the Python seconds
    python = 0.5 - (1000 * o["kernel_calls"] + 100 * o["view_calls"] + 50 * o["metadata_calls"] + 10 * o["scalar_reads"])
    want = scale * (1000 * u["kernel_call"] + 100 * u["view_call"] + 10 * u["scalar_read"] + 50 * u["metadata_call"]
                    + python * budgets.PYTHON_SPEED)
    assert p.host_s == pytest.approx(want)
    assert p.binding == "host" and "Python" in p.binds


def test_phases_scale_by_their_own_knobs(monkeypatch):
    monkeypatch.setattr(budgets, "gpu_compiles", lambda slug: (0, frozenset(), 0))
    monkeypatch.setitem(budgets.PHASE_KNOBS, "upgrade-record", {"serving": (("serve_requests", "value"),)})
    one = {"kernel_calls": 100, "view_calls": 0, "scalar_reads": 0, "triton_launches": 0}
    c = _counts("upgrade-record", kernel_calls=200, phases=[["(before the first record)", "eager", one],
                                                                  ["math-attention", "serving-open-loop", one]])
    p = budgets.predict("upgrade-record", c, budget_s=15)
    g, s = rehearsal.chapter_module("upgrade-record").PRESETS["gpu"], c["params"]
    want = 100 * budgets.count_scale("upgrade-record", g, s) + 100 * g["serve_requests"] / s["serve_requests"]
    assert p.host_s == pytest.approx(want * budgets.HOST_S["kernel_call"])


def test_compile_part_counts_gpu_shapes_and_the_warm_step(monkeypatch):
    monkeypatch.setattr(budgets, "gpu_compiles", lambda slug: (40, frozenset({"k"}), 50))
    c = _counts("chord-w4a16", compiled_graphs=2, compile_cpu_s=10.0, triton_kernels={"k": 5, "other": 5},
                triton_specialisations=4)
    p = budgets.predict("chord-w4a16", c, budget_s=38)
    assert "chord-w4a16" in budgets.WARMED
    shapes = budgets.shape_scale("chord-w4a16", rehearsal.chapter_module("chord-w4a16").PRESETS["gpu"], c["params"])
    assert p.parts["host"]["50 timed Triton benchmarks x 200 samples (GPU only)"] == pytest.approx(
        50 * (budgets.BENCH_SAMPLES + budgets.WARMUP_REPS) * (budgets.HOST_S["triton_launch"] + budgets.SAMPLE_SYNC_S))
    assert p.compile_s == pytest.approx(40 * budgets.CACHE_HIT_S + 0.5 * 4 * shapes * budgets.TRITON_COMPILE_S
                                        + 2 * budgets.TORCH_COMPILE_GRAPH_S)
    assert p.warm_s == pytest.approx(40 * budgets.TRITON_COMPILE_S / budgets.WARM_JOBS)
    assert budgets.warm_step_s([p]) == pytest.approx(budgets.WARM_START_S + p.warm_s)


def test_device_part_uses_the_cost_model(monkeypatch):
    monkeypatch.setattr(budgets, "triton_device_seconds", lambda slug: (1e-3, "cost model (sm_90 SASS)"))
    monkeypatch.setattr(budgets, "gpu_compiles", lambda slug: (0, frozenset(), 0))
    p = budgets.predict("deterministic-attention", _counts("deterministic-attention"), budget_s=30)
    assert p.device_s == pytest.approx(1e-3 * (budgets.BENCH_SAMPLES + budgets.WARMUP_REPS))
    c = _counts("te-mxfp8-recipes", torch_bytes=4.8e9, torch_flops=0.0)
    monkeypatch.setattr(budgets, "triton_device_seconds", lambda slug: (0.0, "none"))
    p = budgets.predict("te-mxfp8-recipes", c, budget_s=30)
    g, s = rehearsal.chapter_module("te-mxfp8-recipes").PRESETS["gpu"], c["params"]
    size = budgets.count_scale("te-mxfp8-recipes", g, s, budgets.WORK_KNOBS["te-mxfp8-recipes"]["bytes"])
    steps = g["train_steps"] / s["train_steps"] * g["ep_reps"] / s["ep_reps"]
    assert p.device_s == pytest.approx(1e-3 * steps * size)     # 4.8 GB at 4.8 TB/s, scaled


def test_budgets_command_fails_over_budget_and_without_counts(tmp_path, monkeypatch, capsys):
    from inferbook import presets, toc

    fine = {s: _counts(s) for s in toc.CHAPTERS}
    path = tmp_path / "dry.json"
    budgets.save_dry_run(fine, path)
    monkeypatch.setattr(budgets, "DRY_RUN_FILE", path)
    monkeypatch.setattr(budgets, "triton_device_seconds", lambda slug: (0.0, "test"))
    monkeypatch.setattr(budgets, "gpu_compiles", lambda slug: (0, frozenset(), 0))
    assert cli.main(["budgets", "--preset", "gpu"]) == 0
    heavy = dict(fine, **{"upgrade-record": _counts("upgrade-record", compiled_graphs=100)})
    budgets.save_dry_run(heavy, path)
    assert cli.main(["budgets", "--preset", "gpu"]) == 1
    assert "OVER BUDGET" in capsys.readouterr().out
    del heavy["upgrade-record"]
    budgets.save_dry_run(heavy, path)
    assert cli.main(["budgets", "--preset", "gpu"]) == 1
    assert "no dry-run counts" in capsys.readouterr().out
    assert json.loads(path.read_text())["how"].startswith("inferbook budgets")
    assert cli.main(["budgets", "--preset", "gpu", "--table"]) == 0
    first = capsys.readouterr().out.splitlines()[0].split()
    assert len(first) == 4 and float(first[1]) == presets.budget_for(first[0], "gpu")[0]


def test_the_committed_dry_run_predicts_every_chapter_within_its_budget(capsys):
    """The done-when of issue 22: from data/budgets/gpu-dry-run.json, every chapter's prediction fits its
    budget and the whole run (both parts, warm steps included) fits GPU_RUN_TOTAL_S."""
    rc = cli.main(["budgets", "--preset", "gpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "OVER BUDGET" not in out and "binds" in out


def test_cpu_only_records_are_left_out_and_each_phase_scales_its_own_python(monkeypatch):
    monkeypatch.setattr(budgets, "gpu_compiles", lambda slug: (0, frozenset(), 0))
    monkeypatch.setattr(budgets, "triton_device_seconds", lambda slug: (0.0, "test"))
    slug = "chord-w4a16"
    assert "cpu-" in budgets.CPU_ONLY_RECORDS[slug]

    def phase(kernels, python, nbytes):
        return {"kernel_calls": kernels, "view_calls": 0, "scalar_reads": 0, "metadata_calls": 0, "triton_launches": 0,
                "torch_bytes": nbytes, "torch_flops": 0.0, "python_cpu_s": python}
    routing, roofline, cpu = phase(100, 0.2, 1e6), phase(10, 0.1, 0.0), phase(5000, 5.0, 1e9)
    c = _counts(slug, kernel_calls=5110, torch_bytes=1e6 + 1e9, torch_flops=0.0, python_cpu_s=5.3,
                phases=[["(before the first record)", "routing", routing], ["roofline-model", "cpu-bf16", roofline],
                        ["cpu-bf16", "cpu-w4a16", cpu]])
    p = budgets.predict(slug, c, budget_s=6)
    g = rehearsal.chapter_module(slug).PRESETS["gpu"]
    m_sweep = budgets.count_scale(slug, g, c["params"], (("m_sweep", "len"),))
    assert m_sweep > 1
    o = budgets.COUNTING_OVERHEAD_S["kernel_calls"]
    # the router once, the roofline table per M; the CPU timing phase not at all
    assert p.parts["host"]["the chapter's own Python"] == pytest.approx((0.2 - 100 * o) + m_sweep * (0.1 - 10 * o))
    kernel_row = next(v for k, v in p.parts["host"].items() if k.endswith("torch kernel calls"))
    assert kernel_row == pytest.approx((100 + 10 * m_sweep) * budgets.HOST_S["kernel_call"])
    size = budgets.count_scale(slug, g, c["params"], budgets.WORK_KNOBS[slug]["bytes"])
    card = __import__("inferbook.compiled", fromlist=["CARDS"]).CARDS[budgets.CARD]
    assert p.device_s == pytest.approx(1e6 * size / (card["hbm_tbps"] * 1e12))   # the CPU phase's 1 GB left out
    assert any("CPU-only" in n for n in p.notes)


def test_byte_and_flop_counts_read_with_their_prefix():
    # sglang-fused-comm's device line once said "1.43e+07MB": a count past a million millions takes G or T
    from inferbook.budgets import _fmt
    assert [_fmt(x) for x in (512, 2.5e3, 4.2e6, 1.43e13, 3e9)] == ["512", "2.5k", "4.2M", "14.3T", "3G"]
