import os

import pytest

# No test may reach the network, and chapters execute on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def results_env(tmp_path, monkeypatch):
    """Send records of a test run to a temporary folder."""
    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path / "results"))
    monkeypatch.delenv("INFERBOOK_SAVE_REFERENCE", raising=False)
    return tmp_path / "results"
