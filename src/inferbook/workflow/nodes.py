"""The node classes our workflows use, registered in `executor.REGISTRY`.

- values and lists: Int, Float, String, AddInt, FormatText, MakeList, ListGet, ListLength
- side effects (always run, never cached; each passes its input through so it can be wired to
  a loop's end boundary): Preview, PreviewImage, SaveVideo
- video and audio plumbing: LastFrames, ConcatFrames, EmptyAudio, ConcatAudio, AudioLength,
  LoadImage, LoadVideo, LoadAudio, SaveImage
- the loop chapter's toy generator: ToyScene, GenerateSegment (`segments.py`)
- the H3 workflows' client nodes, shaped like vLLM-Omni's ComfyUI extension: OmniVideoReferences,
  OmniRemoteLoRA, OmniGenerateVideo (one request to the toy server of `omni_server.py`, which owns
  text encoding, denoising and both VAEs)

Media are plain values: IMAGE is a float tensor [T, H, W, 3] in [0, 1] (ComfyUI's IMAGE batch),
AUDIO is {"waveform": float tensor [C, N], "sample_rate": int}.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import loops as _loops  # noqa: F401  (registers StartLoop / EndLoop)
from . import segments
from .executor import MAX_STRING_CHARS, Input, node

# ---------------------------------------------------------------------------
# Values and lists


@node("Int", inputs={"value": "INT"}, outputs=(("value", "INT"),))
def int_node(value):
    """An integer constant."""
    return (value,)


@node("Float", inputs={"value": "FLOAT"}, outputs=(("value", "FLOAT"),))
def float_node(value):
    """A float constant."""
    return (float(value),)


# Size hooks (`executor.predict_sizes`): what each output will hold, predicted from the graph before the run.
_CAP = 2 ** 62


def _same_size(sizes, literals):
    return (sizes.get("value"),)


def _format_size(sizes, literals):
    """FormatText: len(template) + count('{}') x (len(str(value)) - 2), known when the template is a literal and
    the value's length is (a string's characters; a list's characters are a lower bound of its str())."""
    template = literals.get("template")
    if not isinstance(template, str):
        return None
    if "value" in literals:             # a literal, or left out (None, which formats as 'None')
        text = len(str(literals["value"]))
    elif sizes.get("value") is not None:
        text = sizes["value"]["chars"]
    else:
        return None
    slots = template.count("{}")
    n = len(template) + slots * (text - 2) if slots else len(template)
    return ({"items": 0, "chars": min(max(n, 0), _CAP), "elements": 0, "depth": 0},)


def _list_size(sizes, literals):
    """MakeList: one item per input given, plus what each holds (a list shared by two inputs counted twice, as
    `value_size` counts it); nesting one more than the deepest input. Inputs not known before the run add
    nothing (a lower bound)."""
    items = chars = elements = depth = 0
    for name in ("a", "b", "c", "d"):
        s = sizes.get(name)
        if s is None:
            continue
        items, chars = items + 1 + s["items"], chars + s["chars"]
        elements, depth = elements + s["elements"], max(depth, s["depth"])
    return ({"items": min(items, _CAP), "chars": min(chars, _CAP), "elements": min(elements, _CAP),
             "depth": depth + 1},)


@node("String", inputs={"value": "STRING"}, outputs=(("value", "STRING"),), size=_same_size)
def string_node(value):
    """A text constant."""
    return (value,)


@node("AddInt", inputs={"a": "INT", "b": "INT"}, outputs=(("sum", "INT"),))
def add_int(a, b):
    """a + b."""
    return (a + b,)


@node("FormatText", inputs={"template": "STRING", "value": Input("ANY", optional=True)}, outputs=(("text", "STRING"),),
      size=_format_size)
def format_text(template, value):
    """`template` with every '{}' replaced by `value` (no other formatting: nothing is evaluated). The result's
    length is known before it is built, and refused beyond MAX_STRING_CHARS (a chain of doublings stops there)."""
    text = str(value)
    n = len(template) + template.count("{}") * (len(text) - 2)
    if n > MAX_STRING_CHARS:
        raise ValueError(f"the text would be {n} characters; at most {MAX_STRING_CHARS} are allowed")
    return (template.replace("{}", text),)


