"""What a process's memory is made of, and a way to ask a running coordinator for it.

Used by `benchmarks.soak` and `benchmarks.bench_hostile_sockets`. Three parts:
- `diagnosis()` (this process): RSS before and after glibc's `malloc_trim`, RSS split into
  anonymous and file-backed, glibc's heap figures (`mallinfo2`: taken from the OS, in use,
  free), pymalloc's (its 1 MiB arenas are mmapped directly, outside glibc's figures), the
  number of Python blocks, and the gc-tracked objects by type. `report_diagnosis` prints
  the change between two of them, with the tracemalloc growth by line when both have one.
- Run as a script (`python benchmarks/memory_probe.py --serve-coordinator ARGS`) it is the
  coordinator's own `main` with hooks: SIGUSR1 writes `diagnosis()` to
  `$SOAK_DIAG_DIR/diag-N.json` (plus a tracemalloc snapshot when `$SOAK_TRACEMALLOC`
  frames are traced), SIGUSR2 trims the heap. Run as a script, so it can serve the
  coordinator of another checkout (`PYTHONPATH=<checkout>`, e.g. an older commit for a
  before/after comparison): it imports nothing of this repository but `coordinator_stub`.
  The handlers run on the event loop's thread, between two callbacks.
- `launch(flags, diag_dir)` starts that coordinator on a free loopback port and returns a
  `ProbedCoordinator` (`url`, `diagnose()`, `trim()`, `stop()`).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

DIAG_SIGNAL = signal.SIGUSR1
TRIM_SIGNAL = signal.SIGUSR2
_LISTENING = re.compile(r"listening on (https?://\S+)")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def mallinfo() -> dict:
    """glibc's heap figures: `arena` (bytes the main and other arenas took from the OS with
    brk/mmap, excluding large mmapped blocks), `uordblks` in use, `fordblks` free,
    `hblkhd` in large mmapped blocks. Empty when not on glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {name: getattr(info, name) for name, _ in _MallInfo2._fields_}


def _rss() -> int:
    return psutil.Process().memory_info().rss


def rss_parts() -> dict:
    """/proc/self/status: anonymous memory (heaps, arenas, stacks) vs file-backed (code)."""
    parts = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                name, value, _ = line.split()
                parts[name.rstrip(":")] = int(value) * 1024
    return parts


def pymalloc_stats() -> dict:
    """Python's small-object allocator (`sys._debugmallocstats`, written to fd 2): its
    1 MiB arenas are mmapped directly, outside glibc's figures."""
    wanted = {"# arenas allocated current": "arenas", "# bytes in allocated blocks": "in_use",
              "# bytes in available blocks": "free_blocks"}
    with tempfile.TemporaryFile("w+") as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        stats = {}
        for line in capture:
            label, _, value = line.partition("=")
            label = label.strip()
            if label in wanted:
                stats[wanted[label]] = int(value.strip().replace(",", ""))
            elif label.endswith("unused pools * 16384 bytes"):
                stats["unused_pools"] = int(value.strip().replace(",", ""))
    if "arenas" in stats:
        stats["arena_bytes"] = stats["arenas"] * (1 << 20)
    return stats


def _diagnose(out_dir: Path) -> None:
    """Write what this process holds to `out_dir/diag-N.json` (and a tracemalloc snapshot)."""
    number = len(list(out_dir.glob("diag-*.json")))
    report = diagnosis(out_dir / f"diag-{number}.tracemalloc")
    partial = out_dir / f".diag-{number}.json"
    partial.write_text(json.dumps(report))
    partial.rename(out_dir / f"diag-{number}.json")


