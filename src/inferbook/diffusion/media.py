"""Writing and checking video files: H.264 video + AAC audio in MP4, via PyAV.

    write_mp4(path, frames, fps, audio=None, sample_rate=32000) -> Path
    probe_media(path) -> {"frames", "fps", "width", "height", "video_codec", "audio_codec",
                          "sample_rate", "channels", "duration"}

`write_mp4` encodes into a temporary file in the same folder and renames it into place only when the
container is closed, so a crash never leaves a half-written file under the final name. `probe_media`
decodes every video frame to count them (the container's own frame count can be missing or wrong).
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
    """What a file really holds (decoded, not taken from headers where it matters)."""
    import av

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no media file at {str(path)!r}")
    info = {"frames": 0, "fps": None, "width": None, "height": None, "video_codec": None, "audio_codec": None,
            "sample_rate": None, "channels": None, "duration": None}
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
    return info
