"""BlendCoordinatorClient against real loopback servers that misbehave on purpose."""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest

from blend_wire import decode_tokens
from helpers import (NOT_HUNG_S, FakeClock, HangingServer, LoopbackServer, Reply,
                     TricklingServer, closed_port_url, take_when_done, wait_until)
from plugin import BlendCoordinatorClient, BlendNamespace, CBMatchResult, FleetReply, MatchState
from plugin.lookup import columns_of
from plugin.types import NOTHING_FOUND, FoundContent, Place

LANE = "unit"

C = 16
NS = BlendNamespace("model", "salt", 2)
TOKENS = np.arange(4 * C, dtype=np.uint32)  # a 64-token query: cur_st may go up to 48
DONE_EMPTY = FleetReply(MatchState.DONE)
FAILED = FleetReply(MatchState.FAILED)


def make_client(url: str, **kwargs) -> BlendCoordinatorClient:
    options = dict(chunk_size=C, timeout=0.5, match_concurrency=2, breaker_threshold=3,
                   breaker_cooldown_s=0.3)
    options.update(kwargs)
    return BlendCoordinatorClient(url, **options)


def seg(chunk_hash: bytes, old_st: int, cur_st: int) -> CBMatchResult:
    return CBMatchResult(old_st, old_st + C, cur_st, cur_st + C, chunk_hash)


def done(*segments: CBMatchResult) -> FleetReply:
    """The hand-over of a default-form reply: one position and one chunk per match."""
    return FleetReply(MatchState.DONE, columns_of([
        FoundContent((s.cur_st,), Place.PEER, ((s.hash, s.old_st),)) for s in segments]))


def matches_reply(*entries) -> Reply:
    return Reply(200, {"matches": [dict(chunk_hash=h, old_st=o, cur_st=c) for h, o, c in entries]})


@pytest.fixture
def client_factory():
    made = []

    def factory(url, **kwargs):
        made.append(make_client(url, **kwargs))
        return made[-1]

    yield factory
    for client in made:
        client.close()


def test_submit_take_and_request_body(client_factory):
    with LoopbackServer(lambda p, b: matches_reply(("ab01", 32, 16))) as server:
        client = client_factory(server.url)
        assert client.take("r1").state is MatchState.UNKNOWN  # never submitted
        assert client.submit("r1", TOKENS, NS)
        # The same shape as the local leg's: segments with their ends.
        assert take_when_done(client, "r1") == done(seg(b"\xab\x01", 32, 16))
        assert client.take("r1").state is MatchState.UNKNOWN  # handed over once, then forgotten
        (path, body), = server.requests
        sent = json.loads(body)
        assert path == "/directory/blend-lookup"
        assert decode_tokens(sent["tokens_b64"]).tolist() == TOKENS.tolist()
        assert (sent["model_name"], sent["cache_salt"], sent["world_size"]) == ("model", "salt", 2)


def test_submit_once_per_request_id_and_pending_stays_tracked(client_factory):
    with LoopbackServer(lambda p, b: Reply(delay_s=0.1)) as server:
        client = client_factory(server.url)
        assert client.submit("r1", TOKENS, NS)
        assert not client.submit("r1", TOKENS, NS)
        pending = client.take("r1")
        assert pending.state is MatchState.PENDING and pending.found == NOTHING_FOUND
        assert client.take("r1").state is MatchState.PENDING  # asking does not cancel
        assert take_when_done(client, "r1") == DONE_EMPTY
        assert len(server.requests) == 1
        assert client.stats().declined_duplicate == 1


def test_at_most_match_concurrency_round_trips_in_flight(client_factory):
    with LoopbackServer(lambda p, b: Reply(delay_s=0.15)) as server:
        client = client_factory(server.url, match_concurrency=2)
        for i in range(6):
            assert client.submit(f"r{i}", TOKENS, NS, deadline=time.monotonic() + 5)
        for i in range(6):
            assert take_when_done(client, f"r{i}") == DONE_EMPTY
        assert len(server.requests) == 6
        assert server.peak_active == 2


def test_query_whose_deadline_passed_is_not_sent(client_factory):
    released = threading.Event()
    with LoopbackServer(lambda p, b: released.wait(60) and Reply()) as server:
        clock = FakeClock()
        client = client_factory(server.url, match_concurrency=1, clock=clock)
        client.submit("slow", TOKENS, NS, deadline=clock() + 5)
        assert wait_until(lambda: server.active == 1)  # the one worker waits for its reply
        # Queued behind the slow one; its deadline passes before the worker is free.
        client.submit("late", TOKENS, NS, deadline=clock() + 0.05)
        clock.advance(0.1)
        released.set()
        assert take_when_done(client, "late") == FAILED
        assert take_when_done(client, "slow") == DONE_EMPTY
        assert len(server.requests) == 1
        assert client.stats().skipped_deadline == 1


