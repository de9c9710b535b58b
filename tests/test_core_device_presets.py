import pytest
import torch

import inferbook
from inferbook import device as dev
from inferbook.errors import UserError
from inferbook.presets import Param, resolve_params, resolve_preset


def test_auto_is_cpu_without_cuda():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert dev.resolve_device("auto").type == expected


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:0", "", "tpu", 3])
def test_unknown_device_names_value_and_choices(bad):
    with pytest.raises(UserError) as e:
        dev.resolve_device(bad)
    assert repr(bad) in str(e.value) and "'auto'" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(UserError, match="no usable CUDA GPU"):
        dev.resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only on CPU machines")
def test_interpreter_on_for_cpu_and_dot_upcast_decided_in_one_place():
    assert dev.triton_interpreted()
    ok, why = dev.triton_backend_for(torch.device("cpu"))
    assert ok and "interpreter" in why
    assert dev.dot_needs_fp32(torch.device("cpu"))


def test_hardware_info_and_slug():
    info = dev.hardware_info(torch.device("cpu"))
    assert info["cpu_cores"] >= 1 and info["cpu_model"]
    slug = dev.hardware_slug(info)
    assert slug.startswith("cpu-") and slug.endswith(f"-{info['cpu_cores']}c") and " " not in slug
    assert dev.hardware_slug({"device_type": "cuda", "gpu_name": "NVIDIA H200"}) == "nvidia-h200"


@pytest.mark.parametrize("preset,device_type,expected", [("auto", "cpu", "cpu"), ("auto", "cuda", "gpu"),
                                                          ("smoke", "cuda", "smoke"), ("gpu", "cpu", "gpu")])
def test_resolve_preset(preset, device_type, expected):
    assert resolve_preset(preset, device_type) == expected


def test_unknown_preset():
    with pytest.raises(UserError, match="unknown preset 'huge'.*'smoke'"):
        resolve_preset("huge", "cpu")


DECLARED = {"n": Param(int), "lr": Param(float, 0.1), "on": Param(bool, True), "mode": Param(str, "a", choices=("a", "b"))}
PRESETS = {"smoke": {"n": 4}, "cpu": {"n": 64}}


def test_params_merge_preset_defaults_and_overrides():
    assert resolve_params("c", DECLARED, PRESETS, "smoke", {}) == {"n": 4, "lr": 0.1, "on": True, "mode": "a"}
    out = resolve_params("c", DECLARED, PRESETS, "cpu", {"n": None, "lr": "0.5", "on": "false", "mode": "b"})
    assert out == {"n": 64, "lr": 0.5, "on": False, "mode": "b"}


@pytest.mark.parametrize("given,match", [
    ({"m": 1}, "unknown parameter 'm' for chapter 'c'"),
    ({"n": "abc"}, "parameter 'n' must be int, got 'abc'"),
    ({"n": 2.5}, "parameter 'n' must be int, got 2.5"),
    ({"n": True}, "parameter 'n' must be int"),
    ({"on": "maybe"}, "parameter 'on' must be bool"),
    ({"mode": "c"}, "parameter 'mode' must be one of 'a' or 'b', got 'c'"),
])
def test_bad_params(given, match):
    with pytest.raises(UserError, match=match):
        resolve_params("c", DECLARED, PRESETS, "smoke", given)


def test_setup_validates_before_work(results_env):
    with pytest.raises(UserError, match="unknown chapter 'nope'"):
        inferbook.setup("nope")
    with pytest.raises(UserError, match="unknown preset"):
        inferbook.setup("upgrade-record", preset="big")
    with pytest.raises(UserError, match="unknown parameter 'foo'"):
        inferbook.setup("upgrade-record", preset="smoke", foo=1)
    with pytest.raises(UserError, match="seed must be an int"):
        inferbook.setup("upgrade-record", preset="smoke", seed="x")
    assert not results_env.exists(), "validation must not write anything"


def test_planned_chapter_is_a_clear_error(monkeypatch):
    from inferbook import toc

    planned = toc.ChapterInfo("future-chapter", "upgrade", "Not yet", "-", "inferbook.no_such_module")
    monkeypatch.setitem(toc.CHAPTERS, "future-chapter", planned)
    with pytest.raises(UserError, match="'future-chapter' is planned but not built yet"):
        inferbook.setup("future-chapter", preset="smoke")


def test_setup_context(results_env):
    ctx = inferbook.setup("upgrade-record", device="cpu", preset="smoke", seed=3, batch=1)
    assert ctx.preset == "smoke" and ctx.params["batch"] == 1 and ctx.params["d_model"] == 64
    assert ctx.seed == 3 and ctx.device.type == "cpu"
    a = torch.rand(3, generator=ctx.generator())
    b = torch.rand(3, generator=ctx.generator())
    assert torch.equal(a, b)


def test_bounds_derived_from_presets_and_declared():
    declared = {"n": Param(int), "k": Param(int, min=0), "f": Param(float), "cap": Param(int, max=10),
                "ts": Param(tuple), "v": Param(str, check=lambda v: int(v))}
    presets = {"smoke": {"n": 4, "k": 2, "f": 0.5, "cap": 2, "ts": (1, 8), "v": "3"}, "gpu": {"n": 64, "k": 8, "f": 0.5,
                                                                                             "cap": 4, "ts": (1, 8, 64), "v": "4"}}
    ok = resolve_params("c", declared, presets, "smoke", {"n": "1", "k": "0", "f": "0", "ts": "2,16", "cap": "10"})
    assert ok["n"] == 1 and ok["k"] == 0 and ok["ts"] == (2, 16) and ok["cap"] == 10
    for given, match in [({"n": "0"}, "'n' must be >= 1, got 0"), ({"n": str(64 * 64 + 1)}, "'n' must be <= 4096"),
                         ({"k": "-1"}, "'k' must be >= 0"), ({"f": "-0.1"}, "'f' must be >= 0"),
                         ({"f": "nan"}, "finite"), ({"cap": "11"}, "'cap' must be <= 10, got 11$"),
                         ({"ts": "1,0"}, "'ts' must be >= 1, got 0"), ({"ts": "1,a"}, "comma-separated int"),
                         ({"v": "x"}, "parameter 'v': invalid literal"), ({"n": str(2**40)}, "out of range")]:
        with pytest.raises(UserError, match=match):
            resolve_params("c", declared, presets, "smoke", given)


def test_relations_and_chapter_checks_run_in_setup(results_env):
    with pytest.raises(UserError, match="'n_heads' = 3 must divide 'd_model' = 64"):
        inferbook.setup("upgrade-record", preset="smoke", n_heads=3)
    with pytest.raises(UserError, match="axis 'head_dim' got"):
        inferbook.setup("attention-test-matrix", preset="smoke", head_dims="7")
    with pytest.raises(UserError, match="seed must be in"):
        inferbook.setup("upgrade-record", preset="smoke", seed=2**70)
    assert not results_env.exists()


def test_every_preset_of_every_chapter_passes_its_own_checks():
    from inferbook import toc
    from inferbook.context import check_chapter_params

    for info in toc.CHAPTERS.values():
        module = toc.load_module(info)
        for preset in ("smoke", "cpu", "gpu"):
            params = resolve_params(info.slug, module.PARAMETERS, module.PRESETS, preset, {})
            check_chapter_params(info.slug, module, params)

