"""Root of the test tree: the fixtures every coordinator test shares, and the test lanes.

Its presence also puts tests/ on sys.path (pytest's default "prepend" import mode adds each
conftest's folder), so every test module, sub-folders included, imports the shared helpers
(`helpers` for the plugin side, `coordinator_client` for the coordinator side); no test
module imports another (tests/test_public_api.py reads every file's imports to check).

Layout, a folder per package, named for what it tests but never by a module's name (on
sys.path it would hide the package; tests/test_public_api.py checks): `wire/` (blend_wire),
`matcher/` (local_matcher), `serving/` (plugin, its LMCache adapter included),
`coordinator/` (coordinator_stub), `router/` (blend_router), `bench/` (benchmarks); `e2e/`
runs several of them together in real processes (LMCache's servers among them), `hostile/`
the adversarial cases; the whole-project checks (layering, limits, exports, docs, README,
entry points) and the helper modules sit here. Test file names stay unique across folders
(each folder's modules import by their bare name).

- `start(**overrides)`: an in-process coordinator (chunk size 4, blend lookup on) on a free
  loopback port, with `CoordinatorConfig` overrides; every one started is closed after the
  test.
- `coord`: one such coordinator with the defaults.

Lanes, one per test (markers, registered in pyproject.toml with `--strict-markers`):
- `unit`: in this process only: no child process, no LMCache code. `make test-fast` runs
  `-m unit` (and then does not even import a module whose `LANE` is another).
- `coordinator`: starts child processes of this project (the bundled coordinator, a demo,
  a fresh interpreter), but no NATS server and no LMCache.
- `nats`: starts a NATS server (and coordinators on it).
- `lmcache`: runs LMCache's code: its servers, or its modules imported into this process.
Every test module says `LANE = "unit"` (or another): the lane marker of its tests that name
none themselves (a test marked `@pytest.mark.coordinator`, say, is in that lane alone), put
on at collection, so `-m` sees one lane per test. Loudly: a test with no lane (no marker, no
`LANE`) or two stops the run at collection, as does a module holding LMCache's code outside
the lmcache lane; a test that starts more than its lane allows fails, naming the lane it
needs (the command line of every child process is checked, and whether LMCache's modules
were first imported during the test).

`alone` (not a lane): a test that bounds a latency (how long `/healthz` waits, say). `make
test` runs the suite on two workers, whose load on the second core upsets such a bound, so
it runs these afterwards, by themselves (`-m alone`). Mark one only where the bound is what
the test is for.

Hypothesis runs without its per-example deadline: property tests assert results, not
speed, and a first example that compiles or loads kernels on a loaded 2-core machine took
over a second (seen: `test_wire.py`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hypothesis import settings

from coordinator_client import Coordinator, start_coordinator

settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# The lanes, cheapest first: a test's lane must be at least what it starts.
LANES = ("unit", "coordinator", "nats", "lmcache")
_NATS = re.compile(r"nats-server")
_LMCACHE = re.compile(r"(?:^|[\s/])lmcache(?:[\s.]|$)|lmcache\w*\.py\b")  # its CLI, a module, a script
_MODULE_LANE = re.compile(r'^LANE = "(\w+)"$', re.MULTILINE)
_PROJECT = {"plugin", "coordinator_stub", "local_matcher", "blend_wire", "blend_router",
            "benchmarks"}
_running: dict = {}  # while a test runs: its lane, what it did beyond it, LMCache loaded before
_popen_init = subprocess.Popen.__init__


def _lanes(item: pytest.Item) -> list[str]:
    """The test's lane markers (one is right; none or two is an error)."""
    return sorted({mark.name for mark in item.iter_markers() if mark.name in LANES})


def _beyond_its_lane(lane: str, what: str) -> str | None:
    """What the running test did, if `lane` is beyond its own: recorded, to fail it."""
    running = _running.get("lane")
    if running is None or LANES.index(lane) <= LANES.index(running):
        return None  # within its lane, or outside any test (collection, start-up)
    message = (f"it is in the {running} lane but {what}: mark it `{lane}` (the lanes: "
               "tests/conftest.py)")
    _running["beyond"].append(message)
    return message


def _guarded_popen_init(self, args, *rest, **kwargs):
    argv = args if isinstance(args, (str, bytes, os.PathLike)) else " ".join(map(str, args))
    text = os.fsdecode(argv)
    lane = "lmcache" if _LMCACHE.search(text) else "nats" if _NATS.search(text) else "coordinator"
    message = _beyond_its_lane(lane, f"starts a child process ({text[:120]})")
    if message:
        raise RuntimeError(message)
    _popen_init(self, args, *rest, **kwargs)


def _holds_lmcache(module) -> bool:
    """Whether a test module holds LMCache's code: a name imported from LMCache, or from a
    module of this project that imports one (one level down)."""
    def home(value) -> str:
        name = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
        return name if isinstance(name, str) else ""

    for value in vars(module).values():
        name = home(value)
        if name.split(".")[0] == "lmcache":
            return True
        inner = sys.modules.get(name)
        if inner is not None and inner is not module and name.split(".")[0] in _PROJECT:
            if any(home(v).split(".")[0] == "lmcache" for v in vars(inner).values()):
                return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _guarded_popen_init


def pytest_unconfigure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _popen_init


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """Under `-m unit`, a module whose `LANE` is another, and that names the unit lane
    nowhere, is not even imported (LMCache's and torch's imports cost seconds)."""
    if config.option.markexpr != "unit" or collection_path.suffix != ".py":
        return None
    text = collection_path.read_text()
    lane = _MODULE_LANE.search(text)
    if lane and lane.group(1) != "unit" and "pytest.mark.unit" not in text:
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test has its lane
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        lanes, module = _lanes(item), getattr(item, "module", None)
        default = getattr(module, "LANE", None)
        if not lanes and default in LANES:
            item.add_marker(default)
            lanes = [default]
        if len(lanes) != 1:
            wrong.append(f"{item.nodeid}: {'lanes ' + ', '.join(lanes) if lanes else 'no lane'}")
        elif lanes != ["lmcache"] and module is not None and _holds_lmcache(module):
            wrong.append(f"{item.nodeid}: its module holds LMCache's code: lane `lmcache`")
    if wrong:
        raise pytest.UsageError(
            "every test needs one lane (unit, coordinator, nats or lmcache: its module's "
            "`LANE`, or its own marker; tests/conftest.py says which is which):\n  "
            + "\n  ".join(wrong[:40]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _running.update(lane=_lanes(item)[0], beyond=[], had_lmcache="lmcache" in sys.modules)
    try:
        return (yield)
    finally:
        _running.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    if report.when == "teardown" and not _running["had_lmcache"] and "lmcache" in sys.modules:
        _beyond_its_lane("lmcache", "imported LMCache's modules")
    if _running["beyond"] and report.when in ("call", "teardown"):
        if not report.failed:  # failed already: the error says it
            report.outcome, report.longrepr = "failed", "\n".join(_running["beyond"])
        _running["beyond"].clear()
    return report


@pytest.fixture
async def start():
    clients = []
    yield lambda **overrides: start_coordinator(clients, **overrides)
    for client in clients:
        await client.close()


@pytest.fixture
async def coord(start) -> Coordinator:
    return await start()
