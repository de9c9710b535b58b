"""What the machine code of one compiled kernel does per CTA: its main loop and trip count.

Pure functions on text, unit-tested on fixed listings (tests/test_compiled.py):

- `sass_instructions(text)` / `amdgcn_instructions(text)`: a disassembly as a list of
  `(kind, text)` items, kind "label" or "insn" (nvdisasm of the cubin; the AMDGCN assembly).
- `main_loop(items, isa)`: how the main loop is found — every backward branch (a branch to a label
  earlier in the listing) closes a loop whose body runs from the label to the branch; the innermost
  loops (no other loop inside) are candidates, and the main loop is the candidate that moves the
  most global-memory bytes per iteration (ties: the most matrix instructions, then the longest). It
  returns that body's instruction count, global bytes per warp (wave) per iteration, matrix
  instructions, whether its loads are asynchronous copies (cp.async / TMA / direct-to-LDS, which let
  `num_stages` iterations be in flight), the whole kernel's instruction count, and the global-load
  latencies one trip waits one after another, and the code outside the loop (`load_rounds`: each
  register, and each barrier, ready in the round of the last synchronous load it depends on).
- `ttir_loops(ttir, ints, grid, pid)`: the trip counts of the kernel's `scf.for` loops, evaluated from
  the Triton IR's loop bounds with the launch's own integer arguments and one program (`pid`; default
  the program in the middle of the grid) (None where a bound depends on memory, e.g. routing counts
  loaded in the kernel), and the tensor-core FLOPs one CTA executes (`tt.dot` / `tt.dot_scaled`:
  2·M·N·K each, times the trips of the loops around it).
- `program_trips(ttir, ints, grid)`: the main loop's trips across the grid: evaluated at the first,
  middle and last program of each grid axis (the others held in the middle); where one axis changes
  them (an uneven split-K, a causal mask), at every program along it.
"""
from __future__ import annotations

import re

# ---------------------------------------------------------------------------------------------------
# Disassembly -> items

_SASS_INSN = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;?\s*(?:/\*.*)?$")
_LABEL = re.compile(r"^\s*([.\w$]+):\s*(?:;.*|//.*)?$")


def sass_instructions(text: str) -> list[tuple[str, str]]:
    """nvdisasm's listing (`nvdisasm -c k.cubin`) as ('label', name) / ('insn', text) items."""
    out = []
    for line in text.splitlines():
        m = _SASS_INSN.match(line)
        if m:
            out.append(("insn", m.group(1).rstrip(" ;")))
            continue
        m = _LABEL.match(line)
        if m and not line.lstrip().startswith("."+"section"):
            out.append(("label", m.group(1)))
    return out


def amdgcn_instructions(text: str) -> list[tuple[str, str]]:
    """The AMDGCN assembly (Triton's `amdgcn` stage) of the kernel's body: items as above.
    Directives (lines starting with '.') and comments are dropped."""
    out = []
    in_body = False
    for raw in text.splitlines():
        line = raw.split(";")[0].split("//")[0].rstrip()
        if not line.strip():
            continue
        m = _LABEL.match(line)
        if m:
            name = m.group(1)
            if not name.startswith("."):
                in_body = True          # the kernel's symbol opens its body
            out.append(("label", name))
            continue
        s = line.strip()
        if s.startswith("."):
            if s.startswith(".end_amdgpu_metadata") or s.startswith(".section"):
                in_body = in_body and not s.startswith(".section")
            continue
        if in_body and re.match(r"^[sv]_|^buffer_|^global_|^flat_|^ds_|^scratch_", s):
            out.append(("insn", s))
    return out


# ---------------------------------------------------------------------------------------------------
# What one instruction does

# `@P0 BRA `(.L_x_1)` (sm_80/90) and `BRA.U UP0, `(.L_x_1)` (sm_100: a uniform predicate as an operand)
_SASS_BRANCH = re.compile(r"\bBRA(?:\.[A-Z]+)*\s+(?:!?U?P[T\d]+\s*,\s*)?`?\(?([.\w$]+)\)?")
_AMD_BRANCH = re.compile(r"^s_(?:cbranch_\w+|branch)\s+([.\w$]+)")
_SASS_MMA = re.compile(r"\b(?:HMMA|HGMMA|IMMA|QGMMA|UTC\w*MMA\w*|DMMA|OMMA)\b")
_AMD_MMA = re.compile(r"^v_(?:s?mfma|wmma)\w*")


