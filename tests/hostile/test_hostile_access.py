"""Opt-in access control and TLS (issue 11, point 6).

Before: anyone who reached the coordinator could read every tenant's prompt tokens (the
directory queries return `token_ids`) and post events for any instance. Now, with tokens
configured, each endpoint needs its role (401 without a known token, 403 without the
role); off by default, so LMCache's servers, which send no token, work unchanged; TLS by
certificate flags; and the plugin sends its token (`LMCACHE_COORDINATOR_TOKEN`) and checks
the certificate against `LMCACHE_COORDINATOR_CA_FILE`.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import ssl

import httpx
import numpy as np
import pytest

from blend_wire import BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, EVENTS_PATH, HEALTH_PATH, STATS_PATH, encode, encode_tokens
from coordinator_stub.scopes import ANY, AccessConfigError, tokens_from
from coordinator_stub.config import parse_args
from coordinator_stub.launch.process import launch_coordinator
from helpers import poll_lookup, wait_until
from hostile_helpers import A, batch, entry
from plugin import BlendPlugin, CacheEventReporter, InMemoryHost, LookupKey, PluginConfig

LANE = "unit"

EMIT, READ, ADMIN, BOTH = ("e" * 20, "r" * 20, "a" * 20, "b" * 20)
TOKENS = (("emitter", EMIT), ("reader", READ), ("admin", ADMIN),
          ("emitter", BOTH), ("reader", BOTH))
LOOKUP = encode({"tokens_b64": encode_tokens(A), "model_name": "m"})
EVENTS = encode({"batches": [batch(entry("aa01", A, offset=0))]})

# (method, path, body): what each role may do.
CALLS = {
    "events": ("POST", EVENTS_PATH, EVENTS),
    "lookup": ("POST", BLEND_LOOKUP_PATH, LOOKUP),
    "score": ("POST", BLEND_SCORE_PATH, LOOKUP),
    "stats": ("GET", STATS_PATH, b""),
    "metrics": ("GET", "/metrics", b""),
    "instances": ("GET", "/instances", b""),
}
ALLOWED = {EMIT: {"events", "instances"}, READ: {"lookup", "score"},
           BOTH: {"events", "instances", "lookup", "score"},
           ADMIN: set(CALLS)}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("token", [None, "x" * 20, EMIT, READ, BOTH, ADMIN],
                         ids=["none", "unknown", "emitter", "reader", "emitter+reader", "admin"])
async def test_each_endpoint_needs_its_role(start, call, token):
    coord = await start(access_tokens=TOKENS)
    method, path, body = CALLS[call]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = await coord.client.request(method, path, data=body, headers=headers)
    if token is None or token == "x" * 20:
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    elif call in ALLOWED[token]:
        # Allowed: whatever the endpoint answers, but never a refusal of access.
        assert response.status not in (401, 403), await response.text()
    else:
        assert response.status == 403
        assert "role" in (await response.json())["detail"]


async def test_refused_events_apply_nothing_and_health_stays_open(start):
    coord = await start(access_tokens=TOKENS)
    assert (await coord.client.get(HEALTH_PATH)).status == 200
    assert (await coord.client.post(EVENTS_PATH, data=EVENTS,
                                    headers={"Authorization": f"Bearer {READ}"})).status == 403
    stats = await coord.client.get(STATS_PATH, headers={"Authorization": f"Bearer {ADMIN}"})
    assert (await stats.json())["num_keys"] == 0


async def test_off_by_default(coord):
    assert (await coord.client.post(EVENTS_PATH, data=EVENTS)).status == 200
    assert (await coord.client.get(STATS_PATH)).status == 200


def test_tokens_come_from_a_file_and_the_environment(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# serving processes\nemitter {BOTH}\nreader {BOTH}\nadmin {ADMIN}\n")
    env = {"COORDINATOR_READER_TOKEN": f"{READ}, {'q' * 20}"}
    assert set(tokens_from(str(path), env)) == {  # unscoped: any (see test_hostile_scopes)
        ("emitter", BOTH, ANY), ("reader", BOTH, ANY), ("admin", ADMIN, ANY),
        ("reader", READ, ANY), ("reader", "q" * 20, ANY)}
    config = parse_args(["--auth-token-file", str(path)], environ={})
    assert len(config.access_tokens) == 3
    assert parse_args([], environ={}).access_tokens == ()  # off by default
    path.write_text("writer abcdefabcdefabcdef\n")
    with pytest.raises(AccessConfigError, match="ROLE TOKEN"):
        tokens_from(str(path), {})
    with pytest.raises(AccessConfigError, match="at least 16"):
        tokens_from(None, {"COORDINATOR_ADMIN_TOKEN": "short"})


# --- TLS and the plugin, against the coordinator process -------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1: (cert path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    folder = tmp_path_factory.mktemp("tls")
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


C = 256
_ids = itertools.count()


def _server(url: str, name: str, l2: dict, **overrides):
    host = InMemoryHost(C, shared_l2=l2)
    config = PluginConfig(chunk_size=C, coordinator_url=url, event_reporting=True,
                          blend_timeout=1.0, event_flush_interval=0.05, instance_id=name,
                          **overrides)
    return host, BlendPlugin(config, host)


@pytest.mark.coordinator
def test_plugins_with_their_token_find_each_other_over_tls(certificate, tmp_path):
    cert, key = certificate
    tokens = tmp_path / "tokens"
    tokens.write_text(f"emitter {BOTH}\nreader {BOTH}\nadmin {ADMIN}\n")
    flags = ("--enable-blend-lookup", "--auth-token-file", str(tokens), "--tls-cert", cert,
             "--tls-key", key)
    with launch_coordinator(*flags) as running:
        assert running.url.startswith("https://")
        verify = ssl.create_default_context(cafile=cert)
        with httpx.Client(base_url=running.url, verify=verify, timeout=10) as http:
            assert http.get(HEALTH_PATH).status_code == 200
            assert http.get(STATS_PATH).status_code == 401
        l2: dict = {}
        doc = np.random.default_rng(5).integers(1000, 60000, 2 * C, dtype=np.uint32)
        host_a, a = _server(running.url, "a", l2, coordinator_token=BOTH,
                            coordinator_ca_file=cert)
        host_b, b = _server(running.url, "b", l2, coordinator_token=BOTH,
                            coordinator_ca_file=cert)
        host_c, c = _server(running.url, "c", l2, coordinator_ca_file=cert)  # no token
        try:
            key = LookupKey("store", doc, "m")
            hashes = host_a.chunk_hashes(key)
            host_a.store(key, hashes)
            a.on_store(key, hashes)
            assert wait_until(lambda: a.flush(), timeout=10)
            query = np.concatenate([np.arange(7, dtype=np.uint32), doc])
            result, _, _ = poll_lookup(b, LookupKey("q1", query, "m"))
            assert [s.hash for s in result.non_prefix_segments] == hashes
            # Without the token: its events are refused and its lookups find nothing.
            key_c = LookupKey("store-c", doc[::-1].copy(), "m")
            c.on_store(key_c, host_c.chunk_hashes(key_c))
            assert not c.flush()
            assert c.stats().reporter.failed_flushes >= 1
            found, _, _ = poll_lookup(c, LookupKey("q2", query, "m"))
            assert found.non_prefix_segments == []
            assert c.stats().client.failed >= 1  # its lookup was refused (401)
        finally:
            for plugin in (a, b, c):
                plugin.close()


@pytest.mark.coordinator
def test_a_reporter_built_from_the_config_sends_its_token_and_trusts_its_ca(certificate,
                                                                           tmp_path):
    # The LMCache adapter builds its reporter apart from the plugin's; both go through
    # `CacheEventReporter.from_config`, so neither can forget the credentials.
    cert, key = certificate
    tokens = tmp_path / "tokens"
    tokens.write_text(f"emitter {BOTH}\nreader {BOTH}\nadmin {ADMIN}\n")
    with launch_coordinator("--auth-token-file", str(tokens), "--tls-cert", cert,
                            "--tls-key", key) as running:
        config = PluginConfig(chunk_size=C, coordinator_url=running.url, event_reporting=True,
                              instance_id="zmq-only", coordinator_token=BOTH,
                              coordinator_ca_file=cert)
        reporter = CacheEventReporter.from_config(config)
        try:
            reporter.report_store(LookupKey("store", [], "m").namespace, [b"\x01" * 16],
                                  [np.arange(C, dtype=np.uint32)], [0])
            assert reporter.flush()
            assert reporter.stats().failed_flushes == 0
        finally:
            reporter.close()
        admin = ssl.create_default_context(cafile=cert)
        with httpx.Client(base_url=running.url, verify=admin, timeout=10,
                          headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            assert http.get(STATS_PATH).json()["num_keys"] == 1
