"""Writing and checking video files: H.264 video + AAC audio in MP4, via PyAV.

    write_mp4(path, frames, fps, audio=None, sample_rate=32000) -> Path
    probe_media(path) -> {"frames", "fps", "width", "height", "video_codec", "audio_codec", "sample_rate",
                          "channels", "duration", "video_duration", "audio_samples", "audio_duration", "audio_peak"}
    media_problems(info, frames=, fps=, width=, height=, sample_rate=32000, channels=2) -> [problem, ...]
    check_media(path, **want) -> probe + {"problems", "ok"};  require_media(path, **want) raises on problems

`write_mp4` encodes into a temporary file in the same folder and renames it into place only when the
container is closed, so a crash never leaves a half-written file under the final name. `probe_media`
decodes every video frame to count them (the container's own frame count can be missing or wrong) and
the whole audio track. `check_media` is the one output check every workflow uses (the loop chapter's
clip, the H3 workflows' outputs, the VAE toy pipeline): vLLM-Omni's WF-01 acceptance asks for a
non-empty video and audio stream, the requested frame count, fps and size, non-zero audio samples,
32 kHz stereo, and audio/video durations that agree within one video frame plus the codec's padding.
"""
from __future__ import annotations

import os
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np

AAC_FRAME = 1024  # samples per AAC frame
MAX_FPS = 1000    # a rate above this is a mistake (10**30 overflows the encoder's time base)


def _validate(frames, fps, audio, sample_rate):
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got shape {frames.shape}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    T, H, W, _ = frames.shape
    if T < 1:
        raise ValueError("frames must hold at least one frame, got T=0")
    if H % 2 or W % 2:
        raise ValueError(f"H.264 with yuv420p needs even width and height, got {W}x{H}")
    if not (isinstance(fps, (int, float, Fraction)) and not isinstance(fps, bool) and 0 < fps <= MAX_FPS):
        raise ValueError(f"fps must be a number in (0, {MAX_FPS}], got {fps!r}")
    if audio is not None:
        audio = np.asarray(audio)
        if audio.ndim != 2 or audio.shape[0] not in (1, 2):
            raise ValueError(f"audio must be float32 [C, N] with C = 1 or 2, got shape {audio.shape}")
        if audio.dtype != np.float32:
            raise ValueError(f"audio must be float32, got {audio.dtype}")
        if not np.isfinite(audio).all():
            raise ValueError("audio holds NaN or inf samples")
        if not (isinstance(sample_rate, int) and not isinstance(sample_rate, bool) and sample_rate > 0):
            raise ValueError(f"sample_rate must be a positive int, got {sample_rate!r}")
    return frames, audio


def write_mp4(path, frames, fps, audio=None, sample_rate: int = 32000, *, crf: int = 18) -> Path:
    """Encode `frames` (uint8 [T, H, W, 3], RGB) at `fps`, plus `audio` (float32 [C, N] in [-1, 1],
    C = 1 or 2) at `sample_rate` as AAC. Atomic: written to a temp file, then renamed. Returns the path."""
    import av

    frames, audio = _validate(frames, fps, audio, sample_rate)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".partial.mp4", dir=path.parent)
    os.close(fd)
    try:
        rate = Fraction(fps).limit_denominator(1001)
        with av.open(tmp, mode="w", format="mp4") as out:
            vs = out.add_stream("libx264", rate=rate)
            vs.width, vs.height = frames.shape[2], frames.shape[1]
            vs.pix_fmt = "yuv420p"
            vs.options = {"crf": str(crf), "preset": "veryfast"}
            as_ = None
            if audio is not None:
                layout = "stereo" if audio.shape[0] == 2 else "mono"
                as_ = out.add_stream("aac", rate=sample_rate, layout=layout)
            for i, f in enumerate(frames):
                vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
                vf.pts = i
                for pkt in vs.encode(vf):
                    out.mux(pkt)
            for pkt in vs.encode():
                out.mux(pkt)
            if as_ is not None:
                a = np.clip(audio, -1.0, 1.0)
                for start in range(0, a.shape[1], AAC_FRAME):
                    chunk = np.ascontiguousarray(a[:, start:start + AAC_FRAME])
                    af = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
                    af.sample_rate = sample_rate
                    af.pts = start
                    for pkt in as_.encode(af):
                        out.mux(pkt)
                for pkt in as_.encode():
                    out.mux(pkt)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def probe_media(path) -> dict:
    """What a file really holds, decoded rather than taken from headers: every video frame is decoded
    and counted, and the audio track is decoded whole (its sample count, duration and peak level).

    Keys: frames, fps, width, height, video_codec, audio_codec, sample_rate, channels, duration (the
    container's), video_duration (frames / fps), audio_samples, audio_duration (samples / rate),
    audio_peak (max |sample|)."""
    import av

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no media file at {str(path)!r}")
    info = {"frames": 0, "fps": None, "width": None, "height": None, "video_codec": None, "audio_codec": None,
            "sample_rate": None, "channels": None, "duration": None, "video_duration": None,
            "audio_samples": 0, "audio_duration": None, "audio_peak": None}
    try:
        with av.open(str(path)) as c:
            if c.duration is not None:
                info["duration"] = c.duration / av.time_base
            if c.streams.video:
                v = c.streams.video[0]
                info["video_codec"] = v.codec_context.name
                info["width"], info["height"] = v.codec_context.width, v.codec_context.height
                rate = v.average_rate or v.guessed_rate
                info["fps"] = float(rate) if rate else None
            if c.streams.audio:
                a = c.streams.audio[0]
                info["audio_codec"] = a.codec_context.name
                info["sample_rate"] = a.codec_context.sample_rate
                layout = a.codec_context.layout
                info["channels"] = getattr(layout, "nb_channels", None) or len(layout.channels)
            if c.streams.video:
                info["frames"] = sum(1 for _ in c.decode(video=0))
        if info["audio_codec"] is not None:
            with av.open(str(path)) as c:
                peak, samples = 0.0, 0
                for f in c.decode(audio=0):
                    x = f.to_ndarray()
                    samples += f.samples
                    if x.size:
                        peak = max(peak, float(np.abs(x.astype(np.float64)).max()))
                info["audio_samples"], info["audio_peak"] = samples, peak
                if info["sample_rate"]:
                    info["audio_duration"] = samples / info["sample_rate"]
    except av.FFmpegError as e:
        raise ValueError(f"{path.name} cannot be decoded ({type(e).__name__}: {e})") from None
    if info["fps"]:
        info["video_duration"] = info["frames"] / info["fps"]
    return info


