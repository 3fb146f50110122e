"""The LMCache tests again on LMCache 0.5.7rc2: the adapter's unit tests and the whole
e2e (tests/e2e/test_lmcache_e2e.py: fleet leg, union, local-only with the coordinator down, L1
eviction with an L2 copy, restart fencing, abandoned-lookup release, events), the
replicas, CLI and candidates e2e, run in a child pytest whose path puts `make test`'s 0.5.7
install (plugin.harness.lmcache_process's `LMCACHE_057_DIR`) first, plus what only 0.5.7
has: a chunk size negotiated at registration (tests/e2e/lmcache057_negotiation_e2e.py). A child
process, because the engine client speaks the LMCache its own process imports, and one
process cannot import two LMCache versions.

Parametrized by version so a later release is one more entry (and its own install).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from plugin.harness.lmcache_process import LMCACHE_057, lmcache_env

LANE = "lmcache"

ROOT = Path(__file__).resolve().parents[2]
FILES = ("tests/serving/test_lmcache_adapter.py", "tests/e2e/test_lmcache_e2e.py",
         "tests/e2e/lmcache057_negotiation_e2e.py",
         # Several coordinator URLs (the plugin's registrar carries the negotiated size),
         # LMCache's CLI against the coordinator, and LMCache's own coordinator answering
         # the plugin's candidates form with its default one.
         "tests/e2e/test_lmcache_replicas_e2e.py", "tests/e2e/test_lmcache_coordinator_e2e.py",
         "tests/e2e/test_candidates_e2e.py::"
         "test_against_lmcache_coordinator_the_default_form_is_detected_once")


@pytest.mark.parametrize("version", [LMCACHE_057])
def test_the_lmcache_tests_pass_on(version):
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
         "ignore::DeprecationWarning", *FILES],
        cwd=ROOT, env=lmcache_env(version), capture_output=True, text=True, timeout=900)
    tail = "\n".join(child.stdout.splitlines()[-40:])
    print(f"LMCache {version}: {tail}")  # the counts land in the suite's output with -s/-rP
    assert child.returncode == 0, f"the LMCache tests fail on {version}:\n{tail}\n{child.stderr[-3000:]}"
    summary = child.stdout.strip().splitlines()[-1]
    counts = {kind: int(n) for n, kind in
              re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|deselected)", summary)}
    assert set(counts) == {"passed"}, summary  # nothing skipped on the way
