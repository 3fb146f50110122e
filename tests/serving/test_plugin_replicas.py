"""The plugin with several coordinator URLs (replicas over one event log).

Real loopback servers stand in for replicas: lookups take turns over the healthy ones,
fail over within the budget when one is down, and each replica has its own breaker; the
reporter posts to one replica and moves on when it fails. The client, the reporter and the
registrar follow one fail-over policy (plugin.http): what makes them move on, what is
permanent, how long a replica is benched; each test of it runs all three. One URL behaves
as before (the rest of the plugin tests run with one).
"""

from __future__ import annotations

import numpy as np
import pytest

from blend_wire import INSTANCES_PATH
from helpers import LoopbackServer, Reply, closed_port_url, ok_reply, take_when_done, wait_until
from plugin import BlendCoordinatorClient, BlendNamespace, FleetReply, MatchState, PluginConfig
from plugin.config import ConfigError
from plugin.registrar import InstanceRegistrar
from plugin.reporter import CacheEventReporter

LANE = "unit"

C = 16
NS = BlendNamespace("model", "", 1)
TOKENS = np.arange(4 * C, dtype=np.uint32)


def found(name: str):
    return lambda path, body: Reply(200, {"matches": [
        {"chunk_hash": name, "old_st": 0, "cur_st": 0}]})


def make_client(urls, **options) -> BlendCoordinatorClient:
    settings = dict(chunk_size=C, timeout=0.5, match_concurrency=1, breaker_threshold=2,
                    breaker_cooldown_s=60.0)
    settings.update(options)
    return BlendCoordinatorClient(urls, **settings)


def ask(client, request_id: str) -> FleetReply:
    assert client.submit(request_id, TOKENS, NS)
    return take_when_done(client, request_id)


def test_lookups_take_turns_over_the_replicas():
    with LoopbackServer(found("aa")) as a, LoopbackServer(found("bb")) as b:
        client = make_client(f"{a.url},{b.url}")
        try:
            answered = [ask(client, f"r{i}").found.chunk_hashes[0] for i in range(6)]
        finally:
            client.close()
        assert sorted(answered) == [b"\xaa"] * 3 + [b"\xbb"] * 3
        assert len(a.requests) == len(b.requests) == 3


def test_a_replica_down_fails_over_and_opens_only_its_own_breaker():
    with LoopbackServer(found("bb")) as b:
        client = make_client([closed_port_url(), b.url])
        try:
            for i in range(6):  # every lookup is answered, by b
                reply = ask(client, f"r{i}")
                assert reply.state is MatchState.DONE and reply.found.chunk_hashes[0] == b"\xbb"
            stats = client.stats()
            assert stats.failed_over == 2  # then the dead replica's breaker opened
            assert stats.breaker_opened == 1
            assert client.breaker_state == "closed"  # the leg stays on: b is healthy
            assert len(b.requests) == 6
        finally:
            client.close()


def test_every_replica_down_declines_at_once_like_one_url():
    client = make_client([closed_port_url(), closed_port_url()])
    try:
        for i in range(2):
            assert ask(client, f"r{i}").state is MatchState.FAILED
        assert client.breaker_state == "open"
        assert not client.submit("late", TOKENS, NS)  # local-only at once
    finally:
        client.close()


def test_a_client_error_does_not_fail_over():
    """A 4xx is this query's problem, not the replica's: no second replica is asked."""
    with LoopbackServer(lambda p, body: Reply(422, {"error": "bad"})) as a, \
            LoopbackServer(found("bb")) as b:
        client = make_client([a.url, b.url])
        try:
            assert ask(client, "r0").state is MatchState.FAILED
            assert len(a.requests) + len(b.requests) == 1
        finally:
            client.close()


def test_the_reporter_moves_on_to_a_healthy_replica():
    with LoopbackServer() as b:
        reporter = CacheEventReporter(f"{closed_port_url()},{b.url}", instance_id="s",
                                      flush_interval=60, timeout=0.5, start=False)
        try:
            reporter.report_store(NS, [b"\x01"], [np.arange(C, dtype=np.uint32)], [0])
            reporter.flush()
            assert wait_until(lambda: len(b.bodies("/events")) == 1)
            reporter.report_store(NS, [b"\x02"], [np.arange(C, dtype=np.uint32)], [C])
            reporter.flush()  # stays with the replica that works
            assert len(b.bodies("/events")) == 2
            assert [batch["seq"] for body in b.bodies("/events")
                    for batch in body["batches"]] == [1, 2]
        finally:
            reporter.close()


def test_config_takes_comma_separated_urls():
    config = PluginConfig.from_env({"LMCACHE_COORDINATOR_URL":
                                    " http://a:1/ , http://b:2 ,",
                                    "LMCACHE_COORDINATOR_EVENT_REPORTING": "1"})
    assert config.coordinator_urls == ("http://a:1", "http://b:2")
    assert PluginConfig(coordinator_url="http://a:1").coordinator_urls == ("http://a:1",)
    with pytest.raises(ConfigError, match="b:2"):
        PluginConfig(coordinator_url="http://a:1,b:2")


