"""The kernels a reader would use instead of ours, launched at our gpu-preset shapes, for the cost model.

Each peer's own Python entry point runs under `traced()` on `meta` tensors, so its own launch code picks
the grid and the arguments and nothing runs. Peers are optional dependencies (`pip install -e .[peers]`);
a peer that is not installed, or that cannot be imported on this machine, is skipped and said so
(`available()`).

- liger-kernel's RMSNorm beside sglang-fused-comm's RMSNorm (`sglang_fused_comm`).
- fla-core's `chunk_gated_delta_rule_fwd` (cumsum, fused kkt + solve, recompute w/u, state, output: the
  five kernels it launches) beside our chunked forward (`numerics/gdn_chunk.py`) at gdn-backward-check's
  timed shape (`gdn_backward_check`), and its `chunk_gated_delta_rule_bwd` (dv_local, the dh walk, dqkwg,
  the WY backward, the reverse cumsum; less its recompute of w, u and h, which ours keeps from the forward:
  `FLA_BWD_RECOMPUTE`) beside our four backward kernels (`numerics/gdn_chunk_bwd.py`), shape key
  'backward ...'. Our chapter table keeps one launch per specialisation (the checked lengths come first),
  so our kernels at the timed shape are compiled into the peer table too (rows with side "ours"). fla
  picks its tiles and autotuner lists from the device at import, so it is imported afresh per target with
  that card's answers (`fla_as_on`); its lists then differ by card, and the chosen config is carried to
  the other targets by content (`config_choice`), not by index.
- torchao's MX quantize kernels (`to_mxfp8_dim0_kernel` row-wise 1x32, `to_mxfp8_dim1_kernel` column-wise
  32x1, FLOOR scaling) beside te-mxfp8-recipes' timed quantize launches (`te_mxfp8_recipes`); torchao
  defines them only where it finds an sm_100 GPU, so `_torchao_kernels` loads the file by path.
- gemlite's W4A16 kernels (GEMV_REVSPLITK at M <= 4, GEMM_SPLITK at 4 < M < 64, as its `get_matmul_type`
  picks) at chord-w4a16's dense decode shapes (`chord_w4a16`), group 32 as ours. gemlite's package
  `__init__` (through `triton_kernels/utils.py`) calls `torch.cuda.get_device_capability()` at import,
  which asserts a CUDA build of PyTorch, so its two kernel modules are loaded by file path under a
  stand-in package (`_gemlite_modules`), with the device questions `utils.py` asks at import answered as
  on an H100 (why, in its docstring). The shapes (M 1, 2, 16) come from the chapter's parameters, never
  from our kernel's rows, so our W4A16 kernels can change without making these rows stale.
- vLLM's Triton fused-MoE INT4 W4A16 kernel (`fused_moe_kernel_gptq_awq`, the Triton kernel chord's MoE
  decode would face in vLLM) at chord-w4a16's MoE decode shapes (`chord_w4a16_vllm`: M 1, 2, 16 tokens
  per expert, T = ceil(E*M/k) tokens top-8 over Kimi-K2 EP8's 48 local experts, H 7168, I 2048), gate/up
  and down, in the same table as gemlite. vLLM is never imported: `import vllm...fused_moe` needs vLLM's
  ~55 pinned dependencies and its compiled `_C` ops. Instead `vllm_fused_moe_file` finds the installed
  package's `model_executor/layers/fused_moe/fused_moe.py` (`importlib.util.find_spec("vllm")`, which
  does not run the package's `__init__`) and `defs_from_source` parses it with `ast` and executes only
  named top-level definitions (`VLLM_TAKE`), with every `@triton.jit` helper and module-level constexpr
  they reference, in a namespace of `triton`, `tl`, `torch` and stand-ins; nothing else of the file runs.
  *Taken from vLLM at run time, never copied here*: the kernel and its jit helper `write_zeros_to_output`;
  `invoke_fused_moe_wna16_triton_kernel` (the launch itself: grid cdiv(EM, BLOCK_SIZE_M) * cdiv(N,
  BLOCK_SIZE_N) with EM cut to T*k*BLOCK_SIZE_M when T < BLOCK_SIZE_M, strides, constexprs);
  `get_moe_wna16_block_config` (BLOCK_SIZE_N / K: 32 x 64 at one token, else 64 x 32);
  `get_default_config` (BLOCK_SIZE_M 16 / 32 / 64 at T <= 20 / 40 / more, GROUP_SIZE_M 1; no num_warps or
  num_stages, so Triton's 4 and 3); `should_moe_wna16_use_cuda` (asked as on an NVIDIA GPU: at T*k/E <= 6
  tokens per expert vLLM runs its CUDA `moe_wna16_gemm` instead, so at M 1 and 2 these rows are the
  Triton path vLLM takes elsewhere, and the launch name says so); `get_config_file_name` (a tuned
  `E=..,N=..,device_name=NVIDIA_H200,dtype=int4_w4a16.json` in fused_moe/configs would be used, closest M,
  as `try_get_optimal_moe_config` does; vLLM 0.33 ships none for E 48, N 2048). *Ours*: the stand-ins
  (`envs.VLLM_BATCH_INVARIANT` False, `current_platform`, `next_power_of_2`, the device name H200), and
  the arguments `fused_experts_impl` would pass, rebuilt here because running it needs
  `vllm._custom_ops`: vLLM's buffers (w13 [E, 2I, H/2] and w2 [E, H, I/2] uint8, bf16 scales [E, N,
  K/32], no zero points; caches 1 and 3 as views of one buffer), and the routing tables at the sizes
  `moe_align_block_size` allocates (`vllm_align_shapes`; its sort is a CUDA op). The early-exit blocks
  past num_tokens_post_padded (3 of 51 M-blocks at M 2, 12 of 60 at M 16, balanced routing) are counted
  as full CTAs by the cost model. Not on either side: vLLM's `moe_align_block_size`, `silu_and_mul` and
  `moe_sum` (CUDA ops; our gate/up does SiLU * up in its epilogue) and our combine. Get the peer with
  `pip install --no-deps --target DIR vllm==0.33.0` and DIR on PYTHONPATH (336 MB; it is not in the
  `[peers]` extra: its pinned dependencies would replace this environment's); `python -m
  inferbook.compiled.peers chord-w4a16 --save --only vllm` recompiles its rows and keeps gemlite's.

- vLLM's same kernel for kimi-topk-tail-fusion's W4A16 tail (`kimi_topk_tail_fusion`): the down GEMM with the
  router weight only, at the chapter's tail shapes (T tokens top-16 over 896 experts, H 3584, I 256), its
  DRAM bytes stated as our tail builders state theirs (`fused_moe.tail_dram_bytes`: the experts its row
  blocks can reach, not the [E, H, I/2] table its arguments span), ours the faster of the chapter's two
  W4A16 fused tails (tl.dot and decode) at each T.

**Autotuned peers.** fla, torchao and gemlite pick their launch by benchmarking configs on the GPU,
which this machine cannot do. `traced(configs="all")` records one launch per config the peer's own
autotuner would try (after its own pruning; at most `SWEEP_MAX`, evenly spaced through a longer list:
`sweep_indices`); they are compiled for sm_90, and the comparison takes, per
kernel, the config the cost model predicts fastest on H200 (among those that do not spill: the model
does not charge local-memory traffic) — the choice an autotuner agreeing with the model would make, so
the peer is not handicapped by a guessed config. For sm_80 and sm_100 only that
chosen config is compiled (`INFERBOOK_PEER_CONFIGS`, set by `save`). A peer kernel that does not
autotune is recorded once.

`python -m inferbook.compiled.peers SLUG --save` compiles one chapter's peers (sm_90 sweep, then the
chosen configs on sm_80 and sm_100) into data/compiled/peers/<slug>.json; `compare(slug, rows, target,
card)` sets ours beside each peer per shape; the chapter's compiler section glues that sentence.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path

import torch

# {'<kernel> @ <shape>': {'i': config index, 'match': its constexprs}} for the non-sweep targets
# (`config_choice`): a peer whose autotuner list differs by card (fla asks the device at import) gets the
# same config by content where the index would name another
CONFIG_ENV = "INFERBOOK_PEER_CONFIGS"
SWEEP_TARGET = "sm_90"
SWEEP_CARD = "H200"

# peer name -> the module whose import says it is usable here
PEER_MODULES = {"liger-kernel": "liger_kernel.ops.rms_norm", "fla-core": "fla.ops.gated_delta_rule.chunk",
                "torchao": "torchao.prototype.mx_formats.kernels", "gemlite": "gemlite",
                "vllm": "vllm.model_executor.layers.fused_moe.fused_moe"}     # vllm: read by path, never imported


def available() -> dict[str, str]:
    """{peer: 'ok' | why not} for the peers this module knows. gemlite's package import asserts a CUDA
    PyTorch; its kernels are usable through `_gemlite_modules` nonetheless ('ok (kernel modules by path)')."""
    out = {}
    for name, module in PEER_MODULES.items():
        try:
            if name == "gemlite":
                _gemlite_modules()
                out[name] = "ok (kernel modules loaded by path; the package import asserts a CUDA PyTorch)"
                continue
            if name == "vllm":
                V = _vllm()
                out[name] = (f"ok ({V['version']}: kernel and config functions read from {V['file']}; "
                             "the package is not imported)")
                continue
            __import__(module)
            out[name] = "ok"
        except BaseException as e:                  # not installed, or it refuses a CPU-only torch at import
            if isinstance(e, KeyboardInterrupt):
                raise
            msg = str(e).strip().splitlines()[0][:160 if name != "vllm" else 240] if str(e).strip() else ""
            out[name] = f"{type(e).__name__}: {msg}"
    return out


def usable(peer: str) -> bool:
    """Whether `peer` imports here (only its own module is imported)."""
    try:
        if peer == "gemlite":
            _gemlite_modules()
        elif peer == "vllm":
            _vllm()
        else:
            __import__(PEER_MODULES[peer])
        return True
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------------
# Tracing a peer's own launch code

def _is_constexpr(fn, name: str) -> bool:
    import inspect

    try:
        ann = inspect.signature(fn).parameters[name].annotation
    except (KeyError, TypeError, ValueError):
        return False
    return "constexpr" in str(ann)


def _positional(la) -> None:
    """A peer that launches with keyword arguments (`kernel[grid](x_ptr=x, ...)`): move every argument up
    to the last runtime (non-constexpr) parameter into `args`, in the kernel's order, as our builders pass
    them (the compile table's argument specialisation and DRAM bytes read `args`)."""
    fn = getattr(la.kernel, "fn", la.kernel)
    names = list(getattr(la.kernel, "arg_names", []) or [])
    if not names or not la.kwargs:
        return
    named = dict(zip(names, la.args))
    named.update(la.kwargs)
    last = max((i for i, n in enumerate(names) if not _is_constexpr(fn, n)), default=-1)
    if any(n not in named for n in names[:last + 1]):
        return
    la.args = [named.pop(n) for n in names[:last + 1]]
    la.kwargs = {n: v for n, v in named.items() if n not in names[:last + 1]}


@contextlib.contextmanager
def traced(source: str, configs="all"):
    """`compiled.recording(source)` that also (1) evaluates a launcher's callable grid on the launch's
    arguments (fla, torchao and gemlite pass `lambda META: ...`), and (2) answers Triton's autotuner
    without benchmarking: `configs="all"` records one launch per config its (pruned) list holds, each
    named '<kernel> cfg i/n'; a dict {kernel name: i} records config i only; None records the first."""
    from triton.runtime import autotuner as A
    from triton.runtime import jit as J

    from . import recording

    current: dict = {}
    with recording(source) as launches:
        classes = [J.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction
            classes.append(InterpretedFunction)
        except Exception:      # pragma: no cover
            pass
        inner = {cls: cls.__dict__["run"] for cls in classes}     # the recording's own `record`

        def make_run(rec):
            def run(kernel, *args, grid, warmup, **kwargs):
                if callable(grid):
                    named = dict(zip(getattr(kernel, "arg_names", []), args))
                    named.update(kwargs)
                    grid = grid(named)
                grid = tuple(int(g) for g in grid) if isinstance(grid, (tuple, list)) else (int(grid),)
                n = len(launches)
                out = rec(kernel, *args, grid=grid, warmup=warmup, **kwargs)
                for la in launches[n:]:
                    _positional(la)
                    if current.get("cfg"):
                        la.name = f"{la.name} cfg {current['cfg']}"
                return out
            return run

        undo = [(cls, "run", fn) for cls, fn in inner.items()]
        for cls, fn in inner.items():
            cls.run = make_run(fn)

        def tuner_run(self, *args, **kwargs):
            self.nargs = dict(zip(self.arg_names, args))
            cands = list(self.prune_configs(kwargs)) if len(self.configs) > 1 else list(self.configs)
            name = getattr(self.base_fn, "__name__", "kernel")
            if configs == "all":
                pick = sweep_indices(len(cands))
            elif isinstance(configs, dict):
                pick = [_pick(cands, configs.get(name, 0))]
            else:
                pick = [0]
            ret = None
            for i in pick:
                current["cfg"] = f"{i + 1}/{len(cands)}" if len(cands) > 1 else ""
                ret = self.fn.run(*args, **kwargs, **cands[i].all_kwargs())
            current["cfg"] = ""
            self.nargs = None
            return ret

        undo.append((A.Autotuner, "run", A.Autotuner.__dict__["run"]))
        A.Autotuner.run = tuner_run
        try:
            yield launches
        finally:
            for obj, name, value in reversed(undo):
                setattr(obj, name, value)


SWEEP_MAX = 9    # configs compiled per autotuned kernel and shape on the sweep target


def sweep_indices(n: int, most: int = SWEEP_MAX) -> list[int]:
    """Which of an autotuner's `n` configs the sweep compiles: all of them up to `most`, else `most`
    evenly spaced through its list, first and last included (torchao's 24 MX configs and gemlite's
    14 / 16 would take this 2-core machine's compile budget several times over; the names keep each
    config's index in the peer's own list, so the table says which were tried)."""
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


def _pick(cands: list, choice) -> int:
    """The index in this autotuner list of a chosen config: `choice` an index, or {'i': index, 'match':
    constexprs} -- the first candidate whose own values (warps, stages, its kwargs) all equal the chosen
    row's, else the index where it is in range, else the list's last."""
    if not isinstance(choice, dict):
        return int(choice)
    want, i = choice.get("match") or {}, int(choice["i"])

    def same(c) -> bool:
        mine = {k: v for k, v in c.all_kwargs().items() if k in want}
        return bool(mine) and all(want[k] == v for k, v in mine.items())

    if i < len(cands) and same(cands[i]):           # the same list as the sweep's: the same index
        return i
    return next((j for j, c in enumerate(cands) if same(c)), min(i, len(cands) - 1))


def _chosen() -> dict | None:
    """The per-kernel config choice for a non-sweep target (from the environment `save` sets), or None."""
    raw = os.environ.get(CONFIG_ENV)
    return json.loads(raw) if raw else None


def _configs(shape: str):
    """'all' (the sweep), or {kernel: config index} chosen for `shape` (keys '<kernel> @ <shape>'; a bare
    '<kernel>' key applies at every shape)."""
    ch = _chosen()
    if ch is None:
        return "all"
    out = {k: v for k, v in ch.items() if " @ " not in k}
    out.update({k.split(" @ ", 1)[0]: v for k, v in ch.items() if k.endswith(f" @ {shape}")})
    return out


def _label(launches: list, peer: str, shape: str) -> list:
    """Name each traced launch '<peer>: <kernel>[ cfg i/n] @ <shape>'."""
    for la in launches:
        la.name = f"{peer}: {la.name} @ {shape}"
    return launches


# ---------------------------------------------------------------------------------------------------
# liger-kernel: RMSNorm (sglang-fused-comm)

def liger_rmsnorm(T: int, H: int, dtype=torch.bfloat16) -> list:
    """liger-kernel's RMSNorm forward on x [T, H] (its own `calculate_settings` picks the block)."""
    from liger_kernel.ops import rms_norm as R

    with traced("liger_kernel/ops/rms_norm.py", None) as launches:
        R.rms_norm_forward(torch.empty(T, H, dtype=dtype, device="meta"), torch.empty(H, dtype=dtype, device="meta"),
                           1e-6, 0.0, "llama", None)
    for la in launches:
        la.name = f"liger rmsnorm T{T} H{H}"
    return launches


def _our_rmsnorm_shapes(slug: str) -> list[tuple[int, int]]:
    from . import kernel_name, launches_for

    shapes = []
    for la in launches_for(slug):
        if kernel_name(la) == "_rmsnorm_kernel":
            x = la.args[0]
            shape = (int(x.shape[0]), int(x.shape[-1])) if x.dim() == 2 else None
            if shape and shape not in shapes:
                shapes.append(shape)
    return shapes


def sglang_fused_comm(params=None) -> list:
    """liger's RMSNorm at every RMSNorm shape of sglang-fused-comm's gpu preset."""
    return [la for T, H in _our_rmsnorm_shapes("sglang-fused-comm") for la in liger_rmsnorm(T, H)]


# ---------------------------------------------------------------------------------------------------
# fla-core: chunk gated delta rule forward (gdn-backward-check)

def gdn_shapes(params: dict) -> list[tuple[int, int, int, int, int]]:
    """(B, T, H, K, V) of gdn-backward-check's timed forward at its gpu preset."""
    K = int(params["bench_head_dim"])
    return [(int(params["bench_batch"]), int(params["bench_len"]), int(params["bench_heads"]), K, K)]


def gdn_shape_key(B, T, H, K, V) -> str:
    return f"B{B} T{T} H{H} K{K} V{V} bf16"


# the device questions fla-core asks (at import and in its launch code), answered as the target's card
# would: compute capability, name, SMs and the opt-in shared memory per block (its tiles and autotuner
# config lists follow `check_shared_mem`; asked on a machine without a GPU they all fall back to the
# smallest, which is not what fla runs on these cards)
FLA_CARDS = {"sm_80": ((8, 0), "NVIDIA A100-SXM4-80GB", 108, 166912),
             "sm_90": ((9, 0), "NVIDIA H200", 132, 232448),
             "sm_100": ((10, 0), "NVIDIA B200", 148, 232448)}


@contextlib.contextmanager
def fla_as_on(target: str | None = None):
    """fla-core imported afresh with its device questions answered as on `target`'s card (`FLA_CARDS`;
    default: the `device.building_for` target, else sm_90); yields `fla.ops.gated_delta_rule.chunk`. fla
    decides tiles and config lists at import (`BKV_LIST = ... check_shared_mem()`), so its modules are
    dropped from `sys.modules` before and after. Its launch code's own `check_shared_mem(arch, k.device.index)`
    (a meta tensor has no index) is answered with the card's shared memory too."""
    import importlib
    import types

    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from .. import device as D
    from . import _AOTDriver

    if target is None:
        t = D.kernel_target(torch.device("cuda"))
        target = t if t in FLA_CARDS else "sm_90"
    cap, name, sms, smem = FLA_CARDS[target]

    class _Utils:
        @staticmethod
        def get_device_properties(i):
            return {"max_shared_mem": smem, "multiprocessor_count": sms, "max_num_regs": 65536, "warpSize": 32}

    aot = _AOTDriver(GPUTarget("cuda", int(f"{cap[0]}{cap[1]}"), 32))
    aot.utils = _Utils()
    cuda = torch.cuda
    names = ("get_device_capability", "get_device_name", "device_count", "current_device", "get_device_properties")
    real = {n: getattr(cuda, n) for n in names}
    real_driver = driver._active

    def purge():
        for n in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
            del sys.modules[n]

    cuda.get_device_capability = lambda *a, **k: cap
    cuda.get_device_name = lambda *a, **k: name
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        name=name, multi_processor_count=sms, major=cap[0], minor=cap[1], shared_memory_per_block_optin=smem)
    driver.set_active(aot)
    purge()
    try:
        chunk = importlib.import_module("fla.ops.gated_delta_rule.chunk")
        hw = importlib.import_module("fla.utils.hardware")

        def check_shared_mem(arch: str = "none", tensor_idx=0) -> bool:
            return smem >= hw.Backend.get_shared_memory(arch)

        for mod in [m for n, m in sys.modules.items() if n == "fla" or n.startswith("fla.")]:
            if getattr(mod, "check_shared_mem", None) is not None:
                mod.check_shared_mem = check_shared_mem
        yield chunk
    finally:
        for n, fn in real.items():
            setattr(cuda, n, fn)
        driver._active = real_driver
        purge()


def fla_chunk_gdn(B: int, T: int, H: int, K: int, V: int, configs="all") -> list:
    """The launches fla-core's `chunk_gated_delta_rule_fwd` makes for q, k [B, T, H, K], v [B, T, H, V],
    g, beta [B, T, H] (bf16; g fp32 as its `chunk_local_cumsum` takes it), an fp32 initial state and the
    final state kept (as our forward returns it)."""
    bf, f32 = torch.bfloat16, torch.float32
    m = lambda *s, dt=bf: torch.empty(*s, dtype=dt, device="meta")   # noqa: E731
    with fla_as_on() as C, traced("fla/ops/gated_delta_rule/chunk.py", configs) as launches:
        C.chunk_gated_delta_rule_fwd(m(B, T, H, K), m(B, T, H, K), m(B, T, H, V), m(B, T, H, dt=f32), m(B, T, H),
                                     K ** -0.5, m(B, H, K, V, dt=f32), True)
    return _label(launches, "fla-core", gdn_shape_key(B, T, H, K, V))


def our_chunk_gdn(B: int, T: int, H: int, K: int, V: int) -> list:
    from ..numerics import gdn_chunk

    launches = gdn_chunk.chunked_launches(B, T, H, K, V, torch.bfloat16, has_h0=True)
    return _label(launches, "ours", gdn_shape_key(B, T, H, K, V))


# fla's backward first recomputes the forward's w, u (`recompute_w_u_fwd`) and state h
# (`chunk_gated_delta_rule_fwd_h`); ours keeps them from the forward (`gdn_chunk_bwd._ChunkedGDN.forward`
# saves them), so the backward comparison leaves those launches out on fla's side and says so
FLA_BWD_RECOMPUTE = ("recompute_w_u_fwd_kernel", "chunk_gated_delta_rule_fwd_kernel_h")
BWD = "backward "      # the backward's shape key: 'backward B4 T1024 H8 K128 V128 bf16'


def fla_chunk_gdn_bwd(B: int, T: int, H: int, K: int, V: int, configs="all") -> list:
    """The launches fla-core's `chunk_gated_delta_rule_bwd` makes at the shapes of `fla_chunk_gdn` (A
    [B, T, H, 64] bf16, g the fp32 cumulative gate, dS [B, H, K, V] fp32), less its recompute of w, u and
    h (`FLA_BWD_RECOMPUTE`): dv_local, the dh walk, dq/dk/dw/dg, the WY backward, the reverse cumsum."""
    bf, f32 = torch.bfloat16, torch.float32
    m = lambda *s, dt=bf: torch.empty(*s, dtype=dt, device="meta")   # noqa: E731
    with fla_as_on() as C, traced("fla/ops/gated_delta_rule/chunk.py", configs) as launches:
        C.chunk_gated_delta_rule_bwd(m(B, T, H, K), m(B, T, H, K), m(B, T, H, V), m(B, T, H, dt=f32), m(B, T, H),
                                     m(B, T, H, 64), K ** -0.5, m(B, H, K, V, dt=f32), m(B, T, H, V),
                                     m(B, H, K, V, dt=f32))
    keep = [la for la in launches if not la.name.startswith(FLA_BWD_RECOMPUTE)]
    return _label(keep, "fla-core", BWD + gdn_shape_key(B, T, H, K, V))


def our_chunk_gdn_bwd(B: int, T: int, H: int, K: int, V: int) -> list:
    from ..numerics import gdn_chunk_bwd

    return _label(gdn_chunk_bwd.chunked_bwd_launches(B, T, H, K, V, torch.bfloat16, has_h0=True), "ours",
                  BWD + gdn_shape_key(B, T, H, K, V))


def gdn_backward_check(params=None) -> list:
    """Ours (the three chunk kernels of the forward, the four of the backward) and fla-core's (five of
    the forward; its backward's, less the recompute ours saves), at the timed shape."""
    from . import gpu_params

    P = gpu_params("gdn-backward-check")
    out = []
    for shape in gdn_shapes(P):
        out += our_chunk_gdn(*shape) + our_chunk_gdn_bwd(*shape)
        if usable("fla-core"):
            out += fla_chunk_gdn(*shape, configs=_configs(gdn_shape_key(*shape)))
            out += fla_chunk_gdn_bwd(*shape, configs=_configs(BWD + gdn_shape_key(*shape)))
    return out


# ---------------------------------------------------------------------------------------------------
# torchao: MX quantize (te-mxfp8-recipes)

# our launch name (te-mxfp8-recipes' table) -> the torchao kernel doing that work
MX_OURS = {"row-wise 1x32": "quantize-speed e4m3 floor row-wise 1x32",
           "column-wise 32x1": "quantize-speed e4m3 floor column-wise 32x1"}


def mx_shape_key(axis: str, M: int, K: int) -> str:
    return f"{axis} e4m3 floor {M}x{K} bf16"


def torchao_mx_quantize(M: int, K: int, configs=None) -> list:
    """torchao's Triton MXFP8 quantize kernels on x [M, K] bf16, FLOOR scaling, block 32: the launches
    of `triton_to_mxfp8_dim0` (row-wise) and `triton_to_mxfp8_dim1` (column-wise), made by calling the
    kernels as those wrappers do (the wrappers are `torch.library.triton_op`s: on `meta` tensors the
    dispatcher runs their fake implementations, which launch nothing)."""
    import triton

    KX = _torchao_kernels()
    out = []
    x = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
    with traced("torchao/prototype/mx_formats/kernels.py",
                configs or _configs(mx_shape_key("row-wise 1x32", M, K))) as launches:
        KX.to_mxfp8_dim0_kernel[lambda META: (triton.cdiv(M, META["ROW_TILE_SIZE"]), triton.cdiv(K, META["COL_TILE_SIZE"]))](
            x_ptr=x, output_ptr=torch.empty(M, K, dtype=torch.float8_e4m3fn, device="meta"),
            scale_ptr=torch.empty(M, K // 32, dtype=torch.uint8, device="meta"), n_rows=M, n_cols=K,
            SCALE_BLOCK_SIZE=32, SCALING_MODE="floor")
    out += _label(launches, "torchao", mx_shape_key("row-wise 1x32", M, K))
    with traced("torchao/prototype/mx_formats/kernels.py",
                configs or _configs(mx_shape_key("column-wise 32x1", M, K))) as launches:
        KX.to_mxfp8_dim1_kernel[lambda META: (triton.cdiv(M, META["ROW_TILE_SIZE"]), triton.cdiv(K, META["COL_TILE_SIZE"]))](
            x_ptr=x, output_col_major_ptr=torch.empty(K, M, dtype=torch.float8_e4m3fn, device="meta"),
            col_scale_ptr=torch.empty(K, M // 32, 1, dtype=torch.uint8, device="meta"), n_rows=M, n_cols=K,
            INNER_BLOCK_SIZE=32, SCALING_MODE="floor")
    out += _label(launches, "torchao", mx_shape_key("column-wise 32x1", M, K))
    return out


_TORCHAO: dict = {}


def _torchao_kernels():
    """torchao's `prototype/mx_formats/kernels.py` with its Triton kernels defined. It defines them under
    `has_triton() and torch.cuda.is_available() and is_sm_at_least_100() and is_cuda_version_at_least(12, 8)`
    (torchao 0.18 enables its Triton MX quantize on sm_100 and MI350 only), so on a CPU-only build the real
    import has none; a private copy of the file is loaded by path (as `inferbook_peer_torchao_mx_kernels`)
    with those four questions answered yes. Where the real module has them (a B200), it is used."""
    from torchao.prototype.mx_formats import kernels as KX

    if hasattr(KX, "to_mxfp8_dim0_kernel"):
        return KX
    if "mod" not in _TORCHAO:
        import importlib.util

        import torch.utils._triton as TT

        name = "inferbook_peer_torchao_mx_kernels"
        spec = importlib.util.spec_from_file_location(name, KX.__file__)
        mod = importlib.util.module_from_spec(spec)
        import torchao.utils as TU

        yes = lambda *a, **k: True     # noqa: E731
        patch = [(TT, "has_triton"), (torch.cuda, "is_available"), (TU, "is_sm_at_least_100"),
                 (TU, "is_cuda_version_at_least")]
        real = [getattr(o, n) for o, n in patch]
        for o, n in patch:
            setattr(o, n, yes)
        try:
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        finally:
            for (o, n), v in zip(patch, real):
                setattr(o, n, v)
        _TORCHAO["mod"] = mod
    return _TORCHAO["mod"]


def te_mxfp8_recipes(params=None) -> list:
    from . import gpu_params

    P = gpu_params("te-mxfp8-recipes")
    if not usable("torchao"):
        return []
    return torchao_mx_quantize(int(P["quant_m"]), int(P["quant_k"]), configs=None)


# ---------------------------------------------------------------------------------------------------
# gemlite: W4A16 GEMV / GEMM (chord-w4a16)

_GEMLITE: dict = {}


def _gemlite_modules() -> dict:
    """gemlite's kernel modules loaded by file path under a stand-in `gemlite` package whose `__init__`
    never runs: the real one imports `triton_kernels/utils.py`, which at import calls
    `torch.cuda.get_device_capability()` (asserting a CUDA build of PyTorch), reads the SM count from
    `torch.cuda.get_device_properties` and asks Triton's active driver whether it is HIP. While the two
    modules we need load (`gemv_revsplitK_kernels`, `gemm_splitK_kernels`, and the `dtypes`, `config`,
    `utils` they import; not `triton_kernels/__init__`, which imports every kernel) those are answered as
    on an H100 (capability 9.0, 132 SMs as H200, CUDA): capability 9 turns on bf16 atomic adds for the
    split-K output, as on the H200 the page predicts. `gemlite.core` is a stand-in with the empty
    `GEMLITE_TRITON_CONFIG_CACHE` its config pruners read (no cached best config: the autotuner's list is
    swept, see the module docstring) and `GEMLITE_USE_TMA = False`, its default; the pruners' shared-memory
    question is answered 227 KB (H100/H200). On a CUDA machine `gemlite_layer` uses the real package."""
    if _GEMLITE:
        return _GEMLITE
    import importlib.machinery
    import importlib.util
    import types

    spec = importlib.util.find_spec("gemlite") if "gemlite" not in sys.modules else None
    if spec is None and "gemlite" not in sys.modules:
        raise ModuleNotFoundError("No module named 'gemlite'")
    root = Path(spec.origin).parent if spec is not None else Path(sys.modules["gemlite"].__path__[0])
    pkg = types.ModuleType("gemlite")
    pkg.__path__ = [str(root)]
    sub = types.ModuleType("gemlite.triton_kernels")      # its __init__ imports every kernel module
    sub.__path__ = [str(root / "triton_kernels")]
    core = types.ModuleType("gemlite.core")
    core.GEMLITE_TRITON_CONFIG_CACHE = {}
    core.GEMLITE_USE_TMA = False                          # no TMA for W4A16 with int32 packing at these shapes
    sys.modules.update({"gemlite": pkg, "gemlite.triton_kernels": sub, "gemlite.core": core})
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from . import _AOTDriver

    real = (torch.cuda.get_device_capability, torch.cuda.get_device_properties, driver._active)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(   # H100 SXM, as H200: 132 SMs
        name="NVIDIA H100 80GB HBM3", multi_processor_count=132, major=9, minor=0)
    driver.set_active(_AOTDriver(GPUTarget("cuda", 90, 32)))      # utils.py asks `is_hip()` at import
    try:
        mods = {}
        for name in ("dtypes", "triton_kernels.config", "triton_kernels.utils", "triton_kernels.gemv_revsplitK_kernels",
                     "triton_kernels.gemm_splitK_kernels"):
            mods[name] = importlib.import_module(f"gemlite.{name}")
    except BaseException:
        for n in ("gemlite", "gemlite.triton_kernels", "gemlite.core"):
            sys.modules.pop(n, None)
        raise
    finally:
        torch.cuda.get_device_capability, torch.cuda.get_device_properties, driver._active = real
    for mod in mods.values():        # its config pruners ask the driver for the shared memory: H100's 227 KB
        if hasattr(mod, "get_gpu_shared_memory"):
            mod.get_gpu_shared_memory = lambda: 227 * 1024
    _GEMLITE.update(mods)
    return _GEMLITE


def gemlite_kind(M: int) -> str:
    """gemlite's `get_matmul_type` for 4-bit weights, bf16 activations (core.py, 0.6)."""
    return "GEMM" if M >= 64 else "GEMM_SPLITK" if M > 4 else "GEMV_REVSPLITK"


def chord_shapes(params: dict) -> list[tuple[int, int, int]]:
    """(M, N, K) of chord-w4a16's dense decode GEMM at its gpu preset: M 1, 2 and 16 of its M sweep (the
    decode sizes its decode kernels are built and checked for; M 4 and 8 would add two sweeps of gemlite's
    configs to every regeneration for no new regime: 2 is gemlite's last GEMV size, 16 its SPLITK one)."""
    ms = [int(m) for m in str(params["m_sweep"]).split(",") if int(m) in (1, 2, 16)]
    return [(m, int(params["gemm_n"]), int(params["gemm_k"])) for m in ms]


def gemlite_w4a16(M: int, N: int, K: int, group: int = 32, configs="all") -> list:
    """gemlite's W4A16 (INT4 weights packed 8 per int32 along K, bf16 scales per group of `group`,
    symmetric: the integer shift 8 as zero, W_group_mode 3) at x [M, K] bf16 -> [M, N] bf16, through its
    own `<kind>_forward` (grid, strides, dtypes as it computes them)."""
    G = _gemlite_modules()
    D = G["dtypes"].DType
    kind = gemlite_kind(M)
    mod = G["triton_kernels.gemv_revsplitK_kernels"] if kind == "GEMV_REVSPLITK" else G["triton_kernels.gemm_splitK_kernels"]
    if kind == "GEMM":      # pragma: no cover - chord's decode shapes stop at M 16
        raise ValueError("gemlite's GEMM kernel (M >= 64) is not wired")
    fwd = mod.gemv_revsplitK_forward if kind == "GEMV_REVSPLITK" else mod.gemm_splitK_forward
    m = lambda *s, dt: torch.empty(*s, dtype=dt, device="meta")   # noqa: E731
    x = m(M, K, dt=torch.bfloat16)
    W_q = m(K // 8, N, dt=torch.int32)
    scales = m(K // group, N, dt=torch.bfloat16)
    zeros = torch.tensor(8, dtype=torch.int32)          # a scalar shift (gemlite packs an int zero as a 0-d tensor)
    in_t = D.FP16.value                                 # forward_functional's type_id folds BF16 into FP16
    type_id = in_t * 100 + 4
    with traced(f"gemlite/triton_kernels/{mod.__name__.rsplit('.', 1)[-1]}.py", configs) as launches:
        fwd(x, W_q, scales, zeros, None, 4, group, 15, 8, D.BF16.value, D.BF16.value, D.FP32.value, D.BF16.value,
            0, 3, True, type_id)
    return _label(launches, "gemlite", f"M{M} N{N} K{K} g{group}")


def chord_w4a16(params=None) -> list:
    """gemlite at the dense decode shapes, then vLLM at the MoE decode shapes (each where it is usable)."""
    return chord_w4a16_gemlite(params) + chord_w4a16_vllm(params)


def chord_w4a16_gemlite(params=None) -> list:
    from . import gpu_params

    P = gpu_params("chord-w4a16")
    try:
        _gemlite_modules()
    except Exception:
        return []
    from ..moe import w4a16

    return [la for M, N, K in chord_shapes(P)
            for la in gemlite_w4a16(M, N, K, w4a16.GROUP_SIZE, configs=_configs(f"M{M} N{N} K{K} g{w4a16.GROUP_SIZE}"))]


def chord_w4a16_vllm(params=None) -> list:
    from . import gpu_params

    if not usable("vllm"):
        return []
    from ..moe import w4a16

    return [la for shape in moe_shapes(gpu_params("chord-w4a16")) for la in vllm_moe_w4a16(*shape, w4a16.GROUP_SIZE)]


# ---------------------------------------------------------------------------------------------------
# vLLM: the Triton fused-MoE INT4 W4A16 kernel (chord-w4a16's MoE decode)

VLLM_VERSION = "0.33.0"       # the release these launches were read from (the table records the one found)
VLLM_FUSED_MOE = ("model_executor", "layers", "fused_moe", "fused_moe.py")
# What is taken from vLLM's fused_moe.py (by name; every @triton.jit helper they call comes along): the
# kernel, and the plain-Python functions that choose its config and build its launch.
VLLM_TAKE = ("fused_moe_kernel_gptq_awq", "get_default_config", "should_moe_wna16_use_cuda",
             "get_moe_wna16_block_config", "_ensure_block_size_k_divisible", "invoke_fused_moe_wna16_triton_kernel",
             "get_config_file_name")
VLLM_HOWTO = (f"pip install --no-deps --target DIR vllm=={VLLM_VERSION} and put DIR on PYTHONPATH (the package is "
              "only read, never imported)")
_VLLM: dict = {}


def vllm_fused_moe_file() -> Path:
    """The installed vllm package's fused_moe.py, found without importing anything of vLLM's
    (`find_spec` on a top-level package does not run its `__init__`). ModuleNotFoundError, one line, if absent."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        raise ModuleNotFoundError(f"No module named 'vllm' ({VLLM_HOWTO})")
    path = Path(spec.origin).parent.joinpath(*VLLM_FUSED_MOE)
    if not path.is_file():
        raise ModuleNotFoundError(f"the vllm package at {Path(spec.origin).parent} has no {'/'.join(VLLM_FUSED_MOE)}")
    return path


def _is_jit(node) -> bool:
    """A def decorated `@triton.jit` / `@jit` (with or without a call)."""
    import ast

    for d in getattr(node, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        if (isinstance(d, ast.Attribute) and d.attr == "jit") or (isinstance(d, ast.Name) and d.id == "jit"):
            return True
    return False


def defs_from_source(path: Path, names, namespace: dict, text: str | None = None) -> dict:
    """Execute, in `namespace`, only the top-level function definitions `names` of the Python file at
    `path` (with their decorators), plus every `@triton.jit` function and every module-level
    `NAME: tl.constexpr = ...` / `NAME = tl.constexpr(...)` they reference (transitively); nothing else
    of the file runs (its imports, its other statements). Compiled under the file's own name and line
    numbers, so `inspect.getsource` (which Triton's `jit` reads) finds each kernel's text in the file.
    KeyError naming what is missing if a wanted definition is not there."""
    import ast

    src = text if text is not None else Path(path).read_text()
    tree = ast.parse(src, filename=str(path))
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    consts = {}
    for n in tree.body:
        if isinstance(n, ast.AnnAssign):
            target = n.target
        else:
            target = n.targets[0] if isinstance(n, ast.Assign) and len(n.targets) == 1 else None
        if not isinstance(target, ast.Name) or n.value is None:
            continue
        seg = ast.unparse(n.annotation if isinstance(n, ast.AnnAssign) else n.value)
        if "constexpr" in seg:
            consts[target.id] = n
    missing = [k for k in names if k not in defs]
    if missing:
        raise KeyError(f"{path}: no top-level definition of {', '.join(missing)}")
    take, todo = [], list(names)
    while todo:
        name = todo.pop()
        if name in take:
            continue
        take.append(name)
        node = defs.get(name) or consts[name]
        for ref in {x.id for x in ast.walk(node) if isinstance(x, ast.Name)}:
            if ref not in take and ((ref in defs and _is_jit(defs[ref])) or ref in consts):
                todo.append(ref)
    body = sorted((defs.get(n) or consts[n] for n in take), key=lambda node: node.lineno)     # file order
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec")
    exec(code, namespace)      # noqa: S102 - the peer's own definitions, read from its installed file
    return {n: namespace[n] for n in take}


class _Platform:
    """Stand-in for `vllm.platforms.current_platform`: the two questions the taken functions ask."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def is_cuda(self) -> bool:
        return self.cuda

    def is_rocm(self) -> bool:
        return False


def _vllm_namespace(cuda: bool) -> dict:
    import types

    import triton
    import triton.language as tl
    from typing import Any

    return {"__name__": "inferbook_peer_vllm_fused_moe", "triton": triton, "tl": tl, "torch": torch, "Any": Any,
            "envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None),
            "current_platform": _Platform(cuda),
            # vllm.utils.math_utils.next_power_of_2 / platform_utils.get_device_name_as_file_name, as they answer
            "next_power_of_2": lambda n: 1 if n < 1 else 1 << (int(n) - 1).bit_length(),
            "get_device_name_as_file_name": lambda: "NVIDIA_H200"}


def _vllm() -> dict:
    """{'triton': vLLM's functions with `current_platform.is_cuda()` False (its Triton path), 'cuda': the
    same functions asked as on an NVIDIA GPU (which path vLLM takes there), 'file', 'version'}."""
    if not _VLLM:
        import importlib.metadata as md

        path = vllm_fused_moe_file()
        text = path.read_text()
        _VLLM.update({"triton": defs_from_source(path, VLLM_TAKE, _vllm_namespace(False), text),
                      "cuda": defs_from_source(path, ("should_moe_wna16_use_cuda",), _vllm_namespace(True), text),
                      "file": str(path)})
        try:
            _VLLM["version"] = md.version("vllm")
        except md.PackageNotFoundError:
            _VLLM["version"] = "?"
    return _VLLM


def moe_shapes(params: dict) -> list[tuple[int, int, int, int, int, int]]:
    """(m, T, k, E, H, I) of chord-w4a16's MoE decode at its gpu preset, as `gpu_launches` builds them:
    m tokens per expert (1, 2 and 16 of `decode_m`: the rows its decode kernel is built for), T = ceil(E*m/k)
    tokens routed top-k over the E local experts (Kimi-K2 EP8: 48), hidden H, expert FFN size I."""
    E, H, I = int(params["decode_experts"]), int(params["decode_hidden"]), int(params["decode_inter"])
    k = min(int(params["top_k"]), E)
    ms = [int(m) for m in str(params["decode_m"]).split(",") if int(m) in (1, 2, 16)]
    return [(m, -(-E * m // k), k, E, H, I) for m in ms]


def moe_shape_key(m, T, k, E, H, I, group: int = 32) -> str:
    return f"M{m} T{T} k{k} E{E} H{H} I{I} g{group}"


def vllm_align_shapes(numel: int, block_m: int, experts: int) -> tuple[int, int]:
    """(len(sorted_token_ids), len(expert_ids)) as vLLM's `moe_align_block_size` allocates them (its Python
    wrapper's sizes; the sort itself is `vllm._custom_ops`, a CUDA op, not run): every route plus
    block_m - 1 padding per expert, at most numel * block_m where fewer routes than experts; one expert
    id per block_m rows. num_tokens_post_padded is int32 [1]."""
    padded = numel + experts * (block_m - 1)
    if numel < experts:
        padded = min(numel * block_m, padded)
    return padded, -(-padded // block_m)


def vllm_config(T: int, k: int, E: int, H: int, I: int, group: int = 32) -> tuple[dict, str, bool]:
    """(config, where it came from, whether vLLM on an NVIDIA GPU would take its CUDA `moe_wna16_gemm`
    instead of this Triton kernel) for int4_w4a16 with `group` scales at T tokens, as vLLM's
    `try_get_optimal_moe_config` decides: a tuned JSON shipped in fused_moe/configs for
    E, N = I (w2's packed K x 2), device NVIDIA_H200, dtype int4_w4a16 if there is one (closest M), else
    its `get_default_config` on the Triton path."""
    V = _vllm()
    fns = V["triton"]
    name = fns["get_config_file_name"](E, I, "int4_w4a16", [0, group])
    tuned = Path(V["file"]).parent / "configs" / name
    if tuned.is_file():
        table = {int(a): b for a, b in json.loads(tuned.read_text()).items() if a != "triton_version"}
        config, origin = dict(table[min(table, key=lambda x: abs(x - T))]), f"tuned {name}"
    else:
        config, origin = fns["get_default_config"](T, E, I, H, k, "int4_w4a16", [0, group]), \
            f"get_default_config (no {name} in vLLM {V['version']})"
    on_cuda = bool(V["cuda"]["should_moe_wna16_use_cuda"](T * k, group, E, 4))
    return config, origin, on_cuda


def vllm_moe_w4a16(m: int, T: int, k: int, E: int, H: int, I: int, group: int = 32, *,
                   stages_of: tuple[str, ...] = ("gate_up", "down"), key: str | None = None) -> list:
    """vLLM's two `fused_moe_kernel_gptq_awq` launches of `fused_experts_impl` (gate/up, then down with the
    router weights) for INT4 weights, bf16 group scales, no zero points (symmetric, the shift 8 as
    zero, as ours), bf16 activations x [T, H] routed top-k over E experts, through vLLM's own
    `invoke_fused_moe_wna16_triton_kernel` (its grid, strides, BLOCK_SIZE_N / K). The buffers are
    vLLM's: w13 [E, 2I, H/2] and w2 [E, H, I/2] uint8 (two nibbles per byte along K), scales
    [E, N, K/group], intermediate_cache1 [T, k, 2I], cache2 [T*k, I], cache3 [T, k, H] (both views of one
    buffer of T*k*max(2I, H)), the routing tables at `vllm_align_shapes`. Not traced: the
    `moe_align_block_size` sort, `silu_and_mul` between the two GEMMs and `moe_sum` after them (CUDA ops
    of vllm._custom_ops, not Triton). `stages_of`: which of the two GEMMs (kimi's tail: the down one only);
    `key`: the shape label (default `moe_shape_key`)."""
    import triton.language as tl

    V = _vllm()
    config, origin, on_cuda = vllm_config(T, k, E, H, I, group)
    bf, u8, i32, f32 = torch.bfloat16, torch.uint8, torch.int32, torch.float32
    mt = lambda *s, dt: torch.empty(*s, dtype=dt, device="meta")   # noqa: E731
    n_sorted, n_blocks = vllm_align_shapes(T * k, config["BLOCK_SIZE_M"], E)
    sorted_ids, expert_ids, post = mt(n_sorted, dt=i32), mt(n_blocks, dt=i32), mt(1, dt=i32)
    topk_w = mt(T, k, dt=f32)
    cache13 = mt(T * k * max(2 * I, H), dt=bf)
    x = mt(T, H, dt=bf)
    stages = (("gate_up", x, mt(E, 2 * I, H // 2, dt=u8), mt(E, 2 * I, H // group, dt=bf),
               cache13[:T * k * 2 * I].view(T, k, 2 * I), False, k),
              ("down", mt(T * k, I, dt=bf), mt(E, H, I // 2, dt=u8), mt(E, H, I // group, dt=bf),
               cache13[:T * k * H].view(T, k, H), True, 1))
    out = []
    for stage, A, B, S, C, mul_w, top_k in stages:
        if stage not in stages_of:
            continue
        with traced(f"vllm/{'/'.join(VLLM_FUSED_MOE)}:invoke_fused_moe_wna16_triton_kernel", None) as launches:
            V["triton"]["invoke_fused_moe_wna16_triton_kernel"](
                A, B, C, S, None, topk_w, sorted_ids, expert_ids, post, mul_w, top_k, dict(config),
                compute_type=tl.bfloat16, use_int8_w8a16=False, use_int4_w4a16=True, block_shape=[0, group])
        for la in launches:
            kw = la.kwargs
            la.name = (f"{la.name} {stage} cfg {kw['BLOCK_SIZE_M']}x{kw['BLOCK_SIZE_N']}x{kw['BLOCK_SIZE_K']} "
                       f"G{kw['GROUP_SIZE_M']} w{kw.get('num_warps', 4)} s{kw.get('num_stages', 3)}"
                       + (" (on CUDA vLLM runs moe_wna16_gemm here)" if on_cuda else ""))
        out += launches
    return _label(out, "vllm", key or moe_shape_key(m, T, k, E, H, I, group))


def tail_shapes(params: dict) -> list[tuple[int, int, int, int, int]]:
    """(T, k, E, H, I) of kimi-topk-tail-fusion's MoE tail at its gpu preset: each token count T, top-k over
    E experts, the down projection [E, H, I]."""
    E, k, H, I = int(params["experts"]), int(params["top_k"]), int(params["hidden"]), int(params["inter"])
    return [(int(T), k, E, H, I) for T in str(params["tokens"]).split(",")]


def tail_shape_key(T: int, k: int, E: int, H: int, I: int, group: int = 32) -> str:
    return f"T{T} k{k} E{E} H{H} I{I} g{group}"


def kimi_topk_tail_fusion(params=None) -> list:
    """vLLM's W4A16 down GEMM (`fused_moe_kernel_gptq_awq` with the router weight, MUL_ROUTED_WEIGHT) at
    kimi-topk-tail-fusion's tail shapes: the kernel vLLM's Triton path runs for the tail our W4A16 variants
    build (its `moe_sum` after it, a CUDA op, is outside the model, as our zero fill and cast are)."""
    from . import gpu_params

    if not usable("vllm"):
        return []
    from ..moe import fused_moe as FM, w4a16

    g = w4a16.GROUP_SIZE
    out = []
    for T, k, E, H, I in tail_shapes(params or gpu_params("kimi-topk-tail-fusion")):
        for la in vllm_moe_w4a16(-(-T * k // E), T, k, E, H, I, g, stages_of=("down",), key=tail_shape_key(T, k, E, H, I, g)):
            # the bytes as ours are stated (`fused_moe.tail_dram_bytes`): the weights of the experts its row blocks
            # can reach (at 896 experts a T-token step touches a few), not the whole [E, H, I/2] table its
            # arguments span; its output the [T*k, H] BF16 rows moe_sum then reads
            la.dram_bytes = FM.tail_dram_bytes(T, k, E, H, I, w4a16.weight_bytes(H, I, "w4a16"), la.kwargs["BLOCK_SIZE_M"],
                                               torch.empty(T * k, H, dtype=torch.bfloat16, device="meta"), atomic=False)
            out.append(la)
    return out


# A peer's kernel that does not compile for a target, and why (the table keeps the failed row: a fact
# about the peer, shown as such; the freshness test requires exactly these).
PEER_KNOWN_FAILURES = {
    ("te-mxfp8-recipes", "sm_80", "to_mxfp8_dim0_kernel"):
        "Triton: type fp8e4nv not supported in this architecture (E4M3 stores need sm_89+; torchao gates these "
        "kernels to sm_100 itself)",
    ("te-mxfp8-recipes", "sm_80", "to_mxfp8_dim1_kernel"):
        "Triton: type fp8e4nv not supported in this architecture (E4M3 stores need sm_89+; torchao gates these "
        "kernels to sm_100 itself)",
}

PEERS = {"sglang-fused-comm": "py:inferbook.compiled.peers:sglang_fused_comm",
         "gdn-backward-check": "py:inferbook.compiled.peers:gdn_backward_check",
         "te-mxfp8-recipes": "py:inferbook.compiled.peers:te_mxfp8_recipes",
         "chord-w4a16": "py:inferbook.compiled.peers:chord_w4a16",
         "kimi-topk-tail-fusion": "py:inferbook.compiled.peers:kimi_topk_tail_fusion"}
PEER_OF = {"sglang-fused-comm": "liger-kernel", "gdn-backward-check": "fla-core", "te-mxfp8-recipes": "torchao",
           "chord-w4a16": "gemlite", "kimi-topk-tail-fusion": "vllm"}
# a chapter whose table holds several peers (rows named '<peer>: ...'): {slug: {peer: the launch spec that
# builds that peer's launches only}} (`save(slug, only=peer)` recompiles one and keeps the others' rows)
PEER_SPECS = {"chord-w4a16": {"gemlite": "py:inferbook.compiled.peers:chord_w4a16_gemlite",
                              "vllm": "py:inferbook.compiled.peers:chord_w4a16_vllm"}}


def peers_of(slug: str) -> list[str]:
    """Every peer of chapter `slug`'s table, its first (`PEER_OF`) first."""
    return list(dict.fromkeys([PEER_OF[slug], *PEER_SPECS.get(slug, {})]))


def peer_spec(slug: str, peer: str) -> str:
    """The launch spec that builds only `peer`'s launches for `slug`."""
    return PEER_SPECS.get(slug, {}).get(peer) or PEERS[slug]


# ---------------------------------------------------------------------------------------------------
# Ours beside the peer

def _shape_of(name: str) -> str | None:
    return name.split(" @ ", 1)[1] if " @ " in name else None


def _step_of(name: str) -> str:
    """'fla-core: chunk_fwd_kernel_o cfg 2/3 @ ...' -> 'chunk_fwd_kernel_o'."""
    head = name.split(" @ ", 1)[0]
    head = head.split(": ", 1)[-1]
    return head.split(" cfg ", 1)[0]


def _ours_from_chapter(slug: str, target: str, card: str, root: Path | None = None) -> dict[str, list[dict]]:
    """{shape key: [our predictions]} from the chapter's committed table, for the chapters whose peer
    table holds no 'ours' rows."""
    from . import predict_launches

    preds = predict_launches(slug, target, card, root)
    out: dict[str, list[dict]] = {}
    if slug == "sglang-fused-comm":
        for p in preds:
            m = re.search(r"T\d+ H\d+", p["launch"])
            if p["kernel"] == "_rmsnorm_kernel" and m:
                out.setdefault(m.group(0), []).append(p)
    elif slug == "te-mxfp8-recipes":
        P = _params(slug)
        for axis, name in MX_OURS.items():
            out[mx_shape_key(axis, int(P["quant_m"]), int(P["quant_k"]))] = [p for p in preds if p["launch"] == name]
    elif slug == "chord-w4a16":
        from ..moe import w4a16

        # the dense decode: our decode kernel alone; the split-order sum and bf16 cast that follow it at
        # deterministic=True (torch ops) are not on our side, as the zero fill of gemlite's atomic output
        # (torch.zeros at GEMV, its autotuner's pre_hook at GEMM_SPLITK) is not on its side
        for M, N, K in chord_shapes(_params(slug)):
            pat = re.compile(rf"\bM{M} N{N} K{K}\b")
            out[f"M{M} N{N} K{K} g{w4a16.GROUP_SIZE}"] = [
                p for p in preds if pat.search(p["launch"]) and not re.search(r"gate_up|down|\bT\d+", p["launch"])]
        for shape in moe_shapes(_params(slug)):
            out[moe_shape_key(*shape, w4a16.GROUP_SIZE)] = _our_moe_paths(preds, *shape)
    elif slug == "kimi-topk-tail-fusion":
        from ..moe import w4a16

        # the W4A16 fused tails at each T (the tl.dot and the decode kernel; the fastest is compared): one
        # down GEMM with the router weight and the scatter-add, against vLLM's down GEMM with the router weight
        for T, k, E, H, I in tail_shapes(_params(slug)):
            pat = re.compile(rf"^(fused|decode) down_tail \S+ w4a16 fused T{T} k{k} H{H} I{I}\b")
            out[tail_shape_key(T, k, E, H, I, w4a16.GROUP_SIZE)] = [p for p in preds if pat.match(p["launch"])]
    return out


def _our_moe_paths(preds: list[dict], m: int, T: int, k: int, E: int, H: int, I: int) -> list[dict]:
    """Our MoE decode at one shape, one candidate per layout the chapter table holds at it: its gate/up
    and down GEMMs summed ('seconds'), the longer one's bound, named '<layout> gate_up + down'. Our gate/up
    applies SiLU(gate) * up in its epilogue; the combine after the down GEMM is left out, as vLLM's
    `moe_sum` (and its `silu_and_mul`, `moe_align_block_size`: CUDA ops) are on its side."""
    pat = re.compile(rf"^decode M{m} (gate_up|down) (\S+) T{T} k{k} E{E} H{H} I{I}\b")
    by_layout: dict[str, dict[str, dict]] = {}
    for p in preds:
        hit = pat.match(p["launch"])
        if hit:
            by_layout.setdefault(hit.group(2), {}).setdefault(hit.group(1), p)
    out = []
    for layout, steps in by_layout.items():
        if set(steps) == {"gate_up", "down"}:
            longer = max(steps.values(), key=lambda p: p["seconds"])
            out.append({**longer, "seconds": sum(p["seconds"] for p in steps.values()),
                        "launch": f"{layout} gate_up + down (M{m})"})
    return out


def _params(slug: str) -> dict:
    from . import gpu_params

    return gpu_params(slug)


def _fastest(preds: list[dict]) -> dict:
    """The config predicted fastest, among those that do not spill where any does not (the cost model
    does not charge local-memory traffic, so a spilling config would look faster than it runs)."""
    clean = [p for p in preds if not p.get("spill_bytes")]
    return min(clean or preds, key=lambda p: p["seconds"])


def compare(slug: str, peer_rows: list[dict], target: str = "sm_90", card: str = "H200",
            root: Path | None = None) -> list[dict]:
    """Ours beside the peer, same shape, same cost model, per shape of the peer table: [{'peer', 'shape',
    'ours_s', 'ours_bound', 'ours_launch', 'peer_s', 'peer_bound', 'peer_launches', 'ours_over_peer'}].

    A peer's time at a shape is the sum over its kernels, each at the config predicted fastest (the sm_90
    sweep; other targets hold the chosen config only); a bound is that of the side's longest launch. Our
    time: the sum of the 'ours' rows where the peer table has them (GDN: three kernels), else our chapter
    table's launches at that shape — one launch does the work, and where several of ours do the same work
    (chord's generic and decode kernels at one M) the fastest predicted is taken and named."""
    from . import predict_rows

    rows = [r for r in peer_rows if r["target"] == target]
    preds = predict_rows(rows, card)
    by_row = {}
    ok_rows = [r for r in rows if r.get("ok") and ("sass" in r or "isa_loop" in r)]
    # a config over the per-block shared-memory limit is one the peer's autotuner drops at launch (out of
    # resources): never the chosen one
    fits = {id(r) for r in ok_rows if r.get("smem_ok", True)}
    for r, p in zip(ok_rows, preds):
        by_row[id(r)] = p
    groups: dict[tuple[str, str, str], dict[str, list]] = {}     # (side, peer, shape) -> step -> [predictions]
    for r in rows:
        p = by_row.get(id(r))
        if p is None or id(r) not in fits:
            continue
        shape = _shape_of(r["launch"])
        if shape is None:
            m = re.search(r"T\d+ H\d+", r["launch"])
            if not m:
                continue
            shape = m.group(0)
        side = r.get("side", "peer")
        groups.setdefault((side, r.get("peer", "the peer"), shape), {}).setdefault(_step_of(r["launch"]), []).append(
            {**p, "spill_bytes": r.get("spill_bytes") or 0})
    ours_rows = {shape: steps for (side, _, shape), steps in groups.items() if side == "ours"}
    chapter = None
    out = []
    for (side, peer, shape), steps in groups.items():
        if side != "peer":
            continue
        best = [_fastest(ps) for ps in steps.values()]
        peer_s = sum(p["seconds"] for p in best)
        peer_long = max(best, key=lambda p: p["seconds"])
        if shape in ours_rows:
            ours = [_fastest(ps) for ps in ours_rows[shape].values()]
            ours_s = sum(p["seconds"] for p in ours)
            ours_long = max(ours, key=lambda p: p["seconds"])
            ours_launch = f"{len(ours)} kernels"
            ours_spill = sum(p["spill_bytes"] for p in ours)
        else:
            if chapter is None:
                try:
                    chapter = _ours_from_chapter(slug, target, card, root)
                except Exception:
                    chapter = {}
            cands = chapter.get(shape) or []
            if not cands:
                continue
            ours_long = min(cands, key=lambda p: p["seconds"])
            ours_s, ours_launch = ours_long["seconds"], ours_long["launch"]
            ours_spill = ours_long.get("spill_bytes")
        out.append({"peer": peer, "shape": shape, "ours_s": ours_s, "ours_bound": ours_long["bound"],
                    "ours_launch": ours_launch, "ours_spill_bytes": ours_spill,
                    "peer_spill_bytes": sum(p["spill_bytes"] for p in best), "peer_s": peer_s, "peer_bound": peer_long["bound"],
                    "peer_launches": [p["launch"] for p in best], "ours_over_peer": ours_s / peer_s})
    return out


def sentence(slug: str, rows: list[dict], target: str = "sm_90", card: str = "H200", root: Path | None = None,
             peer: str | None = None) -> str:
    """'Beside fla-core (same shape, same model, H200, predicted): ours / fla-core = <shape> 1.23× (ours
    latency-bound, fla-core issue-bound).' — or '' where nothing pairs. `peer`: that peer's part only."""
    pairs = [q for q in compare(slug, rows, target, card, root) if peer is None or q["peer"] == peer]
    if not pairs:
        return ""
    parts = []
    for peer in dict.fromkeys(q["peer"] for q in pairs):
        qs = [q for q in pairs if q["peer"] == peer]
        parts.append(f"Beside {peer} (same shape, same model, {card}, predicted): ours / {peer} = "
                     + "; ".join(f"{q['shape']} {q['ours_over_peer']:.2f}× (ours {q['ours_bound']}-bound, "
                                 f"{peer} {q['peer_bound']}-bound)" for q in qs) + ".")
    fails = {}
    for r in rows if peer is None else []:
        why = PEER_KNOWN_FAILURES.get((slug, r["target"], r.get("kernel")))
        if why and not r.get("ok"):
            fails.setdefault((r["target"], why), []).append(r["kernel"])
    for (t, why), kernels in fails.items():
        parts.append(f"{PEER_OF.get(slug, 'The peer')}'s {' and '.join(dict.fromkeys(kernels))} do not compile for {t}: {why}.")
    return " ".join(parts)


def spill_sentence(slug: str, rows: list[dict], root: Path | None = None) -> str:
    """'Spilled to local memory by the configs compared (the cost model charges nothing for it, so a spilling
    side's prediction is a floor): sm_80 <shape> ours 72 B, fla-core 1928 B; ...' for every target of the peer
    table where a compared side spills at a shape (ours: the kernels `compare` sums, or our chapter launch it
    names), or ''."""
    from . import TARGET_CARD

    said = []
    for t in dict.fromkeys(r["target"] for r in rows):
        if t not in TARGET_CARD:
            continue
        for q in compare(slug, rows, t, TARGET_CARD[t], root):
            ours, peer = q.get("ours_spill_bytes"), q["peer_spill_bytes"]
            if peer or ours:
                said.append(f"{t} {q['shape']} ours {'?' if ours is None else ours} B, {q['peer']} {peer} B")
    if not said:
        return ""
    return ("Spilled to local memory by the configs compared (the cost model charges nothing for it, so a spilling "
            "side's prediction is a floor): " + "; ".join(said) + ".")


# ---------------------------------------------------------------------------------------------------
# On a GPU: ours and the peer timed in the same run

def time_beside(fns: dict, device, *, rounds: int = 4, warmup: int = 3, **bench_kw) -> dict:
    """{label: Timing} for every callable in `fns`, timed in the same run and interleaved: each is warmed
    (`warmup` untimed calls, which also runs a peer's autotuner), then `rounds` rounds in which every
    callable is benchmarked once in turn (`measure.benchmark`, `bench_kw` per round), the rounds'
    samples merged into one Timing per label, so a clock or thermal drift falls on both sides alike."""
    from ..measure import Timing, benchmark

    for fn in fns.values():
        for _ in range(max(1, warmup)):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    merged: dict[str, Timing] = {}
    for r in range(max(1, rounds)):
        order = list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]   # alternate who goes first
        for label, fn in order:
            t = benchmark(fn, device, label=label, warmup=1, **bench_kw)
            if label not in merged:
                merged[label] = t
            else:
                merged[label].samples_s.extend(t.samples_s)
                merged[label].budget_limited = merged[label].budget_limited or t.budget_limited
    return merged


def gemlite_layer(q, group: int):
    """(fn(x) -> y, why) with gemlite's `GemLiteLinearTriton` holding the same INT4 weights as our
    `moe.w4a16` pack `q` (symmetric, per group: gemlite's unsigned codes q + 8 with the integer shift 8 as
    zero, our bf16 scales), or (None, why not). Needs a CUDA build of PyTorch (gemlite's import asserts one)."""
    try:
        import gemlite
        from gemlite.core import DType, GemLiteLinearTriton
    except Exception as e:  # noqa: BLE001 - any import failure: not available
        return None, f"gemlite does not import here ({type(e).__name__}: {str(e)[:80]})"
    from ..moe import w4a16 as W

    codes, scales = W.unpack(q)              # int8 [1, N, K] in [-8, 7], bf16 [1, N, K/g]
    codes, scales = codes[0], scales[0]
    N, K = codes.shape
    layer = GemLiteLinearTriton(W_nbits=4, group_size=group, in_features=K, out_features=N,
                                input_dtype=DType.BF16, output_dtype=DType.BF16)
    layer.pack((codes.to(torch.int16) + 8).to(torch.uint8), scales.to(torch.bfloat16).reshape(N, K // group), 8)
    return layer, f"gemlite {getattr(gemlite, '__version__', '?')} GemLiteLinearTriton (W4, group {group}, shift 8)"


# ---------------------------------------------------------------------------------------------------
# Saving: data/compiled/peers/<slug>.json

def peer_path(slug: str, root: Path | None = None) -> Path:
    from . import DATA_DIR, repo_root

    return (root or repo_root()) / DATA_DIR / "peers" / f"{slug}.json"


def _annotate(rows: list[dict], slug: str) -> list[dict]:
    for r in rows:
        head = r["launch"].split(": ", 1)[0] if " @ " in r["launch"] else ""
        r["side"] = "ours" if head == "ours" else "peer"
        r["peer"] = head if head in peers_of(slug) else PEER_OF[slug]
        r["slug"] = slug
    return rows


def choose(rows: list[dict], card: str = SWEEP_CARD) -> dict[str, int]:
    """{'<kernel> @ <shape>': config index} of the config the cost model predicts fastest per (shape,
    kernel) on `card`, from the sweep target's rows ('cfg i/n' in the launch name; no configs: 0); a
    spilling config only where every config spills (`_fastest`)."""
    from . import predict_rows

    ok = [r for r in rows if r.get("ok") and ("sass" in r or "isa_loop" in r) and r.get("side") == "peer"
          and r.get("smem_ok", True)]        # over the shared-memory limit: the autotuner drops it at launch
    cands: dict[tuple[str, str], list[dict]] = {}
    for r, p in zip(ok, predict_rows(ok, card)):
        cands.setdefault((_shape_of(r["launch"]) or "", r["kernel"]), []).append(
            {"seconds": p["seconds"], "spill_bytes": r.get("spill_bytes") or 0, "i": _cfg_index(r["launch"])})
    return {f"{kernel} @ {shape}": _fastest(ps)["i"] for (shape, kernel), ps in cands.items()}


def _cfg_index(launch: str) -> int:
    """The config index in a traced launch's name ('... cfg i/n ...': i - 1; no configs: 0)."""
    m = re.search(r" cfg (\d+)/\d+", launch)
    return int(m.group(1)) - 1 if m else 0


def config_choice(rows: list[dict], chosen: dict[str, int]) -> dict[str, dict]:
    """`CONFIG_ENV`'s value: {'<kernel> @ <shape>': {'i': the index `choose` picked, 'match': that sweep
    row's constexprs (warps and stages among them)}}."""
    match = {}
    for r in rows:
        key = f"{r.get('kernel')} @ {_shape_of(r['launch']) or ''}"
        if r.get("side") == "peer" and r.get("target") == SWEEP_TARGET and chosen.get(key) == _cfg_index(r["launch"]):
            match[key] = r.get("constexprs") or {}
    return {k: {"i": i, "match": match.get(k, {})} for k, i in chosen.items()}


def save(slug: str, targets=("sm_80", "sm_90", "sm_100"), jobs: int = 1, root: Path | None = None,
         reuse_sweep: bool = False, only: str | None = None) -> Path:
    """Compile `slug`'s peer launches (and ours where the peer table holds them): the sm_90 config sweep,
    then the chosen configs on the other targets; write data/compiled/peers/<slug>.json. `reuse_sweep`:
    take the sweep target's rows from the committed table and recompile the other targets only. `only`:
    compile that one peer's launches (`PEER_SPECS`) and keep the committed table's rows of the others
    (so adding vLLM's rows to chord-w4a16's table does not need gemlite installed); without it, a table
    of several peers keeps the committed rows of those not usable here."""
    import triton

    from . import _dump, inspect
    from ..context import git_state

    if slug not in PEERS:
        from ..errors import UserError, choices

        raise UserError(f"no peer for {slug!r}; choose {choices(PEERS)}")
    spec = PEERS[slug]
    kept: list[dict] = []
    absent: list[str] = []
    if only is not None:
        from ..errors import UserError, choices

        if only not in peers_of(slug):
            raise UserError(f"{slug!r} has no peer {only!r}; choose {choices(peers_of(slug))}")
        if not usable(only):
            raise UserError(f"{only} is not usable here ({available()[only]})")
        spec = peer_spec(slug, only)
        prev = load(slug, root)
        kept = [r for r in (prev["rows"] if prev else []) if not (r.get("side") == "peer" and r.get("peer") == only)]
    elif len(peers_of(slug)) > 1:     # a peer not usable here keeps its committed rows rather than losing them
        absent = [p for p in peers_of(slug) if not usable(p)]
        prev = load(slug, root) if absent else None
        kept = [r for r in (prev["rows"] if prev else []) if r.get("side") == "peer" and r.get("peer") in absent]
    elif not usable(PEER_OF[slug]):   # the table's only peer: saving now would replace its rows by ours alone
        from ..errors import UserError

        raise UserError(f"{PEER_OF[slug]} is not usable here ({available()[PEER_OF[slug]]}); {slug}'s peer table "
                        f"is kept as it is (install the peer to regenerate it)")
    os.environ.pop(CONFIG_ENV, None)
    old = load(slug, root) if reuse_sweep else None
    if old is not None:
        rows = [r for r in old["rows"] if r["target"] == SWEEP_TARGET
                and (only is None or (r.get("side") == "peer" and r.get("peer") == only))
                and not (r.get("side") == "peer" and r.get("peer") in absent)]
    else:
        rows = _annotate(inspect([spec], [SWEEP_TARGET], jobs=jobs), slug)
    chosen = choose(rows)
    rest = [t for t in targets if t != SWEEP_TARGET]
    if rest:
        os.environ[CONFIG_ENV] = json.dumps(config_choice(rows, chosen))
        try:
            rows += _annotate(inspect([spec], rest, jobs=jobs), slug)
        finally:
            os.environ.pop(CONFIG_ENV, None)
    from . import TARGETS

    versions = _versions()
    if kept:      # the other peers' rows first, as committed; this peer's after them
        base = 1 + max((r.get("index", 0) for r in kept), default=-1)
        for r in rows:
            if r.get("index", 0) < base:     # a reused sweep row is already after them
                r["index"] = base + r.get("index", 0)
        prev = load(slug, root) or {}
        chosen = {**{k: v for k, v in prev.get("sweep", {}).get("chosen", {}).items() if k not in chosen}, **chosen}
        if only is not None:          # only this peer was compiled: the installed versions of the others are not theirs
            versions = {d: v for d, v in versions.items() if d == only}
        versions = {**prev.get("peer_versions", {}), **versions}      # the kept rows' peers as they were compiled
        rows = kept + rows
    tix = {t: n for n, t in enumerate(TARGETS)}
    keep = [{k: v for k, v in r.items() if k != "compile_s"} for r in rows]
    keep.sort(key=lambda r: (tix.get(r["target"], 99), r.get("index", 0)))
    doc = {"chapter": slug, "peer": PEER_OF[slug], "triton": triton.__version__, "torch": torch.__version__,
           "git": git_state().get("commit", "unknown"), "peer_versions": versions,
           "targets": sorted({r["target"] for r in keep}, key=list(TARGETS).index),
           "sweep": {"target": SWEEP_TARGET, "card": SWEEP_CARD, "chosen": chosen},
           "note": "ahead-of-time compile on a CPU machine (no GPU, no driver), by inferbook.compiled.peers: the "
                   "peer's own launch code traced on meta tensors; every config its autotuner would try compiled "
                   "for sm_90, the config predicted fastest on H200 compiled for the other targets",
           "rows": keep}
    path = peer_path(slug, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dump(doc))
    return path


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("liger-kernel", "fla-core", "torchao", "gemlite", "vllm"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def load(slug: str, root: Path | None = None) -> dict | None:
    path = peer_path(slug, root)
    return json.loads(path.read_text()) if path.is_file() else None


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m inferbook.compiled.peers",
                                 description="compile a chapter's peers beside ours into data/compiled/peers/")
    ap.add_argument("slug", choices=sorted(PEERS))
    ap.add_argument("--target", action="append", help="sm_80 | sm_90 | sm_100 (default: all three; sm_90 always)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--reuse-sweep", action="store_true", help="keep the committed sm_90 sweep; recompile the rest")
    ap.add_argument("--only", metavar="PEER", help="compile this peer's rows only, keeping the table's other peers' rows")
    ap.add_argument("--available", action="store_true", help="print which peers import here and exit")
    a = ap.parse_args(argv)
    if a.available:
        for k, v in available().items():
            print(f"{k}: {v}")
        return 0
    targets = tuple(a.target or ("sm_80", "sm_90", "sm_100"))
    for t in targets:
        if t not in ("sm_80", "sm_90", "sm_100"):
            print(f"unknown target {t!r}; choose sm_80, sm_90, sm_100", file=sys.stderr)
            return 2
    if not a.save:
        from . import launches_for

        for la in launches_for(PEERS[a.slug]):
            print(la.name, la.grid)
        return 0
    if a.only is not None and a.only not in peers_of(a.slug):
        print(f"{a.slug} has no peer {a.only!r}; choose {', '.join(peers_of(a.slug))}", file=sys.stderr)
        return 2
    from ..errors import UserError

    try:
        path = save(a.slug, targets, a.jobs, reuse_sweep=a.reuse_sweep, only=a.only)
    except UserError as e:          # bad input or an absent peer: one line, exit 2
        print(e, file=sys.stderr)
        return 2
    doc = json.loads(path.read_text())
    print(f"{path}: {len(doc['rows'])} rows; chosen {doc['sweep']['chosen']}")
    print(sentence(a.slug, doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