@node("MakeList", inputs={"a": Input("ANY", optional=True), "b": Input("ANY", optional=True),
                          "c": Input("ANY", optional=True), "d": Input("ANY", optional=True)},
      outputs=(("list", "LIST"),), size=_list_size)
def make_list(a, b, c, d):
    """A list of the inputs given (a mixed list: frames, audio and text together)."""
    return ([x for x in (a, b, c, d) if x is not None],)


@node("ListGet", inputs={"list": "LIST", "index": "INT"}, outputs=(("item", "ANY"),))
def list_get(list, index):  # noqa: A002 - the input is called 'list' in the workflow
    """Item `index` of a list (negative counts from the end)."""
    if not -len(list) <= index < len(list):
        raise ValueError(f"index {index} is out of range for a list of {len(list)} item(s)")
    return (list[index],)


@node("ListLength", inputs={"list": "LIST"}, outputs=(("length", "INT"),))
def list_length(list):  # noqa: A002
    """Number of items."""
    return (len(list),)


# ---------------------------------------------------------------------------
# Side effects: always run; pass their input through so they can sit on a loop's end boundary


@node("Preview", inputs={"value": "ANY", "label": Input("STRING", default="")}, outputs=(("value", "ANY"),),
      side_effect=True, context=True, size=_same_size)
def preview(value, label, run):
    """Records what it saw in the run's event log (a UI preview, here), then passes it on."""
    run.event("preview", label=label, summary=_summary(value))
    return (value,)


@node("PreviewImage", inputs={"images": "IMAGE", "label": Input("STRING", default="")}, outputs=(("images", "IMAGE"),),
      side_effect=True, context=True)
def preview_image(images, label, run):
    """Records the frame count and mean of a batch of frames, then passes the frames on."""
    run.event("preview_image", label=label, frames=int(images.shape[0]), mean=float(images.float().mean()))
    return (images,)


def _summary(value):
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    if isinstance(value, list):
        return [_summary(v) for v in value]
    if isinstance(value, dict) and "waveform" in value:
        return f"audio{tuple(value['waveform'].shape)}@{value['sample_rate']}"
    return value


def _safe_name(prefix: str) -> str:
    if not prefix or any(c in prefix for c in "/\\\0") or prefix.startswith("."):
        raise ValueError(f"filename_prefix must be a plain file name (no '/', no leading '.'), got {prefix!r}")
    return prefix


def to_uint8(images: torch.Tensor) -> np.ndarray:
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


@node("SaveVideo", inputs={"images": "IMAGE", "fps": Input("INT", default=24, min=1, max=240),
                           "filename_prefix": Input("STRING", default="video"), "audio": Input("AUDIO", optional=True)},
      outputs=(("path", "STRING"),), side_effect=True, context=True)
def save_video(images, fps, filename_prefix, audio, run):
    """H.264 (+ AAC when there is audio) in MP4, written atomically (`diffusion.media.write_mp4`),
    then decoded again whole and checked (`diffusion.media.check_media`: frames, size, fps, and a
    non-silent audio track at the asked rate and channels whose duration matches the video's): a file
    that does not hold what was asked for is removed."""
    from ..diffusion import media

    name = _safe_name(filename_prefix)
    path = Path(run.output_dir) / f"{name}.mp4"
    wav, sr = None, 32000
    if audio is not None:
        wav = audio["waveform"].detach().float().cpu().numpy().astype(np.float32)
        sr = int(audio["sample_rate"])
    media.write_mp4(path, to_uint8(images), fps, wav, sr)
    info = media.check_media(path, frames=int(images.shape[0]), fps=fps, width=int(images.shape[2]),
                             height=int(images.shape[1]), audio=audio is not None, sample_rate=sr,
                             channels=None if wav is None else int(wav.shape[0]))
    if not info["ok"]:
        path.unlink(missing_ok=True)
        raise ValueError(f"{path.name} does not hold what was asked for ({'; '.join(info['problems'])}); removed")
    run.event("save_video", path=str(path), **info)
    return (str(path),)


