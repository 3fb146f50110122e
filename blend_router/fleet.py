"""The instances the router may send to, where their engines are, and the work in flight."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from blend_wire import ENGINE_URL_KEY, EngineAddress, InstancesReply, engine_address

log = logging.getLogger(__name__)


@dataclass(eq=False)  # each request is itself: `Fleet.waiting` removes it by identity
class InFlight:
    """One request out to `instance`: `service_s` (its predicted service there) still
    queued until its first piece."""

    instance: str
    service_s: float
    #: Its prompt's chunk hashes (`policy.chunk_hashes`; empty: not known).
    chunks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    prefilled: bool = False


class Fleet:
    """The registered instances whose engine the router knows (`urls`: the base URL it
    built from a host and port, by instance id), and the requests in flight to each.

    An instance's engine is the operator's `--backend` for it, else the `engine_url` its
    registration's metadata names (checked again here: only a host and port are kept).
    A registered instance with neither is not sent to (logged once).

    Per instance: the requests this router has in flight there (`in_flight`), of them those
    still waiting for their first piece (`prefilling`: queued or in prefill) and their
    predicted service in seconds (`queued_s`: prefill and loads, `policy.ServiceRates`) and
    the requests themselves (`waiting`: their chunk hashes, what the instance will hold),
    counted from `begin` until the answer's first piece (`first_piece`) or its end."""

    def __init__(self, backends: Mapping[str, EngineAddress] | None = None) -> None:
        self.urls: dict[str, str] = {}
        self.unroutable: set[str] = set()
        self.in_flight: dict[str, int] = {}
        self.prefilling: dict[str, int] = {}
        self.queued_s: dict[str, float] = {}
        #: Per instance, the requests waiting there (their chunks: what it will hold).
        self.waiting: dict[str, list[InFlight]] = {}
        self._backends = dict(backends or {})
        self._turn = itertools.count()

    def update(self, listing: InstancesReply) -> None:
        urls, unroutable = {}, set()
        for instance in listing.instances:
            address, why = self._backends.get(instance.instance_id), ""
            if address is None:
                named = instance.metadata.get(ENGINE_URL_KEY)
                try:
                    address = None if named is None else engine_address(named)
                except ValueError as exc:
                    why = str(exc)
                why = why or (f"its registration names no {ENGINE_URL_KEY} (the serving "
                              "side's LMCACHE_COORDINATOR_ENGINE_URL) and no --backend names it")
            if address is None:
                unroutable.add(instance.instance_id)
                if instance.instance_id not in self.unroutable:
                    log.warning("instance %s is not routed to: %s", instance.instance_id[:100],
                                why)
                continue
            urls[instance.instance_id] = address.url
        self.urls, self.unroutable = urls, unroutable

    def least_loaded(self, among: list[str] | None = None, exclude: str | None = None
                     ) -> str | None:
        ids = [i for i in (self.urls if among is None else among)
               if i in self.urls and i != exclude]
        if not ids:
            return None
        least = min(self.in_flight.get(i, 0) for i in ids)
        idle = [i for i in ids if self.in_flight.get(i, 0) == least]
        return idle[next(self._turn) % len(idle)]

    def any_url(self) -> str | None:
        """An instance's engine URL, each in turn (None: none known): any engine of the
        fleet tokenizes as the others do."""
        urls = list(self.urls.values())
        return urls[next(self._turn) % len(urls)] if urls else None

    def begin(self, instance: str, service_s: float,
              chunks: np.ndarray | None = None) -> InFlight:
        """A request whose service is predicted to take `service_s` seconds (to its first
        token) goes out to `instance`."""
        self.in_flight[instance] = self.in_flight.get(instance, 0) + 1
        self.prefilling[instance] = self.prefilling.get(instance, 0) + 1
        self.queued_s[instance] = self.queued_s.get(instance, 0.0) + service_s
        request = InFlight(instance, service_s) if chunks is None else \
            InFlight(instance, service_s, chunks)
        self.waiting.setdefault(instance, []).append(request)
        return request

    def first_piece(self, request: InFlight) -> None:
        """The instance sent the first piece of its answer: the prefill is done."""
        if not request.prefilled:
            request.prefilled = True
            self.prefilling[request.instance] -= 1
            self.queued_s[request.instance] -= request.service_s
            self.waiting[request.instance].remove(request)
            if not self.prefilling[request.instance]:  # no float residue once none waits
                self.queued_s[request.instance] = 0.0

    def end(self, request: InFlight) -> None:
        """The request `begin` counted is over (answered, failed or abandoned)."""
        self.first_piece(request)
        self.in_flight[request.instance] -= 1
        if not self.in_flight[request.instance]:
            del self.in_flight[request.instance]
