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
    assert e.value.rules == ["images", "videos", "audios", "total"]
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
    assert g == {"image": [1, 3], "video": [], "audio": [2], "video_seconds": [], "audio_seconds": []}
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
    from inferbook.workflow import omni_server
    from inferbook.chapters import omni_h3_workflows as omni_chapter

    for kind in omni_chapter.WORKFLOWS:
        path = omni_chapter.workflow_path(omni_chapter.WORKFLOWS[kind])
        assert check_service_mapping(path, omni_server.TOY_SERVED) == []


def test_remote_lora_node_and_url_input_are_checked():
    wf = {"lora": {"class_type": "OmniRemoteLoRA", "inputs": {"local_path": "/srv/lora/y.safetensors"}},
          "gen": {"class_type": "OmniGenerateVideo", "inputs": {"url": "http://a:8091", "model": "MiniMax-H3",
                                                                 "lora": ["lora", 0]}}}
    out = check_service_mapping(wf, SERVED)
    assert len(out) == 1 and "LoRA '/srv/lora/y.safetensors' is not on the server" in out[0]
    wf["lora"]["inputs"]["local_path"] = "/srv/lora/x.safetensors"
    assert check_service_mapping(wf, SERVED) == []


TEMPLATE = dict(prompt="Use the subject and visual style from <Picture 1>. Create a cinematic shot.", frames=124,
                width=1344, height=768)


def test_the_template_request_passes():
    assert validate_references(1, 0, 0, **TEMPLATE)["total"] == 1
    assert validate_references(2, 2, 1, video_seconds=[5.0, 10.0], audio_seconds=[15.0],
                               prompt="<Picture 2> walks into <Video 2>, to <Audio 1>", frames=345,
                               width=768, height=1344)["total"] == 5


def test_a_12_second_clip_beside_a_5_second_one_is_refused():
    """17 s of reference video in total: each clip is within 2-15 s, their sum is not."""
    with pytest.raises(ReferenceRuleError) as e:
        validate_references(0, 2, 0, video_seconds=[12.0, 5.0], frames=124, width=1344, height=768)
    assert e.value.rules == ["video total"]
    assert "12.0 s + 5.00 s = 17.0 s" in str(e.value)


@pytest.mark.parametrize("kw, rule", [
    (dict(videos=1, video_seconds=[1.5]), "clip length"),
    (dict(audios=1, audio_seconds=[1.0]), "clip length"),
    (dict(audios=2, audio_seconds=[10.0, 6.0]), "audio total"),
    (dict(frames=125), "frame count"),
    (dict(frames=90), "frame count"),          # 17k + 5, but below the listed 107
    (dict(frames=362), "frame count"),         # 17k + 5, above 345
    (dict(width=1280, height=720), "resolution"),
    (dict(prompt="<Picture 2> beside <Picture 1>"), "prompt tags"),
    (dict(prompt="sound of <Audio 1>"), "prompt tags"),
    (dict(prompt="<Video 1> at dusk"), "prompt tags"),
])
def test_each_request_rule_by_name(kw, rule):
    kw = {"images": 1, **kw}
    images, videos, audios = kw.pop("images"), kw.pop("videos", 0), kw.pop("audios", 0)
    with pytest.raises(ReferenceRuleError) as e:
        validate_references(images, videos, audios, **kw)
    assert e.value.rules == [rule], e.value.violations


def test_a_clip_longer_than_15_s_breaks_both_length_rules():
    with pytest.raises(ReferenceRuleError) as e:
        validate_references(1, 1, 0, video_seconds=[15.5])
    assert e.value.rules == ["clip length", "video total"]


def test_every_broken_rule_is_listed_by_name_in_one_error():
    with pytest.raises(ReferenceRuleError) as e:
        validate_references(10, 2, 2, video_seconds=[12.0, 5.0], audio_seconds=[1.0, 14.9], prompt="<Audio 3>",
                            frames=100, width=640, height=480)
    assert e.value.rules == ["images", "total", "clip length", "video total", "audio total", "frame count",
                             "resolution", "prompt tags"]
    assert str(e.value).startswith("references break 8 rules: images: at most 9 images")


def test_durations_are_checked_numbers():
    with pytest.raises(UserError, match="video 1 must last"):
        validate_references(1, 1, 0, video_seconds=[float("nan")])


# ---------------------------------------------------------------------------
# The rules inside a real workflow run: refused by the server before any work, every rule named


