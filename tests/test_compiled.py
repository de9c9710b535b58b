"""The project's compile check (`inferbook.compiled`): every chapter's gpu-preset Triton launches,
compiled ahead of time for sm_90 (and sm_80, sm_100) without a GPU, must compile and fit the
target's per-block shared memory; the PTX / ptxas parsers on fixed text; and each launch builder
against what its launcher really passes (the launcher run in the interpreter with `run` recorded).

Compiles run in subprocesses with the interpreter off and a persistent Triton cache in
`.cache/triton-aot/`. The committed tables in data/compiled/ cover every target, and a cheap test
holds them to the launches the builders make today (a stale table fails, naming the command that
regenerates it). The compile test then compiles, for sm_90, one launch per distinct kernel (39 of the
353 sm_90 launches; about 120 CPU seconds cold, two processes) and holds each to its committed row;
INFERBOOK_COMPILE_TARGETS=sm_80,sm_90,sm_100 picks the targets, INFERBOOK_COMPILE_FULL=1 compiles and
compares every launch (the old sweep: about a quarter of an hour cold on 2 cores for sm_90 alone).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from inferbook import compiled

triton = pytest.importorskip("triton")


# ---------------------------------------------------------------------------------------------------
# Parsing, on fixed text

PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'moe_gemm_kernel' for 'sm_90a'
ptxas info    : Function properties for moe_gemm_kernel
    412 bytes stack frame, 412 bytes spill stores, 480 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 380 bytes cmem[0]
"""


def test_parse_ptxas():
    assert compiled.parse_ptxas(PTXAS_LOG) == {"regs": 255, "spill_stores": 412, "spill_loads": 480,
                                               "spill_bytes": 892}
    clean = "ptxas info    : Used 40 registers, used 0 barriers\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    assert compiled.parse_ptxas(clean)["spill_bytes"] == 0
    assert compiled.parse_ptxas("")["regs"] is None


def test_mma_family():
    hopper = ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;\n"
              "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f2}, %rd3, %rd4, p, 1, 1, 0, 1;\n"
              "wgmma.fence.sync.aligned;\nwgmma.commit_group.sync.aligned;\n")
    m = compiled.mma_family(hopper)
    assert m["family"] == "wgmma" and m["counts"] == {"wgmma": 2} and m["shapes"] == ["m64n64k16", "m64n128k16"]
    ampere = "\t@%p1 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1,%f2,%f3,%f4}, {%r1}, {%r2}, {%f5};\n" * 3
    m = compiled.mma_family(ampere)
    assert m["family"] == "mma.sync" and m["counts"] == {"mma.sync": 3} and m["shapes"] == ["m16n8k16"]
    blackwell = ("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r1], 128;\n"
                 "tcgen05.mma.cta_group::1.kind::f16 [%r2], %rd1, %rd2, %r3, p;\n"
                 "tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%rd3];\n")
    m = compiled.mma_family(blackwell)
    assert m["family"] == "tcgen05" and m["counts"] == {"tcgen05": 1} and m["shapes"] == ["kind::f16"]
    assert compiled.mma_family("ld.global.b32 %r1, [%rd1];")["family"] == "-"
    assert compiled.mma_summary(compiled.mma_family(ampere + hopper)) == "wgmma+mma.sync m64n64k16,m64n128k16,m16n8k16"


def test_global_loads_by_width():
    ptx = ("\t@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
           "\tld.global.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd2 + 0 ];\n"
           "\t@%p2 ld.global.b16 { %rs1 }, [ %rd3 + 0 ];\n"
           "\tld.global.nc.v2.f32 { %f1, %f2 }, [ %rd4 ];\n"
           "\tld.global.L1::evict_last.b8 %rs2, [%rd5];\n"
           "\t@%p3 st.global.v4.b32 [ %rd6 + 0 ], { %r1, %r2, %r3, %r4 };\n"
           "\tcp.async.cg.shared.global [ %r9 + 0 ], [ %rd7 + 0 ], 0x10, %r10;\n"
           "\tcp.async.ca.shared.global [ %r11 + 0 ], [ %rd8 + 0 ], 0x4, %r12;\n"
           "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd9, {%r2, %r3}], [%r4];\n")
    loads = compiled.global_loads(ptx)
    assert loads["ld"] == {16: 2, 8: 1, 2: 1, 1: 1}
    assert loads["st"] == {16: 1}
    assert loads["cp_async"] == {16: 1, 4: 1}
    assert loads["tma"] == 1
    assert compiled.loads_summary(loads) == "ld 16B×2 8B×1 2B×1 1B×1 · cp.async 16B×1 4B×1 · tma×1"


def test_problems_name_the_resource():
    row = {"ok": True, "launch": "gate_up", "target": "sm_80", "shared_kb": 220.0, "smem_limit_kb": 163}
    (p,) = compiled.problems(row)
    assert "220.0 KB > 163 KB" in p and "sm_80" in p and "A100" in p
    assert compiled.problems({**row, "shared_kb": 100.0}) == []
    spills = {**row, "target": "sm_90", "shared_kb": 100.0, "smem_limit_kb": 227, "spill_bytes": 892, "regs": 255}
    assert compiled.problems({**spills, "kernel": "other_kernel"}) == []          # reported, not a failure
    (p,) = compiled.problems({**spills, "kernel": "moe_gemm_kernel"})
    assert "892 bytes of register spills" in p and "moe_gemm_kernel" in p
    assert compiled.problems({"ok": False, "error": "CompilationError: boom"}) == ["compile error: CompilationError: boom"]


def test_dedupe_keeps_one_launch_per_specialisation():
    k = object()
    a = compiled.Launch("a", k, [compiled.ptr(torch.bfloat16), 4096, 7], dict(BLOCK=16))
    b = compiled.Launch("b", k, [compiled.ptr(torch.bfloat16), 8192, 9], dict(BLOCK=16))   # same: %16, not 1
    c = compiled.Launch("c", k, [compiled.ptr(torch.bfloat16), 4096, 1], dict(BLOCK=16))   # 1 is specialised
    d = compiled.Launch("d", k, [compiled.ptr(torch.float16), 4096, 7], dict(BLOCK=16))    # another dtype
    e = compiled.Launch("e", k, [compiled.ptr(torch.bfloat16), 4096, 7], dict(BLOCK=32))   # another constexpr
    assert [x.name for x in compiled.dedupe([a, b, c, d, e])] == ["a", "c", "d", "e"]


def test_dedupe_keeps_a_row_per_grid_for_the_named_kernels():
    # minimax's decode kernels: one specialisation at several grids (the shared MLP's down, each EP rank) is a
    # row each, since the cost model's waves and residency are the grid's; other kernels keep one row
    def decode_kernel():
        pass

    def other_kernel():
        pass

    args = [compiled.ptr(torch.bfloat16), 4096]
    la = [compiled.Launch(f"{f.__name__} {g}", f, list(args), dict(BLOCK=16), grid=g)
          for f in (decode_kernel, other_kernel) for g in ((48, 8), (96, 4), (48, 8))]
    assert [x.name for x in compiled.dedupe(la, keep_grids=("decode_kernel",))] == [
        "decode_kernel (48, 8)", "decode_kernel (96, 4)", "other_kernel (48, 8)"]
    assert [x.name for x in compiled.dedupe(la)] == ["decode_kernel (48, 8)", "other_kernel (48, 8)"]


def test_roofline_floor_is_labelled_a_floor():
    df = compiled.predicted_roofline("chord-w4a16", [{"name": "gemv", "bytes": 16e6, "flops": 1e8}])
    for card in compiled.FLOOR_CARDS:
        assert "floor, not a prediction" in df.iloc[0][card]
    # H100: 16 MB at 3.35 TB/s = 4.78 us, memory floor
    assert df.iloc[0]["H100"].startswith("4.78 µs (memory floor")
    df = compiled.predicted_roofline("x", [{"name": "gemv", "bytes": 16e6, "flops": 1e8}],
                                     measured={("gemv", "H200"): 5e-6})
    assert df.iloc[0]["H200"] == "5.00 µs (measured)"