def test_every_part_is_built_from_the_configs_one_url_list():
    # The config parses the list once; the client, the reporter and the registrar take it.
    from plugin.config import coordinator_url_list

    assert coordinator_url_list(" http://a:1/ , http://b:2 ,") == ("http://a:1", "http://b:2")
    assert coordinator_url_list(["http://a:1/", " "]) == ("http://a:1",)
    assert coordinator_url_list(None) == ()
    config = PluginConfig(coordinator_url="http://a:1/, http://b:2", event_reporting=True,
                          instance_id="srv")
    client = BlendCoordinatorClient.from_config(config)
    try:
        assert client.base_url == "http://a:1,http://b:2"
        assert (client.chunk_size, client.timeout, client.match_concurrency, client.instance_id,
                client.max_reply_bytes, client.max_tracked) == (
            config.chunk_size, config.blend_timeout, config.match_concurrency, "srv",
            config.max_reply_bytes, config.max_tracked_queries)
    finally:
        client.close()
    registrar = InstanceRegistrar(config.coordinator_urls, instance_id="srv", ip="127.0.0.1",
                                  http_port=1, start=False)
    try:
        assert registrar.stats().url == "http://a:1"
    finally:
        registrar.close()  # never registered: nothing is sent



# --- one fail-over policy (plugin.http.Replicas): the client, the reporter and the registrar
# follow the same rule. Each caller below sends one request at a time through its own
# fail-over; `send()` says whether a replica took it.

def healthy(path: str, body: bytes) -> Reply:
    if path == INSTANCES_PATH:
        return Reply(200, {"instance_id": "s", "re_registered": False})
    if path.endswith("/events"):
        return ok_reply(path, body)
    return found("cc")(path, body)  # a lookup, or a heartbeat (only its status is read)


class Lookups:
    def __init__(self, urls: list[str]) -> None:
        self.client, self.sent = make_client(urls), 0

    def send(self) -> bool:
        self.sent += 1
        request_id = f"r{self.sent}"
        return (self.client.submit(request_id, TOKENS, NS)
                and take_when_done(self.client, request_id).state is MatchState.DONE)

    def close(self) -> None:
        self.client.close()


class Reports:
    def __init__(self, urls: list[str]) -> None:
        self.reporter = CacheEventReporter(urls, instance_id="s", flush_interval=60,
                                           timeout=0.5, start=False)

    def send(self) -> bool:
        taken = self.reporter.stats().sent_batches
        self.reporter.report_store(NS, [bytes([taken + 1])], [np.arange(C, dtype=np.uint32)], [0])
        self.reporter.flush()
        return self.reporter.stats().sent_batches > taken

    def close(self) -> None:
        self.reporter.close()


class Registrations:
    def __init__(self, urls: list[str]) -> None:
        self.registrar = InstanceRegistrar(urls, instance_id="s", ip="127.0.0.1",
                                           http_port=1, timeout=0.5, start=False)

    def send(self) -> bool:
        before = self.registrar.stats()
        self.registrar.beat()
        after = self.registrar.stats()
        return (after.registrations, after.heartbeats) != (before.registrations,
                                                          before.heartbeats)

    def close(self) -> None:
        self.registrar.close()


CALLERS = [Lookups, Reports, Registrations]


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c.__name__)
def test_every_caller_skips_a_replica_answering_503_and_one_answering_502(caller):
    """5xx, 503 included, says "this replica cannot take it now": each caller goes on to
    the next replica at once (the reporter used to stop at a 503)."""
    with LoopbackServer(lambda p, b: Reply(503, "busy")) as a, \
            LoopbackServer(lambda p, b: Reply(502, "bad gateway")) as b, \
            LoopbackServer(healthy) as c:
        sending = caller([a.url, b.url, c.url])
        try:
            assert sending.send()
            assert (len(a.requests), len(b.requests), len(c.requests)) == (1, 1, 1)
        finally:
            sending.close()


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c.__name__)
def test_no_caller_fails_over_a_permanent_refusal(caller):
    """A 422 refuses what the request is: every replica would; none is asked next."""
    with LoopbackServer(lambda p, b: Reply(422, {"detail": "invalid"})) as a, \
            LoopbackServer(healthy) as b:
        sending = caller([a.url, b.url])
        try:
            assert not sending.send()
            assert (len(a.requests), len(b.requests)) == (1, 0)
        finally:
            sending.close()


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c.__name__)
def test_every_caller_benches_a_replica_for_its_retry_after(caller):
    with LoopbackServer(lambda p, b: Reply(503, "busy", headers={"Retry-After": "60"})) as a:
        sending = caller([a.url])
        try:
            assert not sending.send()
            assert not sending.send()  # benched: not asked again before its Retry-After
            assert len(a.requests) == 1
        finally:
            sending.close()


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c.__name__)
def test_a_429_pauses_every_replica_for_every_caller(caller):
    """429: a quota every replica shares (the instance-id cap); the next replica would
    answer the same, so none is asked before the Retry-After."""
    with LoopbackServer(lambda p, b: Reply(429, "cap", headers={"Retry-After": "60"})) as a, \
            LoopbackServer(healthy) as b:
        sending = caller([a.url, b.url])
        try:
            assert not sending.send()
            assert not sending.send()
            assert (len(a.requests), len(b.requests)) == (1, 0)
        finally:
            sending.close()