def _failure_cases():
    yield "refused", None
    yield "5xx", lambda p, b: Reply(503, "overloaded")
    yield "422", lambda p, b: Reply(422, "tokens_b64 is not valid base64")
    yield "non-json", lambda p, b: Reply(200, "<html>proxy error</html>")
    yield "wrong-shape", lambda p, b: Reply(200, {"results": []})
    yield "wrong-types", lambda p, b: Reply(200, {"matches": [{"chunk_hash": 1, "old_st": "x"}]})
    yield "timeout", "hang"


@pytest.mark.parametrize("case, behave", list(_failure_cases()), ids=[c for c, _ in _failure_cases()])
def test_failures_give_failed_and_a_warning(case, behave, client_factory, caplog):
    caplog.set_level(logging.WARNING, logger="plugin.client")
    if behave is None:
        server, url = None, closed_port_url()
    elif behave == "hang":
        server = HangingServer()
        url = server.url
    else:
        server = LoopbackServer(behave)
        url = server.url
    try:
        client = client_factory(url, timeout=0.2)
        assert client.submit("r1", TOKENS, NS)
        assert take_when_done(client, "r1", timeout=NOT_HUNG_S) == FAILED  # hang: not for good
        assert client.stats().failed == 1
        assert any(r.levelno == logging.WARNING and "local-only" in r.getMessage()
                   for r in caplog.records)
    finally:
        if server is not None:
            server.close()


def test_invalid_reply_entries_are_dropped(client_factory, caplog):
    caplog.set_level(logging.WARNING, logger="plugin.client")
    reply = matches_reply(
        ("aa", 0, 0),          # valid
        ("zz", 0, 16),         # bad hex
        ("", 0, 16),           # empty hash
        ("bb", -1, 16),        # negative old_st (unknown offsets are never matchable)
        ("cc", 0, 49),         # cur_st + C beyond the 64-token query
        ("dd", 0, -3),         # negative cur_st
        ("aa", 0, 32),         # the same chunk twice
        ("ee", 512, 48),       # valid, last possible start
        ("ab cd", 0, 16),      # whitespace: not the wire's hex (bytes.fromhex would take it)
    )
    with LoopbackServer(lambda p, b: reply) as server:
        client = client_factory(server.url)
        client.submit("r1", TOKENS, NS)
        assert take_when_done(client, "r1") == done(seg(b"\xaa", 0, 0), seg(b"\xee", 512, 48))
        assert client.stats().dropped_entries == 7
        assert client.stats().failed == 0
        assert any("dropped 7 invalid" in r.getMessage() for r in caplog.records)


def test_circuit_breaker_opens_skips_then_probes(client_factory):
    healthy = threading.Event()
    clock = FakeClock()  # the client's clock: the cool-down passes when the test says so

    def behave(path, body):
        return Reply(200, {"matches": []}) if healthy.is_set() else Reply(500, "down")

    with LoopbackServer(behave) as server:
        client = client_factory(server.url, breaker_threshold=3, breaker_cooldown_s=0.3,
                                clock=clock)
        for i in range(3):
            assert client.submit(f"f{i}", TOKENS, NS, deadline=clock() + 5)
            take_when_done(client, f"f{i}")
        assert client.breaker_state == "open"
        # Open: declined at once (not queued, not tracked), nothing sent.
        assert not client.submit("skipped", TOKENS, NS)
        assert client.take("skipped").state is MatchState.UNKNOWN
        assert client.stats().skipped_breaker == 1
        assert len(server.requests) == 3
        # After the cool-down exactly one probe goes; it fails, so the breaker re-opens.
        clock.advance(0.35)
        assert client.submit("probe1", TOKENS, NS, deadline=clock() + 5)
        assert not client.submit("during-probe", TOKENS, NS)
        take_when_done(client, "probe1")
        assert client.breaker_state == "open"
        assert len(server.requests) == 4
        # The next probe succeeds and closes it.
        healthy.set()
        clock.advance(0.35)
        assert client.submit("probe2", TOKENS, NS, deadline=clock() + 5)
        take_when_done(client, "probe2")
        assert client.breaker_state == "closed"
        assert client.submit("normal", TOKENS, NS, deadline=clock() + 5)
        assert take_when_done(client, "normal") == DONE_EMPTY


def test_breaker_counts_only_consecutive_failures(client_factory):
    outcomes = iter([500, 500, 200, 500, 500])

    with LoopbackServer(lambda p, b: Reply(next(outcomes), {"matches": []})) as server:
        client = client_factory(server.url, breaker_threshold=3)
        for i in range(5):
            client.submit(f"r{i}", TOKENS, NS)
            take_when_done(client, f"r{i}")
        assert client.breaker_state == "closed"
        assert len(server.requests) == 5