@pytest.mark.parametrize("argv, match", [
    (["inspect", "no-such-chapter"], "unknown chapter"),
    (["inspect", "chord-w4a16", "--target", "sm_75"], "unknown target"),
    (["inspect", "upgrade-record"], "launches no Triton kernel"),
    (["inspect"], "give one CHAPTER or --all"),
    (["inspect", "chord-w4a16", "--jobs", "0"], "--jobs"),
])
def test_inspect_bad_input_is_one_line_exit_2(argv, match, capsys):
    from inferbook.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_chapter_section_reads_the_record(tmp_path):
    row = dict(slug="x", index=0, launch="gemv M1", target="sm_90", source="s", kernel="k", ok=True, shared_kb=68.0,
               smem_limit_kb=227, smem_ok=True, regs=167, spill_stores=0, spill_loads=0, spill_bytes=0, num_warps=4,
               num_stages=4, mma="mma.sync m16n8k16", mma_family="mma.sync", loads_summary="ld 2B×32")
    rows = [row, {**row, "target": "sm_100", "mma": "tcgen05 kind::f16", "mma_family": "tcgen05"},
            {**row, "target": "sm_80", "shared_kb": 220.0, "smem_limit_kb": 163, "smem_ok": False},
            {**row, "index": 1, "launch": "gemv M2", "target": "sm_90"},
            {**row, "index": 1, "launch": "gemv M2", "target": "sm_100"}]
    compiled.save_table("x", rows, root=tmp_path)
    sec = compiled.CompilerSection("x", [{"name": "gemv", "bytes": 16e6, "flops": 1e8}], root=tmp_path)
    # rows identical but for the target are merged; the sm_80 overflow keeps its own row
    assert list(sec.table["targets"]) == ["sm_80", "sm_90", "sm_100", "sm_90, sm_100"]
    assert "✗" in sec.table.iloc[0]["shared KB"]
    assert sec.glue["cc_x_sm90_mma"] == "mma.sync" and sec.glue["cc_x_sm100_mma"] == "mma.sync, tcgen05"
    assert sec.glue["cc_x_failures"].startswith("1: gemv M1 on sm_80: shared memory 220.0 KB > 163 KB")
    assert "bounded by" in sec.glue["cc_x_sm90_limit"]
    assert compiled.launch_mma("x", "gemv M1", "sm_100", root=tmp_path) == "tcgen05 kind::f16"
    html = sec._repr_html_()
    assert "floor, not a prediction" in html and "<details>" in html
    assert sec.lines[0].startswith("What binds the kernels: no machine-code facts")   # this table has none
    assert "sm_90, sm_100: mma.sync" not in sec.lines[1]            # sm_100's MMA differs: its own clause


# ---------------------------------------------------------------------------------------------------
# The cost model: the machine code's main loop, the IR's trips, and bounds known by hand

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_CTAID.X ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E.U16 R8, desc[UR4][R10.64] ;
        /*0040*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
        /*0050*/                   IADD3 R2, P0, R2, 0x100, RZ ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0070*/                   LDGSTS.E.BYPASS.128 [R11], desc[UR8][R2.64], P5 ;
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
        /*00a0*/                   NOP;
        /*00b0*/                   NOP;
"""


def test_main_loop_is_the_innermost_backward_branch():
    loop = compiled.machine.main_loop(compiled.machine.sass_instructions(SASS), "sass")
    # 5 instructions from .L_x_1 to its branch; 16 B + 2 B per thread, 32 threads; the trap after EXIT is no loop,
    # and it and the NOPs after it never execute: 9 of the 12 listed
    # one load round a trip (both loads' addresses are ready, the MMA waits for both); the epilogue's cp.async
    # returns into shared memory and waits on nothing
    assert loop == {"instrs": 5, "global_bytes_per_warp": (16 + 2) * 32, "mma": 1, "async": False, "tma_loads": 0,
                    "kernel_instrs": 9, "loops": 1, "load_rounds": 1, "outside_load_rounds": 0}
    # a predicated branch to its own label (a spin) executes, and so do NOPs before the last instruction
    spin = SASS.replace("BRA `(.L_x_2);", "@P1 BRA `(.L_x_2);")
    assert compiled.machine.main_loop(compiled.machine.sass_instructions(spin), "sass")["kernel_instrs"] == 10
    assert compiled.machine.main_loop(compiled.machine.sass_instructions(SASS.split(".L_x_1:")[0]))["instrs"] == 0
    # sm_100's nvdisasm writes a uniform predicate as the branch's first operand: the same loop
    sm100 = SASS.replace("@P0 BRA `(.L_x_1)", "BRA.U UP0, `(.L_x_1)")
    assert compiled.machine.main_loop(compiled.machine.sass_instructions(sm100), "sass")["instrs"] == 5


def _sass(*lines):
    return compiled.machine.sass_instructions("\n".join(f"        /*{16 * i:04x}*/   {l} ;" for i, l in enumerate(lines)))


def test_load_rounds_by_hand_sass():
    rounds = compiled.machine.load_rounds
    # two independent loads, then a use of both: one latency
    assert rounds(_sass("LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E R8, desc[UR4][R20.64]", "FADD R9, R4, R8")) == 1
    # a load nobody waits for within the span: none; a store of loaded data then another load (a copy loop's
    # unrolled trips): one, the latency a trip the model always charges
    assert rounds(_sass("LDG.E R8, desc[UR4][R20.64]", "IADD3 R2, R2, 0x4, RZ")) == 0
    assert rounds(_sass("LDG.E.128 R4, desc[UR4][R2.64]", "STG.E.128 desc[UR4][R6.64], R4", "LDG.E.128 R8, desc[UR4][R20.64]",
                        "STG.E.128 desc[UR4][R22.64], R8")) == 1
    # pointer chasing: the slot id, then the row it gathers, then a use: two
    chase = ("LDG.E R4, desc[UR4][R2.64]", "IMAD.WIDE R6, R4, 0x4, R10", "LDG.E R12, desc[UR4][R6.64]", "FADD R13, R12, R12")
    assert rounds(_sass(*chase)) == 2
    # a predicate from a load guards the next load: two
    assert rounds(_sass("LDG.E R4, desc[UR4][R2.64]", "ISETP.GE.AND P0, PT, R4, RZ, PT", "@!P0 LDG.E R8, desc[UR4][R20.64]",
                        "FADD R9, R8, R8")) == 2
    # tiles staged one by one through one shared buffer: each load issues after the barrier that waits on the
    # store of the last one, so two tiles are two rounds, three are three
    tile = lambda r: (f"LDG.E.128 R{r}, desc[UR4][R{r + 20}.64]", f"STS.128 [R0], R{r}", "BAR.SYNC.DEFER_BLOCKING 0x0",
                      "LDSM.16.M88.4 R40, [R1]", "BAR.SYNC.DEFER_BLOCKING 0x0")
    assert rounds(_sass(*tile(4), *tile(8))) == 2 and rounds(_sass(*tile(4), *tile(8), *tile(12))) == 3
    # the same tiles loaded first, then staged: one round
    assert rounds(_sass("LDG.E.128 R4, desc[UR4][R24.64]", "LDG.E.128 R8, desc[UR4][R28.64]", "STS.128 [R0], R4",
                        "BAR.SYNC.DEFER_BLOCKING 0x0", "STS.128 [R0], R8")) == 1
    # asynchronous copies and their wait: the pipeline's, not counted
    assert rounds(_sass("LDGSTS.E.BYPASS.128 [R11], desc[UR8][R2.64], P5", "LDGDEPBAR", "DEPBAR.LE SB0, 0x0",
                        "LDS R4, [R11]")) == 0


def test_load_rounds_by_hand_amdgcn():
    rounds = compiled.machine.load_rounds

    def amd(text):   # a listing opens with the kernel's symbol
        return compiled.machine.amdgcn_instructions("k:\n" + text)

    staged = ("global_load_dwordx4 v[0:3], v[10:11], off", "s_waitcnt vmcnt(0)", "ds_write_b128 v20, v[0:3]",
              "s_barrier", "global_load_dwordx4 v[4:7], v[12:13], off", "s_waitcnt vmcnt(0)", "ds_write_b128 v20, v[4:7]")
    assert rounds(amd("\n".join(staged)), "amdgcn") == 2
    assert rounds(amd("\n".join(s for s in staged if s != "s_barrier")), "amdgcn") == 1
    # the block's expert by a scalar load, then the rows it addresses, then a use: two
    chase = ("s_load_dword s4, s[0:1], 0x0", "s_waitcnt lgkmcnt(0)", "v_add_u32 v12, s4, v10",
             "global_load_dword v1, v[12:13], off", "s_waitcnt vmcnt(0)", "v_add_f32 v2, v1, v1")
    assert rounds(amd("\n".join(chase)), "amdgcn") == 2


def test_load_rounds_are_recorded_and_named_not_charged():
    # a trip that waits 3 loads one after another (a tile staged three times): recorded and named in the
    # sentence, but the latency bound still charges one latency a trip (which loads hit L2 the code does not say)
    row = _row(ctas=4, grid=[4], dram_bytes=4 * 256 * 8192.0, trips=256)
    plain = compiled.predict(row, "H200")
    three = compiled.predict({**row, "sass": {**row["sass"], "load_rounds": 3, "outside_load_rounds": 2}}, "H200")
    assert three["seconds"] == plain["seconds"] == pytest.approx(257 * 600e-9) and three["load_rounds"] == 3
    assert "waits 3 loads one after another, which the model does not charge" in compiled.bound_sentence(three)
    assert "one after another" not in compiled.bound_sentence(plain)
    assert "one after another" not in compiled.bound_sentence({**three, "load_rounds": 1})


TTIR = """
  tt.func public @k(%a_ptr: !tt.ptr<bf16> {tt.divisibility = 16 : i32}, %K: i32 {tt.divisibility = 16 : i32}, %L: i32) attributes {noinline = false} {
    %c0_i32 = arith.constant 0 : i32
    %c1_i32 = arith.constant 1 : i32
    %c64_i32 = arith.constant 64 : i32
    %pid = tt.get_program_id x : i32
    %hi = arith.addi %pid, %c1_i32 : i32
    %acc = scf.for %k0 = %c0_i32 to %K step %c64_i32 iter_args(%acc_1 = %acc0) -> (tensor<16x32xf32>)  : i32 {
      %r = scf.for %j = %c0_i32 to %hi step %c1_i32 iter_args(%x = %acc_1) -> (tensor<16x32xf32>)  : i32 {
        %d = tt.dot %a, %b, %x, inputPrecision = tf32 : tensor<16x64xbf16> * tensor<64x32xbf16> -> tensor<16x32xf32>
        scf.yield %d : tensor<16x32xf32>
      }
      scf.yield %r : tensor<16x32xf32>
    }
    %n = tt.load %a_ptr : !tt.ptr<i32>
    %w = scf.for %i = %c0_i32 to %n step %c1_i32 iter_args(%y = %c0_i32) -> (i32)  : i32 {
      scf.yield %y : i32
    }
    tt.return
  }