def _sass_global_bytes(insn: str) -> int:
    """Bytes one thread moves from global memory in one SASS instruction (0 for anything else):
    LDG / LDGSTS with their width suffix (.U8/.S8 1, .U16/.S16 2, none 4, .64 8, .128 16)."""
    op = insn.split()[0] if not insn.startswith("@") else insn.split()[1]
    if not (op.startswith("LDG.") or op == "LDG" or op.startswith("LDGSTS")):
        return 0
    if op.startswith("LDGDEPBAR"):
        return 0
    for suffix, n in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if suffix in op:
            return n
    return 4


def _amd_global_bytes(insn: str) -> int:
    """Bytes one lane moves from global memory in one AMDGCN load (global_/buffer_load_*)."""
    m = re.match(r"^(?:global|buffer|flat)_load_(?:lds_)?(\w+)", insn)
    if not m:
        return 0
    kind = m.group(1)
    widths = {"dwordx4": 16, "b128": 16, "dwordx3": 12, "b96": 12, "dwordx2": 8, "b64": 8, "dword": 4, "b32": 4,
              "ushort": 2, "sshort": 2, "u16": 2, "i16": 2, "short_d16": 2, "short_d16_hi": 2, "ubyte": 1, "sbyte": 1,
              "u8": 1, "i8": 1}
    return widths.get(kind, 4)


def _is_tma(insn: str) -> bool:
    return "UTMALDG" in insn or "UBLKCP" in insn


def _is_async(insn: str, isa: str) -> bool:
    if isa == "sass":
        return "LDGSTS" in insn or _is_tma(insn)
    return bool(re.match(r"^(?:global|buffer)_load_lds_|^(?:global|buffer)_load_\w+.*\blds\b", insn))


# ---------------------------------------------------------------------------------------------------
# The main loop

def loops(items: list[tuple[str, str]], isa: str = "sass") -> list[tuple[int, int]]:
    """(start, end) index pairs into `items`, one per backward branch: the body from the label to
    the branch instruction, inclusive."""
    where = {}
    out = []
    branch = _SASS_BRANCH if isa == "sass" else _AMD_BRANCH
    for i, (kind, text) in enumerate(items):
        if kind == "label":
            where[text] = i
            continue
        m = branch.search(text)
        if m and m.group(1) in where:            # the label is above: a backward branch
            out.append((where[m.group(1)], i))
    return out


def body_facts(items: list[tuple[str, str]], isa: str = "sass") -> dict:
    """Counts over a list of items: instructions, global bytes per warp, matrix instructions,
    async-copy loads, TMA loads."""
    lanes = 32 if isa == "sass" else 64
    n = gb = mma = asy = tma = 0
    for kind, text in items:
        if kind != "insn":
            continue
        n += 1
        if isa == "sass":
            b = _sass_global_bytes(text)
            mma += bool(_SASS_MMA.search(text))
            tma += _is_tma(text)
        else:
            b = _amd_global_bytes(text)
            mma += bool(_AMD_MMA.match(text))
        gb += b * lanes
        asy += _is_async(text, isa) and (b > 0 or _is_tma(text))
    return {"instrs": n, "global_bytes_per_warp": gb, "mma": mma, "async_loads": asy, "tma_loads": tma}


_SASS_REG = re.compile(r"\b(U?R\d+|U?P\d)(\.64|\.128)?\b")
_SASS_NO_DEST = ("ST", "STS", "STG", "STL", "STSM", "RED", "REDG", "BAR", "BRA", "EXIT", "DEPBAR", "LDGDEPBAR", "WARPSYNC",
                "BSYNC", "BSSY", "CALL", "RET", "NOP", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "SYNCS", "ARRIVES")
_AMD_VREG = re.compile(r"\b([vsa])(?:(\d+)|\[(\d+):(\d+)\])")


def _sass_regs(operand: str, wide: int) -> list[str]:
    """The registers an SASS operand names: R12.64 (or a .64/.128 instruction's R12) as R12, R13, ...; RZ/PT none."""
    out = []
    for m in _SASS_REG.finditer(operand):
        name, suffix = m.group(1), m.group(2)
        n = {".64": 2, ".128": 4}.get(suffix or "", 1)
        if name[0] == "R" or name.startswith("UR"):
            n = max(n, wide)
            base = "UR" if name.startswith("UR") else "R"
            k = int(name[len(base):])
            out += [f"{base}{k + i}" for i in range(n)]
        else:
            out.append(name)
    return out


