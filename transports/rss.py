"""Peak resident memory of this process (for `inflight bench transports`): the kernel's
high-water mark (VmHWM, reset through /proc/self/clear_refs) where permitted, and a 2 ms
sampling thread in any case."""

from __future__ import annotations

import os
import threading
import time


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (`VmRSS`, `VmHWM`, `RssFile`, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _hwm() -> int:
    try:
        return status_bytes("VmHWM")
    except RuntimeError:
        return 0


def reset_hwm() -> bool:
    """Resets this process's resident high-water mark (Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Peak resident memory of this process while it is entered: the kernel's high-water mark
    after a reset where permitted, and a sampling thread (every `every_s`) in any case."""

    def __init__(self, every_s: float = 0.002):
        self.every_s = every_s
        self.base = _rss_now()
        self.peak = self.base
        self._exact = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_now())
            time.sleep(self.every_s)

    def __enter__(self) -> RssSampler:
        self._exact = reset_hwm()
        self.peak = max(self.peak, _rss_now())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_now(), _hwm() if self._exact else 0)

    @property
    def extra(self) -> int:
        return self.peak - self.base


class PeakRss:
    """Peak RSS over several scoped measurements, against one baseline taken at creation."""

    def __init__(self) -> None:
        self.base = _rss_now()
        self.peak = self.base
        self._sampler: RssSampler | None = None

    def start(self) -> None:
        self._sampler = RssSampler()
        self._sampler.__enter__()

    def stop(self) -> int:
        if self._sampler is not None:
            self._sampler.__exit__(None, None, None)
            self.peak = max(self.peak, self._sampler.peak)
            self._sampler = None
        return self.peak - self.base
