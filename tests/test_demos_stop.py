"""The demos and the LMCache launcher stop what they started when told (or when they fail).

Each demo runs as a real process with its own temporary directory (TMPDIR) and log
directory; a signal is sent once it has started its children, and then nothing of it may
be left: no child process, no listening coordinator, no `/dev/shm/lmcache_kv_<pid>_*`
segment, no temporary directory. The launcher (`plugin.harness.lmcache_process`) is checked on a
server that fails to start.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

LANE = "coordinator"

ROOT = Path(__file__).resolve().parents[1]


def _run_demo(script: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, str(ROOT / "examples" / script), "--log-dir",
                                str(tmp_path / "logs")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    return process, tmp


def _read_until(process: subprocess.Popen, marker: str) -> list[str]:
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"the demo exited ({process.wait()}) before {marker!r}:\n"
                         + "".join(lines))


def _coordinator_port(lines: list[str]) -> int:
    found = next(m for m in (re.search(r"coordinator: .*?http://127\.0\.0\.1:(\d+)", line)
                             for line in lines) if m)
    return int(found.group(1))


def _assert_nothing_left(process: subprocess.Popen, children: list[psutil.Process],
                         tmp: Path, port: int) -> None:
    for child in children:  # reaped by the demo, or at least not running
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, child
    assert not list(tmp.iterdir()), list(tmp.iterdir())  # temporary directories removed
    assert not [f for f in os.listdir("/dev/shm")
                if f.startswith(f"lmcache_kv_{process.pid}_")]
    with pytest.raises(ConnectionRefusedError):  # the coordinator no longer listens
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def _stop_demo(process: subprocess.Popen, signum: int) -> tuple[int, str]:
    try:
        process.send_signal(signum)
        rest = process.stdout.read()
        return process.wait(timeout=120), rest
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_fleet_demo_stops_its_coordinator_on_a_signal(tmp_path, signum):
    process, tmp = _run_demo("fleet_demo.py", tmp_path)
    lines = _read_until(process, "coordinator: http")
    children = psutil.Process(process.pid).children(recursive=True)
    assert children  # the coordinator
    code, rest = _stop_demo(process, signum)
    assert code == 128 + signum, "".join(lines) + rest
    assert "coordinator stopped" in rest and "Traceback" not in rest, rest
    assert f"coordinator logs: {tmp_path / 'logs'}" in rest
    _assert_nothing_left(process, children, tmp, _coordinator_port(lines))


@pytest.mark.lmcache
def test_lmcache_demo_stops_everything_on_sigterm(tmp_path):
    process, tmp = _run_demo("lmcache_demo.py", tmp_path)
    lines = _read_until(process, "lmcache server B: ")
    children = psutil.Process(process.pid).children(recursive=True)
    assert len([c for c in children if c.parent().pid == process.pid]) == 3  # coord. + 2
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"lmcache_kv_{process.pid}_")]
    code, rest = _stop_demo(process, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, "".join(lines) + rest
    assert "servers and coordinator stopped" in rest and "Traceback" not in rest, rest
    _assert_nothing_left(process, children, tmp, _coordinator_port(lines))
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert "coordinator-0.log" in logs and len(logs) == 3, logs  # kept, and named
    assert f"logs: {tmp_path / 'logs'}" in rest


@pytest.mark.lmcache
def test_launcher_stops_a_server_that_fails_and_removes_its_log_dir(tmp_path, monkeypatch):
    from plugin.harness.lmcache_process import start_lmcache_server

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="exited with code"):
        # Blend's lookup needs --engine-type blend: the adapter refuses, the server exits.
        start_lmcache_server("bad", engine_type="default")
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE]
    assert not list(tmp_path.glob("lmcache-logs-*"))