"""


def test_trip_counts_from_the_ir_on_the_launch_arguments():
    ir = compiled.machine.ttir_loops(TTIR, {"K": 640, "L": 3}, (9,))
    # K/64 = 10 outer trips; the inner runs pid+1 = 5 times for the middle program (pid 4 of 9)
    assert [r["trips"] for r in ir["loops"]] == [10, 5, None]       # the last bound is loaded from memory
    assert ir["main_trips"] == 50 and not ir["trips_known"]
    assert ir["dots"] == [[16, 32, 64, "bf16", 50]] and ir["flops_per_cta"] == 2 * 16 * 32 * 64 * 50


SPLIT_TTIR = """
  tt.func public @k(%q_ptr: !tt.ptr<i32> {tt.divisibility = 16 : i32}, %K: i32 {tt.divisibility = 16 : i32}, %SPLITS: i32) attributes {noinline = false} {
    %c1_i32 = arith.constant 1 : i32
    %c255_i32 = arith.constant 255 : i32
    %c256_i32 = arith.constant 256 : i32
    %pid_n = tt.get_program_id x : i32
    %pid_k = tt.get_program_id y : i32
    %runs = arith.addi %K, %c255_i32 : i32
    %runs_1 = arith.divsi %runs, %c256_i32 : i32
    %r0 = arith.muli %pid_k, %runs_1 : i32
    %r0_2 = arith.divsi %r0, %SPLITS : i32
    %r1 = arith.addi %pid_k, %c1_i32 : i32
    %r1_3 = arith.muli %r1, %runs_1 : i32
    %r1_4 = arith.divsi %r1_3, %SPLITS : i32
    %acc = scf.for %r = %r0_2 to %r1_4 step %c1_i32 iter_args(%a = %acc0) -> (tensor<16x128xf32>)  : i32 {
      scf.yield %a : tensor<16x128xf32>
    }
    tt.return
  }
