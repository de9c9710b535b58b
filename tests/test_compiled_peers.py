"""The peers compiled beside ours (data/compiled/peers/<slug>.json, `inferbook.compiled.peers`).

Freshness: our own rows in a peer table (GDN's chunk kernels at the timed shape) are checked everywhere;
a peer's rows only where that peer imports (the peers are optional: `pip install -e .[peers]`), as the
chapter tables' freshness test checks them — the launches built today against the committed rows, by
name, kernel source, argument specialisation and constexprs. Builds launch lists only; compiles nothing.
The page test reads the committed tables: it needs no peer installed."""
from __future__ import annotations

import pytest
import torch

from inferbook import compiled
from inferbook.compiled import peers

TARGETS = ("sm_80", "sm_90", "sm_100")
REGENERATE = "PYTHONPATH=$PWD/src python -m inferbook.compiled.peers SLUG --save   (with the peer installed)"


def _tables():
    return {slug: doc for slug in peers.PEERS if (doc := peers.load(slug)) is not None}


def test_every_peer_table_is_committed_clean_and_on_three_targets():
    tables = _tables()
    assert set(tables) == set(peers.PEERS), f"missing peer tables: {sorted(set(peers.PEERS) - set(tables))}"
    for slug, doc in tables.items():
        assert doc["peer"] == peers.PEER_OF[slug]
        for t in TARGETS:
            rows = [r for r in doc["rows"] if r["target"] == t and r["side"] == "peer"]
            assert rows, f"{slug}: no {t} peer rows"
        known = {(t, k) for (s, t, k) in peers.PEER_KNOWN_FAILURES if s == slug}
        failing = {(r["target"], r["kernel"]) for r in doc["rows"] if compiled.problems(r)}
        # a swept config over the shared-memory limit is one the peer's autotuner drops at launch (never chosen)
        swept_over = lambda r: (r["target"] == peers.SWEEP_TARGET and r.get("ok") and not r.get("smem_ok", True)  # noqa: E731
                                and " cfg " in r["launch"])
        bad = [f"{r['launch']} {r['target']}: {'; '.join(compiled.problems(r))}" for r in doc["rows"]
               if compiled.problems(r) and (r["target"], r["kernel"]) not in known and not swept_over(r)]
        assert not bad, f"{slug}: problem rows:\n" + "\n".join(bad)
        assert known <= failing, f"{slug}: known failures that compile now; remove them: {sorted(known - failing)}"
        # the non-sweep targets hold one config per (shape, kernel), the one chosen on the sweep target
        for t in TARGETS:
            if t == peers.SWEEP_TARGET:
                continue
            keys = [(peers._shape_of(r["launch"]), peers._step_of(r["launch"])) for r in doc["rows"] if r["target"] == t]
            assert len(keys) == len(set(keys)), f"{slug} {t}: more than one config per kernel"


def _check(slug, doc, side, build, peer=None):
    """The committed `side` rows (of `peer`) on every target == `build()`'s launches built for that target:
    the sweep target with every config, the others with the chosen ones (`save`'s environment)."""
    import json
    import os

    from inferbook.device import building_for

    mine = lambda r: r["side"] == side and (peer is None or r.get("peer") == peer)  # noqa: E731
    sweep_rows = [r for r in doc["rows"] if r["target"] == peers.SWEEP_TARGET]
    chosen = doc["sweep"]["chosen"]
    env = {peers.CONFIG_ENV: json.dumps(peers.config_choice(sweep_rows, chosen))}
    for t in TARGETS:
        saved = {k: os.environ.pop(k, None) for k in env}
        try:
            if t != peers.SWEEP_TARGET:
                os.environ.update(env)
            with building_for(t):
                want = [compiled.launch_fingerprint(la) for la in build()]
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
        have = [compiled.row_fingerprint(r) for r in doc["rows"] if r["target"] == t and mine(r)]
        assert have == want, f"{slug} {t}: {side} rows stale; regenerate with `{REGENERATE}`"


def test_our_rows_in_the_gdn_peer_table_are_current():
    """Our chunk kernels at the timed shape (built by `gdn_chunk.chunked_launches` and
    `gdn_chunk_bwd.chunked_bwd_launches`): no peer needed."""
    doc = peers.load("gdn-backward-check")
    P = compiled.gpu_params("gdn-backward-check")
    _check("gdn-backward-check", doc, "ours",
           lambda: [la for s in peers.gdn_shapes(P) for la in peers.our_chunk_gdn(*s) + peers.our_chunk_gdn_bwd(*s)])