@node("SaveImage", inputs={"images": "IMAGE", "filename_prefix": Input("STRING", default="image")},
      outputs=(("path", "STRING"),), side_effect=True, context=True)
def save_image(images, filename_prefix, run):
    """The last frame as PNG (atomic)."""
    path = Path(run.output_dir) / f"{_safe_name(filename_prefix)}.png"
    write_png(path, to_uint8(images[-1:])[0])
    run.event("save_image", path=str(path))
    return (str(path),)


# ---------------------------------------------------------------------------
# Reading media (references). Unreadable or truncated files are errors naming the file.


def write_png(path, rgb: np.ndarray) -> Path:
    """uint8 [H, W, 3] -> PNG, written to a temporary name and renamed into place."""
    import os
    import tempfile

    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".partial.png", dir=path.parent)
    os.close(fd)
    try:
        with av.open(tmp, "w", format="image2") as c:
            s = c.add_stream("png")
            s.width, s.height, s.pix_fmt = rgb.shape[1], rgb.shape[0], "rgb24"
            for pkt in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")):
                c.mux(pkt)
            for pkt in s.encode():
                c.mux(pkt)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _open_media(path: str, what: str):
    import av

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {path!r} does not exist")
    try:
        return av.open(str(p))
    except av.FFmpegError as e:
        raise ValueError(f"{what} {path!r} is unreadable or truncated ({type(e).__name__}: {e})") from None


# What one decoded input may hold in memory as float32 frames (IMAGE) when no max_frames is given:
# a 127 KB mp4 can hold thousands of frames, and decoding it whole would take gigabytes.
MAX_DECODE_BYTES = 1 << 30


def read_video(path: str, *, with_audio: bool = True, what: str = "video", max_frames: int | None = None,
               max_bytes: int = MAX_DECODE_BYTES) -> tuple[np.ndarray, np.ndarray | None, int | None]:
    """Decode the frames (uint8 [T, H, W, 3]; the first `max_frames` when given, decoding stops there)
    and the audio track (float32 [C, N], rate) of a file. Raises ValueError naming the file when it
    cannot be opened, holds no frames, breaks mid-way, or would need more than `max_bytes` as float32
    frames (then `max_frames` must be set)."""
    import av

    frames, chunks, rate = [], [], None
    with _open_media(path, what) as c:
        if not c.streams.video:
            raise ValueError(f"{what} {path!r} has no video stream")
        try:
            for f in c.decode(video=0):
                if max_frames and len(frames) >= max_frames:
                    break
                if (len(frames) + 1) * f.width * f.height * 3 * 4 > max_bytes:
                    raise ValueError(f"{what} {path!r} holds more than {len(frames)} frames of {f.width}x{f.height}, "
                                     f"which would need more than {max_bytes >> 20} MiB as float32 frames; set "
                                     "max_frames to read only the first frames")
                frames.append(f.to_ndarray(format="rgb24"))
        except av.FFmpegError as e:
            raise ValueError(f"{what} {path!r} is truncated or corrupt after {len(frames)} frame(s) "
                             f"({type(e).__name__}: {e})") from None
    if with_audio:
        audio = _read_audio_track(path, required=False)
        if audio is not None:
            chunks, rate = audio
    if not frames:
        raise ValueError(f"{what} {path!r} decodes to 0 frames (truncated or empty)")
    return np.stack(frames), (chunks if len(chunks) else None), rate


