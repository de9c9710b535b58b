"""The package layout: one measure module per chapter, in `inferbook.chapters`, imported by nothing below it."""
import ast
from pathlib import Path

from inferbook import toc

SRC = Path(__file__).resolve().parents[1] / "src" / "inferbook"


def test_one_measure_module_per_chapter():
    modules = {p.stem for p in (SRC / "chapters").glob("*.py") if p.stem != "__init__"}
    assert modules == {slug.replace("-", "_") for slug in toc.CHAPTERS}
    for info in toc.CHAPTERS.values():
        assert info.module == "inferbook.chapters." + info.slug.replace("-", "_")


def _imports(path: Path) -> set[str]:
    """Dotted names a module imports, relative imports resolved against its package."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    package = list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_nothing_below_imports_the_chapters_package():
    for path in SRC.rglob("*.py"):
        if "chapters" in path.relative_to(SRC).parts:
            continue
        bad = {m for m in _imports(path) if m == "inferbook.chapters" or m.startswith("inferbook.chapters.")}
        assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}"


def test_workflow_imports_point_one_way():
    """executor <- loops <- nodes -> omni_server -> references -> executor: no circle, and the executor
    imports none of the node classes it runs."""
    wf = SRC / "workflow"
    order = ["executor", "loops", "segments", "references", "omni_server", "nodes", "cli"]
    rank = {m: i for i, m in enumerate(order)}
    for name in order:
        deps = {m.split(".")[2] for m in _imports(wf / f"{name}.py") if m.startswith("inferbook.workflow.")
                and len(m.split(".")) > 2 and m.split(".")[2] in rank}
        above = {d for d in deps if rank[d] >= rank[name]}
        assert not above, f"workflow/{name}.py imports {sorted(above)}, which sit(s) above it"
