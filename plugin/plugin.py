"""`BlendPlugin`: what a serving process loads for fleet-wide CacheBlend reuse.

`on_store` / `on_evict` feed the local matcher and queue cache events (`plugin.stored`);
`cb_unified_lookup(key, tp_size)` is non-blocking, submit-once / poll-on-recall (None while
pending): the host's prefix lookup, the local matcher and the coordinator leg within one
budget, then one selection and one sparse prefetch. Lookups are released when they
complete, on `cancel`, or when abandoned (a sweep task on the plugin's one worker pool).
Nothing raises into the serving path: an internal error answers "no reuse". This is the
edge: a key's tokens are converted and its namespace checked once, here.
Contract: docs/DESIGN.md, "Plugin".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from blend_wire import BlendNamespace, check_lookup_namespace
from local_matcher import LocalMatcher
from plugin.client import BlendCoordinatorClient, ClientStats
from plugin.config import ENV_COORDINATOR_URL, ENV_EVENT_REPORTING, ENV_INSTANCE_ID, PluginConfig
from plugin.host import ServingHost
from plugin.lookup import Candidate, every_offer, select
from plugin.reporter import CacheEventReporter, ReporterStats
from plugin.stored import StoredChunks
from plugin.workers import DaemonPool
from plugin.types import (CBMatchResult, CBUnifiedLookupResult, FleetStatus,
                          FoundColumns, NOTHING_FOUND, LookupKey, MatchState, Place, Source, tokens_of)

log = logging.getLogger(__name__)


@dataclass
class LookupTrace:
    """What one completed lookup saw and decided; kept for demos, benchmarks and debugging."""

    request_id: str
    num_tokens: int
    prefix_tokens: int
    local_matches: int          # positions the local leg found (each with its chunks)
    fleet_matches: int          # positions the coordinator's reply named
    fleet_status: FleetStatus
    segments: list[CBMatchResult]
    sources: list[Source]       # per segment: which leg(s) found it
    prefetched: int             # segments asked of the sparse prefetch
    elapsed_s: float            # first call to completion
    calls: int                  # how many times the lookup was called

    def tokens_from(self, *sources: Source) -> int:
        return sum(s.cur_ed - s.cur_st for s, src in zip(self.segments, self.sources) if src in sources)


@dataclass
class PluginStats:
    """Counters since start, plus the parts' own stats at the time of `stats()`."""

    lookups: int = 0
    errors: int = 0             # lookups that failed inside and answered "no reuse"
    abandoned: int = 0          # lookups released because nobody polled them in time
    evicted: int = 0            # lookups released to respect max_tracked_lookups
    cancelled: int = 0          # lookups the engine cancelled
    segments_fleet_only: int = 0
    fleet_outcomes: dict[FleetStatus, int] = field(default_factory=dict)
    active_lookups: int = 0
    client: ClientStats | None = None
    reporter: ReporterStats | None = None


@dataclass(eq=False)
class _Lookup:
    # Not the engine's LookupKey: its token list may be much larger than this uint32 copy,
    # and an aborted request's list must not be kept alive here.
    request_id: str
    namespace: BlendNamespace
    tokens: np.ndarray
    tp_size: int
    started_at: float
    deadline: float
    last_call: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False
    calls: int = 0
    prefix_tokens: int | None = None
    local: FoundColumns = field(default_factory=lambda: NOTHING_FOUND)
    fleet: FoundColumns = field(default_factory=lambda: NOTHING_FOUND)
    fleet_status: FleetStatus = FleetStatus.OFF
    prefetch: list[CBMatchResult] | None = None   # what the sparse prefetch was asked for
    selected: list[Candidate] = field(default_factory=list)


