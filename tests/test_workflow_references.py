"""Ref2VA reference rules, reference kinds, and the service-mapping check."""
import random

import pytest

from inferbook.errors import UserError
from inferbook.workflow import check_service_mapping, validate_references
from inferbook.workflow.references import ReferenceRuleError, Served, ServiceMappingError, group_references


@pytest.mark.parametrize("counts, ok", [
    ((9, 0, 0), True), ((10, 0, 0), False),
    ((0, 3, 0), True), ((0, 4, 0), False),
    ((1, 0, 3), True), ((1, 0, 4), False),
    ((9, 3, 0), True), ((9, 3, 1), False), ((6, 3, 3), True), ((7, 3, 3), False),
    ((1, 0, 0), True), ((0, 1, 0), True), ((0, 0, 0), False), ((0, 0, 3), False),
])
def test_each_rule_at_and_past_its_limit(counts, ok):
    if ok:
        assert validate_references(*counts)["total"] == sum(counts)
    else:
        with pytest.raises(ReferenceRuleError):
            validate_references(*counts)


def test_random_counts_follow_the_rules_and_sequences_count_like_ints():
    rng = random.Random()
    for _ in range(200):
        i, v, a = rng.randint(0, 12), rng.randint(0, 5), rng.randint(0, 5)
        ok = i <= 9 and v <= 3 and a <= 3 and i + v + a <= 12 and i + v >= 1
        try:
            validate_references([object()] * i, [object()] * v, [object()] * a)
            assert ok, (i, v, a)
        except ReferenceRuleError:
            assert not ok, (i, v, a)


def test_every_violation_is_listed_with_counts():
    with pytest.raises(ReferenceRuleError) as e:
        validate_references(10, 4, 4)
    msg = str(e.value)
    assert len(e.value.violations) == 4
    for part in ("at most 9 images (got 10)", "at most 3 videos (got 4)", "at most 3 audios (got 4)",
                 "at most 12 references in total (got 18"):
        assert part in msg
    with pytest.raises(ReferenceRuleError, match=r"at least one image or video \(got 0 images, 0 videos, 2 audios\)"):
        validate_references(0, 0, 2)


@pytest.mark.parametrize("bad", [-1, True, 2.0, object()])
def test_bad_counts_are_user_errors(bad):
    with pytest.raises(UserError):
        validate_references(bad, 0, 0)


def test_group_references_and_unknown_kind():
    g = group_references([("image", 1), ("audio", 2), ("image", 3)])
    assert g == {"image": [1, 3], "video": [], "audio": [2]}
    with pytest.raises(UserError, match="reference 1 has unknown kind 'depth'; kinds are 'image', 'video' or 'audio'"):
        group_references([("image", 1), ("depth", 2)])
    with pytest.raises(UserError, match="pair"):
        group_references(["image"])


SERVED = [Served("http://a:8091", "MiniMax-H3", ("/srv/lora/x.safetensors",)),
          {"endpoint": "http://a:8091", "model": "MiniMax-H3-Turbo"},
          Served("http://b:8091", "MiniMax-H3")]


def model_node(endpoint, model, lora=""):
    return {"class_type": "OmniModel", "inputs": {"endpoint": endpoint, "model": model, "lora_path": lora}}


def test_matching_workflow_has_no_mismatches():
    wf = {"m1": model_node("http://a:8091", "MiniMax-H3", "/srv/lora/x.safetensors"),
          "m2": model_node("http://b:8091", "MiniMax-H3"),
          "ep": {"class_type": "String", "inputs": {"value": "http://a:8091"}},
          "m3": {"class_type": "OmniModel", "inputs": {"endpoint": ["ep", 0], "model": "MiniMax-H3-Turbo"}}}
    assert check_service_mapping(wf, SERVED) == []


def test_all_mismatches_are_listed():
    wf = {"m1": model_node("http://a:8091", "MiniMax-H3", "/srv/lora/y.safetensors"),   # LoRA not served
          "m2": model_node("http://c:8091", "MiniMax-H3"),                              # endpoint unknown
          "m3": model_node("http://b:8091", "MiniMax-H3-Turbo"),                        # model not at b
          "m4": model_node("http://a:8091", "MiniMax-H3-Turbo", "/srv/lora/x.safetensors"),  # no LoRAs for Turbo
          "ok": model_node("http://a:8091", "MiniMax-H3")}
    out = check_service_mapping(wf, SERVED)
    assert len(out) == 4
    assert "node 'm1'" in out[0] and "LoRA '/srv/lora/y.safetensors'" in out[0]
    assert "node 'm2'" in out[1] and "endpoint 'http://c:8091'" in out[1]
    assert "node 'm3'" in out[2] and "'MiniMax-H3-Turbo' is not served at 'http://b:8091'" in out[2]
    assert "node 'm4'" in out[3] and "none" in out[3]
    with pytest.raises(ServiceMappingError) as e:
        check_service_mapping(wf, SERVED, raise_on_mismatch=True)
    assert e.value.mismatches == out


def test_computed_endpoint_is_reported_as_uncheckable():
    wf = {"t": {"class_type": "FormatText", "inputs": {"template": "http://{}:8091", "value": "a"}},
          "m": {"class_type": "OmniModel", "inputs": {"endpoint": ["t", 0], "model": "MiniMax-H3"}}}
    out = check_service_mapping(wf, SERVED)
    assert len(out) == 1 and "cannot be checked" in out[0]


def test_shipped_workflows_match_the_toy_service():
    from inferbook.workflow import nodes
    from inferbook.chapters import omni_h3_workflows as omni_chapter

    for kind in omni_chapter.WORKFLOWS:
        assert check_service_mapping(omni_chapter.workflow_path(omni_chapter.WORKFLOWS[kind]), nodes.TOY_SERVED) == []