def diagnosis(snapshot_path: Path | None = None) -> dict:
    """What this process holds: RSS (before and after `malloc_trim`), its parts, the heap
    figures of glibc and of pymalloc, and the gc-tracked objects by type. While tracemalloc
    traces, a snapshot is dumped to `snapshot_path` and named in the report."""
    gc.collect()
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    rss_before = _rss()
    heap_before = mallinfo()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    report = {
        "rss": rss_before, "rss_after_trim": _rss(), "rss_parts": rss_parts(),
        "pymalloc": pymalloc_stats(), "mallinfo": heap_before,
        "mallinfo_after_trim": mallinfo(), "allocated_blocks": sys.getallocatedblocks(),
        "gc_objects": dict(counts), "gc_counts": gc.get_count(),
        "threads": threading.active_count(),
    }
    if snapshot_path is not None and tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(str(snapshot_path))
        report["tracemalloc"] = str(snapshot_path)
        report["traced"] = tracemalloc.get_traced_memory()[0]
    return report


def _trim() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def serve_coordinator(argv: list[str]) -> int:
    """The coordinator's own `main`, after installing the diagnostic hooks: SIGUSR1 writes a
    report to $SOAK_DIAG_DIR, SIGUSR2 trims the heap; $SOAK_TRACEMALLOC frames are traced."""
    from coordinator_stub.__main__ import main

    frames = int(os.environ.get("SOAK_TRACEMALLOC", "0"))
    if frames:
        tracemalloc.start(frames)
    out_dir = os.environ.get("SOAK_DIAG_DIR")
    if out_dir:
        signal.signal(DIAG_SIGNAL, lambda *_: _diagnose(Path(out_dir)))
    signal.signal(TRIM_SIGNAL, lambda *_: _trim())
    return main(argv)


def held_bytes(report: dict) -> int:
    """Bytes live objects hold after the trim: pymalloc blocks in use, glibc's heap in
    use and its large mmapped blocks. What RSS holds beyond it is allocator caching,
    fragmentation or code."""
    heap = report["mallinfo_after_trim"]
    return (report["pymalloc"].get("in_use", 0) + heap.get("uordblks", 0)
            + heap.get("hblkhd", 0))


def _growth_by_type(first: dict, last: dict, top: int = 15) -> list[tuple[str, int, int]]:
    a, b = first["gc_objects"], last["gc_objects"]
    rows = [(name, b.get(name, 0) - a.get(name, 0), b.get(name, 0)) for name in set(a) | set(b)]
    rows.sort(key=lambda r: -abs(r[1]))
    return rows[:top]


def report_diagnosis(who: str, first: dict, last: dict) -> None:
    print(f"\n{who} diagnosis, end of warm-up -> end:")
    for label, key in (("RSS", "rss"), ("RSS after malloc_trim", "rss_after_trim")):
        print(f"  {label:22s} {first[key] / 2**20:8.1f} -> {last[key] / 2**20:8.1f} MB "
              f"({(last[key] - first[key]) / 2**20:+.1f})")
    h0, h1 = held_bytes(first), held_bytes(last)
    print(f"  {'held by live objects':22s} {h0 / 2**20:8.1f} -> {h1 / 2**20:8.1f} MB "
          f"({(h1 - h0) / 2**20:+.1f})  (pymalloc + glibc in use, after the trim)")
    m0, m1 = first["mallinfo"], last["mallinfo"]
    if m0:
        for name, label in (("arena", "heap from the OS"), ("uordblks", "heap in use"),
                            ("fordblks", "heap free (cached)"), ("hblkhd", "large mmapped")):
            print(f"  {label:22s} {m0[name] / 2**20:8.1f} -> {m1[name] / 2**20:8.1f} MB "
                  f"({(m1[name] - m0[name]) / 2**20:+.1f})")
    for name, label in (("RssAnon", "RSS anonymous"), ("RssFile", "RSS file-backed")):
        a, b = first["rss_parts"].get(name, 0), last["rss_parts"].get(name, 0)
        print(f"  {label:22s} {a / 2**20:8.1f} -> {b / 2**20:8.1f} MB ({(b - a) / 2**20:+.1f})")
    p0, p1 = first["pymalloc"], last["pymalloc"]
    for name, label in (("arena_bytes", "pymalloc arenas"), ("in_use", "pymalloc in use"),
                        ("free_blocks", "pymalloc free blocks"),
                        ("unused_pools", "pymalloc unused pools")):
        if name in p0 and name in p1:
            print(f"  {label:22s} {p0[name] / 2**20:8.1f} -> {p1[name] / 2**20:8.1f} MB "
                  f"({(p1[name] - p0[name]) / 2**20:+.1f})")
    print(f"  {'python blocks':22s} {first['allocated_blocks']:8d} -> "
          f"{last['allocated_blocks']:8d} ({last['allocated_blocks'] - first['allocated_blocks']:+d})")
    print("  gc-tracked objects by type, largest change first (change, now):")
    for name, change, now in _growth_by_type(first, last):
        print(f"    {change:+9d} {now:9d}  {name}")
    if "tracemalloc" in first and "tracemalloc" in last:
        before = tracemalloc.Snapshot.load(first["tracemalloc"])
        after = tracemalloc.Snapshot.load(last["tracemalloc"])
        print(f"  traced: {first['traced'] / 2**20:.1f} -> {last['traced'] / 2**20:.1f} MB; "
              "growth by line:")
        for stat in after.compare_to(before, "lineno")[:15]:
            print(f"    {stat}")
        print("  growth by traceback (top 3):")
        for stat in after.compare_to(before, "traceback")[:3]:
            print(f"    {stat.size_diff / 2**10:+.0f} KiB, {stat.count_diff:+d} blocks")
            for line in stat.traceback.format()[-12:]:
                print(f"      {line}")


