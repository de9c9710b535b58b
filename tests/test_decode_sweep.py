"""The decode-config sweep (`python -m inferbook.moe.decode_sweep`): bad arguments get one line and
exit 2 before any compile; the grid is the product asked for; each config's launch is the one
`decode_linear` makes (at the default config, the same launch as `w4a16.decode_launches`); and one real
compile prints a prediction."""
import os
import subprocess
import sys

import pytest

from inferbook.errors import UserError
from inferbook.moe import decode_sweep as S
from inferbook.moe import w4a16 as W


@pytest.mark.parametrize("argv, says", [
    ([], "usage"),
    (["sm_7", "256", "512"], "target 'sm_7'"),
    (["sm_90", "0", "512"], "N: 0 is outside"),
    (["sm_90", "256", "1e3"], "K: '1e3' is not"),
    (["sm_90", "256", "512", "--m", "17"], "--m: 17 is outside 1..16"),
    (["sm_90", "256", "512", "--block-n", "48"], "--block-n: 48 is not allowed"),
    (["sm_90", "256", "512", "--warps", "3"], "--warps: 3 is not allowed"),
    (["sm_90", "256", "512", "--splits", "3"], "--splits: 3 is more than K 512's 2 runs"),
    (["sm_90", "256", "512", "--group", "48"], "--group: 48 is not allowed"),
    (["sm_90", "256", "512", "--bogus", "1"], "unknown option '--bogus'"),
    (["sm_90", "256", "512", "--m"], "'--m' needs a value"),
    (["sm_100", "256", "512", "--swap", "2"], "--swap: 2 is not allowed"),
    (["sm_100", "256", "512", "--m", "1,16", "--swap", "0,1"], "--swap 1 takes M <= 8"),
    (["gfx950", "256", "512", "--moe", "-1"], "--moe: -1 is outside 0..1024"),
    (["gfx950", "256", "512", "--moe", "9", "--swap", "1"], "no swap-AB form"),
    (["sm_90", "256", "8192", "--m", "1,2,3,4,5,6,7,8,9", "--block-n", "16,32,64,128", "--warps", "1,2,4,8",
      "--splits", "1,2"], "288 configs"),
])
def test_bad_arguments_get_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(UserError) as e:
        S.parse(argv)
    assert says in str(e.value)
    assert S.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and err.startswith("decode_sweep: ")


def test_grid_is_the_product_in_order():
    a = S.parse(["sm_100", "6144", "1536", "--m", "1,8", "--block-n", "64,128", "--stages", "3,4", "--splits", "2,3"])
    cs = S.configs(a)
    assert len(cs) == 2 * 2 * 2 * 2 * 2          # m, block_n, warps (default 2,4), stages, splits
    assert cs[0] == dict(M=1, cfg=dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=2, num_warps=2, num_stages=3))
    assert cs[-1]["M"] == 8 and cs[-1]["cfg"]["BLOCK_N"] == 128 and cs[-1]["cfg"]["SPLIT_K"] == 3


def test_swap_axis_sweeps_the_swapped_kernel():
    a = S.parse(["sm_100", "6144", "1536", "--m", "1", "--block-n", "64", "--warps", "1", "--splits", "6", "--swap", "0,1"])
    plain, swapped = S.configs(a)
    assert "SWAP_AB" not in plain["cfg"] and plain["cfg"]["BLOCK_M"] == 16
    assert swapped["cfg"] == dict(BLOCK_M=8, BLOCK_N=64, SPLIT_K=6, num_warps=1, num_stages=3, SWAP_AB=True)
    assert S.launch(a, 1, swapped["cfg"]).kernel is W.w4a16_decode_swapped_kernel
    assert S.line(1, swapped["cfg"], {}, None).startswith("M1 bn64 w1 s3 split6 swap-AB: did not compile")


@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942"])
@pytest.mark.parametrize("m, n, k", [(1, 6144, 1536), (8, 6144, 1536), (8, 4096, 7168), (16, 3072, 6144)])
def test_default_config_launch_is_the_launchers(target, m, n, k):
    # the sweep's launch at the config decode_config picks is decode_launches' (what the chapters compile)
    from inferbook.device import building_for

    with building_for(target):
        cfg = W.decode_config(m, n, k)
        real = W.decode_launches(m, n, k)[0]
    swept = S.launch(S.parse([target, str(n), str(k)]), m, cfg)
    assert swept.name == real.name and swept.grid == real.grid and swept.kwargs == real.kwargs
    assert [getattr(x, "shape", x) for x in swept.args] == [getattr(x, "shape", x) for x in real.args]


@pytest.mark.parametrize("target", ["sm_90", "gfx942", "gfx950"])
@pytest.mark.parametrize("experts", [9, 17, 65])
def test_moe_default_config_launch_is_the_launchers(target, experts):
    # --moe E: the sweep's gate/up launch at the config moe_decode_config picks (its SPLITS as the split count)
    # is fused_moe_decode_launches' (what minimax-m3-moe compiles)
    from inferbook.device import building_for
    from inferbook.moe import fused_moe as FM

    with building_for(target):
        cfg = FM.moe_decode_config(False, True, n=1536, experts=experts, k=6144)
        real = FM.fused_moe_decode_launches(12, 1, experts, 6144, 1536, max_m=12)[0]
    sweep_cfg = {key: v for key, v in cfg.items() if key not in ("SPLITS", "CDNA_LOOP")}
    swept = S.launch(S.parse([target, "1536", "6144", "--moe", str(experts)]), 12,
                     dict(sweep_cfg, SPLIT_K=cfg.get("SPLITS", 1)))
    assert swept.name == real.name and swept.grid == real.grid and swept.kwargs.keys() == real.kwargs.keys()
    assert {k: v for k, v in swept.kwargs.items() if not k.endswith("_ptr")} == \
        {k: v for k, v in real.kwargs.items() if not k.endswith("_ptr")}
    assert [getattr(x, "shape", x) for x in swept.args] == [getattr(x, "shape", x) for x in real.args]


def test_one_real_compile_prints_a_prediction():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "inferbook.moe.decode_sweep", "sm_90", "256", "512", "--block-n", "64",
                        "--warps", "2", "--splits", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    (out,) = r.stdout.splitlines()
    assert out.startswith("M1 bn64 w2 s3 split1: ") and "µs predicted" in out and "-bound" in out, out
