"""The router's configuration: one frozen value, checked once where it is built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    coordinator_url: str
    host: str = "127.0.0.1"
    port: int = 8100
    #: Seconds a score may take; past it the request is routed least-loaded.
    score_budget_s: float = 0.05
    #: Seconds between registry refreshes (`GET /instances`).
    refresh_interval_s: float = 2.0
    #: Bearer token for the coordinator (with access control on: `reader` for the score and
    #: `emitter` or `admin` for `GET /instances`).
    coordinator_token: str = ""
    #: The model name the instances' LMCache uses; "": each request's `model`.
    model_name: str = ""
    world_size: int = 1
    #: Seconds an instance may take to answer (a whole streamed answer included).
    backend_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.coordinator_url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator_url must be http(s)://HOST:PORT, got "
                             f"{self.coordinator_url!r}")
        for name in ("score_budget_s", "refresh_interval_s", "backend_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