"""


def test_trips_of_every_program_along_the_axis_that_changes_them():
    # split pid_k of 9 takes runs [28 pid_k / 9, 28 (pid_k + 1) / 9): 0 3 6 9 12 15 18 21 24 28
    t = compiled.machine.program_trips(SPLIT_TTIR, {"K": 7168, "SPLITS": 9}, (32, 9))
    assert t == {"trips_min": 3, "trips_max": 4, "trips_by_pid": {"axis": 1, "trips": [3] * 8 + [4]}}
    assert compiled.machine.ttir_loops(SPLIT_TTIR, {"K": 7168, "SPLITS": 9}, (32, 9))["main_trips"] == 3  # the middle
    # 7 splits of 28 runs: 4 each, whatever the program
    assert compiled.machine.program_trips(SPLIT_TTIR, {"K": 7168, "SPLITS": 7}, (32, 7)) == \
        {"trips_min": 4, "trips_max": 4, "trips_by_pid": None}
    # the nest of TTIR: K/64 = 10 outer trips times pid + 1 inner
    assert compiled.machine.program_trips(TTIR, {"K": 640, "L": 3}, (9,))["trips_by_pid"] == \
        {"axis": 0, "trips": [10 * (p + 1) for p in range(9)]}


def _row(**kw):
    """A compiled sm_90 row for the model: a loop of `instrs` warp-instructions moving `bpw` bytes per warp."""
    base = dict(ok=True, launch="k", kernel="k", target="sm_90", num_warps=4, num_stages=1, regs=32, shared_kb=0.0,
                smem_limit_kb=227, mma_family="-", ctas=1024, grid=[1024], dram_bytes=1024 * 64 * 8192.0,
                sass={"instrs": 10, "global_bytes_per_warp": 32 * 16 * 2, "mma": 0, "async": False, "tma_loads": 0,
                      "kernel_instrs": 30, "loops": 1}, trips=64, trips_known=True, flops_per_cta=0, dots=[])
    base.update(kw)
    return base


H200 = compiled.CARDS["H200"]


def test_cost_model_copy_is_memory_bound_at_the_ceiling():
    p = compiled.predict(_row(), "H200")
    assert p["bound"] == "memory" and p["ceiling"] == "datasheet"
    assert p["seconds"] == pytest.approx(1024 * 64 * 8192 / 4.8e12) and p["frac_of_copy"] == pytest.approx(1.0)
    # 1024 CTAs on 132 SMs, 16 resident (64 warps / 4): every CTA resident; issue = (30-10+10*64)*4 warp-instr
    # x 1024/132 CTAs / (4 per cycle x 1.98 GHz)
    assert p["bounds"]["issue"] == pytest.approx((30 - 10 + 640) * 4 * 1024 / 132 / (4 * 1.98e9))
    assert p["bounds"]["latency"] == pytest.approx(65 * 600e-9) and p["ctas_per_sm"] == 16
    measured = compiled.predict(_row(), "H200", copy_gbps=4000.0)
    assert measured["ceiling"] == "measured" and measured["seconds"] == pytest.approx(1024 * 64 * 8192 / 4.0e12)


def test_cost_model_dot_bound_tile_is_compute_bound():
    # one 128x128 tile of K 8192 per SM (132 CTAs), bf16 wgmma: 2*128*128*8192 FLOPs at 989.4/132 TFLOP/s per SM
    flops = 2 * 128 * 128 * 8192
    row = _row(ctas=132, grid=[12, 11], num_warps=8, num_stages=4, regs=128, shared_kb=128.0, mma_family="wgmma",
               dram_bytes=50e6, trips=128, flops_per_cta=flops, dots=[[128, 128, 64, "bf16", 128]],
               sass={"instrs": 80, "global_bytes_per_warp": 4096, "mma": 4, "async": True, "tma_loads": 0,
                     "kernel_instrs": 500, "loops": 2})
    p = compiled.predict(row, "H200")
    assert p["bound"] == "compute" and p["seconds"] == pytest.approx(flops / (989.4e12 / 132))
    assert p["residency_limit"] == "shared memory" and p["ctas_per_sm"] == 1
    # the same tile as mma.sync on sm_90 gets 2/3 of the rate; fp8 operands twice it
    assert compiled.predict({**row, "mma_family": "mma.sync"}, "H200")["seconds"] == pytest.approx(1.5 * p["seconds"])
    fp8 = compiled.predict({**row, "dots": [[128, 128, 64, "f8E4M3FN", 128]]}, "H200")
    assert fp8["bounds"]["compute"] == pytest.approx(p["seconds"] / 2, rel=1e-3)
    # 144 tiles: 12 SMs run a second tile, the busiest SM takes twice as long: wave quantization binds
    q = compiled.predict({**row, "ctas": 144, "grid": [12, 12]}, "H200")
    assert q["bound"] == "waves" and q["seconds"] == pytest.approx(2 * p["seconds"])


def test_cost_model_tiny_grid_is_latency_bound():
    row = _row(ctas=4, grid=[4], dram_bytes=4 * 256 * 8192.0, trips=256)
    p = compiled.predict(row, "H200")
    assert p["bound"] == "latency" and p["seconds"] == pytest.approx(257 * 600e-9)
    assert p["bytes_in_flight_per_sm"] < p["bytes_in_flight_needed"]           # Little's law is not met
    # async copies with 4 stages keep 3 iterations in flight: a third of the latency chain
    a = compiled.predict({**row, "num_stages": 4, "sass": {**row["sass"], "async": True}}, "H200")
    assert a["bounds"]["latency"] == pytest.approx((256 / 3 + 1) * 600e-9)


def test_sync_atomic_adds_two_latencies_to_the_chain():
    # a last-arrival reduction (acq_rel count, then the other CTAs' partials): two more latencies a CTA; a
    # relaxed atomic (split-K adds) is a store to the model
    ttir = ("%9 = tt.atomic_rmw add, acq_rel, gpu, %lock, %c1_i32, %true : (!tt.ptr<i32>, i32, i1) -> i32\n"
            "%11 = tt.atomic_rmw exch, relaxed, gpu, %lock, %c0_i32, %true : (!tt.ptr<i32>, i32, i1) -> i32\n"
            "%5 = tt.atomic_rmw fadd, relaxed, gpu, %acquire, %v, %m : (tensor<16x!tt.ptr<f32>>) -> tensor<16xf32>\n"
            "%12 = tt.atomic_cas acquire, gpu, %p, %c0, %c1 : (!tt.ptr<i32>, i32, i32) -> i32")
    assert compiled.machine.sync_atomics(ttir) == 2 and compiled.machine.sync_atomics(ttir.split("\n")[1]) == 0
    row = _row(ctas=4, grid=[4], dram_bytes=4 * 256 * 8192.0, trips=256)
    plain, synced = compiled.predict(row, "H200"), compiled.predict({**row, "sync_atomics": 1}, "H200")
    assert synced["bound"] == "latency" and synced["seconds"] == pytest.approx(plain["seconds"] + 2 * 600e-9)


def test_latency_floor_of_a_small_copy():
    # the model never predicts a launch under two DRAM latencies: a pure copy of 5.3 MB on B200 (0.66 us at
    # 8 TB/s) is at best 0.66 / 1.2 of the copy ceiling, whatever its grid or pipeline depth; 53 MB is not held
    best = 0.0
    for ctas, trips, stages in ((148, 1, 1), (296, 1, 4), (592, 2, 4), (1184, 4, 5)):
        row = _row(target="sm_100", num_stages=stages, ctas=ctas, grid=[ctas], dram_bytes=5.3e6, trips=trips,
                   sass={"instrs": 10, "global_bytes_per_warp": 5.3e6 / ctas / trips / 4, "mma": 0,
                         "async": stages > 1, "tma_loads": 0, "kernel_instrs": 30, "loops": 1})
        p = compiled.predict(row, "B200")
        best = max(best, p["frac_of_copy"])
        assert p["seconds"] >= 2 * 600e-9 and compiled.latency_floor_fraction(p) == pytest.approx(5.3e6 / 8e12 / 1.2e-6)
    assert best == pytest.approx(5.3e6 / 8e12 / 1.2e-6)
    assert compiled.latency_floor_fraction({**p, "bounds": {**p["bounds"], "memory": 10 * p["bounds"]["memory"]}}) == 1.0


def test_cost_model_trips_from_bytes_when_the_ir_cannot_say():
    p = compiled.predict(_row(trips=None, trips_known=False), "H200")
    # 1024*64*8192 bytes over 1024 CTAs, 4 warps x 1024 B per iteration: 128 trips (stores are not in the loop's count)
    assert p["trips"] == 128 and p["trips_from"] == "bytes"


def test_cost_model_busiest_sm_holds_the_long_splits():
    # 66 x 4 CTAs on H200's 132 SMs, all resident (16 a SM): split k (CTAs 66k..66k+65) runs 3, 3, 3, 4 trips.
    # CTA i goes to SM i mod 132: SM s holds CTAs s (split 0 or 1, 3 trips) and s + 132 (split 2 for s < 66,
    # 3 trips; split 3 for s >= 66, 4 trips). A CTA's warp-instructions: (2100 - 2000 + 2000 t) x 4 warps.
    loop = {"instrs": 2000, "global_bytes_per_warp": 1024, "mma": 0, "async": True, "tma_loads": 0,
            "kernel_instrs": 2100, "loops": 1}
    row = _row(ctas=264, grid=[66, 4], num_stages=3, sass=loop, dram_bytes=24e6, trips=3,
               trips_by_pid={"axis": 1, "trips": [3, 3, 3, 4]}, trips_min=3, trips_max=4)
    rate = 4 * 1.98e9
    p = compiled.predict(row, "H200")
    busiest = (100 + 2000 * 3) * 4 + (100 + 2000 * 4) * 4                   # 24400 + 32400 on SMs 66..131
    assert p["busiest_sm_instrs"] == busiest and p["trips_mean"] == 3.25 and p["trips_max"] == 4
    assert p["bounds"]["waves"] == pytest.approx(busiest / rate)                                 # 7.17 µs
    assert p["bounds"]["issue"] == pytest.approx(2 * (100 + 2000 * 3.25) * 4 / rate)            # 6.67 µs, 2 CTAs a SM
    assert p["bounds"]["latency"] == pytest.approx((3.25 / 2 + 1) * 600e-9)      # the mean CTA's chain, 2 trips in flight
    assert p["bound"] == "waves" and p["seconds"] == pytest.approx(busiest / rate)
    # the same row compiled before the spread was kept: every CTA runs the middle program's 3 trips
    old = {k: v for k, v in row.items() if k not in ("trips_by_pid", "trips_min", "trips_max")}
    q = compiled.predict(old, "H200")
    assert q["bound"] == "issue" and q["seconds"] == pytest.approx(2 * (100 + 6000) * 4 / rate)   # 6.16 µs
    # only the longest known (trips vary along several axes): the busiest SM's 2 CTAs both that long
    r = compiled.predict({**old, "trips_max": 4}, "H200")
    assert r["bounds"]["waves"] == pytest.approx(2 * (100 + 8000) * 4 / rate) and r["bounds"]["issue"] == q["bounds"]["issue"]
    # equal splits listed one by one predict what the closed form does
    even = compiled.predict({**row, "trips_by_pid": {"axis": 1, "trips": [3] * 4}}, "H200")
    assert even["bounds"] == pytest.approx(q["bounds"])


def test_busiest_sm_dispatch_fills_the_slot_that_frees_first():
    # 2 SMs, 1 slot each: CTA 0 (4 units) on SM 0, CTA 1 on SM 1, which frees first and so takes CTAs 2, 3, 4;
    # each SM ends with 4 units (round robin would give SM 0 4 + 1 + 1)
    work = [(4.0, 0.0, 1.0)] + [(1.0, 0.0, 1.0)] * 4
    assert compiled.cost._busiest_sm(work, 2, 1) == (4.0, 0.0, 4.0)


def test_residency_limits():
    assert compiled.residency(_row(regs=255, num_warps=4))["limit"] == "registers"      # 65536 / (256*32*4) = 2
    assert compiled.residency(_row(regs=255, num_warps=4))["ctas_per_sm"] == 2
    assert compiled.residency(_row(shared_kb=100.0))["ctas_per_sm"] == 2                # 228 // 101
    assert compiled.residency(_row(num_warps=16, regs=32))["ctas_per_sm"] == 4          # 64 warps


def test_cdna_residency_and_issue_count_waves_per_simd():
    # CDNA: 256 VGPRs a lane leave 2 waves a SIMD; a CU's 4 SIMDs hold 8 waves: eight 1-wave workgroups, four of
    # 2 waves, two of 4 (a workgroup's waves spread over the SIMDs, each wave on one)
    amd = dict(target="gfx942", regs=256, vgprs=256, agprs=0)
    assert [compiled.residency(_row(num_warps=w, **amd))["ctas_per_sm"] for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert compiled.residency(_row(num_warps=1, target="gfx942", regs=384, vgprs=384, agprs=128))["ctas_per_sm"] == 4
    # `.vgpr_count` holds the AGPRs already (the unified file): 450 with 194 of them AGPRs is one wave a SIMD,
    # 200 with 72 two (counting the AGPRs twice would say none, and one)
    assert compiled.residency(_row(num_warps=4, target="gfx942", vgprs=450, agprs=194))["ctas_per_sm"] == 1
    assert compiled.residency(_row(num_warps=4, target="gfx942", vgprs=200, agprs=72))["ctas_per_sm"] == 2
    # one CTA a CU (304 on MI300X): a 1-wave CTA issues from one SIMD (a quarter of the CU's rate), a 4-wave CTA
    # from four, so 4 waves of the same loop take as long as 1
    one = compiled.predict(_row(num_warps=1, ctas=304, grid=[304], **amd), "MI300X")
    four = compiled.predict(_row(num_warps=4, ctas=304, grid=[304], **amd), "MI300X")
    assert one["bounds"]["issue"] == pytest.approx((30 - 10 + 10 * 64) / (2.1e9 / 4))
    assert four["bounds"]["issue"] == pytest.approx(one["bounds"]["issue"])


def test_cdna_register_residency_is_the_compilers():
    # every committed CDNA row: the model's waves a SIMD from registers (a 4-wave workgroup, one wave a SIMD, so
    # its CTAs a CU by registers are its waves a SIMD) against the compiler's own "; Occupancy" comment. Where the
    # VGPRs allow fewer than 8 waves they bind, and the two agree on every row; where they allow 8 the compiler
    # may say fewer (SGPRs, which the model does not count) but never more. Counting the AGPRs twice failed this
    seen = 0
    for slug in compiled.kernel_chapters():
        for r in (compiled.load_table(slug) or {"rows": []})["rows"]:
            if not r["target"].startswith("gfx") or not r.get("ok") or r.get("compiler_occupancy") is None:
                continue
            mine = compiled.residency({**r, "num_warps": 4, "shared_kb": 0.0})["by"]["registers"]
            occ = r["compiler_occupancy"]
            assert (mine == occ) if mine < 8 else (occ <= 8), (slug, r["launch"], r["target"], mine, occ)
            seen += mine < 8
    assert seen > 300, seen


def test_predict_launches_reads_the_committed_table(tmp_path):
    rows = [{**_row(), "slug": "x", "index": 0, "launch": "copy"},
            {**_row(ctas=4, grid=[4], dram_bytes=4 * 256 * 8192.0, trips=256), "slug": "x", "index": 1, "launch": "tiny"}]
    compiled.save_table("x", rows, root=tmp_path)
    preds = compiled.predict_launches("x", "sm_90", "H200", root=tmp_path)
    assert [p["launch"] for p in preds] == ["copy", "tiny"] and [p["bound"] for p in preds] == ["memory", "latency"]
    for p in preds:
        assert {"kernel", "seconds", "bound", "ceiling", "bounds"} <= set(p) and p["ceiling"] == "datasheet"
    assert compiled.predicted_seconds("x", "sm_90", "H200", root=tmp_path) == pytest.approx(sum(p["seconds"] for p in preds))
    from inferbook.errors import UserError
    with pytest.raises(UserError, match="card MI300X cannot run sm_90"):
        compiled.predict_launches("x", "sm_90", "MI300X", root=tmp_path)
    with pytest.raises(UserError, match="unknown card"):
        compiled.predict_launches("x", "sm_90", "H300", root=tmp_path)
    # a committed ceilings record for the card: the memory bound uses it, and says so
    from inferbook.record import RunRecord, save_records
    r = RunRecord(chapter="device-ceilings", name="ceilings", hardware={"device_type": "cuda", "gpu_name": "NVIDIA H200"})
    r.add("copy_bandwidth", 4000.0, "GB/s (read+write)")
    save_records(tmp_path / "data" / "results" / "nvidia-h200" / "device-ceilings.json", [r])
    (copy, _) = compiled.predict_launches("x", "sm_90", "H200", root=tmp_path)
    assert copy["ceiling"] == "measured" and copy["bounds"]["memory"] == pytest.approx(1024 * 64 * 8192 / 4e12)


@pytest.mark.timeout(900)
def test_hand_checked_kernels_compiled_for_sm90():
    """The calibration kernels compiled for sm_90 and predicted on H200 land where the hand count says."""
    if not _has_ptxas():
        pytest.skip("Triton's NVIDIA backend (bundled ptxas) is not installed")
    rows = compiled.inspect(["py:inferbook.compiled.calibration:launches"], ["sm_90"], jobs=1)
    p = {r["launch"]: compiled.predict(r, "H200") for r in rows}
    assert p["copy"]["bound"] == "memory" and p["copy"]["frac_of_copy"] == pytest.approx(1.0)
    assert p["copy"]["trips"] == 64 and p["copy"]["trips_from"] == "ttir"
    assert p["gemm 132 tiles"]["bound"] == "compute"
    assert p["gemm 132 tiles"]["seconds"] == pytest.approx(2 * 128 * 128 * 8192 / (989.4e12 / 132))
    assert p["gemm 144 tiles"]["bound"] == "waves"
    assert p["copy tiny grid"]["bound"] == "latency"


# ---------------------------------------------------------------------------------------------------
# Builders against launchers: run the launcher in the interpreter with `run` recorded (not executed)

@pytest.fixture
def recorded(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    calls = []

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, list(args), dict(kwargs)))

    monkeypatch.setattr(InterpretedFunction, "run", record)
    return calls


def _same_bytes(call, launch):
    """The builder's stand-ins have the launcher's element counts (the cost model counts their bytes)."""
    for i, (a, b) in enumerate(zip(call[1], launch.args)):
        if isinstance(a, torch.Tensor):
            assert a.numel() == b.numel(), f"{launch.name}: argument {i}: {tuple(a.shape)} vs {tuple(b.shape)}"


def _same(call, launch, skip=()):
    kernel, args, kwargs = call
    assert kernel is launch.kernel, f"{launch.name}: launcher ran {kernel}, builder says {launch.kernel}"
    assert len(args) == len(launch.args), f"{launch.name}: {len(args)} positional arguments vs {len(launch.args)}"
    for i, (a, b) in enumerate(zip(args, launch.args)):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, f"{launch.name}: argument {i}: {a.dtype} vs {b}"
        elif isinstance(a, float):
            assert b == pytest.approx(a), f"{launch.name}: argument {i}: {a} vs {b}"
        else:
            assert a == b, f"{launch.name}: argument {i}: {a!r} vs {b!r}"
    want = {k: v for k, v in launch.kwargs.items() if k not in skip}
    got = {k: v for k, v in kwargs.items() if k not in skip}
    assert got == want, f"{launch.name}: keyword arguments differ"


def test_flash_builder_matches_launcher(recorded):
    from inferbook.attention import flash

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 40, 4 + 2 * 2, 64, generator=g).bfloat16()
    q, k, v = (t.clone().requires_grad_() for t in (qkv[:, :37, :4], qkv[:, :40, 4:6], qkv[:, :40, 6:]))
    sinks = torch.randn(4, generator=g).requires_grad_()
    out, lse = flash._FlashAttention.apply(q, k, v, sinks, flash._meta_for(
        q, k, causal=True, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
        max_seqlen_k=None, pack_gqa=True))
    flash._backward(torch.randn_like(q), q, k, v, out, lse, sinks, flash._meta_for(
        q, k, causal=True, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
        max_seqlen_k=None, pack_gqa=True))
    built = flash.attention_launches(compiled.meta(q.shape, q.dtype), compiled.meta(k.shape, k.dtype),
                                     compiled.meta(v.shape, v.dtype), causal=True, sinks=True, backward=True,
                                     device=q.device)
    assert len(recorded) == len(built) == 3
    for call, launch in zip(recorded, built):
        _same(call, launch)


def test_w4a16_and_fused_moe_builders_match_launchers(recorded, monkeypatch):
    from inferbook.moe import fused_moe as FM, mxfp4 as MXF, mxfp4_decode as MXD, w4a16 as W

    monkeypatch.setattr(W, "dot_needs_fp32", lambda d: False)      # what a GPU passes
    monkeypatch.setattr(FM, "dot_needs_fp32", lambda d: False)
    g = torch.Generator().manual_seed(1)
    H, I, E, k, T = 128, 64, 4, 2, 8
    x = torch.randn(T, H, generator=g).bfloat16()
    for m, layout in ((1, "indexed"), (37, "grouped_masked"), (100, "grouped_contiguous")):
        recorded.clear()
        q = W.quantize(torch.randn(96, H, generator=g), layout=layout)
        W.linear(torch.randn(m, H, generator=g).bfloat16(), q, block="gpu")
        (launch,) = W.linear_launches(m, 96, H, layout)
        _same(recorded[0], launch)
        _same_bytes(recorded[0], launch)
    # each expert gets T*k/E rows, as the builder assumes for the masked layout's max_m
    ids = (torch.arange(T * k, dtype=torch.int32) % E).reshape(T, k)
    tw = torch.rand(T, k, generator=g)
    for layout in W.LAYOUTS:
        recorded.clear()
        w13 = W.quantize(torch.randn(E, 2 * I, H, generator=g), layout=layout)
        w2 = W.quantize(torch.randn(E, H, I, generator=g), layout=layout)
        FM.fused_moe(x, w13, w2, tw, ids, block="gpu", max_m=2 * (T * k // E))
        built = FM.fused_moe_launches(T, k, E, H, I, layout)
        assert len(recorded) == len(built) == 3, layout
        for call, launch in zip(recorded, built):
            _same(call, launch)
    act = torch.randn(T * k, I, generator=g).bfloat16()
    weights = {"w4a16": W.quantize(torch.randn(E, H, I, generator=g), layout="indexed"),
               "mxfp4": MXF.quantize(torch.randn(E, H, I, generator=g)),
               "bf16": torch.randn(E, H, I, generator=g).bfloat16()}
    for fmt, w2 in weights.items():
        for kernel in FM.TAIL_KERNELS if fmt in FM.DECODE_FORMATS else ("expert-major", "token-major"):
            w = w2
            if kernel == "decode":   # the decode tail reads the decode packing
                w = MXD.pack_decode(w2) if fmt == "mxfp4" else W.pack_decode(w2)
            for fused, inter in ((True, torch.bfloat16), (False, torch.bfloat16), (False, torch.float32)):
                recorded.clear()
                FM.moe_tail(act, w, tw, ids, fused=fused, inter_dtype=inter, block="gpu", kernel=kernel)
                built = FM.moe_tail_launches(T, k, E, H, I, fmt, fused=fused, inter_dtype=inter, kernel=kernel)
                assert len(recorded) == len(built), (fmt, kernel, fused)
                for call, launch in zip(recorded, built):
                    _same(call, launch)
    # MXFP4's exact-scale decode path (a scale byte outside FOLD_SCALES): what moe_tail runs is the fold=False build
    exact = dataclasses.replace(MXD.pack_decode(weights["mxfp4"]), fold=False)
    recorded.clear()
    FM.moe_tail(act, exact, tw, ids, fused=True, block="gpu", kernel="decode")
    (built,) = FM.moe_tail_launches(T, k, E, H, I, "mxfp4", fused=True, kernel="decode", fold=False)
    assert len(recorded) == 1 and not built.kwargs["FOLD"]
    _same(recorded[0], built)


def test_latent_tail_builders_match_launchers(recorded, monkeypatch):
    # the latent tail's launches, GEMM2 on the tl.dot kernel and on the decode loop, as run_tail launches them
    from inferbook.moe import fused_moe as FM, latent_tail as LT, w4a16 as W

    monkeypatch.setattr(W, "dot_needs_fp32", lambda d: False)      # what a GPU passes
    monkeypatch.setattr(FM, "dot_needs_fp32", lambda d: False)
    monkeypatch.setattr(LT, "dot_needs_fp32", lambda d: False)
    monkeypatch.setattr(LT, "bf16_cast_needs_emulation", lambda d: False)
    T, k, E, L, H, I = 3, 2, 4, 96, 64, 64
    for fmt, gemm2 in (("mxfp4", "decode"), ("w4a16", "decode"), ("mxfp4", "expert-major"), ("bf16", "expert-major")):
        x = LT.make_inputs(1, T, L, H, E, k, I, fmt=fmt, seed=4, gemm2=gemm2)
        for v in LT.VARIANTS:
            recorded.clear()
            LT.run_tail(x, v, block="gpu")
            built = LT.tail_launches(T, k, E, L, H, I, 1, fmt, v, gemm2=gemm2)
            assert len(recorded) == len(built), (fmt, gemm2, v)
            for call, launch in zip(recorded, built):
                _same(call, launch)


def test_mx_and_tail_builders_match_launchers(recorded, monkeypatch):
    from inferbook import device as D
    from inferbook.comm import tail
    from inferbook.numerics import mx

    g = torch.Generator().manual_seed(2)
    for axis, block in ((-1, 32), (0, 32), (None, (32, 32))):
        recorded.clear()
        mx.quantize_triton(torch.randn(67, 133, generator=g), "e2m1", axis=axis, block=block, scale_rounding="up")
        (launch,) = mx.quantize_launches((67, 133), torch.float32, "e2m1", axis=axis, block=block, scale_rounding="up")
        _same(recorded[0], launch)
    recorded.clear()
    monkeypatch.setattr(D, "bf16_cast_needs_emulation", lambda d: False)
    N, T, H = 2, 5, 96
    p = torch.randn(N, T, H, generator=g).bfloat16()
    s, r, w = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16(), torch.randn(H).bfloat16()
    tail.fused_tail(p, s, r, w, backend="triton")
    built = [la for la in tail.tail_launches(N, T, H, 3) if la.kernel is tail._fused_tail_kernel]
    _same(recorded[0], built[0])


@pytest.mark.parametrize("layout", ["ndhwc", "ncdhw"])
def test_recording_on_meta_matches_the_real_launch(recorded, monkeypatch, layout):
    """`compiled.recording` on storage-less meta tensors (how h3-vae-fusion traces its model) sees the
    launches the real call makes: same kernels, dtypes, ints (strides, sizes) and constexprs."""
    from inferbook.diffusion import fused as FU

    monkeypatch.setattr(FU, "bf16_cast_needs_emulation", lambda d: False)   # the real call as on a GPU

    g = torch.Generator().manual_seed(3)
    B, C, T, H, W = 1, 64, 3, 5, 7
    x = torch.randn(B, C, T, H, W, generator=g).bfloat16()
    if layout == "ndhwc":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    norm = FU.Norm("group", torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g))
    FU.norm_silu_pad_triton(x, norm, (1, 1, 1, 1, 2))
    real = list(recorded)
    xm = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    nm = FU.Norm("group", torch.empty(C, device="meta"), torch.empty(C, device="meta"))
    with compiled.recording() as traced:
        FU.norm_silu_pad_triton(xm, nm, (1, 1, 1, 1, 2))
    assert [la.kernel for la in traced] == [FU._frame_stats_kernel, FU._norm_silu_pad_kernel, FU._norm_silu_pad_kernel]
    assert len(real) == len(traced)
    for call, launch in zip(real, traced):
        _same(call, launch)
    assert traced[1].kwargs["EMULATE_BF16"] is False                 # answered as on a GPU


def test_h3_trace_uses_the_gpu_tiles():
    launches = compiled.launches_for("h3-vae-fusion")
    from inferbook.diffusion import fused as FU

    lin = [la for la in launches if la.kernel is FU._fused_linear_kernel]
    gpu_m = {c["BLOCK_M"] for c in FU.LINEAR_GPU_CONFIGS.values()}
    assert lin and all(la.kwargs["BLOCK_M"] in gpu_m and la.kwargs.get("num_stages") for la in lin)
    kernels = {la.kernel for la in launches}
    assert {FU._frame_stats_kernel, FU._norm_silu_pad_kernel, FU._rms_rope_kernel,
            FU._conv3d_implicit_gemm_kernel} <= kernels
    assert all(not la.kwargs.get("EMULATE_BF16") and not la.kwargs.get("DOT_FP32") for la in launches)


@pytest.fixture
def gpu_flags(monkeypatch):
    """The device flags a GPU gives the launchers (no fp32 dot upcast, no bf16-cast emulation)."""
    from inferbook import device as D

    monkeypatch.setattr(D, "dot_needs_fp32", lambda d: False)
    monkeypatch.setattr(D, "bf16_cast_needs_emulation", lambda d: False)


def test_mx_rowcol_builder_matches_launcher(recorded):
    from inferbook.numerics import mx

    x = torch.randn(67, 133, generator=torch.Generator().manual_seed(5)).bfloat16()
    for rule in mx.SCALE_ROUNDING:
        recorded.clear()
        mx.quantize_rowcol_triton(x, "e4m3", scale_rounding=rule)
        (launch,) = mx.quantize_rowcol_launches(x.shape, x.dtype, "e4m3", scale_rounding=rule)
        assert launch.kernel is mx.mx_quantize_rowcol_kernel
        _same(recorded[0], launch)
    assert mx.quantize_rowcol_launches((0, 64)) == []


def test_lean_builder_matches_launcher(recorded, gpu_flags):
    from inferbook.attention import lean

    g = torch.Generator().manual_seed(6)
    B, H, Hk, D, S = 3, 6, 2, 40, 77
    q = torch.randn(B, H, D, generator=g).bfloat16()
    k, v = (torch.randn(B, S, Hk, D, generator=g).bfloat16() for _ in range(2))
    seqlens = [S, 0, 33]
    lean.lean_decode_attention(q, k, v, torch.tensor(seqlens, dtype=torch.int32), ctas=5)
    built = lean.lean_launches(seqlens, H, Hk, D, S, ctas=5, dtype=torch.bfloat16)
    assert [la.kernel for la in built] == [lean._lean_kernel, lean._lean_merge_kernel]
    assert len(recorded) == 2
    for call, launch in zip(recorded, built):
        _same(call, launch)
    # every length 0: no stream-K launch, only the merge (which writes the zeros)
    assert [la.kernel for la in lean.lean_launches([0, 0], H, Hk, D, S, ctas=5)] == [lean._lean_merge_kernel]


@pytest.mark.parametrize("d, dv, kw", [(64, 64, dict(window_size=(16, -1), causal=True)),
                                       (128, 64, dict(softcap=5.0)),
                                       (96, 96, dict(window_size=(9, 7), softcap=2.0))])
def test_flash_variant_builder_matches_launcher(recorded, d, dv, kw):
    """Window, softcap and dv != d live in the main kernel: its builder describes those launches too."""
    from inferbook.attention import flash

    g = torch.Generator().manual_seed(7)
    B, Sq, Sk, H, Hk = 2, 37, 45, 4, 2
    q = torch.randn(B, Sq, H, d, generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, Sk, Hk, d, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, Sk, Hk, dv, generator=g).bfloat16().requires_grad_()
    out = flash.attention(q, k, v, **kw)
    flash._backward(torch.randn_like(out), q, k, v, out, torch.zeros(H, B * Sq), None, _variant_meta(flash, q, k, v, kw))
    built = flash.attention_launches(compiled.meta(q.shape, q.dtype), compiled.meta(k.shape, k.dtype),
                                     compiled.meta(v.shape, v.dtype), backward=True, device=q.device, **kw)
    assert len(recorded) == len(built) == 3
    for call, launch in zip(recorded, built):
        _same(call, launch)


def _variant_meta(flash, q, k, v, kw):
    meta = flash._meta_for(q, k, causal=kw.get("causal", False), softmax_scale=None, cu_seqlens_q=None,
                           cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, pack_gqa=True, v=v)
    meta.window, meta.softcap = flash._check_window_softcap(kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0))
    return meta


def test_fused_exchange_is_covered_by_the_tail_builders(recorded, monkeypatch):
    """comm/fused_exchange.py's finalize into a buffer slot is the launch the tail builders describe."""
    from inferbook import device as D
    from inferbook.comm import fused_exchange, tail

    monkeypatch.setattr(D, "bf16_cast_needs_emulation", lambda d: False)     # what a GPU passes
    g = torch.Generator().manual_seed(8)
    T, K, H = 5, 3, 96
    buf = torch.empty(2, T, H, dtype=torch.bfloat16)
    fused_exchange.finalize_into(torch.randn(T, K, H, generator=g).bfloat16(), torch.rand(T, K, generator=g), buf[1],
                                 backend="triton")
    final = [la for la in tail.tail_launches(2, T, H, K) if la.kernel is tail._finalize_kernel]
    assert len(recorded) == 1 and final
    _same(recorded[0], final[0])


