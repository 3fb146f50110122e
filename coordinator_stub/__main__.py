"""`python -m coordinator_stub`: run the bundled coordinator until SIGINT/SIGTERM.

Contract (`coordinator_stub.launch.process` relies on it; tests, the demo and benchmarks start
the coordinator through that module): once the coordinator is ready (every numba kernel
it uses compiled, see `coordinator_stub.service.coordinator`) and the socket is bound, exactly one
line ``listening on http://HOST:PORT`` (``https://`` with `--tls-cert`) is written to
stdout and flushed, with the real port when `--port 0` asked for a free one. Logs go to
stderr. On SIGINT or SIGTERM the server stops accepting, finishes in-flight requests, stops
its worker threads and exits 0; a signal during start-up (modules loading, kernels
compiling, a replica waiting for its event log or replaying it) stops it too, exit 0, no
traceback, nothing left open: this module holds SIGINT/SIGTERM before it loads anything
else (`coordinator_stub.run` does the rest), so only a signal while the interpreter itself
starts (tens of milliseconds) is fatal. Exit 1 with one CRITICAL line naming the reason:
the port cannot be bound (in use), the event log stayed unreachable for
`--event-log-connect-timeout` s, or a replica (`--event-log`) stopped itself because it
can no longer apply the log without missing records.

Connection hygiene (a client may hold sockets and send nothing): the listening socket
is served through the app's `ConnectionGuard` (at most `--max-connections` open; the
longest-idle makes room), aiohttp's keep-alive timer closes a connection without a
complete request head `--idle-timeout` s after it opened or after its last response,
and the app cuts off a body that takes longer than `--body-timeout`.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    # First, before asyncio and the rest load: a signal from here on is noted, and stops the
    # start-up with exit 0 once `run` can act on it (`run._stop_on_signals`).
    held: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: held.append(signum))

    from coordinator_stub.run import main as run

    return run(argv, held)


if __name__ == "__main__":
    sys.exit(main())
