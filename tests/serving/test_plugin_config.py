"""PluginConfig: the WIRE.md environment names, overrides, and clear start-up errors."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from plugin import ConfigError, PluginConfig

LANE = "unit"

URL = "LMCACHE_COORDINATOR_URL"
REPORTING = "LMCACHE_COORDINATOR_EVENT_REPORTING"
FLUSH = "LMCACHE_COORDINATOR_EVENT_FLUSH_INTERVAL"
TIMEOUT = "LMCACHE_COORDINATOR_BLEND_TIMEOUT"
CONCURRENCY = "LMCACHE_COORDINATOR_BLEND_MATCH_CONCURRENCY"
EVENT_TIMEOUT = "LMCACHE_COORDINATOR_EVENT_TIMEOUT"


def test_defaults_match_wire_md():
    config = PluginConfig.from_env({})
    assert config.coordinator_url is None
    assert config.event_reporting is False
    assert config.event_flush_interval == 1.0
    assert config.blend_timeout == 1.0
    assert config.event_timeout == 2.0  # LMCache 0.5.6's HttpCacheEventSink(timeout=2.0)
    assert config.match_concurrency == 8
    assert config.chunk_size == 256
    assert config.instance_id == f"{socket.gethostname()}:{os.getpid()}"
    assert config.instance_id_is_default
    assert not config.fleet_enabled


def test_reads_every_environment_name():
    config = PluginConfig.from_env({
        URL: "http://127.0.0.1:9300/", REPORTING: "1", FLUSH: "0.25", TIMEOUT: "0.5",
        EVENT_TIMEOUT: "3.5", CONCURRENCY: "3", "LMCACHE_CHUNK_SIZE": "128",
        "LMCACHE_COORDINATOR_INSTANCE_ID": "server-7"})
    assert config.coordinator_url == "http://127.0.0.1:9300"
    assert config.event_reporting is True
    assert config.event_flush_interval == 0.25
    assert config.blend_timeout == 0.5
    assert config.match_budget_s == 0.5  # one value: HTTP timeout and lookup budget
    assert config.event_timeout == 3.5  # event POSTs have their own deadline
    assert config.match_concurrency == 3
    assert config.chunk_size == 128
    assert config.instance_id == "server-7" and not config.instance_id_is_default
    assert config.fleet_enabled


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(URL, "http://127.0.0.1:1")
    monkeypatch.setenv(REPORTING, "yes")
    assert PluginConfig.from_env().fleet_enabled


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", " yes ", "on", "ON"])
def test_event_reporting_truthy_values(raw):
    assert PluginConfig.from_env({REPORTING: raw}).event_reporting is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "OFF", "off", "", "  "])
def test_event_reporting_falsy_values(raw):
    # Empty is as if unset: off.
    assert PluginConfig.from_env({REPORTING: raw}).event_reporting is False


@pytest.mark.parametrize("raw", ["enabled", "2", "y", "n", "treu", "-1"])
def test_event_reporting_refuses_anything_else_naming_the_variable(raw):
    # Silently off was the trap: `=enabled` looked like it worked and reported nothing.
    with pytest.raises(ConfigError, match=f"{REPORTING}={raw!r} is not a boolean"):
        PluginConfig.from_env({REPORTING: raw})


def test_overrides_win_over_environment():
    config = PluginConfig.from_env({TIMEOUT: "2.0", CONCURRENCY: "4"}, blend_timeout=0.3,
                                   instance_id="a")
    assert config.blend_timeout == 0.3 and config.match_concurrency == 4
    assert config.instance_id == "a"


def test_empty_url_disables_the_fleet_leg():
    config = PluginConfig.from_env({URL: "", REPORTING: "1"})
    assert config.coordinator_url is None and not config.fleet_enabled


def test_url_without_reporting_is_not_fleet_enabled():
    assert not PluginConfig.from_env({URL: "http://127.0.0.1:1"}).fleet_enabled


@pytest.mark.parametrize("name, raw", [
    (CONCURRENCY, "0"), (CONCURRENCY, "-2"), (CONCURRENCY, "many"),
    (TIMEOUT, "fast"), (TIMEOUT, "0"), (TIMEOUT, "-1"), (TIMEOUT, "inf"),
    (FLUSH, "soon"), (FLUSH, "0"),
    (EVENT_TIMEOUT, "slow"), (EVENT_TIMEOUT, "0"), (EVENT_TIMEOUT, "nan"),
    ("LMCACHE_CHUNK_SIZE", "0"), (URL, "127.0.0.1:9300"), (URL, "http://a:1,b:2"),
    ("LMCACHE_COORDINATOR_BLEND_MAX_REPLY_BYTES", "10"),
    ("LMCACHE_COORDINATOR_CA_FILE", "/nonexistent/ca.pem"),
])
def test_bad_values_fail_at_start_up_naming_the_variable(name, raw):
    with pytest.raises(ConfigError, match=name):
        PluginConfig.from_env({name: raw})


def test_a_bad_url_in_the_environment_names_the_variable_not_the_field():
    with pytest.raises(ConfigError) as error:
        PluginConfig.from_env({URL: "127.0.0.1:9300"})
    assert str(error.value).startswith(f"{URL}='127.0.0.1:9300' must start with http://")


def test_bad_override_names_the_field():
    with pytest.raises(ConfigError, match="match_concurrency"):
        PluginConfig.from_env({}, match_concurrency=0)
    with pytest.raises(ConfigError, match="coordinator_url"):
        PluginConfig(coordinator_url="127.0.0.1:9300")
    with pytest.raises(ConfigError, match="event_timeout"):
        PluginConfig(event_timeout=0)


def test_unknown_override_is_a_type_error():
    with pytest.raises(TypeError, match="blend_timout"):
        PluginConfig.from_env({}, blend_timout=1.0)


def test_config_is_frozen():
    config = PluginConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.blend_timeout = 5.0  # type: ignore[misc]


def test_the_engine_url_is_a_host_and_port_registered_for_routers():
    name = "LMCACHE_COORDINATOR_ENGINE_URL"
    config = PluginConfig.from_env({name: " http://10.0.0.5:8000 "})
    assert config.engine_url == "http://10.0.0.5:8000"
    assert config.registration_metadata == {"engine_url": "http://10.0.0.5:8000"}
    assert PluginConfig.from_env({}).registration_metadata == {}
    for bad in ("http://10.0.0.5:8000/v1", "http://10.0.0.5", "10.0.0.5:8000",
                "http://u@10.0.0.5:8000", "http://10.0.0.5:8000?x=1"):
        with pytest.raises(ConfigError, match=name):
            PluginConfig.from_env({name: bad})