# ---------------------------------------------------------------------------------------------------
# The compile check itself

# sm_90 by default; INFERBOOK_COMPILE_TARGETS=sm_80,sm_90,sm_100 checks all three. The committed
# tables (data/compiled/, their fingerprints checked below for every target) hold the others.
TARGETS = [t.strip() for t in os.environ.get("INFERBOOK_COMPILE_TARGETS", "sm_90").split(",") if t.strip()]
REGENERATE = "PYTHONPATH=$PWD/src python -m inferbook.cli inspect --all --target all --save --jobs 2"
# (one target at a time also works: --save keeps the other targets' rows)

# Known failures, each to be removed by the change that fixes it. A matching row is reported, not
# failed; once no matching row fails any more, the test fails until the entry is removed.
# (target, kernel, text in the launch name) -> why. Issue 13 item 2 fixes these (the MoE kernels
# are being rewritten on other branches): at merge, delete each entry whose fix has landed (the
# test says which), and the check then holds the fixed kernels to the limits.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {
    # empty: the W4A16 loader's shared memory on sm_80, moe_gemm's decode spills on sm_90 and MX
    # quantize's 128x128 spills were fixed on the moe and numerics branches
}


def _known(row: dict):
    """The KNOWN_FAILURES key a row falls under, or None."""
    return next((k for k in KNOWN_FAILURES
                 if k[0] == row["target"] and k[1] == row.get("kernel") and k[2] in row["launch"]), None)