# --- launching a probed coordinator -------------------------------------------------------------

@dataclass
class ProbedCoordinator:
    url: str
    process: subprocess.Popen
    diag_dir: Path

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname

    @property
    def port(self) -> int:
        return urlsplit(self.url).port

    def diagnose(self, timeout: float = 120.0) -> dict:
        """The coordinator's `diagnosis()` (it collects garbage and trims its heap)."""
        number = len(list(self.diag_dir.glob("diag-*.json")))
        self.process.send_signal(DIAG_SIGNAL)
        path = self.diag_dir / f"diag-{number}.json"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the coordinator wrote no diagnostic report")
            time.sleep(0.05)
        return json.loads(path.read_text())

    def trim(self) -> None:
        self.process.send_signal(TRIM_SIGNAL)

    def stop(self) -> int:
        """SIGTERM (SIGKILL after 15 s); the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        return self.process.returncode


def launch(flags: list[str], diag_dir: Path, *, checkout: str | None = None,
           tracemalloc_frames: int = 0, malloc_arena_max: int = 0,
           startup_timeout: float = 180.0) -> ProbedCoordinator:
    """`python -m coordinator_stub --host 127.0.0.1 --port 0 *flags` with the hooks above,
    from `checkout` (default: the current directory); waits until it listens."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SOAK_DIAG_DIR": str(diag_dir),
           "SOAK_TRACEMALLOC": str(tracemalloc_frames)}
    if malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(malloc_arena_max)
    checkout = os.path.abspath(checkout or os.getcwd())
    env["PYTHONPATH"] = os.pathsep.join([checkout, *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, os.path.abspath(__file__), "--serve-coordinator",
               "--host", "127.0.0.1", "--port", "0", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env,
                               cwd=checkout)
    deadline = time.monotonic() + startup_timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([process.stdout], [], [], remaining)[0]:
            process.kill()
            process.wait()
            raise RuntimeError(f"the coordinator did not start within {startup_timeout:.0f} s")
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the coordinator exited with {process.wait()} before binding")
        found = _LISTENING.search(line)
        if found:
            return ProbedCoordinator(found.group(1), process, diag_dir)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve-coordinator"]:
        sys.exit("usage: memory_probe.py --serve-coordinator COORDINATOR-ARGS...")
    sys.exit(serve_coordinator(sys.argv[2:]))
