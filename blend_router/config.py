"""The router's configuration: one frozen value, checked once where it is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from blend_router.policy import RoutingPolicy
from blend_wire import EngineAddress, engine_address


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
    #: Seconds to open a connection to an instance; past it, it counts as unreachable.
    connect_timeout_s: float = 5.0
    #: Operator-given engine addresses by instance id (`--backend ID=URL`), over what the
    #: instances register.
    backends: dict[str, EngineAddress] = field(default_factory=dict)
    #: `--client-token-file`: client tokens and their salts ("": the router is open).
    client_token_file: str = ""
    #: Forward the client's `Authorization` header to the instance (off: never sent on).
    forward_client_authorization: bool = False
    #: A request body larger than this is refused (413) before it is read.
    max_body_bytes: int = 16 * 1024 * 1024
    #: Seconds a request body may take to arrive (408 past it).
    body_timeout_s: float = 30.0
    #: Connections open to one instance at most (requests beyond wait for one).
    backend_connections_per_host: int = 64
    #: Connections open to the coordinator for scores at most (the registry has its own).
    coordinator_connections: int = 32
    #: The choice of instance: the rates it predicts service with, the wait's weight, the
    #: imbalance bound, or cache-greedy (`--prefill-rate` ..., `--cache-greedy`).
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    #: Ask an engine's `POST /tokenize` for text the `--tokenizer` file cannot tokenize.
    engine_tokenize: bool = False

    def __post_init__(self) -> None:
        if not self.coordinator_url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator_url must be http(s)://HOST:PORT, got "
                             f"{self.coordinator_url!r}")
        for name in ("score_budget_s", "refresh_interval_s", "backend_timeout_s",
                     "connect_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        for name in ("world_size", "max_body_bytes", "backend_connections_per_host",
                     "coordinator_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def parse_backend(value: str) -> tuple[str, EngineAddress]:
    """`--backend INSTANCE=URL`: the instance id and its engine's address."""
    instance, equals, url = value.partition("=")
    if not equals or not instance.strip():
        raise ValueError(f"--backend takes INSTANCE=http(s)://HOST:PORT, got {value[:200]!r}")
    return instance.strip(), engine_address(url.strip())
