"""How a count reads in a sentence: '1 launch', '3 launches', never 'launch(es)'.

Messages and glued prose at every layer (the CLI, the workflow executor, the pages) use it, so it sits in
core; `notebook.count` is the same function."""
from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 launch', '3 launches', '0 tokens': a count with its noun agreeing. `plural` where adding -s/-es
    is wrong ('1 matrix', '2 matrices')."""
    n = int(n)
    if n == 1:
        return f"1 {noun}"
    if plural is None:
        plural = noun + ("es" if noun.endswith(("s", "x", "z", "ch", "sh")) else "s")
    return f"{n} {plural}"
