"""The instances the router may send to, and the work it has in flight at each."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from blend_wire import InstancesReply


@dataclass
class InFlight:
    """One request out to `instance`: `prefill_tokens` still queued until its first piece."""

    instance: str
    prefill_tokens: int
    prefilled: bool = False


class Fleet:
    """The instances the registry lists, and per instance the requests this router has in
    flight there (`in_flight`), of them those still waiting for their first piece
    (`prefilling`: queued or in prefill) and their tokens to prefill (`prefill_tokens`);
    counted from `begin` until the answer's first piece (`first_piece`) or its end."""

    def __init__(self) -> None:
        self.urls: dict[str, str] = {}
        self.in_flight: dict[str, int] = {}
        self.prefilling: dict[str, int] = {}
        self.prefill_tokens: dict[str, int] = {}
        self._turn = itertools.count()

    def update(self, listing: InstancesReply) -> None:
        self.urls = {i.instance_id: f"http://{_host(i.ip)}:{i.http_port}"
                     for i in listing.instances}

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
        """An instance's URL, each in turn (None: none known): any engine of the fleet
        tokenizes as the others do."""
        urls = list(self.urls.values())
        return urls[next(self._turn) % len(urls)] if urls else None

    def begin(self, instance: str, prefill_tokens: int) -> InFlight:
        """A request expected to prefill `prefill_tokens` tokens goes out to `instance`."""
        self.in_flight[instance] = self.in_flight.get(instance, 0) + 1
        self.prefilling[instance] = self.prefilling.get(instance, 0) + 1
        self.prefill_tokens[instance] = self.prefill_tokens.get(instance, 0) + prefill_tokens
        return InFlight(instance, prefill_tokens)

    def first_piece(self, request: InFlight) -> None:
        """The instance sent the first piece of its answer: the prefill is done."""
        if not request.prefilled:
            request.prefilled = True
            self.prefilling[request.instance] -= 1
            self.prefill_tokens[request.instance] -= request.prefill_tokens

    def end(self, request: InFlight) -> None:
        """The request `begin` counted is over (answered, failed or abandoned)."""
        self.first_piece(request)
        self.in_flight[request.instance] -= 1


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip
