"""The instances the router may send to, and the work it has in flight at each."""

from __future__ import annotations

import itertools

from blend_wire import InstancesReply


class Fleet:
    """The instances the registry lists, and the requests this router has in flight to each."""

    def __init__(self) -> None:
        self.urls: dict[str, str] = {}
        self.in_flight: dict[str, int] = {}
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

    def begin(self, instance: str, tokens: int) -> None:
        """A request of `tokens` prompt tokens goes out to `instance`."""
        self.in_flight[instance] = self.in_flight.get(instance, 0) + 1

    def end(self, instance: str, tokens: int) -> None:
        """The request `begin` counted is over (answered, failed or abandoned)."""
        self.in_flight[instance] -= 1


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip
