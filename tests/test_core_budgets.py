"""The step-count model behind `inferbook budgets --preset gpu`: each part priced from the dry run's
counts, scaled by the count knobs, and the command failing when a prediction exceeds its budget."""
import json

import pytest

from inferbook import budgets, cli, rehearsal


def _counts(slug, **kw):
    c = {"slug": slug, "params": rehearsal.rehearsal_params(slug), "cpu_s": 1.0, "torch_calls": 0, "scalar_reads": 0,
         "triton_launches": 0, "triton_specialisations": 0, "compiled_graphs": 0, "checks_failed": []}
    return {**c, **kw}


def test_rehearsal_keeps_the_gpu_branches_at_smoke_sizes():
    p = rehearsal.rehearsal_params("upgrade-record")
    assert p["dtype"] == "bfloat16" and p["d_model"] == 64          # gpu dtype, smoke width
    p = rehearsal.rehearsal_params("attention-test-matrix")
    assert "paged-128" in p["kv"] and p["head_dims"] == "64,96"      # named branches kept, a size list shrunk


def test_count_scale_multiplies_the_count_knobs():
    gpu = {"reps": 20, "sizes": "1,2,4,8", "n": (1, 2)}
    small = {"reps": 2, "sizes": "1,2", "n": (3,)}
    knobs = (("reps", "value"), ("sizes", "len"), ("n", "sum"))
    assert budgets.count_scale("x", gpu, small, knobs) == pytest.approx(10 * 2 * 1)
    assert budgets.count_scale("x", gpu, gpu, knobs) == 1.0


def test_host_and_compile_parts_follow_the_unit_costs():
    c = _counts("upgrade-record", torch_calls=1000, scalar_reads=10, triton_launches=0, compiled_graphs=2)
    p = budgets.predict("upgrade-record", c, budget_s=15)
    u = budgets.UNIT_COSTS_S
    assert p.host_s == pytest.approx(p.scale * (1000 * u["torch_call"] + 10 * u["scalar_read"]))
    assert p.compile_s == pytest.approx(2 * u["compiled_graph"])
    assert p.scale == pytest.approx((128 / 8) * (10 / 3) * (8 / 2))   # new_tokens, reps, n_layers
    assert p.binding == "compile" and p.fits == (p.total_s <= 15)


def test_device_part_uses_the_cost_model_when_it_exists(monkeypatch):
    from inferbook import compiled

    monkeypatch.setattr(compiled, "predicted_seconds", lambda slug, target, card: 1e-3, raising=False)
    p = budgets.predict("deterministic-attention", _counts("deterministic-attention"), budget_s=30)
    reps = 20
    assert p.device_model == "cost model (SASS)"
    assert p.device_s == pytest.approx(1e-3 * (reps + budgets.WARMUP_REPS) * budgets.TIMED_SIDES)
    monkeypatch.delattr(compiled, "predicted_seconds")
    p = budgets.predict("deterministic-attention", _counts("deterministic-attention"), budget_s=30)
    assert "roofline" in p.device_model and p.device_s > 0


def test_budgets_command_fails_over_budget_and_without_counts(tmp_path, monkeypatch, capsys):
    from inferbook import presets, toc

    fine = {s: _counts(s) for s in toc.CHAPTERS}
    path = tmp_path / "dry.json"
    budgets.save_dry_run(fine, path)
    monkeypatch.setattr(budgets, "DRY_RUN_FILE", path)
    monkeypatch.setattr(budgets, "device_seconds", lambda slug, params: (0.0, "test"))
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
