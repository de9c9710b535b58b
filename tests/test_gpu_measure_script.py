"""scripts/gpu_measure.sh: the budgets fit the 12-minute H200 run, and a dry run on CPU
(DEVICE=cpu PRESET=smoke) works from a copy of the working tree without .git, as on a lent GPU
machine: the commit travels in INFERBOOK_GIT_COMMIT, every record is saved, a bad slug is one line.

The dry run measures one chapter (te-mxfp8-recipes, about 10 s at the smoke preset) besides the
device ceilings: all sixteen take minutes on two cores."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from inferbook import presets, toc

ROOT = Path(__file__).resolve().parents[1]


def test_budgets_add_up_to_the_twelve_minute_run():
    gpu = presets.BUDGETS_S["gpu"]
    assert set(gpu) == set(toc.CHAPTERS), "every chapter needs a gpu budget"
    n = presets.RUN_PARTS
    total = n * (presets.CEILINGS_S + presets.PACKING_S + presets.WARM_TIMEOUT_S) + sum(
        sum(b) + presets.STARTUP_ALLOWANCE_S + presets.KILL_GRACE_S for b in gpu.values())
    assert total == presets.worst_case_total_s("gpu", n) <= presets.GPU_RUN_TOTAL_S == 720, total
    script = (ROOT / "scripts" / "gpu_measure.sh").read_text()
    assert f'GRACE="${{KILL_GRACE:-{presets.KILL_GRACE_S}}}"' in script and "echo 590 || echo 720" in script
    parts = presets.budget_parts("gpu", 2)
    assert sum(parts, []) == list(gpu) and all(parts)
    for part in parts:  # one device command may run 600 s
        s = presets.CEILINGS_S + presets.PACKING_S + presets.WARM_TIMEOUT_S + sum(
            sum(gpu[c]) + presets.STARTUP_ALLOWANCE_S + presets.KILL_GRACE_S for c in part)
        assert s <= 590, (part, s)
    for heavy in ("attention-test-matrix", "h3-vae-fusion"):
        assert gpu[heavy][1] > 0, f"{heavy} must budget its compile"
    assert all(m > 0 and c >= 0 for m, c in gpu.values())


def test_dry_run_from_a_copy_without_git(tmp_path):
    copy = tmp_path / "tree"
    for d in ("src", "scripts", "chapters"):
        shutil.copytree(ROOT / d, copy / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy)
    commit = "0123456789abcdef0123456789abcdef01234567"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "DEVICE": "cpu",
           "PRESET": "smoke", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "LOG_DIR": str(tmp_path / "logs"),
           "INFERBOOK_REFERENCE_DIR": str(tmp_path / "ref"), "INFERBOOK_RESULTS": str(tmp_path / "res"),
           "INFERBOOK_GIT_COMMIT": commit, "INFERBOOK_GIT_DIRTY": "1", "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": "1", "GIT_CEILING_DIRECTORIES": str(tmp_path), "CEILINGS_TIMEOUT": "120"}
    p = subprocess.run(["bash", "scripts/gpu_measure.sh", "te-mxfp8-recipes", "no-such-chapter"], cwd=copy, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split("\t") for line in (tmp_path / "logs" / "summary.tsv").read_text().splitlines()[1:]]
    assert [r[:2] for r in rows] == [["te-mxfp8-recipes", "0"], ["no-such-chapter", "2"]], rows
    assert rows[1][3] == "inferbook: error: unknown chapter 'no-such-chapter'; chapters are " + \
        ", ".join(repr(s) for s in list(toc.CHAPTERS)[:-1]) + " or " + repr(list(toc.CHAPTERS)[-1])
    (hw,) = list((tmp_path / "ref").iterdir())
    assert hw.name.startswith("cpu-")
    data = json.loads((hw / "te-mxfp8-recipes.json").read_text())
    assert data["complete"] is True and data["records"]
    for r in data["records"]:
        if r["source"] == "measured":
            assert r["git"]["commit"] == commit and r["git"]["dirty"] is True and r["git"]["from"] == "INFERBOOK_GIT_COMMIT"
            assert len(r["git"]["tree_sha256"]) == 64
    assert (hw / "device-ceilings.json").is_file()
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as t:
        names = t.getnames()
    assert any(n.endswith("te-mxfp8-recipes.json") for n in names) and any(n.endswith("summary.tsv") for n in names)


def _fake_wheel(folder: Path, dist: str, module: str, version: str) -> Path:
    """A minimal pure-Python wheel, written by hand (no network, no build backend)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    name = dist.replace("-", "_")
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{module}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_wheelhouse_installs_offline_and_the_script_says_which_peers(tmp_path):
    copy = tmp_path / "tree"
    for d in ("src", "scripts"):
        shutil.copytree(ROOT / d, copy / d, ignore=shutil.ignore_patterns("__pycache__"))
    _fake_wheel(copy / ".wheelhouse", "liger-kernel", "liger_kernel", "0.0.1")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "DEVICE": "cpu",
           "PRESET": "smoke", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "LOG_DIR": str(tmp_path / "logs"),
           "INFERBOOK_REFERENCE_DIR": str(tmp_path / "ref"), "INFERBOOK_RESULTS": str(tmp_path / "res"),
           "INFERBOOK_GIT_COMMIT": "0" * 40, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
           "GIT_CEILING_DIRECTORIES": str(tmp_path), "CEILINGS_TIMEOUT": "1", "PIP_NO_INDEX": "1"}
    p = subprocess.run(["bash", "scripts/gpu_measure.sh", "no-such-chapter"], cwd=copy, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    peers = (tmp_path / "logs" / "peers.txt").read_text().splitlines()
    assert "liger-kernel 0.0.1" in peers, peers                       # installed offline from the wheelhouse
    assert (copy / ".peers" / "liger_kernel" / "__init__.py").is_file()
    assert "ran liger: no record names it" in peers                   # installed is not ran


def test_make_wheelhouse_downloads_the_four_peers_without_dependencies():
    p = subprocess.run(["make", "-n", "wheelhouse"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    cmds = p.stdout
    assert "pip download" in cmds and "--no-deps" in cmds and "-d .wheelhouse" in cmds
    for peer in ("fla-core", "torchao", "liger-kernel", "gemlite"):
        assert peer in cmds, peer
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/.wheelhouse/" in ignored and "/.peers/" in ignored
