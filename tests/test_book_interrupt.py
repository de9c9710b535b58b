"""An interrupted `inferbook run` loses nothing: a real subprocess, sent SIGINT or SIGKILL mid-cell,
leaves the last good executed notebook and its meta as they were; temporaries are cleaned; a torn
notebook beside a valid meta is re-executed, never reused."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from inferbook import book

ROOT = Path(__file__).resolve().parents[1]

# A stand-in page for the real chapter slug `upgrade-record` (the measure module validates the
# parameters; the page itself only waits): its second cell blocks until told to go on, or until
# its parent (the `inferbook run` process) is gone.
PAGE = textwrap.dedent('''\
    ---
    jupytext:
      text_representation:
        extension: .md
        format_name: myst
    kernelspec:
      display_name: Python 3
      language: python
      name: python3
    ---

    # Stand-in

    ```{code-cell} ipython3
    :tags: [parameters]

    device = "cpu"
    preset = "smoke"
    seed = 0
    ```

    ```{code-cell} ipython3
    import os, time
    from pathlib import Path
    marker = Path(os.environ["FAKE_MARKER"])
    hold = os.environ.get("FAKE_HOLD") == "1"
    parent = os.getppid()
    marker.write_text("started")
    t0 = time.time()
    while hold and os.getppid() == parent and time.time() - t0 < 60:
        time.sleep(0.1)
    print("finished")
    ```
    ''')


@pytest.fixture
def checkout(tmp_path):
    """A checkout of this tree in a temporary folder: src/inferbook copied, the page replaced."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "src" / "inferbook", root / "src" / "inferbook",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    (root / "chapters").mkdir()
    (root / "chapters" / "upgrade-record.md").write_text(PAGE)
    return root


def _env(root: Path, marker: Path, hold: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root / "src"), FAKE_MARKER=str(marker), FAKE_HOLD="1" if hold else "0",
               INFERBOOK_BUILD_DIR=str(root / "_build"))
    env.pop("INFERBOOK_RESULTS", None)
    return env


def _run(root, marker, hold, preexec):
    return subprocess.Popen([sys.executable, "-m", "inferbook.cli", "run", "upgrade-record", "--device", "cpu",
                             "--preset", "smoke"], cwd=root, env=_env(root, marker, hold),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec)


def _wait_for(marker: Path, proc, timeout=120):
    t0 = time.time()
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "the stand-in cell never started"
        time.sleep(0.1)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_run_keeps_the_good_notebook(checkout, tmp_path, sig, sigint_as_a_shell_hands_it):
    executed = checkout / "_build" / "executed"
    good = _run(checkout, tmp_path / "m0", hold=False, preexec=sigint_as_a_shell_hands_it)
    out, err = good.communicate(timeout=300)
    assert good.returncode == 0, err
    nb, meta = executed / "upgrade-record.ipynb", executed / "upgrade-record.meta.json"
    before = (_digest(nb), meta.read_text())
    assert json.loads(meta.read_text())["notebook_sha256"] == before[0]

    proc = _run(checkout, tmp_path / "m1", hold=True, preexec=sigint_as_a_shell_hands_it)
    _wait_for(tmp_path / "m1", proc)
    assert list(executed.glob(".upgrade-record.*.tmp.ipynb")), "execution must write into a temporary"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    if sig == signal.SIGINT:
        # one line: the dying Jupyter kernel's own socket errors go to its log, not to the terminal
        assert err.strip() == "inferbook: interrupted", err
        assert "inferbook/cli.py" not in err and "inferbook/book.py" not in err, err
    assert (_digest(nb), meta.read_text()) == before, "the last good notebook or its meta changed"
    leftovers = list(executed.glob(".*.tmp*"))
    if sig == signal.SIGINT:
        assert not leftovers, leftovers
    else:  # a killed process cleans nothing: the next run (or book) does
        assert leftovers
        removed = subprocess.run([sys.executable, "-c", "from inferbook import book; print(len(book.clean_orphans()))"],
                                 cwd=checkout, env=_env(checkout, tmp_path / "m2", False), capture_output=True,
                                 text=True, timeout=120)
        assert removed.returncode == 0, removed.stderr
        assert not list(executed.glob(".*.tmp*"))
    # the next build reuses the good notebook: its meta still vouches for it
    status = subprocess.run([sys.executable, "-c", "from inferbook import book; "
                             "print(book.chapter_status('upgrade-record', book.run_parameters('cpu', 'smoke')))"],
                            cwd=checkout, env=_env(checkout, tmp_path / "m3", False), capture_output=True, text=True,
                            timeout=120)
    assert status.stdout.strip() == "cached", status.stdout + status.stderr


def test_torn_notebook_with_valid_meta_is_not_reused(tmp_path, monkeypatch):
    executed = tmp_path / "_build" / "executed"
    executed.mkdir(parents=True)
    monkeypatch.setenv("INFERBOOK_BUILD_DIR", str(tmp_path / "_build"))
    nb = executed / "upgrade-record.ipynb"
    nb.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    rp = book.run_parameters("cpu", "smoke")
    meta = {"status": "ok", "hash": book.input_hash("upgrade-record", rp), "notebook_sha256": _digest(nb)}
    (executed / "upgrade-record.meta.json").write_text(json.dumps(meta))
    assert book.chapter_status("upgrade-record", rp) == "cached"
    nb.write_text(nb.read_text()[:20])  # torn mid-write
    assert not book.executed_ok("upgrade-record", book.read_meta("upgrade-record"))
    assert book.chapter_status("upgrade-record", rp) == "stale"
    # a meta from before notebook_sha256 existed: the notebook must at least parse
    del meta["notebook_sha256"]
    (executed / "upgrade-record.meta.json").write_text(json.dumps(meta))
    assert book.chapter_status("upgrade-record", rp) == "stale"


def test_orphans_of_dead_writers_are_removed(tmp_path):
    assert book.clean_orphans(tmp_path / "absent") == []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = tmp_path / f".x.{os.getpid()}.output.tmp.ipynb"
    theirs = tmp_path / f".x.{dead.pid}.output.tmp.ipynb"
    fresh = tmp_path / ".x.meta.json.abc123.tmp"
    old = tmp_path / ".y.meta.json.def456.tmp"
    for f in (mine, theirs, fresh, old):
        f.write_text("{")
    os.utime(old, (time.time() - 2 * book.ORPHAN_AGE_S,) * 2)
    removed = book.clean_orphans(tmp_path)
    assert set(removed) == {theirs, old}
    assert mine.exists() and fresh.exists()
