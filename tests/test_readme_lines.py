"""Every code block of the README (and of docs/OPERATIONS.md) works as written.

The convention, for whoever adds a block: a fence right after an HTML comment
`<!-- readme-test: KIND -->`; a ```sh, ```python or ```text fence without one fails.

- `run` (```sh): every command is run for real on loopback, from the checkout (`$PWD` is
  it; `.venv/` its virtual environment); numbers after `--port` / `--http-port` and in
  `127.0.0.1:PORT` are swapped for free ports, the same in every block. The coordinator line
  (one, a block of its own) starts first and is kept running; the router line must start
  and stop on SIGTERM; each LMCache server line (`lmcache server` or `python -m
  lmcache.v1.multiprocess.server`, one per supported version, its directory on
  `PYTHONPATH`) must start, print the plugin's line naming the coordinator, register with it
  (`lmcache server`) and stop on SIGTERM. Lines are found by the marker, so a line added for
  another LMCache version is run without touching this file.
- `python` (```python): the usage example, run as a script with this checkout importable
  against the coordinator line (its URL swapped like the ports); what it prints must be the
  `output` (```text) block right after it.
- `template` (```sh): placeholders are the reader's; only the coordinator's flags are
  checked (parsed).
- `make` (```sh): each `make TARGET` exists in the Makefile.

The configuration tables list exactly the environment variables the product reads, and a
plugin variable set to its documented default changes nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator_stub.config import parse_args
from plugin.harness.lmcache_process import quiet_lmcache_env

LANE = "unit"

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = (README, ROOT / "docs" / "OPERATIONS.md")  # where marked blocks are looked for
_MARKER = re.compile(r"<!--\s*readme-test:\s*(\w+)")
_FENCE = re.compile(r"^```(sh|python|text)\s*$")
_LANGUAGE = {"run": "sh", "template": "sh", "make": "sh", "python": "python", "output": "text"}
#: Python packages whose environment reads the configuration tables must list.
PRODUCT = ("plugin", "coordinator_stub", "blend_router", "blend_wire", "local_matcher")
_PORT = re.compile(r"(--port |--http-port |127\.0\.0\.1:)(\d+)")
_LMCACHE = re.compile(r"(^|/)lmcache server\b|-m lmcache\.v1\.multiprocess\.server\b")
READY_S = 180.0  # an LMCache server imports torch; a cold numba cache costs more


@dataclass
class Block:
    kind: str
    line: int  # where the fence opens, 1-based
    commands: list[str]  # continuation lines joined, comments dropped
    source: str = "README.md"
    text: str = ""  # the block as written


def readme_blocks(text: str, source: str = "README.md") -> list[Block]:
    lines = text.splitlines()
    blocks = []
    kind, comment_open = None, False
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.search(line)
        if marker:
            kind = marker.group(1)
        fence = _FENCE.match(line)
        if fence:
            assert kind is not None, (
                f"{source}:{i + 1}: a ```{fence.group(1)} block without a `<!-- readme-test: "
                f"KIND -->` comment right before it (see tests/test_readme_lines.py)")
            assert _LANGUAGE.get(kind) == fence.group(1), (
                f"{source}:{i + 1}: a `readme-test: {kind}` block must be a "
                f"```{_LANGUAGE.get(kind, '(sh, python or text)')} fence")
            start, body = i + 1, []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            commands = _commands(body) if fence.group(1) == "sh" else []
            blocks.append(Block(kind, start, commands, source, "\n".join(body) + "\n"))
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

    def lmcache_dir(match: re.Match) -> str:  # $PWD/.lmcache-0.5.7, likewise
        for base in (ROOT, Path(sys.prefix).parent):
            if (base / match.group(1)).is_dir():
                return str(base / match.group(1))
        return match.group(0)  # not installed: the version check below says so
    command = re.sub(r"\$PWD/(\.lmcache-[\w.-]+)", lmcache_dir, command)
    return re.sub(r"(^|\s)(\.venv[\w.-]*)/", replace, command)


def _ports_nobody_else_picks():
    """Free ports below the kernel's ephemeral range, a block of 1,000 per xdist worker.

    A line's server binds its ports seconds after they are chosen (LMCache imports torch
    first); a port from bind(0) is in the ephemeral range, where meanwhile any process's
    bind(0), ZMQ's random ports and outgoing connections take theirs (on CI a ZMQ socket
    answered an LMCache line's HTTP port). Below the range only this worker chooses."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    first = low - 1000 * (worker + 1)
    assert first >= 1024, "too many xdist workers for the ports below the ephemeral range"
    for port in range(first, first + 1000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        yield port


_FREE_PORTS = _ports_nobody_else_picks()  # one per worker process: no port handed out twice


class Ports:
    """Documented port -> a free one, the same for every line of the run."""

    def __init__(self) -> None:
        self.map: dict[str, str] = {}

    def port(self, documented: str) -> str:
        if documented not in self.map:
            self.map[documented] = str(next(_FREE_PORTS))
        return self.map[documented]

    def __call__(self, command: str) -> str:
        return _PORT.sub(lambda m: m.group(1) + self.port(m.group(2)), command)


def _env(*, telemetry_from_the_line: bool = False) -> dict:
    env = quiet_lmcache_env({"PWD": str(ROOT)})
    env.pop("PYTHONPATH", None)  # the lines say what they need
    if telemetry_from_the_line:
        # An LMCache line must turn LMCache's usage telemetry off itself, as an operator
        # copies it. (The unreachable report URL stays: nothing leaves even if it does not.)
        env.pop("LMCACHE_TRACK_USAGE")
        env.pop("DO_NOT_TRACK")
    return env


def _spawn(command: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env or _env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _terminate(process: subprocess.Popen) -> None:
    """SIGTERM, once (a second one cuts LMCache's shutdown short); `_stop` then waits."""
    if process.poll() is None and not getattr(process, "sigterm_sent", False):
        os.killpg(process.pid, signal.SIGTERM)  # bash, or what it exec'd, and its children
        process.sigterm_sent = True


def _stop(process: subprocess.Popen, timeout: float = 30.0) -> int:
    _terminate(process)
    if process.poll() is None:
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
    BLOCKS, UNMARKED = [block for doc in DOCS
                        for block in readme_blocks(doc.read_text(), doc.name)], None
except AssertionError as exc:  # reported by the first test, not as a collection error
    BLOCKS, UNMARKED = [], str(exc)


def test_every_sh_block_has_a_known_kind():
    assert UNMARKED is None, UNMARKED
    assert BLOCKS, "no ```sh block found in README.md"
    for block in BLOCKS:
        assert block.kind in _LANGUAGE, (block.source, block.line, block.kind)
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
                    f"{block.source}:{block.line}: make {target}: no such target in the "
                    f"Makefile")


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
    # The line for LMCache 0.5.7rc2 names its directory; without it the venv's 0.5.6 loads.
    version = r"0\.5\.7\w*" if ".lmcache-0.5.7" in line else r"0\.5\.6"
    assert re.search(rf"loaded into LMCache {version}: cb_unified_lookup is ours", loaded), (
        f"{line}\n{loaded}\n(LMCache 0.5.7rc2 not installed? `make lmcache-057`)")
    assert f"coordinator {coordinator_url}" in loaded, loaded
    assert "budget 1 s" in loaded, loaded
    if not front_end:
        assert "reported by the plugin" in loaded, loaded
        _assert_no_usage_telemetry(line, log)
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
    _assert_no_usage_telemetry(line, log)


_USAGE = re.compile(r"Initializing [\w ]*usage")  # LMCache's lines when telemetry starts


def _assert_no_usage_telemetry(line: str, log: Path) -> None:
    started = _USAGE.findall(log.read_text(errors="replace"))
    assert not started, f"{line}\nturns LMCache's usage telemetry on: {started}"


def test_every_lmcache_line_turns_usage_telemetry_off():
    # LMCache reports usage unless LMCACHE_TRACK_USAGE is exactly `false` (or DO_NOT_TRACK).
    lines = [c for b in BLOCKS if b.kind == "run" for c in b.commands if _LMCACHE.search(c)]
    assert lines
    for line in lines:
        assert "LMCACHE_TRACK_USAGE=false " in line, line


def _start_coordinator(ports: Ports, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """The README's one coordinator line, on a free port, once it is listening."""
    run = [c for b in BLOCKS if b.kind == "run" for c in b.commands]
    coordinators = [c for c in run if "-m coordinator_stub" in c]
    assert len(coordinators) == 1, coordinators
    url = "http://127.0.0.1:" + ports.port("9300")
    coordinator = _spawn(ports(_resolve_venvs(coordinators[0])), tmp_path / "coordinator.log")
    try:
        _wait_for(coordinator, tmp_path / "coordinator.log", f"listening on {url}")
    except BaseException:
        _stop(coordinator)
        raise
    return coordinator, url


@pytest.mark.lmcache
def test_run_lines_work_as_written(tmp_path):
    """The coordinator line, then each LMCache line against it (the README's order)."""
    run = [c for b in BLOCKS if b.kind == "run" for c in b.commands]
    coordinators = [c for c in run if "-m coordinator_stub" in c]
    servers = [c for c in run if _LMCACHE.search(c)]
    routers = [c for c in run if "-m blend_router" in c]
    unknown = [c for c in run if c not in coordinators + servers + routers]
    assert not unknown, f"teach tests/test_readme_lines.py how to run: {unknown}"
    ports = Ports()
    coordinator, coordinator_url = _start_coordinator(ports, tmp_path)
    try:
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
                running.append((line, log, _spawn(ports(_resolve_venvs(line)), log,
                                                  _env(telemetry_from_the_line=True))))
            for line, log, server in running:
                _check_lmcache_server(line, log, server, ports, coordinator_url)
        finally:
            for _, _, server in running:  # all shut down side by side, as each takes seconds
                _terminate(server)
            codes = [(_stop(server), log) for _, log, server in running]
        for code, log in codes:
            assert code in (0, -signal.SIGTERM), log.read_text()[-3000:]
    finally:
        assert _stop(coordinator) == 0


@pytest.mark.coordinator
def test_python_example_prints_what_the_readme_says(tmp_path):
    """The usage example, run as written against the README's coordinator line."""
    examples = [i for i, b in enumerate(BLOCKS) if b.kind == "python"]
    assert examples, "no `readme-test: python` block (the usage example) in README.md"
    for i in examples:
        block = BLOCKS[i]
        assert i + 1 < len(BLOCKS) and BLOCKS[i + 1].kind == "output", (
            f"{block.source}:{block.line}: a python block is followed by its `output` block")
        ports = Ports()
        coordinator, _ = _start_coordinator(ports, tmp_path)
        try:
            script = tmp_path / f"example-{block.line}.py"
            script.write_text(ports(block.text))
            env = {k: v for k, v in _env().items() if not k.startswith("LMCACHE_COORDINATOR_")}
            # A budget a loaded machine cannot run out of: the example shows the fleet leg.
            env.update(PYTHONPATH=str(ROOT), LMCACHE_COORDINATOR_BLEND_TIMEOUT="60")
            done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=READY_S)
        finally:
            assert _stop(coordinator) == 0
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout == BLOCKS[i + 1].text, (
            f"{block.source}:{block.line}: the example printed\n{done.stdout}\nbut the "
            f"README says\n{BLOCKS[i + 1].text}")


def _table(variable_prefixes: tuple[str, ...]) -> dict[str, str]:
    """`{name: default}` of the README's environment-variable tables."""
    rows = {}
    for row in README.read_text().splitlines():
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        if len(cells) == 3 and cells[0].strip("`").startswith(variable_prefixes):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def _environment_reads() -> set[str]:
    """Every environment variable the product reads: the string constants of its `ENV_*`
    names (a name, or a dict of them: `plugin.config`, the coordinator's access tokens) and
    any literal `environ.get("NAME")` / `environ["NAME"]`, wherever the modules live."""
    names: set[str] = set()
    read = re.compile(r"environ(?:\.get\(|\[)\s*[\"']([A-Z][A-Z0-9_]+)[\"']")
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            if "harness" in path.parts:
                continue  # the test/demo harness sets LMCache's variables, reads none
            text = path.read_text()
            names |= set(read.findall(text))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id.startswith("ENV_") for t in node.targets):
                    names |= {c.value for c in ast.walk(node.value)
                              if isinstance(c, ast.Constant) and isinstance(c.value, str)
                              and c.value.isupper()}
    return names


