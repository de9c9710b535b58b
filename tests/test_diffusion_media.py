"""MP4 writing and probing: round trip, atomicity, bad input."""
import numpy as np
import pytest

from inferbook.diffusion import media


def smooth_frames(T=6, H=32, W=48):
    y, x = np.mgrid[0:H, 0:W]
    fr = [np.stack([(x * 5 + 10 * t) % 256, (y * 7) % 256, np.full_like(x, 40 * t % 256)], -1) for t in range(T)]
    return np.array(fr, dtype=np.uint8)


def test_round_trip(tmp_path):
    import av

    frames = smooth_frames()
    n = int(32000 * len(frames) / 24)
    t = np.arange(n) / 32000
    audio = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    p = media.write_mp4(tmp_path / "v.mp4", frames, 24, audio, 32000)
    info = media.probe_media(p)
    assert info["frames"] == 6 and info["fps"] == 24 and (info["width"], info["height"]) == (48, 32)
    assert info["video_codec"] == "h264" and info["audio_codec"] == "aac"
    assert info["sample_rate"] == 32000 and info["channels"] == 2
    assert 0.2 < info["duration"] < 0.5
    with av.open(str(p)) as c:
        dec = np.array([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(float)
    mse = ((dec - frames) ** 2).mean()
    assert 10 * np.log10(255 ** 2 / max(mse, 1e-9)) > 30  # PSNR: lossy, but the same pictures
    assert [q.name for q in tmp_path.iterdir()] == ["v.mp4"]


def test_video_only_and_mono(tmp_path):
    p = media.write_mp4(tmp_path / "a.mp4", smooth_frames(1), 30)
    info = media.probe_media(p)
    assert info["frames"] == 1 and info["audio_codec"] is None
    p = media.write_mp4(tmp_path / "m.mp4", smooth_frames(2), 12, np.zeros((1, 3000), np.float32), 16000)
    assert media.probe_media(p)["channels"] == 1


def test_failure_leaves_no_file(tmp_path, monkeypatch):
    import av

    def boom(*a, **k):
        raise RuntimeError("encoder died")

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", boom)
    with pytest.raises(RuntimeError, match="encoder died"):
        media.write_mp4(tmp_path / "x.mp4", smooth_frames(2), 24)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw,match", [
    (dict(frames=np.zeros((2, 32, 48), np.uint8)), r"\[T, H, W, 3\]"),
    (dict(frames=np.zeros((2, 32, 48, 3), np.float32)), "uint8"),
    (dict(frames=np.zeros((2, 31, 48, 3), np.uint8)), "even"),
    (dict(frames=np.zeros((0, 32, 48, 3), np.uint8)), "at least one frame"),
    (dict(fps=0), "fps must be"),
    (dict(audio=np.zeros((3, 100), np.float32)), "C = 1 or 2"),
    (dict(audio=np.zeros((2, 100), np.float64)), "float32"),
    (dict(audio=np.full((2, 100), np.nan, np.float32)), "NaN"),
    (dict(audio=np.zeros((2, 100), np.float32), sample_rate=0), "sample_rate"),
])
def test_bad_input(tmp_path, kw, match):
    args = dict(frames=smooth_frames(2), fps=24, audio=None, sample_rate=32000) | kw
    with pytest.raises(ValueError, match=match):
        media.write_mp4(tmp_path / "b.mp4", **args)
    assert list(tmp_path.iterdir()) == []


def test_probe_missing(tmp_path):
    with pytest.raises(ValueError, match="no media file"):
        media.probe_media(tmp_path / "nope.mp4")


def tone(seconds, rate=32000, channels=2, level=0.3):
    t = np.arange(int(round(seconds * rate))) / rate
    x = level * np.sin(2 * np.pi * 330 * t)
    return np.stack([x, 0.8 * x][:channels]).astype(np.float32)


CLIP = dict(frames=17, fps=24, width=48, height=32)   # 17 frames at 24 fps: 0.708 s


@pytest.mark.parametrize("audio, rate, problem", [
    (None, 32000, None),                                         # a good clip: 0.708 s of tone
    ("silent", 32000, "audio: silent"),
    (0.1, 32000, "durations"),                                   # 0.1 s of audio on a 0.71 s clip
    (3.0, 32000, "durations"),                                   # 3 s of audio on a 0.71 s clip
    ("mono", 32000, "channels"),
    (None, 44100, "sample_rate"),
])
def test_media_check_decodes_the_audio_track(tmp_path, audio, rate, problem):
    """Each of these passed the old probe (codec, rate and channels from the headers only)."""
    seconds = 17 / 24
    if audio == "silent":
        wav = np.zeros((2, int(seconds * rate)), np.float32)
    elif audio == "mono":
        wav = tone(seconds, rate, channels=1)
    elif isinstance(audio, float):
        wav = tone(audio, rate)
    else:
        wav = tone(seconds, rate)
    p = media.write_mp4(tmp_path / "c.mp4", smooth_frames(17, 32, 48), 24, wav, rate)
    info = media.check_media(p, **CLIP)
    if problem is None:
        assert info["ok"], info["problems"]
        assert info["audio_samples"] >= len(wav[0]) and info["audio_peak"] > 0.1
        assert media.require_media(p, **CLIP)["ok"]
    else:
        assert not info["ok"] and any(x.startswith(problem) for x in info["problems"]), info["problems"]
        with pytest.raises(ValueError, match=problem):
            media.require_media(p, **CLIP)


def test_media_check_names_every_problem_and_video_only(tmp_path):
    p = media.write_mp4(tmp_path / "v.mp4", smooth_frames(5, 32, 48), 24)
    info = media.check_media(p, **CLIP)
    assert info["problems"] == ["frames: 5, asked 17", "audio: no audio track"]
    assert media.check_media(p, frames=5, fps=24, width=48, height=32, audio=False)["ok"]