def ref2va_run(tmp_path, *, video_seconds=(), audio_seconds=(), images=1, prompt="<Picture 1>"):
    import torch

    from inferbook.workflow import Executor

    wf = {"prompt": {"class_type": "String", "inputs": {"value": prompt}}}
    refs = {"video_fps": 24}
    for k in range(images):
        wf[f"img{k}"] = {"class_type": "ToyScene", "inputs": {"width": 32, "height": 32, "prompt": f"i{k}"}}
        refs[f"image_{k + 1}"] = [f"img{k}", 0]
    for k, sec in enumerate(video_seconds):
        wf[f"vid{k}"] = {"class_type": "LastFrames", "inputs": {"images": ["clip", 0], "count": int(sec * 24)}}
        refs[f"video_{k + 1}"] = [f"vid{k}", 0]
    if video_seconds:
        wf["scene"] = {"class_type": "ToyScene", "inputs": {"width": 32, "height": 32, "prompt": "v"}}
        wf["clip"] = {"class_type": "GenerateSegment", "inputs": {"context": ["scene", 0], "prompt": "v",
                                                                  "frames": int(max(video_seconds) * 24), "steps": 1}}
    for k, sec in enumerate(audio_seconds):
        wf["a_scene"] = {"class_type": "ToyScene", "inputs": {"width": 32, "height": 32, "prompt": "a"}}
        wf[f"aud{k}"] = {"class_type": "GenerateSegment", "inputs": {"context": ["a_scene", 0], "prompt": "a",
                                                                     "frames": int(sec * 24), "steps": 1}}
        refs[f"audio_{k + 1}"] = [f"aud{k}", 1]
    wf["refs"] = {"class_type": "OmniVideoReferences", "inputs": refs}
    wf["sampling"] = {"class_type": "OmniDiffusionSampling", "inputs": {"num_inference_steps": 1}}
    wf["gen"] = {"class_type": "OmniGenerateVideo", "inputs": {
        "url": "local://toy-omni/v1", "model": "toy-h3-tiny", "prompt": ["prompt", 0], "width": 96, "height": 96,
        "duration": 5 / 24, "sampling_params": ["sampling", 0], "references": ["refs", 0]}}
    del torch
    return Executor(output_dir=tmp_path).run(wf)


def test_workflow_with_a_12_s_and_a_5_s_reference_clip_is_refused(tmp_path):
    from inferbook.workflow import WorkflowError

    with pytest.raises(WorkflowError, match=r"node 'gen' \(OmniGenerateVideo\).*video total:.*17.0 s"):
        ref2va_run(tmp_path, video_seconds=(12.0, 5.0), prompt="<Video 1> then <Video 2>")


def test_workflow_rules_are_all_named_in_one_error(tmp_path):
    from inferbook.workflow import WorkflowError

    with pytest.raises(WorkflowError) as e:
        ref2va_run(tmp_path, images=0, audio_seconds=(1.0,), prompt="<Picture 1> with <Audio 2>")
    msg = str(e.value)
    for rule in ("image or video:", "clip length:", "prompt tags:"):
        assert rule in msg, msg


def test_workflow_within_the_rules_runs_and_reports_server_stages(tmp_path):
    r = ref2va_run(tmp_path, video_seconds=(2.5,), audio_seconds=(2.0,),
                   prompt="<Picture 1> sails through <Video 1> to <Audio 1>")
    ev = [e for e in r.events if e["kind"] == "server_stages"]
    assert len(ev) == 1 and ev[0]["mode"] == "Ref2VA"
    assert ev[0]["references"] == {"images": 1, "videos": 1, "audios": 1, "total": 3}
    assert set(ev[0]["seconds"]) >= {"text_encode", "denoise", "vae_decode", "audio_decode"}
    request = next(x.seconds for x in r.log if x.id == "gen")
    assert request >= sum(ev[0]["seconds"].values())        # the client sees only the whole round trip
    assert r.output("gen", 0).shape == (5, 96, 96, 3) and r.output("gen", 1)["waveform"].shape[0] == 2


def test_the_server_loads_a_model_once_until_restarted(tmp_path):
    import torch

    from inferbook.workflow import omni_server

    server = omni_server.restart("cpu", torch.float32)
    req = omni_server.Request(url=omni_server.TOY_ENDPOINT, model="toy-h3-tiny", prompt="p", width=96, height=96,
                              frames=5, fps=24, sampling={"num_inference_steps": 1, "seed": 0})
    first = server.generate(req)
    again = omni_server.server_for("cpu", torch.float32).generate(req)
    assert len(server.models) == 1 and first["mode"] == again["mode"] == "T2VA"
    assert torch.equal(first["video"], again["video"])
    with pytest.raises(ValueError, match="LoRA '/elsewhere.safetensors' is not on the server"):
        server.generate(omni_server.Request(**{**req.__dict__, "lora": {"local_path": "/elsewhere.safetensors"}}))
