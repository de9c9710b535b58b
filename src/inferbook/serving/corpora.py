"""Three task corpora for the draft-acceptance chapter, and the byte tokenizer that reads them.

- `math`: generated arithmetic word problems with step-by-step answers (a seeded generator);
- `code`: Python source — a fixed list of standard-library modules, as shipped with CPython 3.11;
- `qa`:   question-answer prose — "What does `name` do?" answered by the first paragraph of that
          standard-library object's docstring (English prose written by CPython's authors).

The files live in `data/corpora/` and are committed, so training reads the same bytes on every
machine; `python -m inferbook.serving.corpora` rewrites them (the code and qa corpora then depend
on the local CPython version, which the README there names). Documents are separated by a line
holding only `<|doc|>`; the last 10% of each corpus is held out for the chapter's prompts.
Tokens are bytes (vocabulary 256); non-ASCII characters become '?'.
"""
from __future__ import annotations

import importlib
import inspect
import random
import sys
from pathlib import Path

TASKS = ("math", "code", "qa")
SEPARATOR = "\n<|doc|>\n"
VOCAB = 256
HELD_OUT = 0.1

CODE_MODULES = ("textwrap", "heapq", "bisect", "fractions", "statistics", "string", "shlex", "queue", "colorsys",
                "calendar", "graphlib", "fnmatch", "glob", "difflib", "json.encoder", "json.decoder", "base64",
                "copy", "functools", "dataclasses", "contextlib", "operator", "random", "enum")
QA_MODULES = ("textwrap", "heapq", "bisect", "fractions", "statistics", "string", "shlex", "queue", "calendar",
              "difflib", "json", "base64", "copy", "functools", "dataclasses", "contextlib", "operator",
              "random", "os", "os.path", "itertools", "collections", "re", "math", "pathlib", "shutil", "tempfile",
              "time", "datetime", "decimal", "zlib", "hashlib", "struct", "array", "csv", "logging", "argparse",
              "threading", "subprocess", "socket", "urllib.parse", "email.utils", "html", "io", "pickle", "sqlite3",
              "unittest", "inspect", "ast", "types", "typing", "weakref", "gc", "sys", "builtins")


def corpora_dir() -> Path:
    from ..context import repo_root

    return repo_root() / "data" / "corpora"


def encode(text: str) -> list[int]:
    return list(text.encode("ascii", errors="replace"))


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("ascii", errors="replace")


def make_math(n_docs: int = 6000, seed: int = 0) -> list[str]:
    """Arithmetic problems answered step by step, e.g.
    'Q: 48 + 37 - 12 = ?\\nA: 48 + 37 = 85. 85 - 12 = 73. The answer is 73.'"""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        terms = [rng.randint(2, 99) for _ in range(rng.randint(2, 4))]
        ops = [rng.choice("+-*") if i == 0 else rng.choice("+-") for i in range(len(terms) - 1)]
        question = " ".join([str(terms[0])] + [f"{o} {t}" for o, t in zip(ops, terms[1:])])
        steps, acc = [], terms[0]
        for o, t in zip(ops, terms[1:]):
            new = acc + t if o == "+" else acc - t if o == "-" else acc * t
            steps.append(f"{acc} {o} {t} = {new}.")
            acc = new
        docs.append(f"Q: {question} = ?\nA: {' '.join(steps)} The answer is {acc}.")
    return docs


def make_code() -> list[str]:
    docs = []
    for name in CODE_MODULES:
        src = inspect.getsource(importlib.import_module(name))
        # one document per top-level block of the module, so prompts start at a def or class
        block: list[str] = []
        for line in src.splitlines():
            if line and not line[0].isspace() and block and (line.startswith(("def ", "class ", "@"))):
                docs.append("\n".join(block).strip("\n"))
                block = []
            block.append(line)
        if block:
            docs.append("\n".join(block).strip("\n"))
    return [d for d in docs if len(d) >= 80]


def make_qa() -> list[str]:
    docs, seen = [], set()
    for modname in QA_MODULES:
        mod = importlib.import_module(modname)
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            doc = inspect.getdoc(obj) if callable(obj) else None
            if not doc:
                continue
            para = doc.split("\n\n")[0].replace("\n", " ").strip()
            if len(para) < 40 or para in seen or "(" in para[:len(attr) + 1]:
                continue
            seen.add(para)
            docs.append(f"Q: What does {modname}.{attr} do?\nA: {para}")
    return docs


def write_corpora(out: Path | None = None) -> dict[str, int]:
    out = Path(out) if out else corpora_dir()
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for task, docs in (("math", make_math()), ("code", make_code()), ("qa", make_qa())):
        rng = random.Random(1)
        rng.shuffle(docs)
        text = SEPARATOR.join(docs)
        text = text.encode("ascii", errors="replace").decode("ascii")
        (out / f"{task}.txt").write_text(text)
        sizes[task] = len(text)
    return sizes


def load_corpus(task: str, split: str = "train", root: Path | None = None) -> list[str]:
    """Documents of one corpus; `split` is 'train' (first 90%) or 'test' (held-out last 10%)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'test'")
    docs = (Path(root) if root else corpora_dir()).joinpath(f"{task}.txt").read_text().split(SEPARATOR)
    cut = int(len(docs) * (1 - HELD_OUT))
    return docs[:cut] if split == "train" else docs[cut:]


if __name__ == "__main__":
    print(write_corpora(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
