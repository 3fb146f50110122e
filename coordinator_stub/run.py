"""The coordinator process: start-up steps, serving, signals and exit codes.

`python -m coordinator_stub` and `fleet-blend-coordinator` (`coordinator_stub.__main__`,
whose docstring is the process's contract) hold SIGINT/SIGTERM before anything loads, then
call `main` here with what they held. Loading this module takes tens of milliseconds
(asyncio, ssl) and `serve` loads the rest (most of a second): a signal meanwhile stops the
start-up, exit 0.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
import ssl
import sys
from typing import TYPE_CHECKING, Sequence

from coordinator_stub.aio import cancel_until_done

# The rest loads in `serve`: importing it takes most of a second.
if TYPE_CHECKING:
    from coordinator_stub.config import CoordinatorConfig

log = logging.getLogger("coordinator_stub")


def _tune_collector() -> None:
    """Before anything is built: the directory keeps GC-untracked records, but each
    ingested entry still allocates a few tracked objects (decoded structs, token lists)
    that refcounting frees at once; the default gen-0 threshold (700) would run a
    collection every few hundred entries, and full ones over a directory that grows by
    millions of records (a replica replaying the event log at start-up ran at a third of
    the speed of serving ingest at 1M chunks)."""
    gc.set_threshold(50_000, 20, 10)


def _tune_runtime() -> None:
    """Once started (a replica has loaded and replayed its state):

    - Objects alive after start-up (modules, compiled kernels, the index, a loaded
      snapshot) are frozen out of every later collection pass, and the memory start-up
      used and freed (a replayed log's records) goes back to the OS
      (`coordinator_stub.memory.give_back_memory`).
    - A shorter GIL switch interval (default 5 ms) lets a match worker finishing its
      kernel, or the loop answering a health check, get the GIL back sooner while another
      thread runs Python: it bounds tail latency, at a small cost in throughput.
    """
    from coordinator_stub.memory import give_back_memory

    gc.collect()
    gc.freeze()
    give_back_memory()
    sys.setswitchinterval(0.001)


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _tls_context(config: CoordinatorConfig) -> ssl.SSLContext | None:
    if not config.tls_cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    return context


class _Stopped(Exception):
    """SIGINT/SIGTERM arrived while the coordinator was still starting."""


async def _unless_stopped(step, stop: asyncio.Event):
    """Await `step` (a coroutine) unless `stop` is set first: then cancel it (it cleans up
    after itself) and raise `_Stopped`."""
    task = asyncio.ensure_future(step)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():
        await cancel_until_done(task)
        raise _Stopped()
    return task.result()


async def serve(config: CoordinatorConfig, held: Sequence[int] = ()) -> int:
    """Serve until SIGINT/SIGTERM; the exit code (1: it could not start — port in use, event
    log unreachable — or a replica that had to stop). A signal at any stage stops it: while
    modules load (`held`: those `main` held), while kernels compile (once they are done),
    while a replica waits for its event log or replays it, and while serving."""
    from coordinator_stub.http.app import CONNECTIONS, WRITES, create_app
    from coordinator_stub.http.server import runner_for

    _tune_collector()
    # Building the app compiles every kernel first (seconds on a cold numba cache), so the
    # socket opens, and /healthz answers, only once the coordinator is ready.
    app = create_app(config)
    runner = runner_for(app, config.idle_timeout_s)
    stop = _stop_on_signals(held)  # the loop takes signals over; one held until now counts
    server = None
    started = False
    try:
        if stop.is_set():  # a signal while the kernels compiled
            raise _Stopped()
        if not await _set_up(runner, stop):
            return 1
        started = True
        _tune_runtime()
        server = await _listen(runner, config)
        if server is None:
            return 1
        _announce(config, server, app[CONNECTIONS].max_connections)
        await stop.wait()
        log.info("shutting down")
    except _Stopped:
        log.info("stopped by a signal while starting")
        return 0
    finally:
        if server is not None:
            server.close()  # stop accepting; runner.cleanup() finishes open connections
        if started:
            await runner.cleanup()
        else:  # setup did not finish: close the contexts it entered (worker pools, ...)
            await app.cleanup()
    failure = app[WRITES].failure
    if failure:
        log.critical("exiting: %s", failure)
        return 1
    return 0


def _stop_on_signals(held: Sequence[int] = ()) -> asyncio.Event:
    """An event set by the first SIGINT or SIGTERM (already set if one was `held`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if held:
        stop.set()
    return stop


async def _set_up(runner, stop: asyncio.Event) -> bool:
    """Start the app (a replica connects to its event log, restores and replays here: a
    signal cancels that, and what it opened is closed). False: it could not start."""
    try:
        await _unless_stopped(runner.setup(), stop)
    except RuntimeError as exc:  # the event log unreachable, or records it needs gone
        log.critical("cannot start: %s", exc)
        log.debug("start-up failed", exc_info=True)
        return False
    return True


async def _listen(runner, config: CoordinatorConfig) -> asyncio.Server | None:
    """The listening server, or None (said why) when the address cannot be bound."""
    from coordinator_stub.http.server import listen

    try:
        return await listen(runner, config.host, config.port, _tls_context(config))
    except OSError as exc:
        log.critical("cannot listen on %s: %s%s", _url(config.host, config.port),
                     exc.strerror or exc,
                     " (another process holds the port: stop it, or choose another "
                     "with --port; --port 0 picks a free one)"
                     if exc.errno == errno.EADDRINUSE else "")
        return None


def _announce(config: CoordinatorConfig, server: asyncio.Server, max_connections: int
              ) -> None:
    """The one `listening on` line on stdout (the start-up contract), then the set-up."""
    host, port = server.sockets[0].getsockname()[:2]
    scheme = "https" if config.tls_cert_file else "http"
    print(f"listening on {_url(host, port, scheme)}", flush=True)
    log.info("access control %s, TLS %s",
             f"on ({len(config.access_tokens)} tokens)" if config.access_tokens else "off",
             "on" if config.tls_cert_file else "off")
    for warning in config.warnings():
        log.warning("%s", warning)
    log.info("at most %d connections; idle timeout %g s, body timeout %g s",
             max_connections, config.idle_timeout_s, config.body_timeout_s)
    log.info("blend lookup %s, chunk size %d, probe stride %d, %s; reaper %s; metrics %s",
             "on" if config.enable_blend_lookup else "off", config.chunk_size,
             config.blend_probe_stride,
             "shared chunk hashes trusted (LMCache's rules)" if config.trust_shared_hashes
             else "content per namespace",
             f"every {config.health_check_interval:g} s, timeout "
             f"{config.instance_timeout:g} s" if config.health_check_interval else "off",
             "on" if config.enable_metrics else "off")


def main(argv: Sequence[str] | None = None, held: Sequence[int] = ()) -> int:
    """Parse `argv`, serve, the exit code. `held`: the signals that arrived while this
    process started (`coordinator_stub.__main__` notes them); one there stops it, exit 0."""
    from coordinator_stub.config import parse_args

    config = parse_args(argv)
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(config, held))

