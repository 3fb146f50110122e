"""The instances the router may send to, where their engines are, and the work in flight."""

from __future__ import annotations

import itertools
import logging
from typing import Mapping

from blend_wire import ENGINE_URL_KEY, EngineAddress, InstancesReply, engine_address

log = logging.getLogger(__name__)


class Fleet:
    """The registered instances whose engine the router knows (`urls`: the base URL it
    built from a host and port, by instance id), and the requests in flight to each.

    An instance's engine is the operator's `--backend` for it, else the `engine_url` its
    registration's metadata names (checked again here: only a host and port are kept).
    A registered instance with neither is not sent to (logged once)."""

    def __init__(self, backends: Mapping[str, EngineAddress] | None = None) -> None:
        self.urls: dict[str, str] = {}
        self.unroutable: set[str] = set()
        self.in_flight: dict[str, int] = {}
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

    def begin(self, instance: str, tokens: int) -> None:
        """A request of `tokens` prompt tokens goes out to `instance`."""
        self.in_flight[instance] = self.in_flight.get(instance, 0) + 1

    def end(self, instance: str, tokens: int) -> None:
        """The request `begin` counted is over (answered, failed or abandoned)."""
        self.in_flight[instance] -= 1
        if not self.in_flight[instance]:
            del self.in_flight[instance]