def _read_audio_track(path: str, *, required: bool):
    import av

    with _open_media(path, "audio") as c:
        if not c.streams.audio:
            if required:
                raise ValueError(f"audio {path!r} has no audio stream")
            return None
        parts, rate = [], c.streams.audio[0].codec_context.sample_rate
        try:
            for f in c.decode(audio=0):
                a = f.to_ndarray()
                if not f.format.is_planar:   # interleaved [1, N*C] -> [C, N]
                    a = a.reshape(-1, len(f.layout.channels)).T
                parts.append(a.astype(np.float32))
        except av.FFmpegError as e:
            raise ValueError(f"audio {path!r} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if not parts:
        if required:
            raise ValueError(f"audio {path!r} decodes to 0 samples (truncated or empty)")
        return None
    return np.concatenate(parts, axis=1), rate


def _input_path(run, path: str) -> str:
    p = Path(path)
    return str(p if p.is_absolute() else Path(run.input_dir) / p)


@node("LoadImage", inputs={"path": "STRING"}, outputs=(("image", "IMAGE"),), context=True)
def load_image(path, run):
    """A PNG (or any single-frame file PyAV reads) as IMAGE [1, H, W, 3]; relative paths are read
    from the executor's input folder."""
    frames, _, _ = read_video(_input_path(run, path), with_audio=False, what="image")
    return (torch.from_numpy(frames[:1]).float() / 255,)


@node("LoadVideo", inputs={"path": "STRING", "max_frames": Input("INT", default=0, min=0, max=100_000)},
      outputs=(("images", "IMAGE"), ("frames", "INT")), context=True)
def load_video(path, max_frames, run):
    """Every frame of a video file (or the first `max_frames` when > 0: decoding stops there) as
    IMAGE [T, H, W, 3]."""
    frames, _, _ = read_video(_input_path(run, path), with_audio=False, max_frames=max_frames or None)
    return torch.from_numpy(frames).float() / 255, int(frames.shape[0])


@node("LoadAudio", inputs={"path": "STRING"}, outputs=(("audio", "AUDIO"),), context=True)
def load_audio(path, run):
    """The audio track of a file as AUDIO."""
    wav, rate = _read_audio_track(_input_path(run, path), required=True)
    return ({"waveform": torch.from_numpy(wav), "sample_rate": int(rate)},)


# ---------------------------------------------------------------------------
# Frames and audio plumbing


@node("LastFrames", inputs={"images": "IMAGE", "count": Input("INT", default=1, min=1, max=100_000)}, outputs=(("images", "IMAGE"),))
def last_frames(images, count):
    """The last `count` frames (fewer when the batch is shorter)."""
    return (images[-count:],)


@node("ConcatFrames", inputs={"a": "IMAGE", "b": "IMAGE"}, outputs=(("images", "IMAGE"),))
def concat_frames(a, b):
    """Video concatenation: the frames of `a` then those of `b` (same size)."""
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f"cannot concatenate frames of size {tuple(a.shape[1:3])} and {tuple(b.shape[1:3])}")
    return (torch.cat([a, b]),)


@node("EmptyAudio", inputs={"channels": Input("INT", default=2, min=1, max=8),
                             "sample_rate": Input("INT", default=32000, min=1, max=384_000)},
      outputs=(("audio", "AUDIO"),))
def empty_audio(channels, sample_rate):
    """Zero samples, to start an audio track that segments append to."""
    return ({"waveform": torch.zeros(channels, 0), "sample_rate": sample_rate},)


@node("ConcatAudio", inputs={"a": "AUDIO", "b": "AUDIO"}, outputs=(("audio", "AUDIO"),))
def concat_audio(a, b):
    """Audio of `a` then `b` (same rate and channels)."""
    if a["sample_rate"] != b["sample_rate"] or a["waveform"].shape[0] != b["waveform"].shape[0]:
        raise ValueError(f"cannot concatenate audio {a['waveform'].shape[0]}ch@{a['sample_rate']} with "
                         f"{b['waveform'].shape[0]}ch@{b['sample_rate']}")
    return ({"waveform": torch.cat([a["waveform"], b["waveform"]], dim=1), "sample_rate": a["sample_rate"]},)


@node("AudioLength", inputs={"audio": "AUDIO"}, outputs=(("samples", "INT"),))
def audio_length(audio):
    """Samples per channel."""
    return (int(audio["waveform"].shape[1]),)


# ---------------------------------------------------------------------------
# The loop chapter's toy generator


@node("ToyScene", inputs={"width": Input("INT", min=8, max=8192), "height": Input("INT", min=8, max=8192), "prompt": "STRING",
                          "seed": Input("INT", default=0)}, outputs=(("image", "IMAGE"),), context=True)
