import os
import signal

# Tests run two at a time (pytest -n 2 on 2 cores), and chapter kernels inherit this
# environment: one math thread each avoids oversubscription, which made loops of small
# ops tens of times slower. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Inductor compiles (the rehearsal's compile=True branches, upgrade-record's notebook) in this process, not in
# a pool of compile workers: each worker imports torch again, and the two cores are busy with the other
# xdist worker anyway. A cold upgrade-record rehearsal: 105 CPU s with one thread, 117 with the default pool.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402

# No test may reach the network, and chapters execute on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def results_env(tmp_path, monkeypatch):
    """Send records of a test run to a temporary folder."""
    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path / "results"))
    monkeypatch.delenv("INFERBOOK_SAVE_REFERENCE", raising=False)
    return tmp_path / "results"


@pytest.fixture(autouse=True, scope="session")
def _one_math_thread():
    """Belt and braces for OMP_NUM_THREADS above, in case torch was imported first."""
    import torch

    torch.set_num_threads(1)


def _as_a_shell_starts_it():
    """Run in the child before exec: SIGINT as an interactive shell hands it over (default action, not
    blocked). The suite itself may have been started with SIGINT ignored: a non-interactive shell starts
    a background command (`make test &`, a CI step, nohup) with SIGINT and SIGQUIT ignored (POSIX,
    "asynchronous lists"), Python keeps an inherited SIG_IGN, and every child inherits it; so the child
    slept through SIGINT and ran to exit 0, and the test measured how it was started, not inferbook.
    (Reproduced: `bash -c 'python3 -c "import signal; print(signal.getsignal(signal.SIGINT))" &'` prints 1,
    SIG_IGN.)"""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sigint_as_a_shell_hands_it():
    """The `preexec_fn` for a child that a test sends SIGINT (see `_as_a_shell_starts_it`)."""
    return _as_a_shell_starts_it


# The files that take minutes each, longest first: `make test` runs `pytest -n 2 --dist loadfile`, which
# hands each worker whole files in collection order, so a long file collected last would leave one
# worker alone at the end. Run first, the two workers take them in parallel and share the many short
# files after (longest-first scheduling).
SLOW_FILES = ("test_book_pages.py", "test_rehearsal.py", "test_compiled.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: n for n, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))   # stable: the rest keep their order
