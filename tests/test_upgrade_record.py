"""upgrade-record's agreement checks: another attention path of the same weights passes, a perturbed
model fails (the check can fail), and greedy tokens are judged only where the top-2 gap decides them."""
import pytest
import torch

from inferbook.chapters import upgrade_record as chapter
from inferbook.record import RunRecord
from inferbook.serving.model import TinyConfig, TinyDecoder, generate, init_weights, load_weights, save_weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = TinyConfig(vocab=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128, max_seq=24)
    path = tmp_path_factory.mktemp("ur") / "m.safetensors"
    save_weights(init_weights(TinyDecoder(cfg), 0), path)
    prompt = torch.randint(cfg.vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = load_weights(path, "cpu")
    tokens, _ = generate(eager, eager, eager, prompt, 8)
    ref = {"tokens": tokens, "logits": chapter.forced_logits(eager, eager, prompt, tokens),
           "gold": chapter.gold_logits(str(path), "cpu", prompt, tokens)}
    return path, prompt, ref


def _checks(model, prompt, ref):
    tokens, _ = generate(model, model, model, prompt, ref["tokens"].shape[1])
    rec = RunRecord(chapter="upgrade-record", name="x", hardware={"device_type": "cpu"})
    chapter.agreement_checks(rec, chapter.forced_logits(model, model, prompt, ref["tokens"]), tokens, ref,
                             torch.float32)
    return {c["name"].split(" ")[0]: c["passed"] for c in rec.checks}


def test_another_attention_path_passes(tiny):
    path, prompt, ref = tiny
    assert all(_checks(load_weights(path, "cpu", attention="math"), prompt, ref).values())


@pytest.mark.parametrize("scale", [1.01, 1.5])
def test_a_perturbed_model_fails(tiny, scale):
    path, prompt, ref = tiny
    model = load_weights(path, "cpu")
    with torch.no_grad():
        model.lm_head.weight[:7] *= scale          # a wrong weight in seven vocabulary rows
    got = _checks(model, prompt, ref)
    assert not got["logits"]
    if scale == 1.5:
        assert not got["greedy"]


def test_the_backend_is_observed_in_the_models_own_forward(tiny):
    """The profiler sees SDPA's kernel in the sdpa model's prefill and decode, and none in the explicit-
    softmax model: a check that names the kernel fails where that kernel is absent."""
    path, prompt, _ = tiny
    sdpa = load_weights(path, "cpu")
    ran = chapter.profiled_forward_attention(sdpa, sdpa, prompt)
    assert all(r["backend"] == "flash" for r in ran.values()), ran   # CPU SDPA: ATen's flash kernel
    math_model = load_weights(path, "cpu", attention="math")
    ran = chapter.profiled_forward_attention(math_model, math_model, prompt)
    assert all(r["backend"] == "none" for r in ran.values()), ran