def _sort_problems(rows: list[dict]) -> tuple[list[str], list[dict], set]:
    """(failures outside KNOWN_FAILURES as messages, rows of known failures that still fail, the
    KNOWN_FAILURES keys no row fails any more)."""
    bad, known, fixed = [], [], set(KNOWN_FAILURES)
    for r in rows:
        key, why = _known(r), compiled.problems(r)
        if key is not None:
            if why:
                fixed.discard(key)
                known.append(r)
            continue
        if why:
            bad.append(f"{r['slug']}: {r['launch']} ({r.get('source', '')}) on {r['target']}: {'; '.join(why)}")
    return bad, known, fixed


def _has_ptxas() -> bool:
    try:
        from triton.backends.nvidia import compiler as nvc

        return os.path.isfile(nvc.get_ptxas(90).path)
    except Exception:
        return False


# The facts a fresh compile must reproduce from the committed row: everything the row holds but its
# place in the table (and, outside the full sweep, the AMD rows' NVIDIA-counterpart compiles, which are
# sampled by position among the compiled launches).
NOT_COMPILER_FACTS = ("slug", "index", "compile_s")
FULL = os.environ.get("INFERBOOK_COMPILE_FULL", "") not in ("", "0")


def representatives(tables: dict[str, dict], targets: list[str]) -> dict[str, list[int]]:
    """{slug: launch indices} to compile: for each target, one launch per distinct kernel (its name and
    source hash, across chapters), the committed row with the most shared memory, then registers,
    then spills (the launch nearest the limits), the first such in chapter and launch order. Rows
    of a launch that failed to build (index -1) are never representatives (the table test fails them)."""
    best: dict[tuple, tuple] = {}
    for n, (slug, doc) in enumerate(tables.items()):
        for r in doc["rows"]:
            if r["target"] not in targets or r.get("index", -1) < 0:
                continue
            key = (r["target"], r["kernel"], r["kernel_src"])
            rank = (-(r.get("shared_kb") or 0), -(r.get("regs") or r.get("vgprs") or 0), -(r.get("spill_bytes") or 0),
                    n, r["index"])
            if key not in best or rank < best[key][0]:
                best[key] = (rank, slug, r["index"])
    out: dict[str, list[int]] = {}
    for _, slug, i in sorted(best.values()):
        out.setdefault(slug, []).append(i)
    return {s: sorted(set(ix)) for s, ix in out.items()}


