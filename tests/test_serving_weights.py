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