# A decoded track quieter than this everywhere counts as silent (-80 dBFS; AAC-coded zeros decode to 0).
SILENCE_PEAK = 1e-4


def media_problems(info: dict, *, frames: int | None = None, fps: float | None = None, width: int | None = None,
                   height: int | None = None, audio: bool = True, sample_rate: int | None = 32000,
                   channels: int | None = 2, video_codec: str | None = "h264", audio_codec: str | None = "aac") -> list[str]:
    """Every way a probed file (`probe_media`) differs from what was asked, as named problems.

    With `audio`, the track must decode to non-silent samples (peak above `SILENCE_PEAK`) at
    `sample_rate` with `channels` channels, and its duration must agree with the video's within one
    video frame plus the AAC codec's padding (one 1024-sample frame of priming and one of final fill)."""
    bad = []
    for key, want in (("frames", frames), ("width", width), ("height", height), ("video_codec", video_codec)):
        if want is not None and info.get(key) != want:
            bad.append(f"{key}: {info.get(key)!r}, asked {want!r}")
    if fps is not None and (info.get("fps") is None or abs(info["fps"] - float(fps)) > 1e-6):
        bad.append(f"fps: {info.get('fps')!r}, asked {fps!r}")
    if info.get("frames", 0) < 1:
        bad.append("video: no decodable frames")
    if not audio:
        return bad
    if info.get("audio_codec") is None:
        return bad + ["audio: no audio track"]
    if audio_codec is not None and info["audio_codec"] != audio_codec:
        bad.append(f"audio_codec: {info['audio_codec']!r}, asked {audio_codec!r}")
    if sample_rate is not None and info.get("sample_rate") != sample_rate:
        bad.append(f"sample_rate: {info.get('sample_rate')!r} Hz, asked {sample_rate} Hz")
    if channels is not None and info.get("channels") != channels:
        bad.append(f"channels: {info.get('channels')!r}, asked {channels} ({'stereo' if channels == 2 else 'mono'})")
    if not info.get("audio_samples"):
        bad.append("audio: the track decodes to 0 samples")
    elif (info.get("audio_peak") or 0.0) <= SILENCE_PEAK:
        bad.append(f"audio: silent (peak |sample| {info.get('audio_peak')!r} <= {SILENCE_PEAK})")
    vdur, adur, rate = info.get("video_duration"), info.get("audio_duration"), info.get("fps")
    if vdur is not None and adur is not None and rate and info.get("sample_rate"):
        tolerance = 1.0 / rate + 2 * AAC_FRAME / info["sample_rate"]
        if abs(adur - vdur) > tolerance:
            bad.append(f"durations: audio {adur:.4f} s against video {vdur:.4f} s, apart by more than one frame "
                       f"plus the codec's padding ({tolerance:.4f} s)")
    return bad


def check_media(path, **want) -> dict:
    """`probe_media(path)` plus "problems" (`media_problems(info, **want)`) and "ok"."""
    info = probe_media(path)
    info["problems"] = media_problems(info, **want)
    info["ok"] = not info["problems"]
    return info


def require_media(path, **want) -> dict:
    """`check_media`, raising ValueError naming every problem when the file is not what was asked."""
    info = check_media(path, **want)
    if not info["ok"]:
        raise ValueError(f"{Path(path).name} does not hold what was asked: " + "; ".join(info["problems"]))
    return info
