"""Prometheus metrics of the coordinator (`GET /metrics`, docs/WIRE.md), on `prometheus_client`.

Contract:
- LMCache's key-directory gauges, by tier: `lmcache_coordinator_key_directory_placements`
  and `lmcache_coordinator_key_directory_placement_bytes`; the standard process and
  Python-platform series (not the GC ones: they hook every collection); and ours, prefixed `blend_coordinator_`: event batches and entries by
  outcome (applied / duplicate / stale), entries applied by type, instances fenced,
  dropped and reaped, registered instances, directory keys, blend-index contents / chunks
  / claims / bytes, lookups with their latency histogram per endpoint, matches returned,
  and rejected requests by reason; STORE entries not indexed because their token list
  is not the coordinator's chunk size (`blend_coordinator_chunk_size_mismatch_entries`)
  and the emitters that sent them. LMCache 0.5.7's gate figures, under its names
  (`lmcache_coordinator_ingest_*`): batches missing and events dropped by servers
  (totals), and per tracked emitter (`instance_id` label) its missing batches, dropped
  events, whether its view is incomplete, seconds since its last batch and its last
  batch's delivery delay.
- A scrape reads running totals (`KeyDirectory.totals`, lock-free) and the index's
  O(1) stats: it never walks the directory, never takes the directory lock. `render()`
  can block for a moment on the index lock while a match runs, so the HTTP layer calls
  it off the event loop.
- Each coordinator has its own `CollectorRegistry`: several coordinators in one process
  (tests) do not share series.
"""

from __future__ import annotations

from typing import Callable, Iterator, get_args

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client import platform_collector, process_collector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from blend_wire import Tier
from coordinator_stub.directory import KeyDirectory
from coordinator_stub.service.quotas import InstanceQuota

#: The exposition's media type (text format; WIRE.md).
CONTENT_TYPE = CONTENT_TYPE_LATEST

_PREFIX = "blend_coordinator_"
# Lookup latency buckets (seconds): a blend lookup takes ~1-20 ms, a directory lookup of
# a long sequence up to ~1 s.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)


