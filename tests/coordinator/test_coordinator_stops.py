"""The coordinator process stops when told, at every stage, and fails to start in one line.

Real processes (`python -m coordinator_stub`) on loopback: SIGINT/SIGTERM while a replica
waits for an unreachable event log, the bounded wait giving up (exit 1, one CRITICAL line),
a port already in use, and event-log flags given without `--event-log` (refused, exit 2).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import closed_port_url

LANE = "coordinator"


def _coordinator(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "coordinator_stub", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _nats_url_nobody_serves() -> str:
    return closed_port_url().replace("http://", "nats://")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_replica_waiting_for_its_event_log(signum):
    process = _coordinator("--event-log", _nats_url_nobody_serves())
    try:
        # The wait is logged when it begins (one line, not one per attempt).
        first = process.stderr.readline()
        while "waiting for the event log" not in first:
            assert first, "the coordinator exited without saying it waits for its event log"
            first = process.stderr.readline()
        assert "giving up in 30 s" in first
        time.sleep(1.5)  # several connection attempts (one per 0.5 s) fail meanwhile
        process.send_signal(signum)
        code = process.wait(timeout=20)
        rest = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 0, rest
    assert "stopped by a signal while starting" in rest
    assert rest.count("waiting for the event log") <= 1, rest  # one per 5 s, not per try
    assert "Traceback" not in rest
    assert process.stdout.read() == ""  # it never bound: no `listening on` line


def test_an_unreachable_event_log_is_given_up_after_the_timeout():
    process = _coordinator("--event-log", _nats_url_nobody_serves(),
                           "--event-log-connect-timeout", "3")
    try:
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1, err
    critical = [line for line in err.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1, err
    assert "cannot reach the event log" in critical[0]
    assert "within 3 s (--event-log-connect-timeout)" in critical[0]
    assert "ConnectionRefusedError" in critical[0]
    # Logged at the start and every 5 s, not per attempt (~6 attempts in 3 s).
    assert err.count("waiting for the event log") == 1, err
    assert "Traceback" not in err


def test_a_port_in_use_is_one_line_and_exit_1():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "coordinator_stub", "--port", str(port)],
                                capture_output=True, text=True, timeout=180)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot listen on http://127.0.0.1:{port}" in lines[0]
    assert "address already in use" in lines[0] and "--port 0" in lines[0]


@pytest.mark.parametrize("flags", [["--snapshot-dir", "/tmp/nowhere"],
                                   ["--snapshot-store", "nats"],
                                   ["--replica-name", "a", "--snapshot-interval", "5"],
                                   ["--event-log-replicas", "3"]])
def test_event_log_flags_without_the_event_log_are_refused(flags):
    result = subprocess.run([sys.executable, "-m", "coordinator_stub", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "given without --event-log" in result.stderr
    for flag in flags:
        if flag.startswith("--"):
            assert flag in result.stderr.splitlines()[-1]


def test_sigterm_while_serving_leaves_no_listener():
    process = _coordinator()
    try:
        line = process.stdout.readline()
        assert line.startswith("listening on "), process.stderr.read()
        port = int(line.strip().rsplit(":", 1)[1])
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_the_first_moments_exits_0_without_a_traceback(signum):
    """While the interpreter loads the coordinator's modules (most of a second, before any
    event loop exists) and compiles its kernels, a signal still stops it: exit 0, one line
    saying so, no traceback. Each delay counts from when `coordinator_stub.__main__` holds
    the signals (it catches SIGTERM from then on; the interpreter itself never does), its
    first act: before, only the interpreter's own start-up runs (see the next test).
    On a fast machine with a warm numba cache the last delay may find it serving already:
    then it stops as a serving coordinator does; at least one delay must find it starting."""
    stopped_while_starting = []
    for delay in (0.0, 0.15, 0.35, 0.6):
        process = _coordinator()
        try:
            deadline = time.monotonic() + 30
            while not _catches(process.pid, signal.SIGTERM):
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.002)
            time.sleep(delay)
            process.send_signal(signum)
            out, err = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 0, (delay, err)
        assert "Traceback" not in err, (delay, err)
        if out.startswith("listening on "):  # it was up by then
            assert "shutting down" in err, (delay, err)
            continue
        assert out == "", (delay, out)
        assert "stopped by a signal while starting" in err, (delay, err)
        stopped_while_starting.append(delay)
    assert stopped_while_starting, "it was serving before the earliest signal"


def test_the_process_holds_signals_before_it_loads_anything():
    """What runs before the hold is outside the start-up contract (a signal there kills the
    process with a traceback): `__main__` imports only `signal` and `sys` at its top, and
    `main` holds the signals before it imports anything else. The package's `__init__`,
    which runs before `__main__`, imports nothing at run time but `typing`'s flag."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "coordinator_stub"
    tree = ast.parse((package / "__main__.py").read_text())
    top = [alias.name for node in tree.body if isinstance(node, ast.Import)
           for alias in node.names]
    top += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert sorted(top) == ["__future__", "signal", "sys"]
    main = next(node for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name == "main")
    first_import = next(i for i, node in enumerate(main.body)
                        if isinstance(node, (ast.Import, ast.ImportFrom)))
    hold = next(i for i, node in enumerate(main.body)
                if "signal.signal" in ast.unparse(node))
    assert hold < first_import
    init = ast.parse((package / "__init__.py").read_text())
    assert [ast.unparse(node) for node in init.body
            if isinstance(node, (ast.Import, ast.ImportFrom))] == \
        ["from __future__ import annotations", "from typing import TYPE_CHECKING"]
