"""What the chapter sources may not do, read from the sources themselves (nothing executed): a chart
without its own caption, and a comparison verdict printed to stdout instead of shown as prose."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "chapters").glob("*.md"))
MODULES = sorted((ROOT / "src" / "inferbook" / "chapters").glob("*.py"))


def _cells(page: Path) -> list[ast.Module]:
    out = []
    for m in re.finditer(r"```\{code-cell\}[^\n]*\n(.*?)\n```", page.read_text(), re.S):
        src = "\n".join(line for line in m.group(1).split("\n") if not line.startswith(":tags:"))
        out.append(ast.parse(src))
    return out


def _trees(path: Path) -> list[ast.AST]:
    return _cells(path) if path.suffix == ".md" else [ast.parse(path.read_text())]


def _is_show(node) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return isinstance(f, ast.Attribute) and f.attr == "show" and isinstance(f.value, ast.Name) and f.value.id == "charts"


def _text(node) -> str | None:
    """The value of a string literal, an implicit concatenation or an f-string's literal parts."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _text(node.left), _text(node.right)
        return None if a is None or b is None else a + b
    return None


def _words(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def _title_of(chart) -> str | None:
    for node in ast.walk(chart):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "title":
                    return _text(kw.value)
    return None


@pytest.mark.parametrize("path", PAGES + MODULES, ids=lambda p: p.name)
def test_every_chart_has_its_own_caption_not_its_title(path):
    shown = 0
    for tree in _trees(path):
        for node in ast.walk(tree):
            if not _is_show(node):
                continue
            shown += 1
            caption = next((kw.value for kw in node.keywords if kw.arg == "caption"), None)
            if caption is None and len(node.args) > 1:
                caption = node.args[1]
            assert caption is not None, f"{path.name}, line {node.lineno}: charts.show without a caption"
            text, title = _text(caption), _title_of(node.args[0]) if node.args else None
            if text is not None:
                assert len(text.split()) >= 12, f"{path.name}: a caption says what the chart shows and what to read: {text!r}"
                if title is not None:
                    assert _words(text) != _words(title), f"{path.name}: the caption repeats the title {title!r}"
                    assert not _words(text).startswith(_words(title)) or len(text) > 2 * len(title), (
                        f"{path.name}: the caption is the title with little added: {text!r}")
    if path.suffix == ".md":
        assert shown == path.read_text().count("charts.show("), "every charts.show call was read"


def _mentions_a_verdict(node) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in ("sentence", "verdict"):
            return True
        if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) and \
                sub.slice.value in ("sentence", "verdict", "_sentence"):
            return True
        if isinstance(sub, ast.Name) and re.search(r"sentence|verdict", sub.id):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "compare_timings":
            return True
    return False


@pytest.mark.parametrize("path", PAGES + MODULES, ids=lambda p: p.name)
def test_no_comparison_verdict_is_printed_to_stdout(path):
    """A verdict is prose with its interval (`nb.verdict`, `nb.verdicts`, or glued into a sentence), never
    a `print` of a comparison's sentence: stdout does not wrap and reads as plumbing."""
    for tree in _trees(path):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                assert not any(_mentions_a_verdict(a) for a in node.args), (
                    f"{path.name}, line {node.lineno}: a comparison verdict printed to stdout; show it with nb.verdict")


def test_the_scan_catches_the_old_pattern():
    old = ast.parse('for w in wrows:\n    print("-", w["sentence"])\nprint(c.sentence("a", "b"))\n')
    prints = [n for n in ast.walk(old) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"]
    assert len(prints) == 2 and all(any(_mentions_a_verdict(a) for a in p.args) for p in prints)
    fine = ast.parse('print(f"{n} cases, {k} failed")\n')
    assert not any(_mentions_a_verdict(a) for n in ast.walk(fine) if isinstance(n, ast.Call) for a in n.args)
