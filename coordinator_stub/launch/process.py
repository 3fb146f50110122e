"""Run the bundled coordinator as a child process (tests, the demo, benchmarks; never
imported by the service: docs/DESIGN.md, "Coordinator layout").

Builds on the start-up contract of `python -m coordinator_stub` (see `__main__`): once
bound (and, with blend lookup on, every kernel compiled: ready) it prints one line
``listening on http://HOST:PORT`` on stdout, and it exits 0 on SIGTERM. `start_coordinator` waits for that line (or fails with what went wrong);
`CoordinatorProcess.stop` sends SIGTERM, then SIGKILL if the process lingers.

`exit_on_signals()`: for programs that start children (the demos): within the block,
the first SIGTERM or SIGINT raises `SystemExit(128 + signal)`, so `finally` and `with`
blocks stop the children and remove temporary files; later ones are ignored while that
clean-up runs. `held_signals()`: SIGTERM/SIGINT wait (blocked) until the block is done,
for a step that must not be cut in half (building an object that starts threads and
registering its close).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Iterator
from urllib.parse import urlsplit

_LISTENING = re.compile(r"listening on (https?://\S+)")


@dataclass
class CoordinatorProcess:
    url: str
    process: subprocess.Popen

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname

    @property
    def port(self) -> int:
        return urlsplit(self.url).port

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait (SIGKILL after `timeout`); returns the exit code. Idempotent."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()
        return self.process.returncode


def start_coordinator(*flags: str, host: str = "127.0.0.1", port: int = 0,
                      stderr: int | IO | None = None, startup_timeout: float = 180.0,
                      module: str = "coordinator_stub") -> CoordinatorProcess:
    """Start `python -m coordinator_stub --host HOST --port PORT *flags`; wait until bound.
    (`module`: another server with the same start-up contract, e.g. `blend_router`.)

    `stderr` is passed to `subprocess.Popen` (None: inherit this process's). The default
    `startup_timeout` covers compiling every kernel on a fresh clone of a slow machine
    (numba caches them on disk; later starts take about a second).
    """
    command = [sys.executable, "-m", module, "--host", host, "--port", str(port), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + startup_timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([process.stdout], [], [], remaining)[0]:
                raise RuntimeError(f"coordinator did not report its address within "
                                   f"{startup_timeout:.0f} s: {' '.join(command)}")
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"coordinator exited with code {process.wait()} before "
                                   f"binding: {' '.join(command)}")
            found = _LISTENING.search(line)
            if found:
                return CoordinatorProcess(found.group(1), process)
    except BaseException:
        process.kill()
        process.wait()
        process.stdout.close()
        raise


class _ExitOnSignals:
    """State of `exit_on_signals` (main thread only): how deep `held_signals` blocks are
    nested, and a signal that came while one was open."""

    def __init__(self, signums: tuple[int, ...]) -> None:
        self.signums = signums
        self.held = 0
        self.pending: int | None = None
        self.exiting = False

    def handler(self, signum, frame) -> None:
        if self.exiting:  # the clean-up the first one started must not be cut short
            return
        if self.held:
            self.pending = self.pending or signum
            return
        self.exit(signum)

    def exit(self, signum: int) -> None:
        self.exiting = True
        raise SystemExit(128 + signum)


_active: _ExitOnSignals | None = None


@contextlib.contextmanager
def exit_on_signals(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
                    ) -> Iterator[None]:
    """SIGTERM/SIGINT raise `SystemExit(128 + signum)` once within the block (the default
    SIGTERM ends the process at once and orphans its children); the previous handlers are
    back after it."""
    global _active
    state = _active = _ExitOnSignals(signums)
    previous = {signum: signal.signal(signum, state.handler) for signum in signums}
    try:
        yield
    finally:
        _active = None
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Within `exit_on_signals`: a signal that arrives during the block takes effect at its
    end, for a step that must not be cut in half (building an object that starts threads,
    and registering its close). Outside `exit_on_signals` it does nothing."""
    state = _active
    if state is None:
        yield
        return
    state.held += 1
    try:
        yield
    finally:
        state.held -= 1
        if not state.held and state.pending is not None and not state.exiting:
            state.exit(state.pending)


@contextlib.contextmanager
def launch_coordinator(*flags: str, **options) -> Iterator[CoordinatorProcess]:
    """`start_coordinator` for the length of a `with` block, stopped on the way out."""
    coordinator = start_coordinator(*flags, **options)
    try:
        yield coordinator
    finally:
        coordinator.stop()