def test_fla_is_traced_as_on_each_card():
    """fla-core decides its tiles and autotuner lists at import from the device's shared memory: traced
    here, it is imported afresh with the card's answers (H200's 227 KB: BK = BV = 128 in its dqkwg; A100's
    163 KB on 16-bit tensors too), not the no-GPU fallback's; its backward leaves out the recompute of w, u
    and h (ours keeps them from the forward)."""
    if not peers.usable("fla-core"):
        pytest.skip(f"fla-core is not usable here ({peers.available()['fla-core']})")
    import sys

    from inferbook.device import building_for
    for t in TARGETS:
        with building_for(t):
            with peers.fla_as_on() as C:
                assert sys.modules["fla.utils.hardware"].IS_NVIDIA_HOPPER == (t == "sm_90")
                assert sys.modules["fla.ops.common.chunk_o"].BKV_LIST == [64, 128]
            launches = peers.fla_chunk_gdn_bwd(1, 128, 2, 128, 128, configs=None)
        assert not any(n.startswith("fla") for n in sys.modules)          # dropped again afterwards
        dq = [la for la in launches if la.name.startswith("fla-core: chunk_bwd_kernel_dqkwg")]
        assert dq and (dq[0].kwargs["BK"], dq[0].kwargs["BV"]) == (128, 128), dq[0].kwargs
        assert not any(k in la.name for la in launches for k in peers.FLA_BWD_RECOMPUTE)


@pytest.mark.parametrize("slug,peer", [(s, p) for s in sorted(peers.PEERS) for p in peers.peers_of(s)])
def test_peer_rows_are_current_where_the_peer_imports(slug, peer, monkeypatch):
    if not peers.usable(peer):
        pytest.skip(f"{peer} is not usable here ({peers.available()[peer]})")
    monkeypatch.delenv(peers.CONFIG_ENV, raising=False)
    doc = peers.load(slug)
    from inferbook.device import kernel_target

    _check(slug, doc, "peer", lambda: [la for la in compiled.launches_for(peers.peer_spec(slug, peer),
                                                                          kernel_target(torch.device("cuda")))
                                       if not la.name.startswith("ours: ")], peer)


def test_each_page_sets_ours_beside_its_peer_with_the_binding_bounds():
    """Every committed peer table pairs with ours at every shape it holds (H200, sm_90), and the
    compiler section's third line says ours / peer per shape with both sides' binding bound."""
    for slug, doc in _tables().items():
        shapes = {(r["peer"], peers._shape_of(r["launch"]) or r["launch"].split(" ", 2)[-1])
                  for r in doc["rows"] if r["side"] == "peer"}
        pairs = peers.compare(slug, doc["rows"], "sm_90", "H200")
        assert {(q["peer"], q["shape"]) for q in pairs} == shapes, f"{slug}: shapes without ours beside the peer"
        line = compiled.CompilerSection(slug).lines[2]
        for peer in {p for p, _ in shapes}:
            assert f"ours / {peer} = " in line and "predicted" in line, (slug, line)
        for q in pairs:
            assert (f"{q['shape']} {q['ours_over_peer']:.2f}× (ours {q['ours_bound']}-bound, {q['peer']} "
                    f"{q['peer_bound']}-bound)") in line, (slug, line)


def test_spills_of_the_compared_configs_are_said_on_every_target():
    # the model charges nothing for local memory: where a compared side spills the page says how much, per target,
    # from the rows compare() took (GDN's backward: ours 72 B on sm_80, fla's dq/dk/dw/dg kernel at every target)
    doc = peers.load("gdn-backward-check")
    said = peers.spill_sentence("gdn-backward-check", doc["rows"])
    for t in TARGETS:
        for q in peers.compare("gdn-backward-check", doc["rows"], t, compiled.TARGET_CARD[t]):
            if q["ours_spill_bytes"] or q["peer_spill_bytes"]:
                assert f"{t} {q['shape']} ours {q['ours_spill_bytes']} B, fla-core {q['peer_spill_bytes']} B" in said
    ours80 = [r for r in doc["rows"] if r["target"] == "sm_80" and r["side"] == "ours" and "dqkwg" in r["launch"]]
    assert ours80 and f"sm_80 backward B4 T1024 H8 K128 V128 bf16 ours {sum(r['spill_bytes'] for r in ours80)} B" in said
    assert said in compiled.CompilerSection("gdn-backward-check").lines[2]
    # a table where neither side spills says nothing
    assert peers.spill_sentence("chord-w4a16", peers.load("chord-w4a16")["rows"]) == ""