class BlendPlugin:
    """Unified CacheBlend lookup (local matcher + coordinator) for one serving process."""

    def __init__(self, config: PluginConfig, host: ServingHost, *,
                 clock: Callable[[], float] = time.monotonic, report_events: bool = True
                 ) -> None:
        self.config = config
        self.host = host
        self.chunk_size = config.chunk_size
        self._clock = clock
        self.client: BlendCoordinatorClient | None = None
        self.reporter: CacheEventReporter | None = None
        # One pool for all background work (threads start only when first used): the local
        # matcher's indexing, the sweep of abandoned lookups (one long task while lookups
        # are pending), and with the fleet leg the round-trips and the reporter's flush
        # loop. One slot each for the two long tasks, so neither starves the others. Its
        # threads are daemons: they never keep the process alive (see `_finalizer`).
        self._workers = DaemonPool(
            config.match_concurrency + 2 if config.fleet_enabled else 2,
            thread_name_prefix="blend-worker")
        _warn_about_gating(config)
        if config.fleet_enabled:
            self.client = BlendCoordinatorClient.from_config(config, executor=self._workers,
                                                             clock=clock)
        if config.fleet_enabled and report_events:
            self.reporter = CacheEventReporter.from_config(config, executor=self._workers)
        self._lock = threading.Lock()
        # One matcher for every namespace: it registers and matches under `key.namespace`.
        self._matcher = LocalMatcher(chunk_size=config.chunk_size, executor=self._workers)
        self._stored = StoredChunks(self._matcher, self.reporter, config.chunk_size)
        self._warned_not_asked = False
        # Least recently polled first: the sweep and the cap look only at the front.
        self._lookups: collections.OrderedDict[str, _Lookup] = collections.OrderedDict()
        self._closed = False
        # The sweep task: at most one runs; `_sweep_again` asks a running one for one more
        # round (something was handed to the host after it last looked). Guarded by _lock.
        self._sweeper_running = False
        self._sweep_again = False
        self._stopping = threading.Event()  # set by close(): the sweep task ends at once
        self._host_settle = getattr(host, "settle", None)
        self.traces: collections.deque[LookupTrace] = collections.deque(maxlen=1024)
        self._stats = PluginStats()
        # What close() closes, in order; none of them refers back to the plugin, so a
        # plugin never closed (a script that ends, or raises, first) is closed when it is
        # collected or the interpreter exits, its last cache events flushed within a bound.
        self._closers = [self._stopping.set]  # the sweep task ends at once
        self._closers += [part.close for part in (self.client, self.reporter) if part is not None]
        self._closers += [self._matcher.close, self._workers.shutdown]
        self._finalizer = weakref.finalize(self, _close_unclosed, self._closers,
                                           config.blend_timeout + config.event_timeout + 1.0)

    # --- the store path ------------------------------------------------------------------------

    def on_store(self, key: LookupKey, chunk_hashes: Sequence[bytes], start: int = 0) -> None:
        """A stored range: chunk i is tokens `[start + i*C, start + (i+1)*C)` of `key`.

        Every chunk hash must be `bytes`; otherwise an error naming the type is logged and the
        whole range is skipped (not indexed, not reported). Never raises.
        """
        try:
            size = self.chunk_size
            tokens = tokens_of(key)
            hashes = list(chunk_hashes)
            if not _all_bytes(hashes, "on_store"):
                return
            if start < 0 or start + len(hashes) * size > len(tokens):
                raise ValueError(f"{len(hashes)} chunks at {start} do not fit in "
                                 f"{len(tokens)} tokens (chunk_size={size})")
            released: list[_Lookup] = []
            with self._lock:
                if self._closed:
                    return
                self._sweep_locked(self._clock(), released)
            self._let_go(released)
            self._stored.add(key.namespace, tokens, hashes, start)
        except Exception:
            log.exception("on_store failed for request %s; the range is not indexed",
                          getattr(key, "request_id", "?"))

    def on_evict(self, chunk_hashes: Sequence[bytes]) -> None:
        """Evicted chunks: removed from the local matcher (every namespace), DELETE events
        queued. Every chunk hash must be `bytes`; otherwise an error naming the type is logged
        and the whole call is skipped. Never raises."""
        try:
            hashes = list(chunk_hashes)
            if _all_bytes(hashes, "on_evict"):
                self._stored.remove(hashes)
        except Exception:
            log.exception("on_evict failed; some chunks may stay indexed")

    # --- the lookup path -----------------------------------------------------------------------

    def cb_unified_lookup(self, key: LookupKey, tp_size: int = 1) -> CBUnifiedLookupResult | None:
        """None while pending; then the prefix coverage and the segments to blend in."""
        request_id = key.request_id
        state = None
        try:
            now = self._clock()
            released: list[_Lookup] = []
            with self._lock:
                self._sweep_locked(now, released)
                state = self._lookups.get(request_id)
                if state is None:
                    if len(self._lookups) >= self.config.max_tracked_lookups:
                        # Full: the lookup polled least recently is the likeliest abandoned.
                        _, oldest = self._lookups.popitem(last=False)
                        released.append(oldest)
                        self._stats.evicted += 1
                    state = _Lookup(request_id, key.namespace, tokens_of(key), tp_size,
                                    started_at=now, deadline=now + self.config.match_budget_s,
                                    last_call=now)
                    self._lookups[request_id] = state
                else:
                    # Under the plugin lock, with the move: a sweep must never see this
                    # lookup at the front with its previous poll time.
                    state.last_call = now
                    self._lookups.move_to_end(request_id)
            self._let_go(released)
            with state.lock:
                state.calls += 1
                if not state.started:
                    state.started = True
                    self._start(state, key)
                result = self._advance(state)
            if result is not None:
                self._release(request_id, state)
            else:
                self._arm_sweeper()
            return result
        except Exception:
            log.exception("unified lookup failed for request %s; answering no reuse", request_id)
            with self._lock:
                self._stats.errors += 1
            # Only the state this call worked on: the map may by now hold a new lookup that
            # another thread started under the same id.
            if state is not None:
                self._release(request_id, state)
            return CBUnifiedLookupResult(0, [])

    def _start(self, state: _Lookup, key: LookupKey) -> None:
        namespace = state.namespace
        self.host.submit_prefix_lookup(key, state.tp_size)
        if len(state.tokens) < self.chunk_size:
            # Shorter than one chunk: neither leg can find anything, so neither is asked.
            state.fleet_status = FleetStatus.OFF if self.client is None else FleetStatus.SHORT
            return
        # The coordinator query goes out before the local match runs, so the round-trip
        # overlaps the local work instead of following it.
        if self.client is None:
            state.fleet_status = FleetStatus.OFF
        elif not _queryable(namespace):
            # The coordinator rejects such a query (422); asking would only cost a round-trip.
            state.fleet_status = FleetStatus.NOT_ASKED
            if not self._warned_not_asked:
                self._warned_not_asked = True
                log.warning("lookup %s has model_name=%r, world_size=%r, cache_salt=%r: "
                            "the coordinator cannot answer that, so such lookups go "
                            "local-only", state.request_id, namespace.model_name,
                            namespace.world_size, namespace.cache_salt[:40])
        elif self.client.submit(state.request_id, state.tokens, namespace, state.deadline):
            state.fleet_status = FleetStatus.PENDING
        else:
            state.fleet_status = FleetStatus.DECLINED
        state.local = FoundColumns.of(
            self._matcher.candidate_columns(state.tokens, namespace=namespace),
            Place.THIS_SERVER)

    def _advance(self, state: _Lookup) -> CBUnifiedLookupResult | None:
        request_id = state.request_id
        if state.prefix_tokens is None:
            prefix_chunks = self.host.poll_prefix_lookup(request_id)
            if prefix_chunks is None:
                return None
            state.prefix_tokens = min(len(prefix_chunks) * self.chunk_size, len(state.tokens))
        if state.fleet_status is FleetStatus.PENDING:
            reply = self.client.take(request_id)
            if reply.state is MatchState.PENDING:
                if self._clock() < state.deadline:
                    return None
                self.client.cancel(request_id)  # a late reply is discarded
                state.fleet_status = FleetStatus.TIMEOUT
            elif reply.state is MatchState.UNKNOWN:
                state.fleet_status = FleetStatus.LOST
            else:
                state.fleet = reply.found
                state.fleet_status = (FleetStatus.OK if reply.state is MatchState.DONE
                                      else FleetStatus.FAILED)
        size = self.chunk_size
        if state.prefetch is None:
            if self.config.resolve_after_prefetch:
                state.prefetch = every_offer(state.local, state.fleet, state.prefix_tokens, size)
            else:
                state.selected = select(state.local, state.fleet, state.prefix_tokens, size)
                state.prefetch = [c.segment for c in state.selected]
            if not state.prefetch:
                return self._complete(state, [])
            self.host.submit_prefetch(request_id, state.prefetch)
        found = self.host.poll_prefetch(request_id)
        if found is None:
            return None
        found = set(found)
        if self.config.resolve_after_prefetch:
            kept = select(state.local, state.fleet, state.prefix_tokens, size, available=found)
        else:
            kept = [c for c in state.selected if c.segment.hash in found]
        return self._complete(state, kept)

    def _complete(self, state: _Lookup, kept: list[Candidate]) -> CBUnifiedLookupResult:
        segments = [c.segment for c in kept]
        self.traces.append(LookupTrace(
            request_id=state.request_id, num_tokens=len(state.tokens),
            prefix_tokens=state.prefix_tokens,
            local_matches=len(state.local.positions),
            fleet_matches=len(state.fleet.positions),
            fleet_status=state.fleet_status, segments=segments,
            sources=[c.source for c in kept], prefetched=len(state.prefetch or ()),
            elapsed_s=self._clock() - state.started_at, calls=state.calls))
        with self._lock:
            stats = self._stats
            stats.lookups += 1
            stats.fleet_outcomes[state.fleet_status] = (
                stats.fleet_outcomes.get(state.fleet_status, 0) + 1)
            stats.segments_fleet_only += sum(c.source is Source.FLEET for c in kept)
        return CBUnifiedLookupResult(state.prefix_tokens, segments)

    def _release(self, request_id: str, state: _Lookup) -> None:
        with self._lock:
            if self._lookups.get(request_id) is state:
                del self._lookups[request_id]
        if self.client is not None and state.fleet_status is FleetStatus.PENDING:
            self.client.cancel(request_id)

    def cancel(self, request_id: str) -> bool:
        """The engine aborted `request_id`: forget its lookup now (its coordinator query and,
        if the host can, the host's operations too). True if a lookup was tracked. A later
        call for the same id starts afresh. Never raises."""
        try:
            with self._lock:
                state = self._lookups.pop(request_id, None)
            if state is None:
                return False
            with self._lock:
                self._stats.cancelled += 1
            self._let_go([state])
            return True
        except Exception:
            log.exception("cancel failed for request %s", request_id)
            return False

    def _sweep_locked(self, now: float, released: list[_Lookup]) -> None:
        # Lookups nobody polled for `abandon_after_s` were dropped by the scheduler. The map
        # is ordered by last poll, so this looks at the front only: O(1) when none expired.
        horizon = now - self.config.abandon_after_s
        lookups = self._lookups
        while lookups:
            state = next(iter(lookups.values()))
            if state.last_call > horizon:
                break
            lookups.popitem(last=False)
            released.append(state)
            self._stats.abandoned += 1

    def _let_go(self, released: list[_Lookup]) -> None:
        """Outside the plugin lock: cancel what released lookups left in flight."""
        if not released:
            return
        host_cancel = getattr(self.host, "cancel", None)
        for state in released:
            try:
                if self.client is not None and state.fleet_status is FleetStatus.PENDING:
                    self.client.cancel(state.request_id)
                if host_cancel is not None:
                    host_cancel(state.request_id)
            except Exception:
                log.exception("could not cancel what lookup %s left in flight",
                              state.request_id)
        if self._host_settle is not None:
            # The host may still hold some of it (a prefetch in flight): the sweep task
            # settles it once it lands, even if no call comes.
            self._arm_sweeper()

    # --- the sweep task: abandoned lookups go without a later call -------------------------------

    def _arm_sweeper(self) -> None:
        """Make sure the sweep task runs (or runs one more round). Never raises."""
        with self._lock:
            if self._closed:
                return
            if self._sweeper_running:
                self._sweep_again = True
                return
            self._sweeper_running, self._sweep_again = True, False
            try:
                self._workers.submit(self._sweep_task)
            except RuntimeError:  # the pool is shut down: close() released everything
                self._sweeper_running = False

    def _sweep_task(self) -> None:
        # Runs on the worker pool while something is held; ends when nothing is, or at close.
        tick = self.config.abandon_after_s / 4
        while not self._stopping.is_set():
            waiting = 0
            try:
                self.sweep()
                with self._lock:
                    # What the host was handed so far is settled just below; only a
                    # hand-over after this point asks for another round.
                    self._sweep_again = False
                if self._host_settle is not None:
                    waiting = self._host_settle() or 0
            except Exception:  # the sweep must outlive any surprise
                log.exception("sweeping abandoned lookups failed")
            with self._lock:
                if self._closed or not (self._lookups or waiting or self._sweep_again):
                    self._sweeper_running = False
                    return
                self._sweep_again = False
                delay = tick
                if self._lookups:
                    front = next(iter(self._lookups.values()))
                    expires_in = front.last_call + self.config.abandon_after_s - self._clock()
                    delay = min(tick, max(expires_in, 0.0) + 0.001)
            self._stopping.wait(delay)
        with self._lock:
            self._sweeper_running = False

    # --- introspection and lifecycle -------------------------------------------------------------

    def sweep(self) -> int:
        """Release abandoned lookups now (the sweep task and lookups do it as they come);
        returns how many."""
        released: list[_Lookup] = []
        with self._lock:
            self._sweep_locked(self._clock(), released)
        self._let_go(released)
        return len(released)

    def trace(self, request_id: str) -> LookupTrace | None:
        """The trace of the most recent completed lookup of `request_id`, if still kept."""
        for trace in reversed(self.traces):
            if trace.request_id == request_id:
                return trace
        return None

    @property
    def active_lookups(self) -> int:
        with self._lock:
            return len(self._lookups)

    def stats(self) -> PluginStats:
        with self._lock:
            stats = dataclasses.replace(self._stats, active_lookups=len(self._lookups),
                                        fleet_outcomes=dict(self._stats.fleet_outcomes))
        stats.client = None if self.client is None else self.client.stats()
        stats.reporter = None if self.reporter is None else self.reporter.stats()
        return stats

    def flush(self) -> bool:
        """Deliver queued cache events now; True when none is left (or there is no reporter)."""
        if self.reporter is None:
            return True
        try:
            return self.reporter.flush()
        except Exception:
            log.exception("cache-event flush failed")
            return False

    def close(self) -> None:
        """Close the client, flush and close the reporter, apply what the local matcher has
        queued, then shut the worker pool down. Idempotent; bounded by the HTTP budget.
        Not calling it is fine too (`with BlendPlugin(...)` calls it): see `_finalizer`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lookups.clear()
        if self._finalizer.detach() is not None:  # None: closed already, at exit
            _close_parts(self._closers)

    def __enter__(self) -> "BlendPlugin":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_parts(closers: list[Callable[[], object]]) -> None:
    for closer in closers:
        try:
            closer()
        except Exception:
            log.exception("error while closing the blend plugin")


def _close_unclosed(closers: list[Callable[[], object]], bound_s: float) -> None:
    """A plugin collected, or alive at interpreter exit, without `close()`: closed on a daemon
    thread (one last cache-event flush), waited for at most `bound_s`; past that, what is
    still in flight goes with the process rather than holding it up."""
    closing = threading.Thread(target=_close_parts, args=(closers,), daemon=True,
                               name="blend-plugin-close")
    try:
        closing.start()
    except RuntimeError:  # no new thread this late: close here, unbounded but each step is
        _close_parts(closers)
        return
    closing.join(bound_s)
    if closing.is_alive():
        log.warning("a BlendPlugin was not closed, and closing it took over %g s: its last "
                    "cache events may be lost (call close(), or use `with BlendPlugin(...)`)",
                    bound_s)


def _warn_about_gating(config: PluginConfig) -> None:
    if config.coordinator_url and not config.event_reporting:
        log.warning("%s is set but %s is off: the coordinator would hold no cache state "
                    "to match, so the fleet leg stays off. Set %s=1 to enable it.",
                    ENV_COORDINATOR_URL, ENV_EVENT_REPORTING, ENV_EVENT_REPORTING)
    if config.fleet_enabled and config.instance_id_is_default:
        log.warning("instance id defaulted to %r (hostname:pid), which changes when this "
                    "process restarts, so the coordinator cannot fence what the previous "
                    "process reported. Set %s to a stable per-server name.",
                    config.instance_id, ENV_INSTANCE_ID)


def _all_bytes(hashes: list, caller: str) -> bool:
    # A chunk hash is opaque bytes, hex on the wire (DESIGN.md). Anything else could not
    # be reported faithfully, so the call is refused whole rather than half-applied.
    bad = [h for h in hashes if not isinstance(h, bytes)]
    if not bad:
        return True
    log.error("%s: chunk hashes must be bytes, got %s; the whole call (%d chunk(s)) is "
              "skipped", caller, type(bad[0]).__name__, len(hashes))
    return False


def _queryable(namespace: BlendNamespace) -> bool:
    # The wire's one rule for a lookup's namespace (no model name, a world size below 1 or
    # a salt no key may carry: the coordinator answers 422, and nothing can match anyway).
    try:
        check_lookup_namespace(namespace)
    except ValueError:
        return False
    return True