def compile_differences(fresh: dict, committed: dict, skip=()) -> list[str]:
    """The committed row's facts that a fresh compile of its launch does not reproduce, one line each."""
    return [f"{k}: committed {committed[k]!r} vs compiled {fresh.get(k)!r}"[:300]
            for k in committed if k not in NOT_COMPILER_FACTS and k not in skip and fresh.get(k) != committed[k]]


def test_compile_differences_sees_a_tampered_row():
    """The comparison can fail: a committed row with its registers, shared memory or MMA changed differs
    from the same row; the untouched row does not."""
    doc = compiled.load_table(compiled.kernel_chapters()[0])
    row = next(r for r in doc["rows"] if r["target"] == "sm_90" and r.get("ok"))
    fresh = {**row, "compile_s": 1.0}
    assert compile_differences(fresh, row) == []
    for k, v in (("regs", (row.get("regs") or 0) + 8), ("shared_kb", row["shared_kb"] + 1), ("mma", "none")):
        assert compile_differences(fresh, {**row, k: v}) == [f"{k}: committed {v!r} vs compiled {row[k]!r}"]
    tables = {"a": {"rows": [{**row, "index": 0, "shared_kb": 1.0}, {**row, "index": 1, "shared_kb": 2.0}]},
              "b": {"rows": [{**row, "index": 0, "shared_kb": 2.0}]}}
    assert representatives(tables, ["sm_90"]) == {"a": [1]}   # most shared memory; the first chapter on a tie


