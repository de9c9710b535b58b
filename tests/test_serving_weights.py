"""Model files are loaded strictly: renamed, missing, extra or wrongly shaped tensors are refused by name."""
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from inferbook.errors import UserError
from inferbook.serving.draft import DraftConfig, HiddenStateDraft, load_draft, save_draft
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights, load_weights, save_weights

CFG = TinyConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn=48, max_seq=32)


@pytest.fixture()
def files(tmp_path):
    target = init_weights(TinyDecoder(CFG), seed=torch.randint(1 << 30, ()).item())
    tpath = tmp_path / "target.safetensors"
    save_weights(target, tpath)
    draft = HiddenStateDraft(DraftConfig(d_model=32, vocab=64, n_layers=2, ffn=40), target)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_()
    dpath = tmp_path / "draft.safetensors"
    save_draft(draft, dpath, extra={"steps": 400})
    return target, tpath, draft, dpath


def rewrite(path: Path, edit) -> Path:
    """The file with its tensors edited by `edit(dict)` and its metadata kept."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    state = load_file(str(path))
    edit(state)
    out = path.with_name("edited-" + path.name)
    save_file(state, str(out), metadata=meta)
    return out


def rename(state, old, new):
    state[new] = state.pop(old)


CASES = {
    "renamed": (lambda s, k: rename(s, k, k.replace("weight", "wieght")), ["missing", "unexpected"]),
    "missing": (lambda s, k: s.pop(k), ["missing"]),
    "extra": (lambda s, k: s.__setitem__("extra.bias", torch.zeros(3)), ["unexpected", "extra.bias"]),
    "wrong shape": (lambda s, k: s.__setitem__(k, torch.zeros(s[k].shape[0], s[k].shape[-1] + 1)), ["wrong shapes"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_target_file_is_refused_with_the_names(files, case):
    _, tpath, _, _ = files
    key = "layers.1.attn.wq.weight"
    edit, words = CASES[case]
    bad = rewrite(tpath, lambda s: edit(s, key))
    with pytest.raises(UserError) as e:
        load_weights(bad, "cpu")
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    if case != "extra":
        assert key in msg, msg


@pytest.mark.parametrize("case", list(CASES))
def test_draft_file_is_refused_with_the_names(files, case):
    target, _, _, dpath = files
    key = "layers.1.mlp.up_proj.weight"
    edit, words = CASES[case]
    bad = rewrite(dpath, lambda s: edit(s, key))
    with pytest.raises(UserError) as e:
        load_draft(bad, target)
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    if case != "extra":
        assert key in msg, msg


def test_good_files_load_exactly(files):
    target, tpath, draft, dpath = files
    loaded = load_weights(tpath, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), target.state_dict().values()))
    d = load_draft(dpath, loaded)
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), draft.state_dict().values()))


def test_a_draft_that_claims_more_layers_than_it_holds_is_refused(files):
    target, _, _, dpath = files
    # the metadata says 2 layers; drop every tensor of layer 1 (an untrained, partly saved draft)
    bad = rewrite(dpath, lambda s: [s.pop(k) for k in list(s) if k.startswith("layers.1.")])
    with pytest.raises(UserError, match="missing tensors: layers.1."):
        load_draft(bad, target)


def test_unreadable_or_metadata_free_files(tmp_path, files):
    target, tpath, _, _ = files
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot be read"):
        load_weights(junk, "cpu")
    with pytest.raises(UserError, match="does not exist"):
        load_draft(tmp_path / "absent.safetensors", target)
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(str(tpath)), str(bare))          # tensors without the config metadata
    with pytest.raises(UserError, match="lacks config metadata"):
        load_weights(bare, "cpu")


def test_committed_models_load_strictly():
    root = Path(__file__).resolve().parents[1] / "data" / "models"
    target = load_weights(root / "dspark-target.safetensors", "cpu")
    for name in ("small", "large"):
        load_draft(root / f"dspark-draft-{name}.safetensors", target)


# -- model files say what they are: kind, role, config and digest --------------------------------

def test_metadata_carries_kind_role_config_and_digest(files):
    import json

    from inferbook.record import tensors_revision
    from inferbook.serving import weights

    _, tpath, draft, dpath = files
    for path, kind in ((tpath, "target"), (dpath, "draft")):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        assert meta[weights.KIND_KEY] == kind and meta[weights.ROLE_KEY] == path.stem
        assert meta[weights.DIGEST_KEY] == "sha256:" + tensors_revision(load_file(str(path)))
        assert json.loads(meta[weights.CONFIG_KEY])["d_model"] == 32
    assert json.loads(safe_open(str(dpath), framework="pt").metadata()[weights.CONFIG_KEY])["n_layers"] == 2


def test_a_file_under_another_models_name_is_refused(files, tmp_path):
    """The large draft copied over the small one's file: same tensor names, other shapes, which its
    own config would accept; its role (the name it was saved under) says what it is."""
    import shutil

    target, _, _, dpath = files
    other = tmp_path / "dspark-draft-small.safetensors"
    shutil.copy(dpath, other)
    with pytest.raises(UserError, match="was saved as 'draft' but is named 'dspark-draft-small'"):
        load_draft(other, target)


def test_a_target_file_is_not_a_draft(files):
    target, tpath, _, _ = files
    with pytest.raises(UserError, match="holds a 'target' model, not a 'draft' one|draft_format"):
        load_draft(tpath, target)


def _with_meta(path: Path, edit_meta=None, edit_state=None, name=None) -> Path:
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    state = load_file(str(path))
    if edit_meta:
        edit_meta(meta)
    if edit_state:
        edit_state(state)
    out = path.parent / "edited" / (name or path.name)
    out.parent.mkdir(exist_ok=True)
    save_file(state, str(out), metadata=meta)
    return out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_by_name(files, value):
    target, tpath, _, dpath = files

    def poison(s):
        s["layers.0.attn.wq.weight"][0, 0] = value

    with pytest.raises(UserError, match=r"non-finite weights .* layers\.0\.attn\.wq\.weight"):
        load_weights(_with_meta(tpath, edit_state=poison), "cpu")

    def poison_draft(s):
        s["norm.weight"][1] = value

    with pytest.raises(UserError, match=r"non-finite weights .* norm\.weight"):
        load_draft(_with_meta(dpath, edit_state=poison_draft), target)


def test_changed_weights_do_not_match_the_digest(files):
    _, tpath, _, _ = files

    def nudge(s):
        s["norm.weight"] += 1e-3

    with pytest.raises(UserError, match="not to the digest in its metadata"):
        load_weights(_with_meta(tpath, edit_state=nudge), "cpu")


@pytest.mark.parametrize("field,value,words", [
    ("n_heads", "0", "n_heads=0 must be an int >= 1"),
    ("vocab", "-5", "vocab=-5 must be an int >= 1"),
    ("n_kv_heads", "0", "n_kv_heads=0 must be an int >= 1"),
    ("rope_theta", "nan", "rope_theta=nan must be a finite number > 0"),
    ("norm_eps", "-1e-6", "norm_eps=-1e-06 must be a finite number > 0"),
    ("norm_eps", "0", "norm_eps=0.0 must be a finite number > 0"),
])
def test_impossible_target_configs_are_refused_by_name(files, field, value, words):
    import json

    from inferbook.serving import weights

    _, tpath, _, _ = files

    def edit(meta):
        meta[field] = value
        cfg = json.loads(meta[weights.CONFIG_KEY])
        cfg[field] = float(value) if field in ("rope_theta", "norm_eps") else int(value)
        meta[weights.CONFIG_KEY] = json.dumps(cfg)

    with pytest.raises(UserError) as e:
        load_weights(_with_meta(tpath, edit_meta=edit), "cpu")
    assert words in str(e.value) and str(tpath.name) in str(e.value)
    # the flat fields alone (files without the JSON config) are checked the same way
    with pytest.raises(UserError, match=words.split(" must")[0].replace("(", r"\(")):
        load_weights(_with_meta(tpath, edit_meta=lambda m: (edit(m), m.pop(weights.CONFIG_KEY))), "cpu")


def test_config_rules_hold_for_direct_construction():
    for bad in (dict(n_heads=0), dict(d_model=66, n_heads=2), dict(norm_eps=float("nan")), dict(max_seq=-1),
                dict(rope_theta=0.0)):
        with pytest.raises(UserError):
            TinyConfig(**bad)
    with pytest.raises(UserError, match="n_heads=0"):
        DraftConfig(d_model=32, vocab=64, n_heads=0)
    with pytest.raises(UserError, match="norm_eps"):
        DraftConfig(d_model=32, vocab=64, norm_eps=-1.0)


def test_a_missing_file_names_the_command_that_rebuilds_it(tmp_path, files):
    target = files[0]
    with pytest.raises(UserError, match=r"does not exist; rebuild it with `make models`"):
        load_weights(tmp_path / "none.safetensors", "cpu", rebuild="make models")
    with pytest.raises(UserError, match="is not a regular file"):
        load_draft(tmp_path, target)


def test_the_chapter_never_retrains_silently(monkeypatch, tmp_path):
    from inferbook.chapters import kimi_dspark_acceptance as ch

    monkeypatch.setattr(ch, "models_dir", lambda: tmp_path)
    monkeypatch.setattr(ch, "run_all", lambda *a, **k: pytest.fail("retrained without being asked"))
    with pytest.raises(UserError, match=r"dspark-target.safetensors.*missing.*python -m inferbook.serving.train all"):
        ch.committed_models()
    params = {name: p.default for name, p in ch.PARAMETERS.items()} | ch.PRESETS["smoke"]
    with pytest.raises(UserError, match="rebuild with"):
        ch.check_params(params)


def test_the_committed_large_draft_under_the_small_name_is_refused(tmp_path):
    import shutil

    root = Path(__file__).resolve().parents[1] / "data" / "models"
    target = load_weights(root / "dspark-target.safetensors", "cpu")
    shutil.copy(root / "dspark-draft-large.safetensors", tmp_path / "dspark-draft-small.safetensors")
    with pytest.raises(UserError, match="saved as 'dspark-draft-large' but is named 'dspark-draft-small'"):
        load_draft(tmp_path / "dspark-draft-small.safetensors", target)