@pytest.mark.parametrize("status, body", [(422, "model_name is required"), (404, "no such path"),
                                          (200, "<html>not json</html>"), (200, {"results": []})])
def test_caller_errors_and_bad_replies_do_not_count_toward_the_breaker(status, body,
                                                                     client_factory):
    # One misconfigured caller (422) or one odd reply must not turn the fleet leg off for
    # every lookup of the process; each such lookup still goes local-only.
    with LoopbackServer(lambda p, b: Reply(status, body)) as server:
        client = client_factory(server.url, breaker_threshold=2)
        for i in range(4):
            assert client.submit(f"r{i}", TOKENS, NS)
            assert take_when_done(client, f"r{i}") == FAILED
        assert client.breaker_state == "closed"
        assert client.stats().failed == 4 and len(server.requests) == 4


def test_a_caller_error_between_outages_does_not_reset_the_count(client_factory):
    outcomes = iter([503, 422, 503])
    with LoopbackServer(lambda p, b: Reply(next(outcomes), "x")) as server:
        client = client_factory(server.url, breaker_threshold=2)
        for i in range(3):
            client.submit(f"r{i}", TOKENS, NS)
            take_when_done(client, f"r{i}")
        assert client.breaker_state == "open"


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_trickling_coordinator_cannot_hold_a_round_trip_past_its_budget(part, client_factory):
    # httpx's timeouts are per read: a byte every 50 ms never trips a 0.3 s read timeout.
    budget = 0.3
    with TricklingServer(part, interval_s=0.05) as server:
        client = client_factory(server.url, timeout=budget, breaker_threshold=1)
        assert client.submit("r1", TOKENS, NS)
        # Unbounded, the round-trip would last hours (1 MB at 20 bytes/s); bounded, 0.3 s.
        assert take_when_done(client, "r1", timeout=NOT_HUNG_S) == FAILED
        assert client.stats().failed == 1
        assert client.breaker_state == "open"  # a timeout counts toward the breaker
        assert client.stats().in_flight == 0  # the worker is free again


def test_results_nobody_takes_expire(client_factory):
    with LoopbackServer() as server:
        clock = FakeClock()
        client = client_factory(server.url, result_ttl_s=0.1, clock=clock)
        client.submit("forgotten", TOKENS, NS)
        assert wait_until(lambda: client.stats().succeeded == 1)  # done, never taken
        clock.advance(0.15)
        client.submit("next", TOKENS, NS)  # housekeeping runs on submit
        assert client.take("forgotten").state is MatchState.UNKNOWN
        assert client.stats().expired >= 1


def test_tracking_map_is_bounded(client_factory):
    with LoopbackServer() as server:
        client = client_factory(server.url, max_tracked=3)
        for i in range(10):
            assert client.submit(f"r{i}", TOKENS, NS)
            assert wait_until(lambda: client.stats().succeeded == i + 1)  # done, never taken
        # Unclaimed finished results made room for the newest ones.
        assert client.stats().tracked <= 3
        assert client.take("r9") == DONE_EMPTY
        assert client.take("r0").state is MatchState.UNKNOWN
    with HangingServer() as hanging:
        client = client_factory(hanging.url, max_tracked=2, timeout=2.0)
        assert client.submit("a", TOKENS, NS)
        assert client.submit("b", TOKENS, NS)
        assert not client.submit("c", TOKENS, NS)  # all in flight: declined, not queued
        assert client.stats().tracked == 2 and client.stats().declined_full == 1


def test_reply_after_cancel_is_discarded(client_factory):
    with LoopbackServer(lambda p, b: Reply(200, {"matches": [
            {"chunk_hash": "aa", "old_st": 0, "cur_st": 0}]}, delay_s=0.15)) as server:
        client = client_factory(server.url)
        client.submit("r1", TOKENS, NS)
        assert wait_until(lambda: len(server.requests) == 1)  # in flight now
        client.cancel("r1")
        assert client.stats().cancelled == 1
        assert wait_until(lambda: client.stats().late_discarded == 1)
        assert client.take("r1").state is MatchState.UNKNOWN
        # The id can be used again afterwards.
        assert client.submit("r1", TOKENS, NS)
        assert take_when_done(client, "r1") == done(seg(b"\xaa", 0, 0))


def _match_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("blend-match") and t.is_alive()]


def test_close_waits_for_the_round_trip_in_flight_stops_workers_and_declines_afterwards():
    before = _match_threads()
    with LoopbackServer(lambda p, b: Reply(delay_s=0.2)) as server:
        client = make_client(server.url)
        assert client.submit("r1", TOKENS, NS)
        assert wait_until(lambda: client.stats().in_flight == 1)
        client.close()
        assert client.stats().in_flight == 0 and client.stats().late_discarded == 1
        assert not client.submit("r1", TOKENS, NS)
        assert client.stats().declined_closed == 1
        assert _match_threads() == before
