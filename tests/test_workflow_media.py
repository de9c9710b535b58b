"""Media through the executor: save -> probe round trip, truncated inputs, no half-written outputs,
and the toy segment generator's continuity measurements."""
import numpy as np
import pytest
import torch

from inferbook.workflow import Executor, WorkflowError, nodes, omni_server, segments


def clip_workflow(frames=6, width=32, height=24, prefix="clip", audio=True):
    wf = {"scene": {"class_type": "ToyScene", "inputs": {"width": width, "height": height, "prompt": "p", "seed": 1}},
          "seg": {"class_type": "GenerateSegment", "inputs": {"context": ["scene", 0], "prompt": "p", "frames": frames,
                                                              "seed": 3, "steps": 2}},
          "save": {"class_type": "SaveVideo", "inputs": {"images": ["seg", 0], "fps": 24, "filename_prefix": prefix}}}
    if audio:
        wf["save"]["inputs"]["audio"] = ["seg", 1]
    return wf


def test_save_then_probe_round_trip(tmp_path):
    from inferbook.diffusion.media import probe_media

    frames = np.random.default_rng().integers(3, 9)
    r = Executor(output_dir=tmp_path).run(clip_workflow(frames=int(frames)))
    info = probe_media(r.output("save"))
    assert info["frames"] == frames and (info["width"], info["height"]) == (32, 24)
    assert info["video_codec"] == "h264" and info["audio_codec"] == "aac"
    assert info["sample_rate"] == 32000 and info["channels"] == 2 and abs(info["fps"] - 24) < 1e-6
    assert r.events[-1]["kind"] == "save_video" and r.events[-1]["frames"] == frames
    loaded = Executor(input_dir=tmp_path).run(
        {"v": {"class_type": "LoadVideo", "inputs": {"path": "clip.mp4"}},
         "a": {"class_type": "LoadAudio", "inputs": {"path": "clip.mp4"}}})
    assert loaded.output("v").shape == (frames, 24, 32, 3) and loaded.output("v", 1) == frames
    wav = loaded.output("a")["waveform"]
    assert wav.shape[0] == 2 and wav.shape[1] >= int(frames / 24 * 32000) and torch.isfinite(wav).all()


def test_png_reference_round_trip(tmp_path):
    img = torch.rand(1, 20, 28, 3)
    nodes.write_png(tmp_path / "r.png", nodes.to_uint8(img)[0])
    out = Executor(input_dir=tmp_path).run({"i": {"class_type": "LoadImage", "inputs": {"path": "r.png"}}}).output("i")
    assert out.shape == (1, 20, 28, 3) and (out - img).abs().max() <= 0.5 / 255 + 1e-6


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "missing"])
def test_unreadable_or_truncated_media_is_a_clear_error(tmp_path, damage):
    Executor(output_dir=tmp_path).run(clip_workflow(frames=8))
    path = tmp_path / "clip.mp4"
    data = path.read_bytes()
    bad = tmp_path / "bad.mp4"
    if damage == "truncate":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(b"\x00not a video" * 50)
    elif damage == "empty":
        bad.write_bytes(b"")
    with pytest.raises(WorkflowError) as e:
        Executor(input_dir=tmp_path).run({"v": {"class_type": "LoadVideo", "inputs": {"path": "bad.mp4"}}})
    msg = str(e.value)
    assert "node 'v' (LoadVideo)" in msg and "bad.mp4" in msg
    assert ("does not exist" in msg) if damage == "missing" else ("unreadable or truncated" in msg or "truncated" in msg)


def test_failed_save_leaves_no_file(tmp_path, monkeypatch):
    import av

    calls = {"n": 0}
    real = av.VideoFrame.from_ndarray

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", staticmethod(flaky))
    with pytest.raises(WorkflowError, match="disk full"):
        Executor(output_dir=tmp_path).run(clip_workflow(frames=6))
    assert list(tmp_path.iterdir()) == []


def test_save_that_does_not_match_the_request_is_removed(tmp_path, monkeypatch):
    from inferbook.diffusion import media

    real = media.probe_media
    monkeypatch.setattr(media, "probe_media", lambda p: {**real(p), "frames": 1})
    with pytest.raises(WorkflowError, match="does not hold what was asked for"):
        Executor(output_dir=tmp_path).run(clip_workflow(frames=5))
    assert not list(tmp_path.glob("*.mp4"))


def test_bad_filename_prefix_is_refused(tmp_path):
    with pytest.raises(WorkflowError, match="plain file name"):
        Executor(output_dir=tmp_path).run(clip_workflow(prefix="../escape"))