def load_rounds(items: list[tuple[str, str]], isa: str = "sass") -> int:
    """How many global-load latencies `items` (a loop body, or a straight-line span) wait one after another: the
    longest chain of synchronous global loads each of which cannot issue before the one before it returns.
    A load waits on an earlier one when its address or predicate comes from it (the slot ids, then the rows
    they gather) or when it follows a barrier that waits on a store of the earlier load's data to shared
    memory (tiles staged one by one through one shared buffer: load, store, barrier, the next load). Each
    register carries the round its value is ready in (a synchronous load's destination one round after its
    operands), and so does a barrier (the latest round of the data stored to shared memory before it); the
    answer is the latest round anything waits for. A warp that stalls behind an ordinary store or an ALU
    instruction is not counted (that is the one latency a trip the model always charges). Asynchronous
    copies (cp.async, TMA, loads into LDS) return into shared memory, not a register, and their waits are the
    pipeline's: not counted; nor are atomics that return a value (their round trips are the cost model's
    synchronising atomics). The registers are the operands' (SASS: a .64 / .128 access names 2 / 4; AMDGCN:
    v7, s[4:7], a[0:3], vcc; a scalar load's destination is a load's too, s_barrier is the barrier, ds_write the
    store to shared memory)."""
    ready: dict[str, int] = {}
    top = bar = stored = 0
    for kind, text in items:
        if kind != "insn":
            continue
        role, dests, srcs = _sass_role(text) if isa == "sass" else _amd_role(text, isa)
        if role == "barrier":           # every instruction after it waits for the data stored before it
            bar = max(bar, stored)
            continue
        at = max([bar] + [ready.get(r, 0) for r in srcs])
        if role == "shared store":
            stored = max(stored, at)
        for r in dests:
            ready[r] = at + 1 if role == "load" else at
        top = max(top, at)
    return top


def _sass_role(text: str) -> tuple[str, list[str], list[str]]:
    """(role, destination registers, source registers) of one SASS instruction for `load_rounds`: role 'barrier'
    (BAR), 'shared store' (STS, STSM), 'load' (a synchronous global or generic load; LDS, LDSM and LDL are
    on-chip) or 'other'. The predicate is a source."""
    pred, body = "", text
    if body.startswith("@"):
        pred, _, body = body.partition(" ")
    op = body.split()[0] if body.split() else ""
    rest = body[len(op):].strip()
    operands = [o.strip() for o in rest.split(",")] if rest else []
    wide = 4 if ".128" in op else 2 if ".64" in op else 1
    base = op.split(".")[0]
    if base == "BAR":
        return "barrier", [], []
    is_store = base in _SASS_NO_DEST or base.startswith(("ST", "RED"))
    dests = [] if is_store or not operands else _sass_regs(operands[0], wide if base.startswith("LD") else 1)
    srcs = _sass_regs(pred, 1) + [r for o in (operands if is_store else operands[1:])
                                  for r in _sass_regs(o, wide if is_store else 1)]
    role = "shared store" if base in ("STS", "STSM") else "load" if base in ("LDG", "LD") else "other"
    return role, dests, srcs


def _amd_role(text: str, isa: str = "amdgcn") -> tuple[str, list[str], list[str]]:
    """`_sass_role` for one AMDGCN instruction: 'barrier' (s_barrier), 'shared store' (ds_write / ds_store),
    'load' (a synchronous global or buffer load, or a scalar load) or 'other'."""
    op = text.split()[0]
    rest = text[len(op):].strip()
    operands = [o.strip() for o in rest.split(",")] if rest else []
    if op == "s_barrier":
        return "barrier", [], []
    no_dest = op.startswith(_AMD_NO_DEST)
    dests = [] if no_dest or not operands else _amd_regs(operands[0])
    srcs = [r for o in (operands if no_dest else operands[1:]) for r in _amd_regs(o)]
    if op.startswith(("ds_write", "ds_store")):
        return "shared store", dests, srcs
    if (_amd_global_bytes(text) > 0 and not _is_async(text, isa)) or re.match(r"^s_(?:buffer_)?load_", op):
        return "load", dests, srcs
    return "other", dests, srcs


