"""One request cannot ask for unbounded work (issue 30, item 3; docs/WIRE.md, "Limits").

A real coordinator process (chunk 8) where 16 instances each hold one chunk of one token
repeated, asked about 2^20 tokens of that token in 11 KB of gzip. Before the limits the
candidates form answered 7.3 MB (every one of the ~10^6 positions) and the score took
seconds of CPU while every other lookup waited. Now the candidates reply names the
content's leftmost `MAX_CANDIDATE_POSITIONS` positions and says `truncated`, the score
answers with the figures the full reply would give, and a lookup sent beside it is
answered. (How long each takes is `make bench-bounded`'s to measure.)
"""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading

import httpx
import msgspec
import numpy as np
import pytest

from benchmarks.bench_bounded_work import (REPEATED_TOKEN, coordinator, repeated_body,
                                           repeated_fleet)
from blend_wire import BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, MAX_CANDIDATE_POSITIONS, encode, \
    encode_tokens

LANE = "coordinator"

CHUNK, INSTANCES, TOKENS = 8, 16, 1 << 20
REPLY_LIMIT = 4 << 20  # the plugin's LMCACHE_COORDINATOR_BLEND_MAX_REPLY_BYTES default


@pytest.fixture(scope="module")
def fleet():
    with coordinator(CHUNK) as process:
        with httpx.Client(base_url=process.url, timeout=120) as client:
            repeated_fleet(client, CHUNK, INSTANCES)
            yield client


def _post(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"Content-Encoding": "gzip",
                                                    "Content-Type": "application/json"})


def test_the_candidates_reply_names_the_leftmost_positions_and_says_it_was_cut(fleet):
    reply = _post(fleet, BLEND_LOOKUP_PATH, repeated_body("candidates", TOKENS))
    assert reply.status_code == 200, reply.text
    assert len(reply.content) <= REPLY_LIMIT
    decoded = msgspec.json.decode(reply.content)
    assert decoded["truncated"] is True
    [content] = decoded["candidates"]  # one content: CHUNK tokens of the repeated token
    assert content["positions"] == list(range(MAX_CANDIDATE_POSITIONS))
    # Every instance's chunk is offered (16 < 1024 + 4), each at its instance's L1.
    assert sorted(chunk["l1"][0] for chunk in content["chunks"]) == sorted(
        f"inst-{i}" for i in range(INSTANCES))


def test_the_score_answers_what_every_instance_would_reuse(fleet):
    reply = _post(fleet, BLEND_SCORE_PATH, repeated_body("blend-score", TOKENS))
    assert reply.status_code == 200, reply.text
    scores = msgspec.json.decode(reply.content)["instances"]
    assert len(scores) == INSTANCES
    for score in scores:
        # Its own chunk first (L1), then the 15 peers' at the next positions: 16 chunks of
        # the one content, each once; nobody holds the request's prefix chain.
        assert (score["prefix_tokens"], score["l1_tokens"], score["shared_tokens"],
                score["peer_tokens"]) == (0, CHUNK, 0, (INSTANCES - 1) * CHUNK), score
        assert score["score"] == CHUNK + 0.25 * (INSTANCES - 1) * CHUNK


def test_a_small_lookup_beside_the_score_is_answered_right(fleet):
    small = np.concatenate([np.full(CHUNK, REPEATED_TOKEN, dtype=np.uint32),
                            np.arange(4096, dtype=np.uint32) + 100])
    answers: list[httpx.Response] = []
    scored = threading.Thread(target=lambda: answers.append(
        _post(fleet, BLEND_SCORE_PATH, repeated_body("blend-score", TOKENS))))
    scored.start()
    body = gzip.compress(encode({"tokens_b64": encode_tokens(small), "model_name": "m"}))
    with httpx.Client(base_url=str(fleet.base_url), timeout=120) as other:
        reply = _post(other, BLEND_LOOKUP_PATH, body)
    scored.join()
    assert reply.status_code == 200 and answers[0].status_code == 200
    [match] = msgspec.json.decode(reply.content)["matches"]
    assert (match["old_st"], match["cur_st"]) == (0, 0)


_KERNELS_AFTER_START = """
from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.service.coordinator import Coordinator
from local_matcher import selection_kernels
Coordinator(CoordinatorConfig(chunk_size=8, enable_blend_lookup=True))
print(len(selection_kernels.score.signatures), len(selection_kernels.occurrences.signatures))
"""


def test_the_score_kernels_are_ready_when_the_coordinator_starts():
    """Compiled (or loaded from numba's cache) by the first score instead, they took 5.4-5.9
    s of that request's CPU on a cold cache, every lookup queued behind it."""
    ready = subprocess.run([sys.executable, "-c", _KERNELS_AFTER_START], capture_output=True,
                           text=True, timeout=600, check=True).stdout.split()
    assert [int(count) >= 1 for count in ready] == [True, True], ready
