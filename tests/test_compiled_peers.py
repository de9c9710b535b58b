"""The peers compiled beside ours (data/compiled/peers/<slug>.json, `inferbook.compiled.peers`).

Freshness: our own rows in a peer table (GDN's chunk kernels at the timed shape) are checked everywhere;
a peer's rows only where that peer imports (the peers are optional: `pip install -e .[peers]`), as the
chapter tables' freshness test checks them — the launches built today against the committed rows, by
name, kernel source, argument specialisation and constexprs. Builds launch lists only; compiles nothing.
The page test reads the committed tables: it needs no peer installed."""
from __future__ import annotations

import pytest

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
            keys = [(peers._shape_of(r["launch"]), r["kernel"]) for r in doc["rows"] if r["target"] == t]
            assert len(keys) == len(set(keys)), f"{slug} {t}: more than one config per kernel"


def _check(slug, doc, side, launches):
    want = [compiled.launch_fingerprint(la) for la in launches]
    sweep = [compiled.row_fingerprint(r) for r in doc["rows"] if r["target"] == peers.SWEEP_TARGET and r["side"] == side]
    assert sweep == want, f"{slug} {side} rows stale; regenerate with `{REGENERATE}`"
    names = {w["launch"]: w for w in want}
    for t in TARGETS:
        for r in (r for r in doc["rows"] if r["target"] == t and r["side"] == side):
            assert compiled.row_fingerprint(r) == names.get(r["launch"]), f"{slug} {t}: {r['launch']} stale"


def test_our_rows_in_the_gdn_peer_table_are_current():
    """Our chunk kernels at the timed shape (built by `gdn_chunk.chunked_launches`): no peer needed."""
    doc = peers.load("gdn-backward-check")
    P = compiled.gpu_params("gdn-backward-check")
    _check("gdn-backward-check", doc, "ours", [la for s in peers.gdn_shapes(P) for la in peers.our_chunk_gdn(*s)])


@pytest.mark.parametrize("slug", sorted(peers.PEERS))
def test_peer_rows_are_current_where_the_peer_imports(slug, monkeypatch):
    peer = peers.PEER_OF[slug]
    if not peers.usable(peer):
        pytest.skip(f"{peer} is not importable here ({peers.available()[peer]})")
    monkeypatch.delenv(peers.CONFIG_ENV, raising=False)
    doc = peers.load(slug)
    built = [la for la in compiled.launches_for(peers.PEERS[slug]) if not la.name.startswith("ours: ")]
    _check(slug, doc, "peer", built)


def test_each_page_sets_ours_beside_its_peer_with_the_binding_bounds():
    """Every committed peer table pairs with ours at every shape it holds (H200, sm_90), and the
    compiler section's third line says ours / peer per shape with both sides' binding bound."""
    for slug, doc in _tables().items():
        peer = doc["peer"]
        shapes = {peers._shape_of(r["launch"]) or r["launch"].split(" ", 2)[-1] for r in doc["rows"] if r["side"] == "peer"}
        pairs = peers.compare(slug, doc["rows"], "sm_90", "H200")
        assert {q["shape"] for q in pairs} == shapes, f"{slug}: shapes without ours beside the peer"
        line = compiled.CompilerSection(slug).lines[2]
        assert f"ours / {peer} = " in line and "predicted" in line, (slug, line)
        for q in pairs:
            assert f"{q['shape']} {q['ours_over_peer']:.2f}× (ours {q['ours_bound']}-bound, {peer} {q['peer_bound']}-bound)" in line, (slug, line)


def test_config_choice_takes_the_fastest_predicted(monkeypatch):
    rows = [{"launch": "p: k cfg 1/2 @ S", "kernel": "k", "side": "peer", "ok": True, "sass": {}},
            {"launch": "p: k cfg 2/2 @ S", "kernel": "k", "side": "peer", "ok": True, "sass": {}}]
    monkeypatch.setattr(compiled, "predict_rows", lambda rs, card, root=None: [{"seconds": 2.0}, {"seconds": 1.0}][:len(rs)])
    assert peers.choose(rows) == {"k @ S": 1}


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
