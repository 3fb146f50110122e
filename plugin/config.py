"""Plugin configuration: one frozen value, read once at start-up.

Contract:
- `PluginConfig.from_env(**overrides)` reads the `LMCACHE_COORDINATOR_*` names of WIRE.md
  (plus `LMCACHE_CHUNK_SIZE`, `LMCACHE_COORDINATOR_INSTANCE_ID`, `LMCACHE_COORDINATOR_TOKEN`
  and `LMCACHE_COORDINATOR_CA_FILE`, this project's additions), then applies keyword
  overrides, which win over the environment.
- A bad value is a `ConfigError` at start-up whose message names the environment variable
  (or the field, for an override) and says what is accepted. Nothing is clamped silently.
  A boolean (`LMCACHE_COORDINATOR_EVENT_REPORTING`) takes `1`, `true`, `yes`, `on` and `0`,
  `false`, `no`, `off` (any case; empty is unset) and refuses anything else: LMCache reads
  every value but `1`/`true`/`yes` as off, so a typo silently reported nothing. Inside an
  LMCache server LMCache's rule decides (`on` is off there, and the plugin warns that the
  fleet leg is off); a value neither takes still stops the plugin's start (WIRE.md).
- `engine_url` (`LMCACHE_COORDINATOR_ENGINE_URL`): the engine's OpenAI server,
  `http(s)://HOST:PORT` and nothing more (`blend_wire.engine_address`, a `ConfigError`
  otherwise); `registration_metadata` carries it as `engine_url` (WIRE.md "Instances"), and
  under LMCache the plugin's registrar then registers in place of LMCache's.
- `instance_id` defaults to `hostname:pid`, which changes on restart; the plugin warns about
  it when the fleet leg is on (`instance_id_is_default`).
- The fleet leg is on only with a URL *and* event reporting (`fleet_enabled`); deciding what
  to do about a URL without reporting (warn, no client) belongs to the plugin.
- `blend_timeout` is both the lookup's per-request HTTP timeout and its match budget
  (`match_budget_s`), as in LMCache. Cache-event POSTs are background work, off the serving
  path: they have their own total deadline, `event_timeout` (LMCache's event sink allows
  2 s per POST, `HttpCacheEventSink(timeout=2.0)`), so a slow but alive coordinator does not
  make them fail and retry while lookups keep their budget.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, get_args

from blend_wire import ENGINE_URL_KEY, Tier, engine_address

ENV_COORDINATOR_URL = "LMCACHE_COORDINATOR_URL"
ENV_EVENT_REPORTING = "LMCACHE_COORDINATOR_EVENT_REPORTING"
ENV_EVENT_FLUSH_INTERVAL = "LMCACHE_COORDINATOR_EVENT_FLUSH_INTERVAL"
ENV_BLEND_TIMEOUT = "LMCACHE_COORDINATOR_BLEND_TIMEOUT"
ENV_MATCH_CONCURRENCY = "LMCACHE_COORDINATOR_BLEND_MATCH_CONCURRENCY"
# Not in WIRE.md (LMCache hard-codes its sink's 2 s): the total deadline of one event POST.
ENV_EVENT_TIMEOUT = "LMCACHE_COORDINATOR_EVENT_TIMEOUT"
# Not in WIRE.md: LMCache's own chunk-size name, and an id for this serving process.
ENV_CHUNK_SIZE = "LMCACHE_CHUNK_SIZE"
ENV_INSTANCE_ID = "LMCACHE_COORDINATOR_INSTANCE_ID"
# Not in WIRE.md either: a bearer token for a coordinator with access control on (it needs
# the emitter and reader roles), and a CA file for an https:// coordinator.
ENV_COORDINATOR_TOKEN = "LMCACHE_COORDINATOR_TOKEN"
ENV_COORDINATOR_CA_FILE = "LMCACHE_COORDINATOR_CA_FILE"
# Ours: where this server's engine serves its OpenAI API (http(s)://HOST:PORT), sent in the
# registration's metadata for routers (WIRE.md, "Instances").
ENV_ENGINE_URL = "LMCACHE_COORDINATOR_ENGINE_URL"
# Ours: the cap on one blend-lookup reply, in bytes after decoding.
ENV_MAX_REPLY_BYTES = "LMCACHE_COORDINATOR_BLEND_MAX_REPLY_BYTES"

#: Default `max_reply_bytes`: a reply for a 100k-token query with every chunk found is well
#: under 1 MiB; anything much larger is not a coordinator answering honestly.
DEFAULT_MAX_REPLY_BYTES = 4 << 20

#: Default `event_timeout`: LMCache 0.5.6's cache-event sink timeout (`HttpCacheEventSink`).
DEFAULT_EVENT_TIMEOUT_S = 2.0

#: Default `abandon_after_s`, in match budgets.
ABANDON_AFTER_BUDGETS = 4

# A boolean variable's spellings (any case); anything else is refused, naming the variable.
# LMCache reads only 1/true/yes as on (inside an LMCache server, it resolves the variable).
_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True,
             "0": False, "false": False, "no": False, "off": False}


class ConfigError(ValueError):
    """A configuration value that cannot be used. The message names the variable."""


def coordinator_url_list(urls: str | Sequence[str] | None) -> tuple[str, ...]:
    """Coordinator URLs (one, or replicas over one event log: comma-separated, or a list) as
    the parts use them: stripped, without a trailing `/`, empty ones left out. The one
    place a URL list is parsed (`PluginConfig.coordinator_urls` holds its result)."""
    parts = (urls or "").split(",") if urls is None or isinstance(urls, str) else urls
    return tuple(url for url in (part.strip().rstrip("/") for part in parts) if url)


def default_instance_id() -> str:
    """`hostname:pid`: unique, but not stable across restarts (see `instance_id_is_default`)."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class PluginConfig:
    """Everything the plugin reads at start-up. Construct with `from_env` or directly."""

    coordinator_url: str | None = None
    event_reporting: bool = False
    event_flush_interval: float = 1.0
    blend_timeout: float = 1.0
    # Total deadline of one cache-event POST (up to 4,096 entries): background delivery,
    # not the lookup's budget.
    event_timeout: float = DEFAULT_EVENT_TIMEOUT_S
    match_concurrency: int = 8
    # A blend-lookup reply larger than this (decoded) fails the fleet leg of that lookup.
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    chunk_size: int = 256
    instance_id: str = field(default_factory=default_instance_id)
    # Bearer token sent with every coordinator request (access control on; needs the
    # emitter and reader roles), and a CA file to check an https:// coordinator against.
    coordinator_token: str | None = field(default=None, repr=False)
    coordinator_ca_file: str | None = None
    # This server's engine's OpenAI server, http(s)://HOST:PORT, registered for routers
    # (`engine_url` in the registration's metadata); None: not registered.
    engine_url: str | None = None
    # Incarnation of this emitter; None derives one from the start time (time.time_ns()), so
    # a restarted process always outranks its predecessor and the coordinator fences it.
    incarnation: int | None = None
    # Tier and backend reported in cache events (WIRE.md: tier is "l1" or "l2").
    event_tier: str = "l1"
    event_backend: str = "dram"
    # Events held while the coordinator is unreachable; beyond this the oldest are dropped.
    event_queue_limit: int = 100_000
    # Consecutive failed round-trips that open a replica's circuit breaker, and how long it
    # stays open before one probe may close it again: the one fail-over policy (plugin.http)
    # of the client, the reporter and the registrar alike.
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    # A finished coordinator result nobody takes is dropped after this long.
    result_ttl_s: float = 30.0
    # Upper bound on coordinator queries tracked at once (queued, in flight or unclaimed).
    max_tracked_queries: int = 4096
    # Optional and better (DESIGN.md): prefetch every usable candidate, overlapping ones
    # included, and resolve overlaps among the chunks the prefetch actually found, so a
    # missing chunk cannot shadow an available one. Costs loads of overlap losers.
    resolve_after_prefetch: bool = False
    # A lookup nobody polled for this long is released (the scheduler dropped it); None:
    # `ABANDON_AFTER_BUDGETS` match budgets (see `abandon_after_s`). An engine polls a live
    # lookup every scheduler step, so a few budgets without a poll means it is gone.
    abandoned_lookup_s: float | None = None
    # Lookups tracked at once; a new one beyond this releases the least recently polled.
    max_tracked_lookups: int = 4096

    def __post_init__(self) -> None:
        # One URL, or several replicas of one coordinator, comma-separated.
        urls = coordinator_url_list(_parse_urls("coordinator_url", self.coordinator_url))
        object.__setattr__(self, "coordinator_url", ",".join(urls) or None)
        object.__setattr__(self, "_coordinator_urls", urls)  # not a field: derived, parsed once
        _check_positive("event_flush_interval", self.event_flush_interval)
        _check_positive("blend_timeout", self.blend_timeout)
        _check_positive("event_timeout", self.event_timeout)
        _check_int_at_least("match_concurrency", self.match_concurrency, 1)
        _check_int_at_least("max_reply_bytes", self.max_reply_bytes, 1024)
        _check_int_at_least("chunk_size", self.chunk_size, 1)
        if not isinstance(self.instance_id, str) or not self.instance_id:
            raise ConfigError("instance_id must be a non-empty string")
        if self.incarnation is not None:
            _check_int_at_least("incarnation", self.incarnation, 0)
        if self.event_tier not in get_args(Tier):
            raise ConfigError(f"event_tier={self.event_tier!r} must be one of {get_args(Tier)}")
        if not self.event_backend:
            raise ConfigError("event_backend must be non-empty (e.g. 'dram')")
        _check_int_at_least("event_queue_limit", self.event_queue_limit, 1)
        _check_int_at_least("breaker_threshold", self.breaker_threshold, 1)
        _check_positive("breaker_cooldown_s", self.breaker_cooldown_s)
        _check_positive("result_ttl_s", self.result_ttl_s)
        _check_int_at_least("max_tracked_queries", self.max_tracked_queries, 1)
        if self.abandoned_lookup_s is not None:
            _check_positive("abandoned_lookup_s", self.abandoned_lookup_s)
        _check_int_at_least("max_tracked_lookups", self.max_tracked_lookups, 1)
        if self.engine_url is not None:
            try:
                engine_address(self.engine_url)
            except ValueError as exc:
                raise ConfigError(f"engine_url ({ENV_ENGINE_URL}): {exc}") from None
        if self.coordinator_ca_file is not None and not os.path.isfile(self.coordinator_ca_file):
            raise ConfigError(f"coordinator_ca_file={self.coordinator_ca_file!r} is not a file "
                              f"({ENV_COORDINATOR_CA_FILE}: a PEM file of CA certificates)")

    @property
    def coordinator_urls(self) -> tuple[str, ...]:
        """Every coordinator URL (replicas over one event log), in the order given."""
        return self._coordinator_urls

    @property
    def registration_metadata(self) -> dict[str, str]:
        """What this server adds to its registration's `metadata` (its engine's URL)."""
        return {} if self.engine_url is None else {ENGINE_URL_KEY: self.engine_url}

    @property
    def match_budget_s(self) -> float:
        """Wall-clock budget of one unified lookup for the coordinator leg."""
        return self.blend_timeout

    @property
    def abandon_after_s(self) -> float:
        """How long a lookup may go unpolled before it is released."""
        if self.abandoned_lookup_s is not None:
            return self.abandoned_lookup_s
        return ABANDON_AFTER_BUDGETS * self.match_budget_s

    @property
    def fleet_enabled(self) -> bool:
        """The coordinator leg runs only with a URL and event reporting on (WIRE.md)."""
        return self.coordinator_url is not None and self.event_reporting

    @property
    def instance_id_is_default(self) -> bool:
        """True when `instance_id` is this process's `hostname:pid`, which a restart changes,
        so the coordinator would never fence the previous process's placements."""
        return self.instance_id == default_instance_id()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "PluginConfig":
        """Read the environment (`os.environ` unless `environ` is given), then apply overrides.

        Raises `ConfigError` naming the variable for a value that cannot be parsed or is out
        of range, and `TypeError` for an override that is not a field.
        """
        env = os.environ if environ is None else environ
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown PluginConfig field(s): {', '.join(unknown)}")

        values: dict[str, Any] = {}
        if ENV_COORDINATOR_URL in env:
            values["coordinator_url"] = _parse_urls(ENV_COORDINATOR_URL, env[ENV_COORDINATOR_URL])
        if env.get(ENV_EVENT_REPORTING, "").strip():
            values["event_reporting"] = _parse_bool(ENV_EVENT_REPORTING, env[ENV_EVENT_REPORTING])
        if ENV_EVENT_FLUSH_INTERVAL in env:
            values["event_flush_interval"] = _parse_seconds(
                ENV_EVENT_FLUSH_INTERVAL, env[ENV_EVENT_FLUSH_INTERVAL])
        if ENV_BLEND_TIMEOUT in env:
            values["blend_timeout"] = _parse_seconds(ENV_BLEND_TIMEOUT, env[ENV_BLEND_TIMEOUT])
        if ENV_EVENT_TIMEOUT in env:
            values["event_timeout"] = _parse_seconds(ENV_EVENT_TIMEOUT, env[ENV_EVENT_TIMEOUT])
        if ENV_MATCH_CONCURRENCY in env:
            values["match_concurrency"] = _parse_int(
                ENV_MATCH_CONCURRENCY, env[ENV_MATCH_CONCURRENCY], minimum=1)
        if ENV_MAX_REPLY_BYTES in env:
            values["max_reply_bytes"] = _parse_int(
                ENV_MAX_REPLY_BYTES, env[ENV_MAX_REPLY_BYTES], minimum=1024)
        if ENV_CHUNK_SIZE in env:
            values["chunk_size"] = _parse_int(ENV_CHUNK_SIZE, env[ENV_CHUNK_SIZE], minimum=1)
        if env.get(ENV_INSTANCE_ID):
            values["instance_id"] = env[ENV_INSTANCE_ID]
        if env.get(ENV_COORDINATOR_TOKEN, "").strip():
            values["coordinator_token"] = env[ENV_COORDINATOR_TOKEN].strip()
        if env.get(ENV_ENGINE_URL, "").strip():
            values["engine_url"] = env[ENV_ENGINE_URL].strip()
        if env.get(ENV_COORDINATOR_CA_FILE, "").strip():
            values["coordinator_ca_file"] = env[ENV_COORDINATOR_CA_FILE].strip()
        values.update(overrides)
        return cls(**values)


def _parse_urls(name: str, raw: str | None) -> str | None:
    """`raw` unchanged if every URL of it (comma-separated) starts with http(s)://."""
    for url in coordinator_url_list(raw):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{name}={url!r} must start with http:// or https:// "
                              "(several replicas: comma-separated URLs)")
    return raw


def _parse_bool(name: str, raw: str) -> bool:
    value = _BOOLEANS.get(raw.strip().lower())
    if value is None:
        raise ConfigError(f"{name}={raw!r} is not a boolean: use 1, true, yes or on to turn "
                          "it on, 0, false, no or off (or leave it unset) for off")
    return value


def _parse_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds (e.g. 0.5)") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a finite number of seconds > 0")
    return value


def _parse_int(name: str, raw: str, *, minimum: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be an integer >= {minimum}")
    return value


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} must be a number of seconds > 0")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={value!r} must be a finite number > 0")


def _check_int_at_least(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