def test_segments_continuity_inside_vs_boundary():
    W, H, F, n = 32, 24, 5, 3
    sps = int(round(F / 24 * 32000))
    for carry in (False, True):
        clip = segments.scene(W, H, "kite", 0)
        audio = torch.zeros(2, 0)
        for k in range(n):
            ctxf = clip[-2:] if carry else clip[-1:]
            v, a = segments.generate_segment(ctxf, "kite", F, 0, k, steps=2,
                                             audio_offset=audio.shape[1] if carry else None)
            clip, audio = torch.cat([clip, v]), torch.cat([audio, a["waveform"]], dim=1)
        m = segments.continuity(clip, audio, first_segment_start=1, segment_frames=F, segment_samples=sps)
        assert m["boundaries"] == n
        # frames inside a segment are not pure shifts (the texture drifts), yet the boundary's residual,
        # where the texture is re-invented, is several times the inside one
        assert m["residual_inside"] > 1e-3
        assert m["residual_boundary"] > 3 * m["residual_inside"]
        pair = m["series"][1]
        assert not pair["boundary"]
        v0, v1 = clip[1], clip[2]
        assert (torch.roll(v0, tuple(pair["pan"]), dims=(0, 1)) - v1).abs().max() > 1e-3
        assert m["pan_change_inside_px"] == 0
        if carry:
            assert m["pan_change_boundary_px"] == 0
            assert m["audio_jump_boundary_max"] < 2 * m["audio_jump_inside_max"]
        else:
            assert m["audio_jump_boundary_max"] > 5 * m["audio_jump_inside_max"]


def test_estimate_shift_recovers_a_random_pan():
    img = torch.rand(24, 32, 3)
    dy, dx = (int(x) for x in torch.randint(-3, 4, (2,)))
    assert segments.estimate_shift(img, torch.roll(img, (dy, dx), dims=(0, 1))) == (dy, dx)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(width=30, height=24), "multiples of 4"), (dict(width=32, height=24, frames=0), "frames must be >= 1"),
])
def test_generator_bad_sizes(kwargs, fragment):
    frames = kwargs.pop("frames", 3)
    with pytest.raises(ValueError, match=fragment):
        segments.generate_segment(torch.rand(1, kwargs["height"], kwargs["width"], 3), "p", frames, 0, 0)


@pytest.mark.parametrize("w, h, f, T", [(64, 48, 9, 3), (64, 48, 8, 3), (64, 48, 22, 7), (60, 48, 9, None),
                                        (16, 16, 1, 1), (16, 16, 0, None)])
def test_toy_latent_covers_the_frames(w, h, f, T):
    """The toy VAE makes 1 + 4 (T - 1) frames: T rounds up, the server trims to the frames it serves."""
    if T is not None:
        assert omni_server.latent_shape(w, h, f) == (1, T, h // 8, w // 8) and 1 + 4 * (T - 1) >= f
    else:
        with pytest.raises(ValueError):
            omni_server.latent_shape(w, h, f)


@pytest.mark.parametrize("duration, fps, sent, served", [(5.167, 24, 124, 124), (0.208, 24, 5, 5), (0.5, 24, 12, 22),
                                                          (1.0, 24, 24, 39), (0.01, 24, 1, 1), (14.375, 24, 345, 345)])
def test_duration_to_frames_to_the_17k_plus_5_lattice(duration, fps, sent, served):
    assert nodes.frames_for(duration, fps) == sent and omni_server.align_frames(sent) == served
    assert served == 1 or (served - 5) % 17 == 0 and served >= sent


@pytest.mark.parametrize("change, match", [(dict(width=112), "none of its presets"), (dict(frames=346), "at most 345"),
                                           (dict(model="MiniMax-H3"), "not served"),
                                           (dict(sampling={"num_inference_steps": 0}), "num_inference_steps"),
                                           (dict(model_params={"flow_shift": 0.0}), "flow_shift")])
def test_server_enforces_the_contract_on_every_request(change, match):
    server = omni_server.ToyOmniServer()
    req = omni_server.Request(url=omni_server.TOY_ENDPOINT, model="toy-h3-tiny", prompt="p", width=96, height=96,
                              frames=5, fps=24)
    assert server.check(req)["frames"] == 5 and server.check(req)["aspect_ratio"] == "1:1"
    with pytest.raises(ValueError, match=match):
        server.check(omni_server.Request(**{**req.__dict__, **change}))


def test_decoding_an_input_video_stops_at_max_frames(tmp_path, monkeypatch):
    """A small file can hold thousands of frames: decoding stops at max_frames, and without it a file
    that would need more than the decode budget is refused naming max_frames."""
    from inferbook.diffusion import media

    frames = np.random.default_rng().integers(0, 255, (120, 16, 16, 3), dtype=np.uint8)
    media.write_mp4(tmp_path / "long.mp4", frames, 24)
    r = Executor(input_dir=tmp_path).run({"v": {"class_type": "LoadVideo", "inputs": {"path": "long.mp4",
                                                                                         "max_frames": 5}}})
    assert r.output("v").shape == (5, 16, 16, 3) and r.output("v", 1) == 5
    budget = 10 * 16 * 16 * 3 * 4                     # room for 10 float32 frames
    got, _, _ = nodes.read_video(str(tmp_path / "long.mp4"), with_audio=False, max_frames=8, max_bytes=budget)
    assert got.shape[0] == 8                          # stopped before the budget mattered
    with pytest.raises(ValueError, match="set max_frames"):
        nodes.read_video(str(tmp_path / "long.mp4"), with_audio=False, max_bytes=budget)
    monkeypatch.setattr(nodes, "MAX_DECODE_BYTES", budget)
    monkeypatch.setattr(nodes.read_video, "__kwdefaults__", {**nodes.read_video.__kwdefaults__, "max_bytes": budget})
    with pytest.raises(WorkflowError, match="node 'v' \\(LoadVideo\\).*set max_frames"):
        Executor(input_dir=tmp_path).run({"v": {"class_type": "LoadVideo", "inputs": {"path": "long.mp4"}}})
