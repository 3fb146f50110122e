"""A process whose `BlendPlugin` was never closed still exits, promptly, and its queued cache
events still reach the coordinator (issue 33: such a script hung until interrupted).

Real processes: a fresh interpreter builds a plugin with a coordinator URL and event
reporting on (a lookup in flight, events queued), then ends without `close()`, or raises
first; the bundled coordinator (`coordinator_stub.launch`) receives the events, or a socket
that never answers stands in for a coordinator that hangs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from coordinator_stub.launch.process import launch_coordinator

LANE = "coordinator"

ROOT = Path(__file__).resolve().parents[2]
#: The exit hook's bound with the default budgets (blend 1 s + events 2 s + 1 s), plus the
#: interpreter's own teardown on a loaded machine.
PROMPT_EXIT_S = 12.0

CHILD = """
import sys
from plugin import BlendPlugin, InMemoryHost, LookupKey, PluginConfig

url, ending = sys.argv[1], sys.argv[2]
host = InMemoryHost(chunk_size=256)
plugin = BlendPlugin(PluginConfig(coordinator_url=url, event_reporting=True,
                                  instance_id="never-closed"), host)
stored = LookupKey("stored", list(range(1000, 1512)), model_name="m")
hashes = host.chunk_hashes(stored)
host.store(stored, hashes)
plugin.on_store(stored, hashes)  # two STORE events queued (flushed every second)
plugin.cb_unified_lookup(LookupKey("asked", [7] * 40 + list(range(1000, 1512)), model_name="m"))
print("built", flush=True)
if ending == "raise":
    raise RuntimeError("the script fails before close()")
"""


def _run_child(url: str, ending: str) -> tuple[subprocess.CompletedProcess, float]:
    """The child's result and how long it took to exit once its plugin was built."""
    process = subprocess.Popen([sys.executable, "-c", CHILD, url, ending], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    try:
        assert process.stdout.readline() == "built\n", process.stderr.read()
        built = time.monotonic()
        out, err = process.communicate(timeout=60)
        took = time.monotonic() - built
    finally:
        if process.poll() is None:  # hung: what this test is about
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), took


@pytest.mark.parametrize("ending, code", [("end", 0), ("raise", 1)])
def test_a_never_closed_plugin_exits_and_flushes_its_events(ending, code):
    with launch_coordinator() as coordinator:
        done, took = _run_child(coordinator.url, ending)
        keys = httpx.get(f"{coordinator.url}/directory/stats").json()["num_keys"]
    assert done.returncode == code, done.stderr
    assert took < PROMPT_EXIT_S, f"exited {took:.1f} s after its plugin was built"
    assert keys == 2, "the queued STORE events were not delivered at exit"
    if ending == "raise":
        assert "the script fails before close()" in done.stderr
    else:
        assert "Traceback" not in done.stderr, done.stderr


def test_a_coordinator_that_never_answers_holds_the_exit_only_within_the_bound():
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        done, took = _run_child(url, "end")
    assert done.returncode == 0, done.stderr
    assert took < PROMPT_EXIT_S, f"exited {took:.1f} s after its plugin was built"
    assert "Traceback" not in done.stderr, done.stderr
