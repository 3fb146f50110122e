"""Every shell block of the README works as written (the convention is in README.md,
"Inside a real LMCache MP server": a ```sh fence right after `<!-- readme-test: KIND -->`).

`run` blocks are run for real on loopback: the coordinator line first (kept running),
then each LMCache server line, one at a time, on free ports: it must start, print the
plugin's line naming the coordinator, register with it (`lmcache server`), and stop on
SIGTERM. The router line starts and stops on SIGTERM. `template` blocks: the
coordinator's flags are parsed. `make` blocks: each target exists. Lines are found by the
marker, so a line added for another LMCache version is run without touching this file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator_stub.config import parse_args
from plugin.harness.lmcache_process import free_port, quiet_lmcache_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_MARKER = re.compile(r"<!--\s*readme-test:\s*(\w+)")
_FENCE = re.compile(r"^```sh\s*$")
_PORT = re.compile(r"(--port |--http-port |127\.0\.0\.1:)(\d+)")
_LMCACHE = re.compile(r"(^|/)lmcache server\b|-m lmcache\.v1\.multiprocess\.server\b")
READY_S = 180.0  # an LMCache server imports torch; a cold numba cache costs more


@dataclass
class Block:
    kind: str
    line: int  # where the fence opens, 1-based
    commands: list[str]  # continuation lines joined, comments dropped


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks = []
    kind, comment_open = None, False
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.search(line)
        if marker:
            kind = marker.group(1)
        if _FENCE.match(line):
            assert kind is not None, (
                f"README.md:{i + 1}: a ```sh block without a `<!-- readme-test: KIND -->` "
                f"comment right before it (see the convention in README.md)")
            start, body = i + 1, []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append(Block(kind, start, _commands(body)))
            kind = None
        elif line.strip() and not marker and not comment_open and kind is not None \
                and not line.lstrip().startswith("<!--"):
            if not line.rstrip().endswith("-->"):
                kind = None  # prose between the comment and a fence: not its marker
        if "<!--" in line and "-->" not in line:
            comment_open = True
        elif "-->" in line:
            comment_open = False
        i += 1
    return blocks


def _commands(body: list[str]) -> list[str]:
    joined, current = [], ""
    for raw in body:
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line and not current:
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        joined.append((current + line).strip())
        current = ""
    return [c for c in joined if c]


def _resolve_venvs(command: str) -> str:
    """`.venv*/` paths: this checkout's, or (a worktree, which has none) the ones beside the
    virtual environment running these tests."""
    def replace(match: re.Match) -> str:
        name = match.group(2)
        for base in (ROOT, Path(sys.prefix).parent):
            if (base / name).is_dir():
                return match.group(1) + str(base / name) + "/"
        if name == ".venv":
            return match.group(1) + sys.prefix + "/"
        raise AssertionError(f"{name}/ (in the README line {command!r}) does not exist here")
    return re.sub(r"(^|\s)(\.venv[\w.-]*)/", replace, command)


class Ports:
    """Documented port -> a free one, the same for every line of the run."""

    def __init__(self) -> None:
        self.map: dict[str, str] = {}

    def __call__(self, command: str) -> str:
        return _PORT.sub(lambda m: m.group(1) + self.map.setdefault(m.group(2),
                                                                    str(free_port())), command)


def _env() -> dict:
    env = quiet_lmcache_env({"PWD": str(ROOT)})
    env.pop("PYTHONPATH", None)  # the lines say what they need
    return env


def _spawn(command: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen, timeout: float = 30.0) -> int:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # bash, or what it exec'd, and its children
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise AssertionError(f"did not stop on SIGTERM within {timeout:.0f} s")
    return process.returncode


def _wait_for(process: subprocess.Popen, log: Path, *needles: str) -> str:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if all(n in text for n in needles):
            return text
        if process.poll() is not None:
            raise AssertionError(f"exited with code {process.returncode} before "
                                 f"{needles}:\n{text[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"not ready within {READY_S:.0f} s:\n{log.read_text()[-3000:]}")


def _get_json(url: str, until=lambda reply: True, timeout: float = 60.0):
    """GET `url` until it answers JSON that `until` accepts (the HTTP front end binds, and
    the server registers, just after its 'initialized' line); the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                answer = json.load(reply)
            if until(answer) or time.monotonic() > deadline:
                return answer
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


try:
    BLOCKS, UNMARKED = readme_blocks(README.read_text()), None
except AssertionError as exc:  # reported by the first test, not as a collection error
    BLOCKS, UNMARKED = [], str(exc)


