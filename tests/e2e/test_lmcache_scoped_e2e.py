"""Real LMCache 0.5.6 MP servers loading the plugin, against a coordinator whose tokens are
scoped (issue 19, item 1).

Processes, on free loopback ports: the bundled coordinator with a token file; two
ZMQ-only servers (`python -m lmcache.v1.multiprocess.server`, where the plugin reports
cache events itself) sharing a filesystem L2, each given its token through
`LMCACHE_COORDINATOR_TOKEN`: C with a token scoped to its own id and the empty salt, X
with that same token but another instance id. C's events are taken and X finds C's
document through the fleet (reads are scoped to the salt, which X's requests use); X's
own events are refused (403: the id is outside the token's scope), so the coordinator
never offers X's document, and neither server raises or stalls.
"""

from __future__ import annotations

import functools
import random
import re

import httpx
import numpy as np

from blend_wire import BLEND_LOOKUP_PATH, DIRECTORY_LOOKUP_PATH, encode_tokens
from coordinator_stub.launch.process import launch_coordinator
from helpers import wait_until
from plugin.harness.lmcache_process import ServerFleet

LANE = "lmcache"

C = 256
MODEL = "fleet-model"
TOKEN_C, ADMIN = "c" * 24, "z" * 24
rng = random.Random(20261219)
settled = functools.partial(wait_until, timeout=60.0, interval=0.05)


def tokens(n: int) -> list[int]:
    return [rng.randrange(1000, 60000) for _ in range(n)]


def test_lmcache_servers_with_scoped_tokens(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text(f'emitter {TOKEN_C} instances=srv-c salts=""\n'
                          f'reader {TOKEN_C} salts=""\n'
                          f"admin {ADMIN}\n")
    l2_dir = tmp_path / "l2"
    l2_dir.mkdir()
    (tmp_path / "logs").mkdir()
    with launch_coordinator("--enable-blend-lookup", "--auth-token-file",
                            str(token_file)) as coordinator:
        admin = httpx.Client(base_url=coordinator.url, timeout=30,
                             headers={"Authorization": f"Bearer {ADMIN}"})

        def fleet_matches(sequence: list[int]) -> int:
            body = {"tokens_b64": encode_tokens(np.asarray(sequence, dtype=np.uint32)),
                    "model_name": MODEL, "world_size": 1, "cache_salt": ""}
            return len(admin.post(BLEND_LOOKUP_PATH, json=body).json()["matches"])

        def in_l2(sequence: list[int]) -> bool:
            body = {"token_ids": sequence, "model_name": MODEL, "world_size": 1}
            results = admin.post(DIRECTORY_LOOKUP_PATH, json=body).json()["results"]
            return len(results) == len(sequence) // C and all(
                any(p["tier"] == "l2" for p in r["placements"]) for r in results)

        def forbidden() -> float:
            found = re.search(r'rejected_requests_total\{reason="forbidden"\} ([0-9.]+)',
                              admin.get("/metrics").text)
            return float(found.group(1)) if found else 0.0

        env = {"LMCACHE_COORDINATOR_TOKEN": TOKEN_C}
        with ServerFleet(coordinator_url=coordinator.url, l2_dir=str(l2_dir),
                         log_dir=str(tmp_path / "logs"), front_end=False, env=env,
                         module_config={"blend_timeout": 0.5}) as fleet:
            c, x = fleet.start_many({"C": dict(instance_id="srv-c"),
                                     "X": dict(instance_id="srv-x")})
            doc = tokens(2 * C)
            assert c.store(doc, "c-doc")
            assert settled(lambda: fleet_matches(doc) == 2)  # C's events were taken
            assert settled(lambda: in_l2(doc))
            result, _, _ = x.lookup(tokens(50) + doc, "x-finds-c-doc")
            assert [s.cur_st for s in result.non_prefix_segments] == [50, 50 + C]
            # X's own events speak for srv-x: outside the token's scope, refused.
            own = tokens(2 * C)
            assert x.store(own, "x-doc")
            assert settled(lambda: forbidden() >= 1)  # its reporter's posts: 403
            assert fleet_matches(own) == 0
            result, _, _ = x.lookup(tokens(50) + doc, "x-still-finds-c-doc")  # still serving
            assert [s.cur_st for s in result.non_prefix_segments] == [50, 50 + C]
        admin.close()