def test_the_configuration_tables_list_what_the_code_reads():
    reads = _environment_reads()
    table = _table(("LMCACHE_", "COORDINATOR_", "ROUTER_"))
    assert reads, "found no environment variable read by the product"
    assert not reads - set(table), f"missing from the README's tables: {reads - set(table)}"
    assert not set(table) - reads, f"in the README's tables, read by nothing: {set(table) - reads}"


def test_a_plugin_variable_set_to_its_documented_default_changes_nothing():
    from plugin import PluginConfig

    default = PluginConfig.from_env(environ={})
    for name, cell in _table(("LMCACHE_",)).items():
        value = cell.strip("`")
        if value == "unset":
            assert getattr(default, _field_of(name)) is None, name
            continue
        if value == "hostname:pid":
            assert getattr(default, _field_of(name)) == f"{socket.gethostname()}:{os.getpid()}"
            continue
        if value == "off":
            value = "0"
        assert PluginConfig.from_env(environ={name: value}) == default, (
            f"{name}={value!r}, the README's default, is not the default")


def _field_of(name: str) -> str:
    """The `PluginConfig` field an (unset by default) variable sets."""
    from plugin import PluginConfig

    fields = [f.name for f in dataclasses.fields(PluginConfig)]
    sample = {"LMCACHE_COORDINATOR_CA_FILE": __file__,
              "LMCACHE_COORDINATOR_URL": "http://x",
              "LMCACHE_COORDINATOR_ENGINE_URL": "http://x:8000"}.get(name,
                                                                     "sample-value-0123456789")
    changed = [f for f in fields
               if getattr(PluginConfig.from_env(environ={name: sample}), f)
               != getattr(PluginConfig.from_env(environ={}), f)]
    assert len(changed) == 1, (name, changed)
    return changed[0]