def test_every_sh_block_has_a_known_kind():
    assert UNMARKED is None, UNMARKED
    assert BLOCKS, "no ```sh block found in README.md"
    for block in BLOCKS:
        assert block.kind in ("run", "template", "make"), (block.line, block.kind)
    run = [c for b in BLOCKS if b.kind == "run" for c in b.commands]
    assert any("-m coordinator_stub" in c for c in run)
    assert any(_LMCACHE.search(c) for c in run)


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    for block in (b for b in BLOCKS if b.kind == "make"):
        for command in block.commands:
            words = shlex.split(command)
            assert words[0] == "make", (block.line, command)
            for target in words[1:]:
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), (
                    f"README.md:{block.line}: make {target}: no such target in the Makefile")


def test_template_coordinator_flags_parse():
    for block in (b for b in BLOCKS if b.kind == "template"):
        for command in block.commands:
            if "-m coordinator_stub" in command:
                argv = shlex.split(command.split("-m coordinator_stub", 1)[1])
                parse_args(argv, environ={})  # exits (SystemExit 2) on a refused flag


def _check_lmcache_server(line: str, log: Path, server: subprocess.Popen, ports: Ports,
                          coordinator_url: str) -> None:
    front_end = "lmcache server" in line
    text = _wait_for(server, log, "fleet-blend plugin",
                     "LMCache HTTP server initialized" if front_end
                     else "LMCache cache server is running")
    loaded = next(row for row in text.splitlines() if "fleet-blend plugin" in row)
    assert re.search(r"loaded into LMCache [\w.]+: cb_unified_lookup is ours", loaded), loaded
    assert f"coordinator {coordinator_url}" in loaded, loaded
    assert "budget 1 s" in loaded, loaded
    if not front_end:
        assert "reported by the plugin" in loaded, loaded
        return
    assert "reported by LMCache's subscriber" in loaded, loaded
    http = re.search(r"--http-port (\d+)", ports(line)).group(1)
    status = _get_json(f"http://127.0.0.1:{http}/status")["fleet_blend"]
    assert status["name"] == "fleet-blend"
    assert status["coordinator_urls"] == [coordinator_url]
    instances = _get_json(f"{coordinator_url}/instances",
                          until=lambda reply: any(i["http_port"] == int(http)
                                                  for i in reply["instances"]))
    assert any(i["http_port"] == int(http) for i in instances["instances"]), \
        f"the server on HTTP port {http} did not register with the coordinator: {instances}"


def test_run_lines_work_as_written(tmp_path):
    """The coordinator line, then each LMCache line against it (the README's order)."""
    run = [c for b in BLOCKS if b.kind == "run" for c in b.commands]
    coordinators = [c for c in run if "-m coordinator_stub" in c]
    servers = [c for c in run if _LMCACHE.search(c)]
    routers = [c for c in run if "-m blend_router" in c]
    unknown = [c for c in run if c not in coordinators + servers + routers]
    assert not unknown, f"teach tests/test_readme_lines.py how to run: {unknown}"
    assert len(coordinators) == 1, coordinators
    ports = Ports()
    coordinator_line = ports(_resolve_venvs(coordinators[0]))
    coordinator_url = "http://127.0.0.1:" + ports.map["9300"]
    coordinator = _spawn(coordinator_line, tmp_path / "coordinator.log")
    try:
        _wait_for(coordinator, tmp_path / "coordinator.log",
                  f"listening on {coordinator_url}")
        for n, line in enumerate(routers):  # it starts, and stops on SIGTERM (exit 0)
            log = tmp_path / f"router-{n}.log"
            router = _spawn(ports(_resolve_venvs(line)), log)
            try:
                _wait_for(router, log, "listening on http://")
            finally:
                assert _stop(router) == 0, log.read_text()[-3000:]
        # Side by side (each its own ports): every one must start, say the plugin is
        # there, and stop on SIGTERM.
        running = []
        try:
            for n, line in enumerate(servers):
                log = tmp_path / f"lmcache-{n}.log"
                running.append((line, log, _spawn(ports(_resolve_venvs(line)), log)))
            for line, log, server in running:
                _check_lmcache_server(line, log, server, ports, coordinator_url)
        finally:
            codes = [(_stop(server), log) for _, log, server in running]
        for code, log in codes:
            assert code in (0, -signal.SIGTERM), log.read_text()[-3000:]
    finally:
        assert _stop(coordinator) == 0


def test_every_environment_variable_the_plugin_reads_is_in_the_readme_table():
    from plugin import config

    names = {value for name, value in vars(config).items() if name.startswith("ENV_")}
    table = {row.split("|")[1].strip().strip("`") for row in README.read_text().splitlines()
             if row.startswith("| `LMCACHE_")}
    assert names and not names - table, f"missing from the README's table: {names - table}"
