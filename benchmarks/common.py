"""Helpers every benchmark shares: what machine it ran on, percentiles, process memory."""

from __future__ import annotations

import os
import platform
import time

import numpy as np


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process `pid` has used so far, all its threads, to the
    nanosecond on Linux (its process CPU clock); elsewhere psutil's, to the clock tick
    (10 ms: too coarse to time a short step)."""
    try:
        # Linux's clock id of a process's CPU clock: MAKE_PROCESS_CPUCLOCK(pid, SCHED).
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        import psutil

        return sum(psutil.Process(pid).cpu_times()[:2])


def machine_description() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = ""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f", {pages / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    return (f"{os.cpu_count()} cores ({model}){memory}, Python {platform.python_version()}, "
            f"{platform.system()} {platform.machine()}")


def percentile_ms(samples_s: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples_s), q) * 1e3)


def release_free_memory() -> None:
    """Hand memory the allocator keeps cached back to the OS, so RSS shows what is held."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default), from /proc."""
    with open(f"/proc/{pid or 'self'}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def prefault_memory(num_bytes: int) -> None:
    """Touch and free `num_bytes` once before measuring.

    On a freshly booted VM the first write to each page is far slower than any later
    one (the host backs guest memory lazily); without this, whichever measurement runs
    first pays that once-per-machine cost.
    """
    block = np.ones(num_bytes, dtype=np.uint8)
    del block
    release_free_memory()
