"""Keeps a serving process registered with its coordinator: register, heartbeat, deregister.

What LMCache 0.5.6's `lmcache server` does for itself with one coordinator URL
(`keep_registered`, WIRE.md "What an LMCache MP server and LMCache's tools call"), for several replicas
of one coordinator (comma-separated URLs), which LMCache's own cannot use.

Contract:
- `InstanceRegistrar(urls, instance_id=..., ip=..., http_port=..., heartbeat_interval=...)`
  starts a daemon thread (unless `start=False`) that registers at once
  (`POST /instances`), then heartbeats every `heartbeat_interval` s
  (`PUT /instances/{id}/heartbeat`). A `404` means the coordinator forgot the instance:
  it registers again at once. Any other failure keeps the registration and tries again
  at the next beat. `close()` stops the thread and deregisters (`DELETE`), once (not
  sent while every replica is benched: the coordinator reaps the instance after its timeout).
- Several URLs: one replica at a time, by the plugin's one fail-over policy (`plugin.http`):
  a request it answers `UNAVAILABLE` (no connection, a timeout, any 5xx) goes on to the next
  replica at once; the next requests stay there; a replica is benched as the policy says
  (its breaker, a `Retry-After`), and a 429 pauses every replica. The replicas share one
  registry (`coordinator_stub.writes.replicated`), so a heartbeat that moves keeps the
  registration: no re-registration, no fencing.
- A registration the coordinator refuses as invalid (4xx) is logged as an error, not sent
  to another replica (every one would refuse it), and tried again at the next beat (an
  operator may fix the coordinator meanwhile).
- LMCache 0.5.7: `chunk_size` (or, once negotiated, `bind_chunk_size(size)`, the
  server's bind listener under replicas) is sent with every registration from then on;
  `bind_chunk_size` registers at once, so the coordinator binds or checks it, and raises
  `RuntimeError` on a `409` (a size that fleet cannot take), as LMCache's own listener.
- Every request goes through the plugin's one HTTP policy (plugin.http): `timeout`
  bounds each round-trip, so `close()` ends within about one timeout per replica. No
  method but `bind_chunk_size` raises: failures are logged (one warning per outage) and
  counted in `stats()`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import httpx

from blend_wire import INSTANCES_PATH, RegisterReply, WireError, decode, encode
from plugin.config import coordinator_url_list
from plugin.http import Replicas, coordinator_http

log = logging.getLogger(__name__)


@dataclass
class RegistrarStats:
    """Counters since start, and where the registrar talks now."""

    registrations: int = 0      # accepted registrations (the first and every re-registration)
    heartbeats: int = 0         # accepted heartbeats
    forgotten: int = 0          # heartbeats answered 404 (the coordinator forgot us)
    failed: int = 0             # requests no replica took
    moved: int = 0              # times a request went on to the next replica
    registered_id: str | None = None
    url: str = ""


class InstanceRegistrar:
    """Registers one serving process and keeps it registered (module doc)."""

    def __init__(self, urls: str | Sequence[str], *, instance_id: str, ip: str,
                 http_port: int, heartbeat_interval: float = 5.0, timeout: float = 2.0,
                 p2p_advertised_url: str = "", mq_port: int = 0,
                 metadata: dict[str, str] | None = None, token: str | None = None,
                 ca_file: str | None = None, chunk_size: int | None = None,
                 breaker_threshold: int = 3, breaker_cooldown_s: float = 5.0,
                 start: bool = True) -> None:
        urls = coordinator_url_list(urls)
        if not urls:
            raise ValueError("InstanceRegistrar needs at least one coordinator URL")
        if not heartbeat_interval > 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval!r}")
        self.heartbeat_interval = heartbeat_interval
        self._fields = {"instance_id": instance_id, "ip": ip, "http_port": http_port,
                        "metadata": dict(metadata or {}),
                        "p2p_advertised_url": p2p_advertised_url, "mq_port": mq_port}
        self._body = self._registration(chunk_size)
        # One replica at a time, the next when it is unavailable: the plugin's one
        # fail-over policy (plugin.http).
        self._replicas = Replicas(
            urls, lambda url: coordinator_http(url, timeout=timeout, token=token,
                                               ca_file=ca_file),
            breaker_threshold=breaker_threshold, breaker_cooldown_s=breaker_cooldown_s)
        self._lock = threading.Lock()
        self._beat_lock = threading.Lock()  # one registration or heartbeat at a time
        self._stats = RegistrarStats(url=urls[0])
        self._registered: str | None = None
        self._failing = False
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="fleet-registrar",
                                            daemon=True)
            self._thread.start()

    @property
    def registered_id(self) -> str | None:
        """The id the coordinator knows this process by, or None while unregistered."""
        return self._registered

    def stats(self) -> RegistrarStats:
        with self._lock:
            return dataclasses.replace(self._stats, registered_id=self._registered,
                                       url=self._replicas.url)

    # --- one beat ----------------------------------------------------------------------------

    def _registration(self, chunk_size: int | None) -> bytes:
        """The `POST /instances` body; with LMCache 0.5.7's `chunk_size` once it is known."""
        fields = self._fields if chunk_size is None else {**self._fields,
                                                          "chunk_size": chunk_size}
        return encode(fields)

    def bind_chunk_size(self, chunk_size: int) -> None:
        """LMCache 0.5.7 bound the server's chunk size (its bind listener, in place of
        LMCache's own, which takes one URL): every registration carries it from now on,
        and one goes out now, so the coordinator binds (or checks) it at once. Raises
        `RuntimeError` when the coordinator refuses the size (`409`: this server cannot
        join that fleet), as LMCache's listener does; an unreachable coordinator is not
        an error (the next beat registers with it)."""
        with self._beat_lock:
            self._body = self._registration(chunk_size)
            response = self._request("POST", INSTANCES_PATH, self._body)
            if response is not None and response.status_code == 409:
                raise RuntimeError(f"the coordinator at {self._replicas.url} refuses "
                                   f"chunk size {chunk_size}: {response.text[:300]}")
            if response is not None and response.status_code == 200:
                self._registered_by(response)
            elif response is not None:
                log.error("coordinator at %s refused the registration: HTTP %d %s",
                          self._replicas.url, response.status_code,
                          response.text[:300])

    def beat(self) -> None:
        """Register if not registered, else heartbeat (re-registering if forgotten)."""
        with self._beat_lock:
            self._beat()

    def _beat(self) -> None:
        if self._registered is None:
            self._register()
            return
        response = self._request("PUT", f"{INSTANCES_PATH}/{self._registered}/heartbeat")
        if response is None:
            return
        if response.status_code == 404:
            log.info("coordinator at %s no longer knows %s; registering again",
                     self._replicas.url, self._registered)
            with self._lock:
                self._stats.forgotten += 1
            self._registered = None
            self._register()
        elif response.status_code == 200:
            with self._lock:
                self._stats.heartbeats += 1
        else:
            self._failed(f"heartbeat answered HTTP {response.status_code}: "
                         f"{response.text[:200]!r}")

    def _register(self) -> None:
        response = self._request("POST", INSTANCES_PATH, self._body)
        if response is None:
            return
        if response.status_code != 200:
            log.error("coordinator at %s refused the registration: HTTP %d %s",
                      self._replicas.url, response.status_code, response.text[:300])
            return
        self._registered_by(response)

    def _registered_by(self, response: httpx.Response) -> None:
        try:
            reply = decode(response.content, RegisterReply)
        except WireError as exc:
            self._failed(f"registration reply is not {{instance_id, re_registered}}: {exc}")
            return
        self._registered = reply.instance_id
        with self._lock:
            self._stats.registrations += 1
        log.info("registered with the coordinator at %s as %s", self._replicas.url,
                 reply.instance_id)

    def _request(self, method: str, path: str, body: bytes | None = None
                 ) -> httpx.Response | None:
        """Send to the current replica, moving on to the next while one is unavailable
        (plugin.http's policy); None when none answered."""
        sent = self._replicas.request(method, path, content=body, headers=(
            {"content-type": "application/json"} if body is not None else None))
        with self._lock:
            self._stats.moved += sent.moved
        if sent.response is None:
            self._failed(sent.failure)
            return None
        if self._failing:
            log.info("coordinator at %s answers again", self._replicas.url)
            self._failing = False
        return sent.response

    def _failed(self, reason: str) -> None:
        with self._lock:
            self._stats.failed += 1
        emit = log.debug if self._failing else log.warning  # one warning per outage
        self._failing = True
        emit("coordinator registration/heartbeat failed at every replica (%s); retrying in "
             "%g s", reason, self.heartbeat_interval)

    # --- lifecycle -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception:  # the registrar must outlive any surprise
                log.exception("coordinator registration/heartbeat failed")
            if self._stop.wait(self.heartbeat_interval):
                return

    def close(self) -> None:
        """Stop beating and deregister (tried at each replica). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._registered is not None:
                self._request("DELETE", f"{INSTANCES_PATH}/{self._registered}")
                self._registered = None
        finally:
            self._replicas.close()


__all__ = ["InstanceRegistrar", "RegistrarStats"]