_AMD_NO_DEST = ("global_store", "buffer_store", "flat_store", "ds_write", "ds_store", "s_store", "s_cmp", "s_bitcmp",
                "s_cbranch", "s_branch", "s_waitcnt", "s_barrier", "s_endpgm", "s_nop", "s_setprio", "s_sleep",
                "global_atomic", "buffer_atomic", "s_sendmsg", "s_set", "v_cmpx", "s_dcache", "buffer_wbl2",
                "buffer_inv", "s_trap")


def _amd_regs(operand: str) -> list[str]:
    """The registers an AMDGCN operand names: v7, s[4:7] (s4 .. s7), a[0:3], vcc, exec."""
    out = []
    for m in _AMD_VREG.finditer(operand):
        kind, one, lo, hi = m.groups()
        out += [f"{kind}{one}"] if one is not None else [f"{kind}{k}" for k in range(int(lo), int(hi) + 1)]
    out += [w for w in ("vcc", "exec") if re.search(rf"\b{w}\b", operand)]
    return out


def executable(items: list[tuple[str, str]], isa: str = "sass") -> list[tuple[str, str]]:
    """`items` less the padding after the kernel's last instruction, which never executes: nvdisasm lists a
    `BRA` to its own label after the final EXIT (a trap for a fall-through) and then the NOPs that align the
    section (16 of the 952 instructions nvdisasm lists for the Kimi decode tail on sm_100). AMDGCN's listing
    ends at s_endpgm."""
    out = list(items)
    if isa != "sass":
        return out
    while out and (out[-1][0] == "label" or out[-1][1].split()[0] == "NOP"):
        out.pop()
    m = _SASS_BRANCH.search(out[-1][1]) if out else None
    if m and len(out) > 1 and out[-2] == ("label", m.group(1)) and not out[-1][1].startswith("@"):
        out = out[:-2]
    return out


def main_loop(items: list[tuple[str, str]], isa: str = "sass") -> dict:
    """The kernel's main loop, found as the module docstring says: {'instrs', 'global_bytes_per_warp',
    'mma', 'async', 'tma_loads', 'kernel_instrs', 'loops', 'load_rounds', 'outside_load_rounds'} ('instrs' 0
    when the kernel has no loop): `load_rounds` of the loop's body (one trip), and of the code before and
    after it (the prologue's and the epilogue's, added; the whole kernel where there is no loop)."""
    items = executable(items, isa)       # the trap after EXIT and the alignment NOPs are neither loop nor work
    spans = loops(items, isa)
    spans = [(a, b) for a, b in spans if sum(k == "insn" for k, _ in items[a:b + 1]) > 1]   # not a one-instruction spin
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    whole = body_facts(items, isa)
    best, best_key = None, None
    for a, b in inner:
        f = body_facts(items[a:b + 1], isa)
        key = (f["global_bytes_per_warp"] + 1e6 * f["tma_loads"], f["mma"], f["instrs"])
        if best_key is None or key > best_key:
            best, best_key, best_span = f, key, (a, b)
    if best is None:
        return {"instrs": 0, "global_bytes_per_warp": 0, "mma": 0, "async": False, "tma_loads": 0,
                "kernel_instrs": whole["instrs"], "loops": 0, "load_rounds": 0,
                "outside_load_rounds": load_rounds(items, isa)}
    a, b = best_span
    return {"instrs": best["instrs"], "global_bytes_per_warp": best["global_bytes_per_warp"], "mma": best["mma"],
            "async": best["async_loads"] > 0 or best["tma_loads"] > 0, "tma_loads": best["tma_loads"],
            "kernel_instrs": whole["instrs"], "loops": len(spans), "load_rounds": load_rounds(items[a:b + 1], isa),
            "outside_load_rounds": load_rounds(items[:a], isa) + load_rounds(items[b + 1:], isa)}


# ---------------------------------------------------------------------------------------------------
# Trip counts and FLOPs from the Triton IR

_TT_ARG = re.compile(r"%([\w$.-]+): (?:i1|i8|i16|i32|i64|f32|f16|bf16|!tt\.ptr<[^>]*>)")
_TT_DEF = re.compile(r"^\s*%([\w$.-]+)(?::\d+)? = ([\w.]+)(.*)$")
_TT_FOR = re.compile(r"scf\.for %([\w$.-]+) = %([\w$.-]+) to %([\w$.-]+) step %([\w$.-]+)")
_TT_DOT = re.compile(r"tt\.dot(?:_scaled)?\b.*?: tensor<(\d+)x(\d+)x(\w+)>.*?\* tensor<(\d+)x(\d+)x")
_INT = re.compile(r"^\s*(-?\d+)")


