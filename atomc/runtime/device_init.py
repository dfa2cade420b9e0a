"""Create the CUDA context on a thread while the start-up's Python work goes on.

A warm start is mostly single-threaded Python (importing triton and torch's compiler, unpickling
the artifact) and, apart from it, the CUDA context (driver init, the primary context): C++ that
releases the GIL (torch.cuda's lazy init says so, and tensor ops drop it around their calls). Done
on a thread, the context is made while the main thread imports; the weights then find it ready.

torch.cuda's lazy init takes a lock, so a main thread that reaches CUDA first simply waits for the
thread's init to finish: the order of the two never matters. Only CUDA devices start a thread.
"""

from __future__ import annotations

import threading
import time

import torch


class DeviceInit:
    """`wait()` joins the thread (re-raising its error) and returns the seconds spent waiting."""

    def __init__(self, device: str):
        self.device = device
        self.seconds = 0.0  # the thread's own time (the context creation)
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if str(device).startswith("cuda"):
            self._thread = threading.Thread(target=self._run, name="atomc-cuda-init", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            torch.cuda.init()
            torch.empty(1, device=self.device)  # the primary context is made at the first allocation
            torch.cuda.synchronize(self.device)
        except BaseException as e:  # the main thread re-raises it, where a start-up error belongs
            self.error = e
        self.seconds = time.perf_counter() - t0

    @property
    def started(self) -> bool:
        return self._thread is not None

    def wait(self) -> float:
        if self._thread is None:
            return 0.0
        t0 = time.perf_counter()
        self._thread.join()
        self._thread = None
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0