@pytest.mark.timeout(1800)  # cold, on a loaded 2-core machine: minutes (warm: seconds); the full sweep longer
def test_representative_gpu_launches_compile_as_committed():
    """One test (so that pytest-xdist runs the compiles once): for each target, one launch per distinct
    kernel (`representatives`: the one nearest the limits) compiles fresh to exactly its committed row in
    data/compiled/ (registers, shared memory, spills, MMA, load widths, SASS main loop, IR trips...), and
    fits. With the neighbouring table test (every committed row is a launch built today, and none has a
    problem) this says the tables are what today's compiler makes of the gpu-preset launches, at a tenth
    of the cost of compiling all of them. INFERBOOK_COMPILE_FULL=1 compiles and compares every launch.
    A table made by another Triton than the one installed is only compiled and held to the limits."""
    if not _has_ptxas():
        pytest.skip("Triton's NVIDIA backend (bundled ptxas) is not installed")
    slugs = compiled.kernel_chapters()
    tables = {s: compiled.load_table(s) for s in slugs}
    missing = [s for s, doc in tables.items() if doc is None]
    assert not missing, f"no committed compile table for {missing}; regenerate with `{REGENERATE}`"
    only = ({s: sorted({r["index"] for r in doc["rows"] if r["target"] in TARGETS}) for s, doc in tables.items()}
            if FULL else representatives(tables, TARGETS))
    rows = compiled.inspect([s for s in slugs if s in only], TARGETS, jobs=2, only=only)
    got = {(r["slug"], r["index"], r["target"]) for r in rows}
    want = {(s, i, t) for s, ix in only.items() for i in ix for t in TARGETS
            if any(r["index"] == i and r["target"] == t for r in tables[s]["rows"])}
    assert got >= want, f"no compile row for {sorted(want - got)[:10]}"
    bad, known, fixed = _sort_problems(rows)
    if known:
        import warnings

        warnings.warn(f"{len(known)} known failure(s) still fail (KNOWN_FAILURES): " + "; ".join(
            f"{r['launch']} on {r['target']}: {'; '.join(compiled.problems(r))}" for r in known))
    assert not bad, f"{len(bad)} gpu-preset launch(es) fail:\n" + "\n".join(bad)
    if FULL:
        fixed = {k for k in fixed if k[0] in TARGETS}        # a target not checked here proves nothing
        assert not fixed, f"these known failures no longer fail; remove them from KNOWN_FAILURES: {sorted(fixed)}"
    committed = {(s, r["index"], r["target"]): r for s, doc in tables.items() for r in doc["rows"]}
    versions = {s: doc.get("triton") for s, doc in tables.items()}
    differ = []
    for r in rows:
        if versions[r["slug"]] != triton.__version__:
            continue
        d = compile_differences(r, committed[(r["slug"], r["index"], r["target"])], skip=() if FULL else ("nvidia_config",))
        if d:
            differ.append(f"{r['slug']} {r['target']} launch {r['index']} ({r['launch']}): " + "; ".join(d))
    other = sorted(s for s, v in versions.items() if v != triton.__version__)
    if other:
        import warnings

        warnings.warn(f"tables made by another Triton than {triton.__version__} are compiled, not compared: {other}")
    assert not differ, (f"{len(differ)} committed row(s) are not what today's compiler makes; regenerate with "
                        f"`{REGENERATE}`:\n" + "\n".join(differ)[:6000])


def _first_difference(have: list[dict], want: list[dict]) -> str:
    for i, (h, w) in enumerate(zip(have, want)):
        if h != w:
            fields = [k for k in w if h.get(k) != w[k]]
            return f"launch {i} ({w['launch']}): " + "; ".join(f"{k} table {h.get(k)!r} vs built {w[k]!r}" for k in fields)
    return f"{len(have)} rows in the table vs {len(want)} launches built"


def test_committed_compile_tables_are_current_and_clean():
    """data/compiled/<slug>.json (what the chapter pages show) holds, for sm_80, sm_90 and sm_100,
    exactly the launches `gpu_launches` builds today (name, kernel and its source, argument
    specialisation, constexprs and warps/stages, in order), and no row with a problem outside
    KNOWN_FAILURES. Builds the launch lists only; compiles nothing."""
    from pathlib import Path

    slugs = compiled.kernel_chapters()
    root = Path(compiled.repo_root()) / compiled.DATA_DIR
    extra = sorted(p.stem for p in root.glob("*.json") if p.stem not in slugs)
    assert not extra, f"tables for chapters that launch no Triton kernel: {extra}"
    stale, rows = [], []
    for slug in slugs:
        doc = compiled.load_table(slug)
        if doc is None:
            stale.append(f"{slug}: no table")
            continue
        # every NVIDIA target; an AMD target wherever the table has it (the integrator's full regeneration
        # adds gfx942 and gfx950 to every table); each target's launches built for it (device.pick_config)
        targets = list(compiled.NVIDIA_TARGETS) + [t for t in compiled.AMD_TARGETS if t in doc.get("targets", [])]
        built = compiled.launches_by_target(slug, targets)
        for t in targets:
            want = [compiled.launch_fingerprint(la) for la in built[t]]
            got = sorted((r for r in doc["rows"] if r["target"] == t), key=lambda r: r["index"])
            have = [compiled.row_fingerprint(r) for r in got]
            if have != want:
                stale.append(f"{slug} {t}: {_first_difference(have, want)}"[:400])
        rows += [{**r, "slug": slug} for r in doc["rows"]]
    assert not stale, (f"{len(stale)} stale compile table(s) in data/compiled/; regenerate with `{REGENERATE}`:\n"
                       + "\n".join(stale))
    bad, _, fixed = _sort_problems(rows)
    assert not bad, f"{len(bad)} problem row(s) in the committed tables:\n" + "\n".join(bad)
    assert not fixed, f"the committed tables show these known failures fixed; remove them: {sorted(fixed)}"


def test_every_kernel_chapter_counts_its_roofline_work():
    """The pages' "What the compiler made of it" cell calls `roofline_work(gpu params)`: it must run
    (a chapter rewrite once left it calling removed functions) and give positive byte counts."""
    from inferbook import toc

    for slug in compiled.kernel_chapters():
        mod = toc.load_module(toc.get_chapter(slug))
        work = mod.roofline_work(compiled.gpu_params(slug))
        assert work and all(w["bytes"] > 0 and w["flops"] >= 0 and w["name"] for w in work), slug


def test_peer_launches_at_our_shapes():
    """liger-kernel's RMSNorm, traced at sglang-fused-comm's RMSNorm shapes by its own config code
    (skipped where the optional peer is not installed)."""
    pytest.importorskip("liger_kernel")
    from inferbook.compiled import peers

    built = peers.sglang_fused_comm()
    ours = peers._our_rmsnorm_shapes("sglang-fused-comm")
    assert ours and [la.name for la in built] == [f"liger rmsnorm T{T} H{H}" for T, H in ours]
    assert all(la.grid == (T,) for la, (T, _) in zip(built, ours))
    assert peers.available()["liger-kernel"] == "ok"


def test_the_page_sets_ours_beside_the_committed_peer():
    """data/compiled/peers/sglang-fused-comm.json (liger's RMSNorm compiled at our shape, sm_90): the
    section's third line gives ours / peer from the same model."""
    sec = compiled.CompilerSection("sglang-fused-comm")
    assert "ours / liger-kernel = T" in sec.lines[2] and "predicted" in sec.lines[2]


def test_decode_and_mx_gemm_builders_match_launchers(recorded, monkeypatch):
    from inferbook.moe import fused_moe as FM, w4a16 as W
    from inferbook.numerics import mx

    monkeypatch.setattr(W, "dot_needs_fp32", lambda d: False)      # what a GPU passes
    monkeypatch.setattr(FM, "dot_needs_fp32", lambda d: False)
    g = torch.Generator().manual_seed(5)
    d = W.pack_decode(W.quantize(torch.randn(256, 512, generator=g)))
    for deterministic in (True, False):
        recorded.clear()
        W.decode_linear(torch.randn(3, 512, generator=g).bfloat16(), d, deterministic=deterministic, block="gpu")
        (launch,) = W.decode_launches(3, 256, 512, deterministic=deterministic)
        _same(recorded[0], launch)
        _same_bytes(recorded[0], launch)
    E, H, I, T, k = 4, 256, 64, 4, 2
    ids = (torch.arange(T * k, dtype=torch.int32) % E).reshape(T, k)
    d13 = W.pack_decode(W.quantize(torch.randn(E, 2 * I, H, generator=g)))
    d2 = W.pack_decode(W.quantize(torch.randn(E, H, I, generator=g)))
    recorded.clear()
    FM.fused_moe_decode(torch.randn(T, H, generator=g).bfloat16(), d13, d2, torch.rand(T, k, generator=g), ids,
                        max_m=2, block="gpu")
    built = FM.fused_moe_decode_launches(T, k, E, H, I, max_m=2)
    assert len(recorded) == len(built) == 3
    for call, launch in zip(recorded, built):
        _same(call, launch)
        if launch.kernel is FM.moe_decode_kernel:
            _same_bytes(call, launch)
    # a simulated EP rank (minimax-m3-moe): expert_map skips the other ranks' slots, fp32 partials
    recorded.clear()
    emap = torch.tensor([0, 1, -1, -1, 2, 3, -1, -1], dtype=torch.int32)
    FM.fused_moe_decode(torch.randn(T, H, generator=g).bfloat16(), d13, d2, torch.rand(T, k, generator=g),
                        (torch.arange(T * k, dtype=torch.int32) % 8).reshape(T, k), max_m=T, block="gpu",
                        out_dtype=torch.float32, expert_map=emap)
    built = FM.fused_moe_decode_launches(T, k, E, H, I, max_m=T, out_dtype=torch.float32)
    assert len(recorded) == len(built) == 3
    for call, launch in zip(recorded, built):
        _same(call, launch)
    recorded.clear()
    a, b = mx.quantize(torch.randn(32, 256, generator=g), "e4m3"), mx.quantize(torch.randn(48, 256, generator=g), "e4m3")
    monkeypatch.setattr(mx, "_interpreted", lambda: True)
    mx.mx_gemm(a, b, block="gpu")
    (launch,) = mx.mx_gemm_launches(32, 48, 256)
    _same(recorded[0], launch, skip=("EMULATE", "DOT_FP32"))       # the CPU run decodes; the GPU launch does not