def toy_scene(width, height, prompt, seed, run):
    """A first frame from a prompt and seed (`segments.scene`), on the executor's device."""
    return (segments.scene(width, height, prompt, seed, device=run.device),)


@node("GenerateSegment", inputs={
    "context": "IMAGE", "prompt": "STRING", "frames": Input("INT", min=1, max=10_000), "seed": Input("INT", default=0),
    "index": Input("INT", default=0), "steps": Input("INT", default=8, min=1, max=10_000),
    "fps": Input("INT", default=24, min=1, max=240), "sample_rate": Input("INT", default=32000, min=1, max=384_000),
    "audio_offset": Input("INT", optional=True)},
    outputs=(("images", "IMAGE"), ("audio", "AUDIO")), work=lambda v: v["frames"] * v["steps"])
def generate_segment(context, prompt, frames, seed, index, steps, fps, sample_rate, audio_offset):
    """A segment continuing from the last frame of `context` (`segments.generate_segment`); the pan
    continues only when `context` holds two frames or more, the audio phase only when
    `audio_offset` is wired."""
    video, audio = segments.generate_segment(context, prompt, frames, seed, index, steps=steps, fps=fps,
                                             sample_rate=sample_rate, audio_offset=audio_offset)
    return video, audio


# ---------------------------------------------------------------------------
# The H3 workflows: client nodes shaped like vLLM-Omni's ComfyUI extension, against a toy server


@node("OmniVideoReferences", inputs={
    **{f"image_{k}": Input("IMAGE", optional=True) for k in range(1, 10)},
    **{f"video_{k}": Input("IMAGE", optional=True) for k in range(1, 4)},
    **{f"audio_{k}": Input("AUDIO", optional=True) for k in range(1, 4)},
    "video_fps": Input("INT", default=24, min=1, max=240, help="frame rate of the video references"),
}, outputs=(("references", "REFS"),))
def omni_video_references(video_fps, **slots):
    """`VLLMOmniVideoReferences`: slots numbered per kind (image_1..9, video_1..3, audio_1..3); empty
    slots are skipped; references go out in the order images, videos, audios, each video and audio
    with its length in seconds (a video keeps its own soundtrack; only standalone audio counts as audio)."""
    refs = []
    for kind, n in (("image", 9), ("video", 3), ("audio", 3)):
        for k in range(1, n + 1):
            media = slots.get(f"{kind}_{k}")
            if media is None:
                continue
            if kind == "image":
                refs.append(("image", media))
            elif kind == "video":
                refs.append(("video", media, media.shape[0] / video_fps))
            else:
                refs.append(("audio", media, media["waveform"].shape[1] / media["sample_rate"]))
    return (refs,)


@node("OmniRemoteLoRA", inputs={"local_path": "STRING", "name": Input("STRING", default=""),
                                "scale": Input("FLOAT", default=1.0)}, outputs=(("lora", "LORA"),))
def omni_remote_lora(local_path, name, scale):
    """`VLLMOmniRemoteLoRA`: a LoRA already on the server, named by its server-side path."""
    if not local_path:
        raise ValueError("local_path must name the LoRA's path on the server")
    return ({"local_path": local_path, "name": name, "scale": float(scale)},)


@node("OmniDiffusionSampling", inputs={
    "n": Input("INT", default=1, min=1, max=1, help="videos per request (the toy server makes one)"),
    "num_inference_steps": Input("INT", default=50, min=1, max=1000, help="Base: 50; Turbo (4 forwards): 5"),
    "guidance_scale": Input("FLOAT", default=1.0, min=0.0, max=20.0),
    "seed": Input("INT", default=1101, min=-1, help="-1: the server picks"),
}, outputs=(("diffusion sampling params", "SAMPLING_PARAMS"),))
def omni_diffusion_sampling(n, num_inference_steps, guidance_scale, seed):
    """`VLLMOmniDiffusionSampling`: the denoiser's settings, sent with the request (the H3 templates' Base
    node: 50 steps, seed 1101; Turbo: 5)."""
    return ({"type": "diffusion", "n": n, "num_inference_steps": num_inference_steps,
             "guidance_scale": float(guidance_scale), "seed": seed},)