def _int_binop(op: str, a: int, b: int) -> int | None:
    if op == "arith.addi":
        return a + b
    if op == "arith.subi":
        return a - b
    if op == "arith.muli":
        return a * b
    if op in ("arith.divsi", "arith.divui"):
        return int(a / b) if b else None
    if op == "arith.ceildivsi":
        return -(-a // b) if b else None
    if op == "arith.floordivsi":
        return a // b if b else None
    if op in ("arith.remsi", "arith.remui"):
        return a - b * int(a / b) if b else None
    if op in ("arith.minsi", "arith.minui"):
        return min(a, b)
    if op in ("arith.maxsi", "arith.maxui"):
        return max(a, b)
    if op == "arith.shli":
        return a << b
    if op in ("arith.shrsi", "arith.shrui"):
        return a >> b
    if op == "arith.andi":
        return a & b
    if op == "arith.ori":
        return a | b
    return None


_CMP = {"slt": lambda a, b: a < b, "sle": lambda a, b: a <= b, "sgt": lambda a, b: a > b,
        "sge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
        "ult": lambda a, b: a < b, "ule": lambda a, b: a <= b, "ugt": lambda a, b: a > b, "uge": lambda a, b: a >= b}


def ttir_loops(ttir: str, ints: dict[str, int], grid: tuple | list = (), pid: tuple | list | None = None) -> dict:
    """{'loops': [{'trips', 'depth'}...], 'main_trips', 'flops_per_cta', 'dots'}: every `scf.for`
    with its trip count (None when a bound is not a function of the integer arguments and the program
    id), 'main_trips' the largest product of trips along a loop nest (the main loop's), and the FLOPs
    of one CTA's `tt.dot`s (operand element type kept in 'dots': [(M, N, K, dtype, executions)]).
    `pid`: the program whose trips these are (one id per grid axis; default the middle one)."""
    grid = tuple(int(g) for g in grid) + (1, 1, 1)
    pid = tuple(int(p) for p in pid) + (0, 0, 0) if pid is not None else tuple((g - 1) // 2 for g in grid)
    env: dict[str, int | None] = {}
    for name, value in ints.items():
        env[name] = int(value)
    body = ttir
    m = re.search(r"tt\.func public @\w+\((.*?)\)\s*(?:attributes|\{)", ttir, re.S)
    if m:
        for a in _TT_ARG.finditer(m.group(1)):
            env.setdefault(a.group(1), None)
    stack: list[int | None] = []          # trips of the enclosing loops (None = unknown)
    opened: list[bool] = []               # for each open '{': whether it opened an scf.for
    loop_rows, dots = [], []
    for line in body.splitlines():
        f = _TT_FOR.search(line)
        d = _TT_DEF.match(line)
        if d and not f:
            name, op, rest = d.groups()
            args = re.findall(r"%([\w$.-]+)", rest)
            val = None
            if op == "arith.constant":
                c = _INT.match(rest.replace("true", "1").replace("false", "0"))
                val = int(c.group(1)) if c and ":" in rest and "tensor" not in rest.split(":")[-1] else None
            elif op == "tt.get_program_id":
                axis = "xyz".index(rest.split()[0]) if rest.split() and rest.split()[0] in "xyz" else 0
                val = pid[axis]
            elif op == "tt.get_num_programs":
                axis = "xyz".index(rest.split()[0]) if rest.split() and rest.split()[0] in "xyz" else 0
                val = grid[axis]
            elif op in ("arith.extsi", "arith.extui", "arith.trunci", "arith.index_cast", "arith.bitcast") and args:
                val = env.get(args[0])
            elif op == "arith.cmpi" and len(args) >= 2:
                pred = rest.split(",")[0].split()[-1]
                a, b = env.get(args[0]), env.get(args[1])
                val = int(_CMP[pred](a, b)) if pred in _CMP and a is not None and b is not None else None
            elif op == "arith.select" and len(args) >= 3:
                c = env.get(args[0])
                val = None if c is None else env.get(args[1] if c else args[2])
            elif op.startswith("arith.") and len(args) >= 2:
                a, b = env.get(args[0]), env.get(args[1])
                val = _int_binop(op, a, b) if a is not None and b is not None else None
            if "tensor<" in rest.split(":")[-1] if ":" in rest else False:
                val = None
            env[name] = val
        if f:
            iv, lb, ub, st = f.groups()
            lo, hi, step = env.get(lb), env.get(ub), env.get(st)
            trips = max(0, -(-(hi - lo) // step)) if None not in (lo, hi, step) and step else None
            loop_rows.append({"trips": trips, "depth": len(stack)})
            stack.append(trips)
            env[iv] = lo                      # the first iteration's value (inner bounds rarely use it)
        g = _TT_DOT.search(line)
        if g:
            M, K, dt, K2, N = int(g.group(1)), int(g.group(2)), g.group(3), int(g.group(4)), int(g.group(5))
            execs = 1
            for t in stack:
                execs = execs * t if (t is not None and execs is not None) else None
            dots.append((M, N, K, dt, execs))
        opens, closes = line.count("{"), line.count("}")
        # attribute dicts ({axis = 1 : i32}) open and close on one line; count only the net change
        for _ in range(max(0, opens - closes)):
            opened.append(bool(f))
            f = None
        for _ in range(max(0, closes - opens)):
            if opened and opened.pop():
                stack.pop()
    best = None
    nest: list = []
    for r in loop_rows:
        nest = nest[:r["depth"]] + [r["trips"]]
        prod = 1
        for t in nest:
            prod = prod * t if (t is not None and prod is not None) else None
        if prod is not None and (best is None or prod > best):
            best = prod
    unknown = any(r["trips"] is None for r in loop_rows)
    flops = sum(2 * M * N * K * (e if e is not None else 0) for M, N, K, _dt, e in dots)
    return {"loops": loop_rows, "main_trips": best, "trips_known": bool(loop_rows) and not unknown,
            "flops_per_cta": flops, "flops_known": all(e is not None for *_, e in dots),
            "dots": [list(x) for x in dots]}


_RE_SYNC_ATOMIC = re.compile(r"\btt\.atomic_(?:rmw|cas)\s[^:]*?(?<![\w%])(acq_rel|acquire),")


def sync_atomics(ttir: str) -> int:
    """The Triton IR's synchronising atomics (`tt.atomic_rmw` / `tt.atomic_cas` with acquire or acq_rel
    semantics): each is a CTA waiting on a global round trip to learn what other CTAs published (a
    last-arrival count), then reading it. Relaxed atomics (an atomic split-K add) are stores to the model."""
    return sum(1 for line in ttir.splitlines() if _RE_SYNC_ATOMIC.search(line))


PROGRAM_TRIPS_AXIS_MAX = 512      # programs along one axis evaluated one by one (a parse of the IR each)


def program_trips(ttir: str, ints: dict[str, int], grid: tuple | list = ()) -> dict:
    """The main loop's trips across the grid: {'trips_min', 'trips_max', 'trips_by_pid'}. Each grid
    axis is probed at its first, middle and last program (the other axes in the middle); where exactly
    one axis changes the trips and it has at most `PROGRAM_TRIPS_AXIS_MAX` programs, every program
    along it is evaluated: 'trips_by_pid' = {'axis': a, 'trips': [trips of pid_a = 0, 1, ...]} (the
    trips of every CTA, whatever its other ids). None there where the trips are the same for every
    program probed, or vary along several axes (then min/max are of the probes). Empty where the
    middle program's trips are unknown."""
    dims = [int(g) for g in grid] or [1]
    mid = [(g - 1) // 2 for g in dims]

    def at(axis: int, p: int):
        q = list(mid)
        q[axis] = p
        return ttir_loops(ttir, ints, dims, q)["main_trips"]

    centre = ttir_loops(ttir, ints, dims, mid)["main_trips"]
    if centre is None:
        return {}
    seen, varying = [centre], []
    for a, g in enumerate(dims):
        if g <= 1:
            continue
        ends = [at(a, 0), at(a, g - 1)]
        if any(t is None for t in ends):
            return {}
        seen += ends
        if any(t != centre for t in ends):
            varying.append(a)
    by_pid = None
    if len(varying) == 1 and dims[varying[0]] <= PROGRAM_TRIPS_AXIS_MAX:
        a = varying[0]
        trips = [at(a, p) for p in range(dims[a])]
        if all(t is not None for t in trips):
            by_pid = {"axis": a, "trips": trips}
            seen = trips
    return {"trips_min": min(seen), "trips_max": max(seen), "trips_by_pid": by_pid}
