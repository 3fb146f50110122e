"""Tokens in clear are warned about (issue 19, item 6).

Before: a coordinator with access control on and no TLS said nothing, and the plugin sent
its bearer token over `http://` to another machine silently. Now the coordinator warns at
start-up when it has tokens, no TLS and a non-loopback listening address, and the plugin
warns (once per coordinator host) when its token would go over `http://` to a host that
is not loopback.
"""

from __future__ import annotations

import logging

import pytest

from blend_wire import is_loopback_host
from coordinator_stub.config import parse_args
from plugin.http import coordinator_http

LANE = "unit"

TOKEN = "t" * 20


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LOCALHOST", True), ("10.0.0.5", False), ("0.0.0.0", False),
    ("::", False), ("coordinator.internal", False), ("127.0.0.1.evil.example", False),
])
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback


def test_the_coordinator_warns_when_tokens_are_on_without_tls(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"emitter {TOKEN}\n")
    exposed = parse_args(["--host", "0.0.0.0", "--auth-token-file", str(tokens)], environ={})
    assert any("without TLS" in w and "0.0.0.0" in w for w in exposed.warnings())
    cleartext = lambda *flags: [w for w in parse_args(list(flags), environ={}).warnings()  # noqa: E731
                                if "without TLS" in w]
    assert cleartext("--host", "0.0.0.0") == []  # no tokens
    assert cleartext("--auth-token-file", str(tokens)) == []  # loopback
    assert cleartext("--host", "0.0.0.0", "--auth-token-file", str(tokens),
                     "--tls-cert", "c.pem", "--tls-key", "k.pem") == []


@pytest.mark.parametrize("url,warned", [
    ("http://10.20.30.40:9300", True), ("http://coordinator.internal:9300", True),
    ("http://127.0.0.1:9300", False), ("http://localhost:9300", False),
    ("http://[::1]:9300", False), ("https://10.20.30.41:9300", False),
])
def test_the_plugin_warns_before_sending_its_token_in_clear(caplog, url, warned):
    caplog.set_level(logging.WARNING, logger="plugin.http")
    for _ in range(2):  # once per host, not once per client
        coordinator_http(url, timeout=1.0, token=TOKEN).close()
    coordinator_http(url.replace("9300", "9301"), timeout=1.0).close()  # no token: silent
    messages = [r.getMessage() for r in caplog.records if "plain http://" in r.getMessage()]
    assert len(messages) == (1 if warned else 0)