@node("OmniMiniMaxH3Params", inputs={
    "audio_flow_shift": Input("FLOAT", default=3.0, min=0.0, max=100.0),
    "flow_shift": Input("FLOAT", default=12.0, min=0.0, max=100.0, help="video flow shift: Base 12, Turbo 6"),
}, outputs=(("MiniMax-H3 video params", "VIDEO_PARAMS"),))
def omni_minimax_h3_params(audio_flow_shift, flow_shift):
    """`VLLMOmniMiniMaxH3Params`: H3's model-specific settings (both modalities' flow shifts)."""
    return ({"type": "minimax_h3", "audio_flow_shift": float(audio_flow_shift), "flow_shift": float(flow_shift)},)


def frames_for(duration: float, fps: int) -> int:
    """The client's conversion (`VLLMOmniGenerateVideo`): frames stay the wire unit, `max(1, round(duration x
    fps))`; 5.167 s at 24 FPS is 124 frames. The server rounds up to its model's lattice."""
    return max(1, round(duration * fps))


def _generate_work(v) -> int:
    return frames_for(v["duration"], v["fps"]) * int(v["sampling_params"]["num_inference_steps"]
                                                     if v["sampling_params"] else 50)


def _generate_check(v) -> None:
    """The server's request contract on whatever is known before the run (literals; links are None)."""
    from .omni_server import TOY_SERVED, contract_for

    if v["url"] is None or v["model"] is None:
        return
    if not any(s.endpoint == v["url"] and s.model == v["model"] for s in TOY_SERVED):
        raise ValueError(f"model {v['model']!r} is not served at {v['url']!r}")
    contract = contract_for(v["model"])
    if v["width"] is not None and v["height"] is not None:
        contract.aspect_ratio(v["width"], v["height"])
    if v["duration"] is not None and v["fps"] is not None:
        contract.served_frames(frames_for(v["duration"], v["fps"]))


@node("OmniGenerateVideo", inputs={
    "url": "STRING", "model": "STRING", "prompt": "STRING", "negative_prompt": Input("STRING", default=""),
    "width": Input("INT", min=16, max=8192), "height": Input("INT", min=16, max=8192),
    "fps": Input("INT", default=24, min=1, max=240),
    "duration": Input("FLOAT", min=0.1, max=60.0, help="seconds; converted to frames with fps (5.167 s -> 124)"),
    "references": Input("REFS", optional=True), "sampling_params": Input("SAMPLING_PARAMS", optional=True),
    "model_params": Input("VIDEO_PARAMS", optional=True), "lora": Input("LORA", optional=True),
    "reference_strength": Input("FLOAT", default=0.5, min=0.0, max=1.0, help="ours: the toy's conditioning mix"),
}, outputs=(("images", "IMAGE"), ("audio", "AUDIO")), context=True, work=_generate_work, check=_generate_check)
def omni_generate_video(url, model, prompt, negative_prompt, width, height, fps, duration, references, sampling_params,
                        model_params, lora, reference_strength, run):
    """`VLLMOmniGenerateVideo`: one request to the (toy, in-process) server, T2VA without references and
    Ref2VA with them; the duration becomes a frame count here, the server rounds it to its lattice and
    checks size, frames and references on every request. Text encoding, denoising and both VAEs run on the
    server; the client sees the request's round trip. The server's own stage times are logged as a
    `server_stages` event."""
    from .omni_server import Request, server_for

    req = Request(url=url, model=model, prompt=prompt, width=width, height=height, frames=frames_for(duration, fps),
                  fps=fps, sampling=sampling_params, model_params=model_params, references=references, lora=lora,
                  reference_strength=reference_strength, negative_prompt=negative_prompt)
    out = server_for(run.device, run.dtype).generate(req)
    run.event("server_stages", mode=out["mode"], references=out["references"], seconds=out["server_seconds"],
              requested_frames=req.frames, frames=out["frames"], aspect_ratio=out["aspect_ratio"], steps=out["steps"],
              flow_shift=out["flow_shift"])
    return out["video"], out["audio"]
