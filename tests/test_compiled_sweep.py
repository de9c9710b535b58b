"""`python -m inferbook.compiled.sweep`: a named config's values put over the chosen one reach the
launches the chapters' own builders make (their grids follow the tile), bad input is refused before any
build or compile, and a real sweep compiles the override it names (a subprocess, the interpreter off)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferbook import device
from inferbook.compiled import sweep
from inferbook.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_swept_is_the_config_outside_an_override_and_the_values_over_it_inside():
    cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4)
    assert device.swept("conv3d", cfg) is cfg
    with device.overriding_config("conv3d", {"BLOCK_N": 32}) as o:
        assert device.swept("attention.fwd", cfg) is cfg          # another config's name: untouched
        assert device.swept("conv3d", cfg) == dict(BLOCK_M=128, BLOCK_N=32, num_warps=4)
        assert cfg["BLOCK_N"] == 64                                # a copy: the chosen dict is not edited
        with pytest.raises(UserError, match="no BLOCK_Q; its keys are BLOCK_M, BLOCK_N, num_warps"):
            with device.overriding_config("conv3d", {"BLOCK_Q": 16}):
                device.swept("conv3d", cfg)
    assert o.asked == 1 and o.keys == set(cfg)
    assert device.swept("conv3d", cfg) is cfg                      # the block is over


def _args(**kw) -> dict:
    a = dict(slug="te-mxfp8-recipes", target="sm_90", name="mx.gemm", kernel="mx_gemm_kernel", launch=[],
             set={}, card="H200", jobs=1, each=False)
    return {**a, **kw}


def test_an_override_reaches_the_builders_launch_and_its_grid_follows_the_tile():
    a = _args(launch=["(gemm_paths, timed)"])
    i = sweep.match(a, sweep.build(a, {})[0])[0]
    chosen = sweep.build(a, {})[0][i]
    half = sweep.build(a, {"BLOCK_M": 64})[0][i]
    assert chosen.kwargs["BLOCK_M"] == 128 and half.kwargs["BLOCK_M"] == 64
    assert half.grid[0] == 2 * chosen.grid[0] and half.grid[1:] == chosen.grid[1:]
    assert {k: v for k, v in half.kwargs.items() if k != "BLOCK_M"} == \
        {k: v for k, v in chosen.kwargs.items() if k != "BLOCK_M"}
    # the per-target choice is still the target's: sm_80 takes BLOCK_K 32 unless the sweep sets it
    a80 = _args(target="sm_80", launch=["(gemm_paths, timed)"])
    assert sweep.build(a80, {"BLOCK_M": 64})[0][i].kwargs["BLOCK_K"] == 32
    assert sweep.build(a80, {"BLOCK_K": 64})[0][i].kwargs["BLOCK_K"] == 64


def test_launch_texts_select_any_of_them():
    a = _args(slug="attention-test-matrix", target="sm_90", name="attention.dkdv", kernel="_attn_bwd_dkdv_kernel")
    launches = sweep.build(a, {})[0]
    names = lambda texts: [launches[i].name for i in sweep.match({**a, "launch": texts}, launches)]  # noqa: E731
    full, causal = names(["throughput d128 full"]), names(["throughput d128 causal"])
    assert len(full) == len(causal) == 1
    assert sorted(names(["throughput d128 full", "throughput d128 causal"])) == sorted(full + causal)
    assert len(names([])) > 2 and names(["no such launch"]) == []


@pytest.mark.parametrize("argv, says", [
    (["te-mxfp8-recipes", "sm_90"], "usage"),
    (["te-mxfp8-recipes", "sm_91", "mx.gemm", "--kernel", "k", "--set", "BLOCK_M=64"], "target 'sm_91'"),
    (["te-mxfp8-recipes", "sm_90", "mx.gem", "--kernel", "k", "--set", "BLOCK_M=64"], "config 'mx.gem'"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--set", "BLOCK_M=64"], "--kernel is required"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel"], "nothing to sweep"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_M=6x"], "BLOCK_M: '6x'"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_M=0"], "outside"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_M"], "KEY=V1,V2"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_Q=64"], "no BLOCK_Q"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm", "--set", "BLOCK_M=64"], "its kernels: "),
    (["te-mxfp8-recipes", "sm_90", "conv3d", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_M=64"], "not asked for"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_M=64",
      "--card", "MI300X"], "cannot run sm_90"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_M=1,2,3,4,5,6,7,8",
      "--set", "BLOCK_N=1,2,3,4,5,6,7,8,9"], "72 configs"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_M=64", "--jobs", "0"],
     "--jobs 0"),
    (["no-such-chapter", "sm_90", "mx.gemm", "--kernel", "k", "--set", "BLOCK_M=64"], "no-such-chapter"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "a", "--kernel", "b", "--set", "BLOCK_M=64"], "--kernel given twice"),
    (["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel", "--set", "BLOCK_M=64", "--set", "BLOCK_M=32"],
     "--set BLOCK_M given twice"),
])
def test_bad_input_is_one_line_naming_it(argv, says):
    with pytest.raises(UserError, match=None) as e:
        sweep.parse(argv)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_cli_exits_2_on_bad_input_before_any_compile(capsys):
    assert sweep.main(["te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sweep: nothing to sweep") and err.count("\n") == 1


def test_help_lists_the_configs_and_the_inferbook_command_passes_arguments_on(capsys, monkeypatch):
    from inferbook import cli

    assert sweep.main(["-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and all(name in out for name in sweep.CONFIGS)
    monkeypatch.setenv("TRITON_INTERPRET", "0")      # the command runs the sweep in this process then
    assert cli.main(["sweep", "te-mxfp8-recipes", "sm_90", "mx.gemm", "--kernel", "mx_gemm_kernel"]) == 2
    assert capsys.readouterr().err.startswith("sweep: nothing to sweep")


def test_a_sweep_compiles_each_config_it_names(tmp_path):
    """One launch, the chosen 2 warps and 2 and 4 warps swept, compiled for sm_90: the swept 2 is the chosen
    config (the same prediction, neither faster nor slower anywhere), 4 is a different compile."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(ROOT / ".cache" / "triton-aot"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "inferbook.compiled.sweep", "te-mxfp8-recipes", "sm_90", "mx.quantize",
                          "--kernel", "mx_quantize_kernel", "--launch", "quantize-speed e4m3 floor row-wise",
                          "--set", "num_warps=2,4", "--each"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "predicted by the cost model, not measured" in lines[0]
    chosen = next(x for x in lines if x.startswith("chosen: "))
    two = next(x for x in lines if x.startswith("num_warps=2: "))
    four = next(x for x in lines if x.startswith("num_warps=4: "))
    assert "over 1 launches" in chosen and two.split(": ", 1)[1].startswith(chosen.split(": ", 1)[1].split(" over")[0])
    assert ", faster on 0, slower on 0," in two
    assert "did not compile" not in four
    per_launch = {head: lines[lines.index(head) + 1] for head in (chosen, two, four)}
    assert ", 2 warps, " in per_launch[chosen] and ", 2 warps, " in per_launch[two] and ", 4 warps, " in per_launch[four]


def test_a_configs_work_pickles_for_the_process_pool():
    """--jobs N hands each config to a spawned process: `run_config` and its arguments must pickle."""
    import pickle

    a = _args(indices=[30])
    assert pickle.loads(pickle.dumps((sweep.run_config, a, {"BLOCK_M": 64})))[1] == a
