"""The ROCm path of the device layer, with a faked ROCm build of PyTorch (`torch.version.hip` set,
HIP device properties as torch.cuda reports them on MI300X). Nothing here runs on a GPU or claims
that a run happened: only what the records and the set-up would say on such a machine."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from inferbook import device as dev

MI300X = SimpleNamespace(name="AMD Instinct MI300X", total_memory=192 * 2**30, multi_processor_count=304,
                         major=9, minor=4, gcnArchName="gfx942:sramecc+:xnack-", L2_cache_size=4 * 2**20)


@pytest.fixture
def rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0.51831", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: MI300X)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: MI300X.name)
    monkeypatch.setattr(dev, "_rocm_driver", lambda: "6.10.5")
    monkeypatch.setattr(dev, "_nvidia_driver", lambda: pytest.fail("nvidia-smi asked on a ROCm build"))


def test_a_rocm_build_reports_hip_and_the_gfx_arch(rocm):
    assert dev.gpu_vendor() == "rocm"
    assert dev.gcn_arch(torch.device("cuda")) == "gfx942"
    info = dev._hardware_info.__wrapped__("cuda")
    assert info["gpu_vendor"] == "amd" and info["gpu_arch"] == "gfx942" and info["hip_runtime"] == "7.0.51831"
    assert info["gpu_sms"] == 304 and info["driver"] == "6.10.5" and "cuda_runtime" not in info
    assert dev.hardware_label(info) == "AMD Instinct MI300X (gfx942)"
    assert dev.hardware_slug(info) == "amd-instinct-mi300x-gfx942"


def test_a_cuda_build_is_not_mistaken_for_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert dev.gpu_vendor() == "cuda" and dev.gcn_arch(torch.device("cuda")) is None
    assert dev.hardware_slug({"device_type": "cuda", "gpu_name": "NVIDIA H200"}) == "nvidia-h200"


def test_the_cost_model_takes_a_committed_mi300x_ceiling(tmp_path):
    from inferbook.compiled import cost
    from inferbook.record import RunRecord, save_records

    assert cost.measured_copy_gbps("MI300X", tmp_path) is None          # datasheet until a record exists
    r = RunRecord(chapter="device-ceilings", name="ceilings",
                  hardware={"device_type": "cuda", "gpu_name": "AMD Instinct MI300X", "gpu_arch": "gfx942"})
    r.add("copy_bandwidth", 4300.0, "GB/s (read+write)")
    save_records(tmp_path / "amd-instinct-mi300x-gfx942" / "device-ceilings.json", [r])
    gbps, path = cost.measured_copy_gbps("MI300X", tmp_path)
    assert gbps == 4300.0 and "gfx942" in path
    assert cost.measured_copy_gbps("MI355X", tmp_path) is None


@pytest.mark.parametrize("tool, index", [("rocm-smi", "download.pytorch.org/whl/rocm"), ("nvidia-smi", None),
                                         (None, None)])
def test_setup_picks_the_rocm_wheel_when_rocm_smi_is_on_path(tmp_path, tool, index):
    """`make setup`'s torch step, dry-run (-n) with only `tool` on PATH: the ROCm index and a line
    saying so when rocm-smi is there; never with nvidia-smi."""
    make = subprocess.run(["which", "make"], capture_output=True, text=True).stdout.strip()
    if not make:
        pytest.skip("make is not installed")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if tool:
        (bindir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bindir / tool).chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"}
    out = subprocess.run([make, "-n", "-B", "-C", str(root), "VENV=" + str(tmp_path / "venv"),
                          str(tmp_path / "venv" / ".torch")], capture_output=True, text=True, env=env).stdout
    if index:
        assert index in out and "rocm-smi found" in out
    else:
        assert "whl/rocm" not in out and "rocm-smi found" not in out


# ---------------------------------------------------------------------------------------------------
# Per-target launch configs (device.pick_config): the runtime path and the compile tables' builds agree

CONFIGS = {"nvidia": "nv", "hip": "amd", "gfx950": "cdna4"}


def test_pick_config_on_a_faked_rocm_device_takes_the_amd_entry(rocm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda")
    assert dev.kernel_target(cuda) == "gfx942" and dev.target_vendor("gfx942") == "hip"
    assert dev.pick_config(CONFIGS, cuda) == "amd"           # vendor key: gfx942 has no entry of its own
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: SimpleNamespace(**{**vars(MI300X), "gcnArchName": "gfx950:sramecc+:xnack-"}))
    assert dev.pick_config(CONFIGS, cuda) == "cdna4"         # the exact target wins
    assert dev.wants_gpu_config(cuda) and not dev.wants_gpu_config("cpu")


def test_pick_config_on_a_faked_cuda_device_and_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(major=9, minor=0))
    assert dev.kernel_target("cuda") == "sm_90" and dev.pick_config(CONFIGS, "cuda") == "nv"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # a builder's stand-in CUDA device on a machine with no GPU: the NVIDIA config, as before
    assert dev.kernel_target("cuda") is None and dev.pick_config(CONFIGS, "cuda") == "nv"
    assert dev.kernel_target("cpu") is None and dev.target_vendor(None) is None


def test_building_for_names_the_target_whatever_the_device():
    assert dev.build_target() is None
    with dev.building_for("gfx942") as build:
        assert not build.asked
        assert dev.pick_config(CONFIGS, "cpu") == "amd" and dev.wants_gpu_config("cpu")
        assert build.asked and dev.build_target() == "gfx942"
        with dev.building_for("sm_80"):
            assert dev.pick_config(CONFIGS, "cuda") == "nv"
        assert dev.kernel_target("cuda") == "gfx942"
    assert dev.build_target() is None and not dev.wants_gpu_config("cpu")


def test_launches_are_built_per_target_only_where_a_config_asks(monkeypatch):
    from inferbook import compiled

    calls = []

    def build(slug, target):
        calls.append(target)
        with dev.building_for(target) as b:
            cfg = dev.pick_config(CONFIGS, "cuda") if slug == "asks" else "same"
        return [cfg], b.asked

    monkeypatch.setattr(compiled, "_build_launches", build)
    targets = ["sm_80", "sm_90", "gfx942", "gfx950"]
    assert compiled.launches_by_target("asks", targets) == {"sm_80": ["nv"], "sm_90": ["nv"], "gfx942": ["amd"],
                                                            "gfx950": ["cdna4"]}
    assert calls == targets
    calls.clear()
    assert compiled.launches_by_target("never", targets) == {t: ["same"] for t in targets} and calls == ["sm_80"]


def test_the_runtime_launch_on_a_faked_mi300x_takes_the_amd_configs(rocm, monkeypatch):
    """What the launchers would run on a ROCm GPU (no building_for: the device's own gfx942) is what
    `inferbook inspect --target gfx942` records; nothing is launched."""
    from inferbook import compiled
    from inferbook.attention import flash
    from inferbook.numerics import gdn_chunk

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda")
    runtime = gdn_chunk.chunked_launches(1, 256, 2, 128, 128)        # builds with torch.device("cuda")
    with dev.building_for("gfx942"):
        table = gdn_chunk.chunked_launches(1, 256, 2, 128, 128)
    assert [compiled.launch_fingerprint(a) for a in runtime] == [compiled.launch_fingerprint(b) for b in table]
    state = next(la for la in runtime if "state" in la.name)
    assert state.kwargs["num_stages"] == 1 and state.kwargs["PRECISION"] == "ieee"
    # the device's own gfx942 takes CDNA's forward tile (4 waves, one stage), as gfx950 does; sm_90 NVIDIA's
    amd_fwd = flash.block_config(cuda, 128, "fwd")
    assert (amd_fwd["num_warps"], amd_fwd["num_stages"]) == (4, 1)
    with dev.building_for("gfx950"):
        assert flash.block_config(cuda, 128, "fwd") == amd_fwd
    with dev.building_for("sm_90"):
        assert (flash.block_config(cuda, 128, "fwd")["num_warps"], flash.block_config(cuda, 128, "fwd")["num_stages"]) == (8, 3)
    with dev.building_for("sm_90"):
        state = next(la for la in gdn_chunk.chunked_launches(1, 256, 2, 128, 128) if "state" in la.name)
        assert state.kwargs["num_stages"] == 3 and state.kwargs["PRECISION"] == "tf32"


def test_the_nvidia_config_beside_an_amd_row_is_said_from_the_table(tmp_path):
    from inferbook import compiled
    from inferbook.compiled.section import amd_config_sentence

    k1, k2 = object(), object()
    nv = [compiled.Launch("a", k1, [], dict(num_stages=3)), compiled.Launch("b", k2, [], dict(num_stages=2))]
    amd = [compiled.Launch("a", k1, [], dict(num_stages=1)), compiled.Launch("b", k2, [], dict(num_stages=2))]
    assert [x and x.name for x in compiled.nvidia_counterparts(amd, nv)] == ["a", None]
    assert [x and x.name for x in compiled.nvidia_counterparts(amd[:1], nv[::-1])] == ["a"]   # by name
    facts = compiled.nvidia_config_facts(amd[0], nv[0], {"ok": True, "shared_kb": 80.0, "smem_limit_kb": 64,
                                                         "smem_ok": False, "scratch_bytes": 44})
    assert facts["differ"] == {"num_stages": [3, 1]} and facts["shared_kb"] == 80.0
    row = dict(slug="x", index=0, launch="a", target="gfx942", ok=True, shared_kb=32.0, smem_limit_kb=64, smem_ok=True,
               scratch_bytes=0, nvidia_config=facts)
    compiled.save_table("x", [row], root=tmp_path)
    text = amd_config_sentence("x", tmp_path)
    assert text == ("on gfx942 (MI300X, 64 KB of LDS) 1 launch runs num_stages 1 where the NVIDIA config has "
                    "num_stages 3: the NVIDIA config needs up to 80.0 KB of LDS (1 over the limit) and spills "
                    "(44 B of scratch), the AMD one up to 32.0 KB, no scratch")
