"""A toy in-process stand-in for a vLLM-Omni server that serves H3-style video+audio generation.

In vLLM-Omni's H3 workflows (`MiniMax_H3_Text_to_Video.json`, the Ref2VA workflow) ComfyUI loads no
H3 weights: `VLLMOmniGenerateVideo` sends the prompt, the sizes and the references (bundled by
`VLLMOmniVideoReferences`, with a server-side LoRA named by `VLLMOmniRemoteLoRA`) to the server, and
"the service owns text encoding, denoising and both VAEs". A client sees one request and its
response; the stages inside the request are the server's.

`ToyOmniServer` plays the server's part for the workflows in `data/workflows/` without a network:
it checks the request against what it serves (model name, LoRA, the reference rules), then runs
its stages — text encoding (the toy's is a hash of the prompt), denoising (a random-weight DiT,
`diffusion.toy_pipeline`), the video VAE (`diffusion.vae`) and the audio decoder (`synth_audio`) —
and returns the video, the audio and its own stage times. Those times are what a server's logs
would show; a ComfyUI client cannot see them, and the chapter labels them so.

One server object per (device, dtype) lives for the whole process, like a server that loads its
models at startup: the first request for a model builds it (`load`), later ones reuse it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..errors import UserError
from . import segments
from .references import Served, group_references, validate_references

# What the toy "server" serves. Model names say the toy sizes; none of them is MiniMax-H3.
TOY_ENDPOINT = "local://toy-omni/v1"
TOY_LORA = "/srv/loras/toy-style-a.safetensors"          # a server-side path, as Remote LoRA's local_path is
TOY_TURBO_LORA = "/srv/loras/toy-h3-turbo-4step.safetensors"   # the Turbo recipe's LoRA (lightx2v's, for H3)
TOY_SERVED = (
    Served(TOY_ENDPOINT, "toy-h3-tiny", (TOY_LORA, TOY_TURBO_LORA)),
    Served(TOY_ENDPOINT, "toy-h3-small", (TOY_LORA, TOY_TURBO_LORA)),
    Served(TOY_ENDPOINT, "toy-h3-base", (TOY_LORA, TOY_TURBO_LORA)),
)


# ---------------------------------------------------------------------------------------------------
# The H3 request contract, as vLLM-Omni's server applies it (every request, before any work).

FRAME_STEP, FRAME_BASE = 17, 5      # H3: a clip is 17k + 5 frames (1 frame is an image)
MAX_FRAME_K = 20                    # 345 frames: 14.4 s at 24 FPS, within the 15 s a clip may last
# vLLM-Omni's H3 defaults when a request brings no Sampling / H3-params node (the Base recipe)
DEFAULT_STEPS, DEFAULT_FLOW_SHIFT, DEFAULT_AUDIO_FLOW_SHIFT, DEFAULT_GUIDANCE = 50, 12.0, 3.0, 1.0


def align_frames(frames: int) -> int:
    """The served frame count for a requested one: 1 stays 1 (an image); anything else rounds *up* to the next
    17k + 5, as vLLM-Omni's `_minimax_align_frame_count` does, so a clip may come back slightly longer than
    asked (124 frames, the template's 5.167 s at 24 FPS, is already on the lattice: 17 x 7 + 5)."""
    if frames == 1:
        return 1
    n = max(FRAME_BASE, int(frames))
    r = (n - FRAME_BASE) % FRAME_STEP
    return n if r == 0 else n + FRAME_STEP - r


@dataclass(frozen=True)
class Contract:
    """What a served model accepts: its five resolution presets {(width, height): aspect} and the 17k + 5 frame
    lattice up to MAX_FRAME_K. MiniMax-H3's presets are `references.RESOLUTIONS`; a toy model's are the same five
    aspects divided by `scale` (each side rounded down to the toy's 16-pixel unit)."""

    model: str
    presets: dict

    def aspect_ratio(self, width: int, height: int) -> str:
        """The preset the client selects from the dimensions (it never sends a rounded pixel ratio)."""
        if (width, height) not in self.presets:
            allowed = ", ".join(f"{w}x{h} ({a})" for (w, h), a in self.presets.items())
            raise ValueError(f"{self.model} makes {width}x{height} in none of its presets: {allowed}")
        return self.presets[(width, height)]

    def served_frames(self, frames: int) -> int:
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            raise ValueError(f"frames must be an integer >= 1, got {frames!r}")
        served = align_frames(frames)
        top = FRAME_STEP * MAX_FRAME_K + FRAME_BASE
        if served > top:
            raise ValueError(f"{self.model} makes at most {top} frames (17k + 5, k <= {MAX_FRAME_K}); {frames} "
                             f"requested rounds up to {served}")
        return served


def scaled_presets(scale: int, unit: int = 16) -> dict:
    from .references import RESOLUTIONS

    return {((w // scale) // unit * unit, (h // scale) // unit * unit): a for (w, h), a in RESOLUTIONS.items()}


TOY_SCALE = {"toy-h3-tiny": 8, "toy-h3-small": 8, "toy-h3-base": 2}


def contract_for(model: str) -> Contract:
    """The request contract of a served toy model (H3's presets scaled by TOY_SCALE, H3's frame lattice)."""
    if model not in TOY_SCALE:
        raise ValueError(f"model {model!r} is not served here; served: {', '.join(TOY_SCALE)}")
    return Contract(model, scaled_presets(TOY_SCALE[model]))
TOY_SIZES = {
    "toy-h3-tiny": dict(dit=dict(d_model=64, n_layers=1, n_heads=4), vae=(32, 32, 16, 16)),
    "toy-h3-small": dict(dit=dict(d_model=128, n_layers=2, n_heads=4), vae=(64, 48, 32, 16)),
    "toy-h3-base": dict(dit=dict(d_model=384, n_layers=6, n_heads=6), vae=(384, 384, 192, 96)),
}
VAE_SPATIAL, VAE_TEMPORAL = 8, 4      # latent -> video: 8x in H and W, frames = 1 + 4 (T - 1)
SERVER_STAGES = ("text_encode", "denoise", "vae_decode", "audio_decode")


def latent_shape(width: int, height: int, frames: int) -> tuple[int, int, int, int]:
    """(B, T, h, w) of the toy latent whose decode covers `frames` frames of width x height: the toy VAE makes
    1 + 4 (T - 1) frames, so T rounds up and the server trims the decode to `frames` (H3's own VAE maps each 17
    frames to 5 latent frames; ComfyUI trims its pad frames the same way)."""
    unit = VAE_SPATIAL * 2   # 8x VAE, then the DiT's 2x2 patches
    if width % unit or height % unit:
        raise UserError(f"width and height must be multiples of {unit}, got {width}x{height}")
    if frames < 1:
        raise UserError(f"frames must be >= 1, got {frames}")
    return 1, -(-(frames - 1) // VAE_TEMPORAL) + 1, height // VAE_SPATIAL, width // VAE_SPATIAL


@dataclass
class Request:
    """What `VLLMOmniGenerateVideo` sends: the served model, the prompt, the sizes, the sampling settings,
    the references [(kind, media, seconds)] and the server-side LoRA path (or None)."""

    url: str
    model: str
    prompt: str
    width: int
    height: int
    frames: int                          # the wire unit: the client converts its duration (round(duration x fps))
    fps: int
    sampling: dict | None = None         # VLLMOmniDiffusionSampling: num_inference_steps, guidance_scale, seed
    model_params: dict | None = None     # VLLMOmniMiniMaxH3Params: flow_shift, audio_flow_shift
    references: list | None = None
    lora: dict | None = None
    reference_strength: float = 0.5
    negative_prompt: str = ""
    sample_rate: int = 32000

    @property
    def steps(self) -> int:
        return int((self.sampling or {}).get("num_inference_steps", DEFAULT_STEPS))

    @property
    def seed(self) -> int:
        s = (self.sampling or {}).get("seed", -1)
        return 0 if s is None or s < 0 else int(s)

    @property
    def flow_shift(self) -> float:
        return float((self.model_params or {}).get("flow_shift", DEFAULT_FLOW_SHIFT))


class ToyOmniServer:
    """See the module docstring. `generate(request)` -> {"video": float [T, H, W, 3] in [0, 1],
    "audio": {"waveform": [2, N], "sample_rate"}, "mode": "T2VA" | "Ref2VA", "references": counts,
    "server_seconds": {stage: s}}."""

    def __init__(self, device="cpu", dtype=torch.float32, served=TOY_SERVED):
        self.device, self.dtype = torch.device(device), dtype
        self.served = tuple(served)
        self.models: dict[tuple, dict] = {}

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def model(self, name: str, lora: str | None, seed: int = 0) -> dict:
        """The served model (built on first use: the server's startup load)."""
        from ..diffusion.toy_pipeline import DiTConfig, init_dit
        from ..diffusion.vae import VAEConfig, init_decoder

        key = (name, lora)
        if key not in self.models:
            size = TOY_SIZES[name]
            dit = init_dit(DiTConfig(**size["dit"]), seed, device=self.device, dtype=self.dtype)
            if lora:
                g = torch.Generator().manual_seed(segments.prompt_seed(lora))
                w = dit.out.weight
                a, b = torch.randn(w.shape[0], 4, generator=g), torch.randn(4, w.shape[1], generator=g)
                with torch.no_grad():
                    w += (0.02 * a @ b / 4).to(device=self.device, dtype=self.dtype)
            vae = init_decoder(VAEConfig(channels=size["vae"], temporal_up=(True, True, False)), seed + 1,
                               device=self.device, dtype=self.dtype)
            self.models[key] = {"dit": dit, "vae": vae}
        return self.models[key]

    def check(self, req: Request) -> dict:
        """What the server refuses before any work, on every request: an unserved model or LoRA, a size outside
        its model's presets, a frame count past its lattice's top (a count between lattice points is rounded up,
        as vLLM-Omni's server does), sampling settings out of range, and references that break the Ref2VA rules
        (all broken rules in one error). Returns {"counts", "frames", "aspect_ratio"}."""
        row = next((s for s in self.served if s.endpoint == req.url and s.model == req.model), None)
        if row is None:
            raise ValueError(f"model {req.model!r} is not served at {req.url!r}")
        path = (req.lora or {}).get("local_path")
        if path and path not in row.loras:
            raise ValueError(f"LoRA {path!r} is not on the server for {req.model!r}")
        contract = contract_for(req.model)
        aspect = contract.aspect_ratio(req.width, req.height)
        frames = contract.served_frames(req.frames)
        latent_shape(req.width, req.height, frames)
        if not 1 <= req.steps <= 1000:
            raise ValueError(f"num_inference_steps must be in [1, 1000], got {req.steps}")
        if not 0.0 < req.flow_shift <= 100.0:
            raise ValueError(f"flow_shift must be in (0, 100], got {req.flow_shift}")
        out = {"counts": {}, "frames": frames, "aspect_ratio": aspect}
        if req.references is None:
            return out
        refs = group_references(req.references)
        out["counts"] = validate_references(refs["image"], refs["video"], refs["audio"],
                                            video_seconds=refs["video_seconds"], audio_seconds=refs["audio_seconds"],
                                            prompt=req.prompt)
        return out

    def generate(self, req: Request) -> dict:
        from ..diffusion.toy_pipeline import denoise, flow_times, synth_audio

        checked = self.check(req)
        counts, n_frames = checked["counts"], checked["frames"]
        seconds = {}

        def stage(name, t0):
            self._sync()
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0

        t0 = time.perf_counter()
        m = self.model(req.model, (req.lora or {}).get("local_path"))
        stage("load", t0)
        shape = latent_shape(req.width, req.height, n_frames)
        t0 = time.perf_counter()
        seed = req.seed + segments.prompt_seed(req.prompt) % 100_000   # the toy's "text encoder"
        stage("text_encode", t0)
        dit = m["dit"]
        t0 = time.perf_counter()
        refs = group_references(req.references) if req.references else None
        if refs is None:
            latent = denoise(dit, shape, req.steps, seed, device=self.device, dtype=self.dtype, shift=req.flow_shift)
        else:
            ref = reference_latent(refs, shape, dit.cfg.z_dim, seed, self.device, self.dtype)
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(1, dit.cfg.z_dim, *shape[1:], generator=g).to(device=self.device, dtype=self.dtype)
            if ref is not None:
                x = (1 - req.reference_strength) * x + req.reference_strength * ref
            with torch.no_grad():
                ts = flow_times(req.steps, req.flow_shift)
                for i in range(req.steps):
                    x = x - dit(x, ts[i]) * (ts[i] - ts[i + 1])
            latent = x
        stage("denoise", t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            video = m["vae"](latent)[:, :, :n_frames]    # [1, 3, T', H, W] roughly in [-1, 1], trimmed
        frames = ((video[0].float().clamp(-1, 1) + 1) / 2).permute(1, 2, 3, 0).contiguous()
        stage("vae_decode", t0)
        t0 = time.perf_counter()
        wav = torch.from_numpy(synth_audio(latent, n_frames, req.fps, req.sample_rate))
        for r in (refs or {}).get("audio", ()):
            wav = wav + 0.25 * _fit_audio(r, req.sample_rate, wav.shape[1])
        stage("audio_decode", t0)
        return {"video": frames, "audio": {"waveform": wav.clamp(-1, 1), "sample_rate": req.sample_rate},
                "mode": "T2VA" if refs is None else "Ref2VA", "references": counts, "server_seconds": seconds,
                "frames": n_frames, "aspect_ratio": checked["aspect_ratio"], "steps": req.steps,
                "flow_shift": req.flow_shift}


def _fit_audio(ref: dict, rate: int, n: int) -> torch.Tensor:
    """A reference track resampled to `rate`, made stereo and repeated or cut to `n` samples."""
    r = ref["waveform"].float()
    if ref["sample_rate"] != rate:
        m = int(round(r.shape[1] * rate / ref["sample_rate"]))
        r = torch.nn.functional.interpolate(r[None], size=max(m, 1), mode="linear", align_corners=False)[0]
    r = r.expand(2, -1) if r.shape[0] == 1 else r[:2]
    reps = math.ceil(n / max(r.shape[1], 1))
    return r.repeat(1, reps)[:, :n]


def reference_latent(refs: dict, shape, z_dim: int, seed: int, device, dtype) -> torch.Tensor | None:
    """Images and video frames resized to the latent grid, projected to z_dim channels by a fixed
    random map and averaged: what the toy conditions on (None without visual references)."""
    import torch.nn.functional as F

    _, T, h, w = shape
    pics = [m[-1:] for m in refs["image"]] + [m for m in refs["video"]]
    if not pics:
        return None
    g = torch.Generator().manual_seed(seed + 17)
    proj = torch.randn(z_dim, 3, generator=g)
    acc = torch.zeros(z_dim, h, w)
    for p in pics:
        x = F.interpolate(p.float().permute(0, 3, 1, 2), size=(h, w), mode="area").mean(0)   # [3, h, w]
        acc += torch.einsum("zc,chw->zhw", proj, (x - 0.5) * 2)
    ref = acc / len(pics)
    return ref[None, :, None].expand(1, z_dim, T, h, w).to(device=device, dtype=dtype)


_SERVERS: dict[tuple, ToyOmniServer] = {}


def server_for(device, dtype) -> ToyOmniServer:
    """The process's toy server for a device and dtype (models stay loaded between requests)."""
    key = (str(torch.device(device)), str(dtype))
    if key not in _SERVERS:
        _SERVERS[key] = ToyOmniServer(device, dtype)
    return _SERVERS[key]


def restart(device, dtype) -> ToyOmniServer:
    """A fresh server for a device and dtype (its models are built again on the next request)."""
    key = (str(torch.device(device)), str(dtype))
    _SERVERS[key] = ToyOmniServer(device, dtype)
    return _SERVERS[key]