def test_config_choice_takes_the_fastest_predicted(monkeypatch):
    rows = [{"launch": "p: k cfg 1/2 @ S", "kernel": "k", "side": "peer", "ok": True, "sass": {}},
            {"launch": "p: k cfg 2/2 @ S", "kernel": "k", "side": "peer", "ok": True, "sass": {}}]
    monkeypatch.setattr(compiled, "predict_rows", lambda rs, card, root=None: [{"seconds": 2.0}, {"seconds": 1.0}][:len(rs)])
    assert peers.choose(rows) == {"k @ S": 1}


def test_a_chosen_config_is_carried_by_content_where_the_lists_differ():
    """`_pick`: a bare index as it is; {'i', 'match'}: the index where that candidate is the chosen config,
    else the first candidate equal to it (another card's list), else the index clipped to the list."""
    import triton

    a, b, c = (triton.Config({"BV": 32}, num_warps=2, num_stages=2), triton.Config({"BV": 64}, num_warps=4, num_stages=2),
               triton.Config({"BV": 64}, num_warps=4, num_stages=3))
    want = {"BV": 64, "num_warps": 4, "num_stages": 2, "K": 128}
    assert peers._pick([a, b, c], 2) == 2
    assert peers._pick([a, b, c], {"i": 1, "match": want}) == 1
    assert peers._pick([c, a, b], {"i": 1, "match": want}) == 2          # moved: found by content
    assert peers._pick([a, c], {"i": 5, "match": want}) == 1             # absent: clipped


def test_gemlite_and_torchao_loaders_say_why_when_absent():
    """`available()` answers for every peer, in one line each, whether or not it is installed."""
    got = peers.available()
    assert set(got) == set(peers.PEER_MODULES)
    assert all(v and "\n" not in v for v in got.values())


def test_time_beside_interleaves_and_merges_rounds():
    """Both sides warmed, then timed in alternating rounds; each label's samples are all its rounds'."""
    import torch

    calls = []
    fns = {"ours": lambda: calls.append("o"), "peer": lambda: calls.append("p")}
    got = peers.time_beside(fns, torch.device("cpu"), rounds=3, warmup=2, min_reps=2, max_reps=2, min_time_s=0.0)
    assert set(got) == {"ours", "peer"} and all(t.n == 6 for t in got.values())
    assert calls[:4] == ["o", "o", "p", "p"]                          # warmed first
    seq = "".join(calls[4:])                                           # round 1 ours, peer; round 2 peer, ours; ...
    assert seq.startswith("o") and "pppppp" in seq and "oooooo" in seq


# ---------------------------------------------------------------------------------------------------
# vLLM: its fused_moe.py read by path (never imported); a fake package stands in where vLLM is absent

FAKE_FUSED_MOE = """\
raise RuntimeError("the module body of fused_moe.py ran")
import vllm.envs as envs

BLOCK: tl.constexpr = 16
UNUSED: tl.constexpr = 3


@triton.jit
def helper(x, B: tl.constexpr):
    return x + B


@triton.jit
def kern(x_ptr, n):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, helper(tl.load(x_ptr + i, mask=i < n), BLOCK), mask=i < n)


@triton.jit
def other_kernel(x_ptr):
    tl.store(x_ptr, 1)


def pick(n):
    return {"BLOCK_SIZE_M": 16 if n <= 20 else 64}


SIDE_EFFECT = print("module-level statement ran")
"""


def _fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "vllm"
    (pkg / "model_executor/layers/fused_moe").mkdir(parents=True)
    (pkg / "__init__.py").write_text('raise RuntimeError("vllm/__init__.py ran")\n')
    f = pkg / "model_executor/layers/fused_moe/fused_moe.py"
    f.write_text(FAKE_FUSED_MOE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(peers, "_VLLM", {})
    return f


def test_vllm_loader_refuses_cleanly_without_vllm(monkeypatch):
    """No vllm package on the path: one line saying how to get it; nothing built, nothing imported."""
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "vllm" else real(name, *a, **k))
    monkeypatch.setattr(peers, "_VLLM", {})
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps"):
        peers.vllm_fused_moe_file()
    assert not peers.usable("vllm")
    why = peers.available()["vllm"]
    assert why.startswith("ModuleNotFoundError") and "\n" not in why and "PYTHONPATH" in why
    assert peers.chord_w4a16_vllm() == []
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)


