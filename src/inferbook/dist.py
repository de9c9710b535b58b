"""Spawning torch.distributed ranks on this machine, for notebooks and tests.

Workers are package functions with the signature
`worker(rank, world_size, init_method, *args, out_dir, timeout_s)`; each writes its result
(or `rank{N}.err` with its traceback) into `out_dir`. The same worker runs under torchrun
across nodes; here ranks meet on loopback only (127.0.0.1) and every wait has a deadline,
so a stuck rank can never hang a notebook or the test suite.
"""
from __future__ import annotations

import contextlib
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def loopback_ranks(worker: Callable, world_size: int, args: tuple, *, timeout_s: float, what: str,
                   prefix: str = "inferbook-dist-") -> Iterator[Path]:
    """Run `world_size` spawned ranks of `worker` to completion; yield the folder of their results.

    Ranks get `(rank, world_size, "tcp://127.0.0.1:PORT", *args, out_dir, timeout_s)`. On failure or
    after `timeout_s + 30` s every rank is killed and RuntimeError carries each rank's traceback.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=prefix) as out_dir:
        init = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.start_processes(worker, args=(world_size, init, *args, out_dir, float(timeout_s)),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s + 30
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} with {world_size} ranks did not finish within {timeout_s + 30:.0f} s")
        except BaseException as e:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=5)
            detail = "\n".join(f.read_text() for f in sorted(Path(out_dir).glob("rank*.err")))
            raise RuntimeError(f"{what} failed on {world_size} ranks: {e}\n{detail}") from None
        yield Path(out_dir)
