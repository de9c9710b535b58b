"""`inferbook workflow run FILE.json` and `inferbook workflow validate FILE.json`.

Wired into the main CLI by `add_parser(subparsers)`; also runnable alone as
`python -m inferbook.workflow.cli run FILE.json`. A bad workflow (malformed JSON, unknown class,
missing input, wrong type, bad link, cycle, loop error, a node failing on its input) prints one
line naming the node and input and exits 2 — never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `workflow` command to the main `inferbook` parser."""
    p = subparsers.add_parser("workflow", help="validate or run a workflow file (ComfyUI API format)")
    sub = p.add_subparsers(dest="workflow_command", required=True)
    v = sub.add_parser("validate", help="check a workflow file without running it")
    v.add_argument("file")
    v.set_defaults(fn=main_workflow)
    r = sub.add_parser("run", help="validate and run a workflow file")
    r.add_argument("file")
    r.add_argument("--output-dir", default=None, help="where save nodes write (default: _build/results/workflow-outputs)")
    r.add_argument("--input-dir", default=None, help="where relative input paths are read (default: the file's folder)")
    r.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    r.add_argument("--no-cache", action="store_true", help="run every node (the cache lives for one command anyway)")
    r.set_defaults(fn=main_workflow)
    p.set_defaults(fn=main_workflow)
    return p


def main_workflow(args) -> int:
    """Run the `workflow` subcommand; raises UserError (printed as one line by the caller)."""
    from ..device import resolve_device
    from .executor import Executor, load_workflow

    path = Path(args.file)
    graph = load_workflow(path)
    if args.workflow_command == "validate":
        plan = Executor().preflight(graph)   # every check `run` makes before its first node
        print(f"{path}: valid, {len(graph)} nodes, {len(plan.loops)} loop(s)")
        return 0
    device = resolve_device(args.device)
    sync = None
    if device.type == "cuda":
        import torch
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    ex = Executor(cache=not args.no_cache, output_dir=args.output_dir,
                  input_dir=args.input_dir or path.resolve().parent, device=device, sync=sync)
    result = ex.run(graph)
    for info in result.loops:
        print(f"loop {info['start']}..{info['end']}: {info['iterations']} iteration(s), "
              f"{info['projected_nodes']} projected nodes, cache_iterations={info['cache_iterations']}")
    by_class = result.seconds_by_class()
    for cls in sorted(by_class, key=by_class.get, reverse=True)[:8]:
        print(f"  {cls:18} {by_class[cls]:8.3f} s")
    for e in result.events:
        detail = e.get("path") or e.get("label") or ""
        print(f"  {e['kind']:14} {e['node']:16} {detail}")
    print(f"{path}: ok, {len(result.ran)} node(s) ran, {len(result.cached)} from cache, "
          f"{len(result.side_effects)} side effect(s), {result.seconds:.2f} s on {device}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..errors import UserError

    ap = argparse.ArgumentParser(prog="inferbook")
    add_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["workflow", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.fn(args)
    except UserError as e:
        print(f"inferbook: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