def test_defs_from_source_takes_the_named_kernel_and_its_helpers_only(tmp_path, monkeypatch):
    """The fake fused_moe.py raises at its first line and its package `__init__` raises: neither runs.
    The named jit kernel comes with the jit helper and the constexpr it calls; the other kernel, the
    unused constexpr, the plain function and the module-level statements are not executed."""
    import inspect
    import sys

    import triton
    import triton.language as tl

    f = _fake_vllm(tmp_path, monkeypatch)
    assert peers.vllm_fused_moe_file() == f                      # found without running vllm/__init__.py
    assert "vllm" not in sys.modules
    ns = {"triton": triton, "tl": tl}
    got = peers.defs_from_source(f, ["kern"], ns)
    assert set(got) == {"kern", "helper", "BLOCK"}
    assert not {"other_kernel", "UNUSED", "pick", "SIDE_EFFECT", "envs"} & set(ns)
    assert callable(getattr(ns["kern"], "fn", None)) and ns["BLOCK"] == 16        # jit (or interpreted, as tests run)
    assert inspect.getsource(ns["kern"].fn).lstrip().startswith("@triton.jit\ndef kern(")   # the file's own text
    with compiled.recording("fake") as launches:                 # a real kernel: it launches (recorded)
        ns["kern"][(1,)](compiled.meta((16,), __import__("torch").float32), 7)
    assert [la.name for la in launches] == ["kern"]
    assert peers.defs_from_source(f, ["pick"], {})["pick"](30) == {"BLOCK_SIZE_M": 64}   # a plain function on request
    with pytest.raises(KeyError, match="not_there"):
        peers.defs_from_source(f, ["not_there"], {})


def test_committed_vllm_rows_load_and_pair_with_ours():
    """chord-w4a16's table holds vLLM's gate/up and down launches at every MoE decode shape on three
    targets, and `compare` sets ours (both GEMMs of our fastest layout) beside them; no vLLM needed."""
    from inferbook.moe import w4a16

    doc = peers.load("chord-w4a16")
    P = compiled.gpu_params("chord-w4a16")
    keys = [peers.moe_shape_key(*s, w4a16.GROUP_SIZE) for s in peers.moe_shapes(P)]
    assert len(keys) == 3
    rows = [r for r in doc["rows"] if r.get("peer") == "vllm"]
    for t in TARGETS:
        for key in keys:
            steps = sorted(peers._step_of(r["launch"]) for r in rows if r["target"] == t and peers._shape_of(r["launch"]) == key)
            assert steps == ["fused_moe_kernel_gptq_awq down", "fused_moe_kernel_gptq_awq gate_up"], (t, key, steps)
    assert all(r["ok"] and r["kernel"] == "fused_moe_kernel_gptq_awq" for r in rows)
    for t, card in (("sm_80", "A100"), ("sm_90", "H200"), ("sm_100", "B200")):
        pairs = {q["shape"]: q for q in peers.compare("chord-w4a16", doc["rows"], t, card) if q["peer"] == "vllm"}
        assert set(pairs) == set(keys), t
        for q in pairs.values():
            assert q["ours_launch"].endswith("gate_up + down (M" + q["shape"].split()[0][1:] + ")")
            assert len(q["peer_launches"]) == 2 and q["ours_s"] > 0 and q["peer_s"] > 0


def test_save_only_one_peer_keeps_the_other_peers_rows(tmp_path, monkeypatch):
    """`save(slug, only="vllm")` compiles vLLM's launches only (compiling stubbed here) and keeps gemlite's
    committed rows, their chosen configs and versions as they were; vLLM's old rows are replaced."""
    import json

    from inferbook.compiled import DATA_DIR

    gem = {"launch": "gemlite: k cfg 2/3 @ S", "kernel": "k", "target": "sm_90", "index": 0, "side": "peer",
           "peer": "gemlite", "ok": True, "sass": {}}
    stale = {**gem, "launch": "vllm: old @ S2", "kernel": "old", "peer": "vllm", "index": 1}
    path = tmp_path / DATA_DIR / "peers" / "chord-w4a16.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"rows": [gem, stale], "sweep": {"chosen": {"k @ S": 1}},
                                "peer_versions": {"gemlite": "0.6"}}))
    built = []

    def fake_inspect(specs, targets, jobs=1):
        built.append((specs, targets))
        return [{"launch": "vllm: fused_moe_kernel_gptq_awq gate_up cfg 16x64x32 G1 w4 s3 @ S2", "kernel": "fused_moe_kernel_gptq_awq",
                 "target": t, "index": 0, "ok": True, "sass": {}} for t in targets]

    monkeypatch.setattr(peers, "usable", lambda p: True)
    monkeypatch.setattr(compiled, "inspect", fake_inspect)
    monkeypatch.setattr(compiled, "predict_rows", lambda rs, card, root=None: [{"seconds": 1.0} for _ in rs])
    doc = json.loads(peers.save("chord-w4a16", root=tmp_path, only="vllm").read_text())
    assert {tuple(s) for s, _ in built} == {(peers.PEER_SPECS["chord-w4a16"]["vllm"],)}
    assert [r for r in doc["rows"] if r["peer"] == "gemlite"] == [gem]
    new = [r for r in doc["rows"] if r["peer"] == "vllm"]
    assert sorted(r["target"] for r in new) == sorted(TARGETS) and all(r["index"] > gem["index"] for r in new)
    assert doc["sweep"]["chosen"]["k @ S"] == 1 and doc["peer_versions"]["gemlite"] == "0.6"


