"""Block copies off the engine thread: a CUDA stream and its events on a GPU, a worker thread on
a CPU."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class CopyJob:
    """One batch of block copies. `t_submit`/`t_done`: perf_counter at submission and at completion
    (the event completed on CUDA; the worker's copy returned on CPU)."""

    on_done: object
    copy_fn: object = None
    event: object = None
    t_submit: float = 0.0
    t_done: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class CopyStream:
    """Block copies that never run on (or wait on) the engine thread.

    CUDA: one dedicated stream. `submit` makes the stream wait for the compute stream (the KV to
    copy was written there), launches the copies non_blocking (pinned host rows), records an
    event and returns at once; a completion thread waits on the events in submission order and
    runs each job's `on_done(job)` — as vLLM's CPU offload worker queries its transfer events.
    CPU: the same jobs run on a worker thread that performs the copies itself (threads stand in
    for streams). Jobs complete in submission order in both cases."""

    def __init__(self, device: torch.device, name: str = "kv-copy"):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._jobs: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._inflight = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, copy_fn, on_done, *, after_compute: bool = True) -> CopyJob:
        job = CopyJob(on_done=on_done, t_submit=time.perf_counter())
        with self._cv:
            self._inflight += 1
        if self.cuda:
            if after_compute:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                copy_fn()
                job.event = torch.cuda.Event()
                job.event.record(self.stream)
        else:
            job.copy_fn = copy_fn
        self._jobs.put(job)
        return job

    def submit_from_worker(self, copy_fn, on_done) -> CopyJob:
        """A follow-up job submitted from an `on_done` callback (on the copy stream after the jobs
        before it, so it needs no new wait on the compute stream)."""
        return self.submit(copy_fn, on_done, after_compute=False)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self.cuda:
                    job.event.synchronize()
                else:
                    job.copy_fn()
            except BaseException as e:      # a failed copy is reported to its callback, never raised here
                job.error = e
            job.t_done = time.perf_counter()
            try:
                job.on_done(job)
            finally:
                job.done.set()
                with self._cv:
                    self._inflight -= 1
                    self._cv.notify_all()

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._inflight > 0

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(timeout=left)
        return True

    def close(self) -> None:
        self.wait_idle(30.0)
        self._jobs.put(None)
        self._thread.join(timeout=10)