class CoordinatorMetrics:
    """The coordinator's series. Request-path code records with `observe_lookup`,
    `rejected` and `reaped`; everything else is read at scrape time."""

    def __init__(self, directory: KeyDirectory, registered: Callable[[], int],
                 quota: InstanceQuota | None = None) -> None:
        self.registry = CollectorRegistry()
        process_collector.ProcessCollector(registry=self.registry)
        platform_collector.PlatformCollector(registry=self.registry)
        self._lookup_seconds = Histogram(
            _PREFIX + "lookup_seconds", "Time to answer a lookup, by endpoint",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._matches = Counter(_PREFIX + "matches_returned",
                                "Blend matches returned by blend lookups",
                                registry=self.registry)
        self._rejected = Counter(_PREFIX + "rejected_requests",
                                 "Requests refused, by reason (validation: 422, "
                                 "bad_request: 400, forbidden: 403, too_large: 413)", ["reason"],
                                 registry=self.registry)
        # Children bound once: the request path skips the label lookup.
        self._seconds_of = {endpoint: self._lookup_seconds.labels(endpoint)
                            for endpoint in ("blend-lookup", "blend-score",
                                             "directory-lookup")}
        self._reaped = Counter(_PREFIX + "instances_reaped",
                               "Instances deregistered for missing heartbeats",
                               registry=self.registry)
        self.registry.register(_DirectoryCollector(directory, registered, quota))

    def observe_lookup(self, endpoint: str, seconds: float, matches: int = 0) -> None:
        """`endpoint`: "blend-lookup", "blend-score" or "directory-lookup"."""
        self._seconds_of[endpoint].observe(seconds)
        if matches:
            self._matches.inc(matches)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def reaped(self, count: int = 1) -> None:
        self._reaped.inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _DirectoryCollector:
    """Reads the directory's running totals at scrape time."""

    def __init__(self, directory: KeyDirectory, registered: Callable[[], int],
                 quota: InstanceQuota | None) -> None:
        self._directory, self._registered, self._quota = directory, registered, quota

    def describe(self) -> list[Metric]:
        return []  # families are only known at collect time; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        totals = self._directory.totals()
        placements = GaugeMetricFamily(
            "lmcache_coordinator_key_directory_placements",
            "Placements recorded in the key directory, by tier", labels=["tier"])
        placement_bytes = GaugeMetricFamily(
            "lmcache_coordinator_key_directory_placement_bytes",
            "Reported logical bytes of the placements in the key directory, by tier",
            labels=["tier"])
        for tier in get_args(Tier):
            placements.add_metric([tier], totals[f"{tier}_count"])
            placement_bytes.add_metric([tier], totals[f"{tier}_size_bytes"])
        yield placements
        yield placement_bytes

        batches = CounterMetricFamily(_PREFIX + "event_batches",
                                      "Event batches received, by outcome", labels=["outcome"])
        entries = CounterMetricFamily(_PREFIX + "event_entries",
                                      "Event entries received, by the outcome of their batch",
                                      labels=["outcome"])
        for outcome in ("applied", "duplicate", "stale"):
            batches.add_metric([outcome], totals[f"batches_{outcome}"])
            entries.add_metric([outcome], totals[f"entries_{outcome}"])
        yield batches
        yield entries
        by_type = CounterMetricFamily(_PREFIX + "entries_applied",
                                      "Entries of applied batches, by event type",
                                      labels=["event_type"])
        for event_type, counter in (("store", "entries_stored"), ("delete", "entries_deleted"),
                                    ("access", "entries_accessed")):
            by_type.add_metric([event_type], totals[counter])
        yield by_type
        yield GaugeMetricFamily(_PREFIX + "instances_registered", "Registered instances",
                                value=self._registered())
        yield GaugeMetricFamily(_PREFIX + "directory_keys", "Keys with a placement",
                                value=totals["num_keys"])
        for name, field, text in _DIRECTORY_COUNTERS:
            yield CounterMetricFamily(_PREFIX + name, text, value=totals[field])
        if self._quota is not None:
            yield GaugeMetricFamily(_PREFIX + "scoped_instance_ids",
                                    "Instance ids scoped tokens brought in, counted against "
                                    "--max-instances-per-scope", value=self._quota.counted())
            yield CounterMetricFamily(_PREFIX + "instance_cap_refusals",
                                      "New instance ids refused: their token's scope was at "
                                      "--max-instances-per-scope", value=self._quota.refused)
        yield from _gate_metrics(totals, self._directory.ingest_streams())
        blend = self._directory.blend_stats()
        for name, field, text in (
                ("index_contents", "num_contents", "Distinct contents in the blend index"),
                ("index_chunks", "num_chunks", "Chunks in the blend index"),
                ("index_claims", "num_claims", "Namespace claims on indexed chunks"),
                ("index_bytes", "bytes", "Bytes held by the blend index")):
            yield GaugeMetricFamily(_PREFIX + name, text, value=blend[field])


#: Running totals of the directory exposed as counters: (series, totals field, help).
_DIRECTORY_COUNTERS = (
    ("instances_fenced", "instances_fenced", "Instances fenced by a higher incarnation"),
    ("instances_dropped", "instances_dropped",
     "Instances whose L1 was fenced on deregistration or reaping"),
    ("chunk_size_mismatch_entries", "token_lists_wrong_length",
     "STORE entries not indexed: their token list is not the coordinator's chunk size"),
    ("chunk_size_mismatched_emitters", "chunk_size_mismatched_emitters",
     "Emitters warned of a chunk-size mismatch"),
    ("conflicting_stores", "stores_conflicting",
     "STORE entries refused: other tokens than the chunk's, which another instance holds "
     "in the namespace"),
    ("foreign_placement_changes", "foreign_placement_changes",
     "STOREs and DELETEs left undone: a shared pool's placement reported by an instance "
     "outside the token's scope"),
)


_LMCACHE = "lmcache_coordinator_ingest_"


def _gate_metrics(totals: dict, streams: dict[str, dict]) -> Iterator[Metric]:
    """LMCache 0.5.7's event-gate series (`observability._event_gate_specs`)."""
    yield CounterMetricFamily(_LMCACHE + "event_batches_missing",
                              "Cache-event batches that never arrived: skipped seq values "
                              "in a stream the gate was already tracking",
                              value=totals["batches_missing"])
    yield CounterMetricFamily(_LMCACHE + "events_dropped_by_servers",
                              "Cache events the servers reported dropping before they "
                              "reached the coordinator", value=totals["events_dropped"])
    for name, field, text in (
            ("server_event_batches_missing", "missing_batches",
             "Cache-event batches from this server that never arrived, in its current run"),
            ("server_events_dropped", "events_dropped",
             "Cache events this server reported dropping, in its current run"),
            ("server_view_incomplete", "gap_detected",
             "1 while the coordinator knows it is missing part of this server's cache"),
            ("server_seconds_since_last_event", "seconds_since_last_event",
             "Seconds since this server's last cache-event batch was applied"),
            ("server_event_delivery_delay_seconds", "event_delivery_delay_seconds",
             "For this server's last applied batch, time from sending to applying it "
             "(across the two hosts' clocks)")):
        family = GaugeMetricFamily(_LMCACHE + name, text, labels=["instance_id"])
        for instance_id, stream in streams.items():
            if stream[field] is not None:
                family.add_metric([instance_id], float(stream[field]))
        yield family