def test_chord_peer_rows_whose_ir_loops_over_a_dot_have_a_machine_code_loop():
    """A row whose Triton IR runs a dot in a loop of two or more trips must have a main loop in its
    machine code, else the cost model counts the loop body once: its issue and latency bounds are those
    of straight-line code and the prediction falls to the memory floor. gemlite's GEMM_SPLITK row on
    sm_100 was committed so (compiled before sm_100's `BRA.U UP0` loops were found) and predicted
    memory-bound, faster than our decode kernel, where its sm_80 and sm_90 rows (same config, loop
    found) are bound by their loop (waves, latency)."""
    doc = peers.load("chord-w4a16")
    looped = [r for r in doc["rows"] if r.get("ok") and any((d[4] or 0) > 1 for d in r.get("dots") or [])]
    assert {r["target"] for r in looped} == set(TARGETS)
    bad = [f"{r['target']} {r['launch']}: {r['sass']}" for r in looped
           if not (r["sass"]["instrs"] and r["sass"]["global_bytes_per_warp"])]
    assert not bad, "rows with no machine-code main loop; regenerate with `" + REGENERATE + "`:\n" + "\n".join(bad)


def test_chord_gemlite_pairs_with_ours_at_every_dense_shape_on_three_targets():
    """`compare` sets our decode kernel beside gemlite at M 1, 2 and 16 on every target, each side with
    a positive time and a named bound (B200 for sm_100)."""
    doc = peers.load("chord-w4a16")
    want = {f"M{m} N{n} K{k} g32" for m, n, k in peers.chord_shapes(compiled.gpu_params("chord-w4a16"))}
    for t, card in (("sm_80", "A100"), ("sm_90", "H200"), ("sm_100", "B200")):
        pairs = {q["shape"]: q for q in peers.compare("chord-w4a16", doc["rows"], t, card) if q["peer"] == "gemlite"}
        assert set(pairs) == want, t
        for q in pairs.values():
            assert q["ours_launch"].startswith("decode kernel M") and q["ours_s"] > 0 and q["peer_s"] > 0, q


def test_save_without_the_tables_only_peer_keeps_the_table(tmp_path, monkeypatch):
    """A one-peer table saved where that peer does not import: one line, exit 2, the committed table as it
    was (it once became our 9 rows alone when fla lacked einops)."""
    import json

    from inferbook.compiled import DATA_DIR

    path = tmp_path / DATA_DIR / "peers" / "gdn-backward-check.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"rows": [{"launch": "fla: k @ S", "side": "peer", "peer": "fla-core"}]}))
    before = path.read_text()
    monkeypatch.setattr(peers, "usable", lambda p: False)
    monkeypatch.setattr(peers, "available", lambda: {"fla-core": "ModuleNotFoundError: No module named 'einops'"})
    monkeypatch.setattr(compiled, "inspect", lambda *a, **k: pytest.fail("compiled although the peer is absent"))
    from inferbook.errors import UserError

    with pytest.raises(UserError, match="fla-core is not usable here .*einops"):
        peers.save("gdn-backward-check", root=tmp_path)
    assert path.read_text() == before


def test_kimi_tail_pairs_our_fused_tails_with_vllms_down_gemm():
    doc = peers.load("kimi-topk-tail-fusion")
    assert doc is not None and doc["peer"] == "vllm"
    pairs = peers.compare("kimi-topk-tail-fusion", doc["rows"])
    P = compiled.gpu_params("kimi-topk-tail-fusion")
    assert len(pairs) == len(str(P["tokens"]).split(","))
    for q in pairs:
        assert q["ours_launch"].startswith(("fused down_tail", "decode down_tail")), q["ours_launch"]
        assert q["peer_launches"] and all("fused_moe_kernel_gptq_awq down" in n for n in q["peer_launches"])
    # the peer's bytes are the reachable experts', not the whole table its arguments span
    rows = [r for r in doc["rows"] if r["target"] == "sm_90" and r.get("ok")]
    table = 896 * 3584 * 256 // 2
    assert rows and all(r["dram_bytes"] < table / 10 for r in rows if " T1 " in r["launch"] or "@ T1 " in r["launch"])
