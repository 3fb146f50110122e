"""Configuration of the bundled coordinator: one frozen value, built from flags or in code.

Contract:
- `CoordinatorConfig` holds every knob the coordinator reads; `parse_args(argv)` builds
  it from the command line (WIRE.md, "Coordinator command line") and `--help` explains
  every flag. Tests build it directly and pass it to `create_app`.
- Limits are checked here once, so the rest of the package can trust them:
  `chunk_size >= 1`, `blend_probe_stride >= 1`, both caps >= 1, `match_workers >= 1`,
  `instance_timeout > 0`, `health_check_interval >= 0` (0: no reaper).
- `enable_blend_lookup` is the value at start-up only; enabling later is a runtime act on
  the running coordinator (`KeyDirectory.enable_blend_lookup`), never a config change.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from blend_wire import MAX_CHUNK_SIZE, is_loopback_host
from blend_wire.version import version_line
from coordinator_stub.scopes import tokens_from

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9300
DEFAULT_CHUNK_SIZE = 256
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_QUERY_TOKENS = 1 << 20
#: `/events` request bytes being read or waiting to be applied, all clients together.
DEFAULT_MAX_INGEST_BYTES = 2 * DEFAULT_MAX_BODY_BYTES
#: A connection that has not sent a complete request head this long after it opened, or
#: after its previous response, is closed (aiohttp's keep-alive timer covers both).
DEFAULT_IDLE_TIMEOUT_S = 30.0
#: A request body must arrive within this long of its headers.
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Open connections beyond this make room by closing the longest-idle one.
DEFAULT_MAX_CONNECTIONS = 4096
# LMCache's defaults: servers heartbeat every 5 s.
DEFAULT_INSTANCE_TIMEOUT = 30.0
DEFAULT_HEALTH_CHECK_INTERVAL = 10.0
#: Blend-score weights of a token whose KV an instance reads from a shared tier, and of one
#: only a peer holds, relative to one in its own L1 (1) and one recomputed (0).
DEFAULT_SCORE_SHARED_WEIGHT = 0.5
DEFAULT_SCORE_PEER_WEIGHT = 0.25
#: Instance ids (registered or reporting) one scoped token may bring in: a fleet's worth
#: for a pool of servers (restarts under new ids are let go after --instance-timeout),
#: while a token making up ids stops at about a megabyte of state.
DEFAULT_MAX_INSTANCES_PER_SCOPE = 1024


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    enable_blend_lookup: bool = False
    chunk_size: int = DEFAULT_CHUNK_SIZE
    blend_probe_stride: int = 1
    # LMCache's cross-namespace rules for a chunk hash stored in several namespaces
    # (WIRE.md, "Chunk hashes shared by namespaces"); off: each namespace its own content.
    trust_shared_hashes: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_query_tokens: int = DEFAULT_MAX_QUERY_TOKENS
    max_ingest_bytes: int = DEFAULT_MAX_INGEST_BYTES
    # The index serialises matches under its lock: more matcher threads only add lock
    # and GIL hand-offs (measured: ~10% fewer lookups/s with two than with one).
    match_workers: int = 1
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # Instance ids per scoped token (coordinator_stub.service.quotas); 0: no cap.
    max_instances_per_scope: int = DEFAULT_MAX_INSTANCES_PER_SCOPE
    # Opt-in access control (coordinator_stub.scopes): (role, token[, scope]); empty = off.
    access_tokens: tuple[tuple, ...] = ()
    # TLS: both or neither (PEM files); off = plain HTTP.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    instance_timeout: float = DEFAULT_INSTANCE_TIMEOUT
    health_check_interval: float = DEFAULT_HEALTH_CHECK_INTERVAL  # 0: never reap
    score_shared_weight: float = DEFAULT_SCORE_SHARED_WEIGHT
    score_peer_weight: float = DEFAULT_SCORE_PEER_WEIGHT
    enable_metrics: bool = True
    log_level: str = "INFO"
    # Replicas over an event log (`coordinator_stub.writes.replicated`); None: one process, in memory.
    cluster: "ClusterConfig | None" = None

    def __post_init__(self) -> None:
        for name in ("chunk_size", "blend_probe_stride", "max_body_bytes", "max_query_tokens",
                     "max_ingest_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.chunk_size > MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be at most {MAX_CHUNK_SIZE} (WIRE.md, \"PUT "
                             f"/config/chunk-size (LMCache 0.5.7)\"), got {self.chunk_size}")
        if self.max_ingest_bytes < self.max_body_bytes:
            raise ValueError(f"max_ingest_bytes ({self.max_ingest_bytes}) must be at least "
                             f"max_body_bytes ({self.max_body_bytes}), or the largest "
                             "accepted body could never be admitted")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not isinstance(self.match_workers, int) or self.match_workers < 1:
            raise ValueError(f"match_workers must be an integer >= 1, got {self.match_workers!r}")
        if not isinstance(self.max_instances_per_scope, int) or self.max_instances_per_scope < 0:
            raise ValueError(f"max_instances_per_scope must be an integer >= 0 (0: no cap), "
                             f"got {self.max_instances_per_scope!r}")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ValueError(f"max_connections must be an integer >= 1, got "
                             f"{self.max_connections!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert, --tls-key)")
        for name in ("idle_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got "
                                 f"{value!r}")
        if not 0 < self.instance_timeout < float("inf"):
            raise ValueError(f"instance_timeout must be a finite number of seconds > 0, got "
                             f"{self.instance_timeout!r}")
        for name in ("score_shared_weight", "score_peer_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a number in [0, 1] (a token in the "
                                 f"instance's own L1 weighs 1), got {value!r}")
        if not 0 <= self.health_check_interval < float("inf"):
            raise ValueError("health_check_interval must be a finite number of seconds >= 0 "
                             f"(0: never reap), got {self.health_check_interval!r}")


    def warnings(self) -> list[str]:
        """What an operator should hear about this configuration at start-up."""
        found = []
        if self.access_tokens and self.tls_cert_file is None and not is_loopback_host(self.host):
            found.append(
                f"access control is on without TLS while listening on {self.host}: bearer "
                "tokens (and the token ids of every tenant's prompts) cross the network in "
                "clear, for anyone on the path to copy; serve HTTPS (--tls-cert, --tls-key) "
                "or bind a loopback address")
        if not self.enable_blend_lookup:
            # LMCache's default, kept (docs/OPERATIONS.md, "Blend lookup is off by
            # default"); said, because what it costs is invisible: zero fleet reuse.
            found.append(
                "blend lookup is off (no --enable-blend-lookup): blend lookups answer no "
                "matches, so serving processes reuse nothing through the fleet; start the "
                "coordinator with --enable-blend-lookup to index content and match it")
        return found


@dataclass(frozen=True)
class ClusterConfig:
    """Replication over a NATS JetStream event log (docs/DESIGN.md, "Coordinator replicas")."""

    servers: tuple[str, ...]
    stream: str = "blend-events"
    replicas: int = 1
    max_bytes: int = 1 << 30
    max_msgs: int = 0  # 0: no limit
    max_age_s: float = 0.0  # 0: no limit
    snapshot_dir: str = ""  # "": none on local disk
    # JetStream object store bucket on the event log's servers, shared by the replicas;
    # "": none. Neither a directory nor a bucket: no snapshots (a restart replays it all).
    snapshot_bucket: str = ""
    snapshot_keep: int = 3  # newest snapshots kept in each place
    snapshot_interval_s: float = 60.0
    replica_name: str = ""  # "": host name and port
    apply_timeout_s: float = 10.0
    # How long start-up waits for the NATS servers before it gives up (exit code 1).
    connect_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.servers or not all(url.startswith(("nats://", "tls://"))
                                       for url in self.servers):
            raise ValueError(f"--event-log needs nats://HOST:PORT URLs, comma-separated, got "
                             f"{','.join(self.servers)!r}")
        if not self.stream or any(c in self.stream for c in " .*>"):
            raise ValueError(f"stream name {self.stream!r} must be non-empty, without "
                             "spaces, dots or wildcards")
        if not 1 <= self.replicas <= 5:
            raise ValueError(f"stream replicas must be 1..5, got {self.replicas}")
        if self.max_bytes < 0 or self.max_msgs < 0 or self.max_age_s < 0:
            raise ValueError("event log retention limits must be >= 0 (0: no limit)")
        if self.snapshot_bucket and not re.fullmatch(r"[A-Za-z0-9_-]+", self.snapshot_bucket):
            raise ValueError(f"snapshot bucket name {self.snapshot_bucket!r} may hold only "
                             "letters, digits, '-' and '_' (name the stream so)")
        if not isinstance(self.snapshot_keep, int) or self.snapshot_keep < 1:
            raise ValueError(f"snapshots kept must be an integer >= 1, got "
                             f"{self.snapshot_keep!r}")
        if not 0 < self.connect_timeout_s < float("inf"):
            raise ValueError(f"event log connect timeout must be a finite number of seconds "
                             f"> 0, got {self.connect_timeout_s!r}")
        if not 0 < self.snapshot_interval_s < float("inf"):
            raise ValueError(f"snapshot interval must be a finite number of seconds > 0, "
                             f"got {self.snapshot_interval_s!r}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _seconds_or_zero(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator_stub",
        description=(
            "Bundled LMCache-compatible coordinator: ingests cache events from serving "
            "processes (POST /events), keeps a key directory, and answers fleet-wide "
            "CacheBlend lookups (POST /directory/blend-lookup). Prints one line "
            "'listening on http://HOST:PORT' once bound; exits 0 on SIGINT/SIGTERM."),
    )
    parser.add_argument("--version", action="version", version=version_line("coordinator"))
    _listening_flags(parser)
    _lookup_flags(parser)
    _limit_flags(parser)
    _instance_flags(parser)
    parser.set_defaults(_event_log_only=_event_log_flags(parser))
    return parser


def _listening_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("listening and access")
    group.add_argument("--host", default=DEFAULT_HOST,
                       help="address to bind (default: %(default)s)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT,
                       help="TCP port to bind; 0 picks a free port and prints it "
                            "(default: %(default)s)")
    group.add_argument("--auth-token-file", metavar="PATH",
                       help="turn access control on: a file of 'ROLE TOKEN "
                            "[instances=P,...] [salts=S,...]' lines (roles: emitter, reader, "
                            "admin; P an instance id or a prefix ending in '*', S a cache "
                            "salt, \"\" the empty one; a scope left out is any). The "
                            "variables COORDINATOR_EMITTER_TOKEN, "
                            "COORDINATOR_READER_TOKEN and COORDINATOR_ADMIN_TOKEN add tokens "
                            "(and turn it on) too. Off by default: LMCache servers send no "
                            "token")
    group.add_argument("--tls-cert", metavar="PEM",
                       help="serve HTTPS with this certificate (chain); needs --tls-key")
    group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")


def _lookup_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("content index and lookups")
    group.add_argument("--enable-blend-lookup", action="store_true",
                       help="index the content of stored chunks and answer blend lookups. "
                            "Off by default: no content is hashed and every lookup answers "
                            "{\"matches\": []}")
    group.add_argument("--chunk-size", type=_positive_int, default=DEFAULT_CHUNK_SIZE,
                       help="tokens per chunk; only stored content of exactly this many "
                            "tokens is indexed. The minimum an LMCache 0.5.7 fleet may "
                            f"bind with PUT /config/chunk-size; at most {MAX_CHUNK_SIZE} "
                            "(default: %(default)s)")
    group.add_argument("--blend-probe-stride", type=_positive_int, default=1,
                       help="probe the query every N positions; 1 finds every stored chunk "
                            "at any offset (full recall), larger values trade recall for "
                            "speed (default: %(default)s)")
    group.add_argument("--trust-shared-hashes", action="store_true",
                       help="LMCache's rules for a chunk hash stored in several namespaces "
                            "or by several instances: one content and offset per hash, set "
                            "by whichever namespace or instance stored it last, and claimed "
                            "by a token-less STORE of any namespace; any reporter changes "
                            "a shared placement. Only for fleets whose namespaces trust each other "
                            "(one tenant): a namespace's report then changes what the others "
                            "match. Off by default: each namespace keeps its own content and "
                            "offset for a hash (WIRE.md)")
    group.add_argument("--max-query-tokens", type=_positive_int,
                       default=DEFAULT_MAX_QUERY_TOKENS,
                       help="longest blend-lookup query in tokens; longer ones are answered "
                            "413 (default: %(default)s)")
    group.add_argument("--match-workers", type=_positive_int, default=1,
                       help="worker threads that run blend matching off the event loop; "
                            "the index serialises matches, so more than one only helps "
                            "when large queries are parsed while others match "
                            "(default: %(default)s)")


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits on clients")
    group.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body accepted; larger ones are answered 413 "
                            "(default: %(default)s = 64 MiB)")
    group.add_argument("--max-ingest-bytes", type=_positive_int,
                       default=DEFAULT_MAX_INGEST_BYTES,
                       help="/events request bytes in flight (being read or waiting to be "
                            "applied), all clients together; beyond it a body is answered "
                            "503 with Retry-After, without being read. Bodies up to 1 MiB "
                            "have a reserve of their own (default: %(default)s = 128 MiB)")
    group.add_argument("--idle-timeout", type=_positive_seconds,
                       default=DEFAULT_IDLE_TIMEOUT_S,
                       help="close a connection that sends no complete request head within "
                            "this many seconds of opening or of its last response "
                            "(default: %(default)s)")
    group.add_argument("--body-timeout", type=_positive_seconds,
                       default=DEFAULT_BODY_TIMEOUT_S,
                       help="answer 408 to a request whose body has not fully arrived this "
                            "many seconds after its head (default: %(default)s)")
    group.add_argument("--max-connections", type=_positive_int,
                       default=DEFAULT_MAX_CONNECTIONS,
                       help="open connections at most; a new one beyond it closes the "
                            "longest-idle connection, or is refused when every connection "
                            "has a request in progress. Also kept below the process's "
                            "descriptor limit (default: %(default)s)")
    group.add_argument("--max-instances-per-scope", type=int,
                       default=DEFAULT_MAX_INSTANCES_PER_SCOPE,
                       help="instance ids (registered or sending events) one scoped token "
                            "may have in the coordinator at once; past it a new id is "
                            "answered 429 until some leave. Unscoped tokens are not "
                            "counted; 0: no cap (default: %(default)s)")


def _instance_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("instances, scoring and logs")
    group.add_argument("--instance-timeout", type=_positive_seconds,
                       default=DEFAULT_INSTANCE_TIMEOUT,
                       help="seconds without a heartbeat after which a registered instance "
                            "is deregistered and its L1 placements fenced "
                            "(default: %(default)s)")
    group.add_argument("--health-check-interval", type=_seconds_or_zero,
                       default=DEFAULT_HEALTH_CHECK_INTERVAL,
                       help="seconds between checks for silent instances; 0 turns the "
                            "check off (default: %(default)s)")
    group.add_argument("--score-shared-weight", type=float,
                       default=DEFAULT_SCORE_SHARED_WEIGHT,
                       help="POST /directory/blend-score: weight of a reused token read from "
                            "a shared tier, where one in the instance's own L1 weighs 1 "
                            "and one recomputed 0 (default: %(default)s)")
    group.add_argument("--score-peer-weight", type=float, default=DEFAULT_SCORE_PEER_WEIGHT,
                       help="POST /directory/blend-score: weight of a reused token only "
                            "another instance holds (default: %(default)s)")
    group.add_argument("--disable-metrics", action="store_true",
                       help="do not serve Prometheus metrics: GET /metrics answers 404")
    group.add_argument("--log-level", default="INFO",
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="logging level on stderr (default: %(default)s)")


def _event_log_flags(parser: argparse.ArgumentParser) -> tuple[argparse.Action, ...]:
    """The replicas' group; returns the flags that mean something only with --event-log
    (parse_args refuses them alone)."""
    cluster = parser.add_argument_group(
        "replicas over an event log",
        "Several coordinator processes share one NATS JetStream stream: /events taken by "
        "any of them is appended to it, and each applies the stream in order, so all "
        "answer alike. Without --event-log, one process holds everything in memory.")
    cluster.add_argument("--event-log", metavar="nats://HOST:PORT[,...]", default="",
                         help="NATS servers of the JetStream event log, comma-separated")
    event_log_only: list[argparse.Action] = []

    def only(*names: str, **options) -> None:
        event_log_only.append(cluster.add_argument(*names, **options))

    only("--event-log-stream", default="blend-events",
         help="stream name, created if missing (default: %(default)s)")
    only("--event-log-replicas", type=_positive_int, default=1,
         help="copies of the stream when this replica creates it; 3 on a "
              "3-node NATS cluster survives a node (default: %(default)s)")
    only("--event-log-connect-timeout", type=_positive_seconds, default=30.0,
         help="seconds start-up waits for the NATS servers (logged every 5 s) "
              "before it gives up with exit code 1; SIGINT/SIGTERM stop the "
              "wait at once (default: %(default)s)")
    only("--event-log-max-bytes", type=int, default=1 << 30,
         help="retention: the stream keeps at most this many bytes, oldest "
              "records dropped first; 0 = no limit (default: %(default)s)")
    only("--event-log-max-msgs", type=int, default=0,
         help="retention by record count; 0 = no limit (default: %(default)s)")
    only("--event-log-max-age", type=float, default=0.0,
         help="retention by age in seconds; 0 = no limit (default: "
              "%(default)s)")
    only("--snapshot-dir", default="",
         help="directory for this replica's snapshots (may be shared by the "
              "replicas); the newest is loaded on start. Without it (or "
              "--snapshot-store) a restart replays the whole stream")
    only("--snapshot-store", choices=["nats"], default=None,
         help="also keep snapshots in a JetStream object store on the event "
              "log's NATS servers (bucket '<stream>-snapshots', as many "
              "copies as the stream), shared by every replica: a fresh "
              "replica, or one on another machine, starts from a peer's "
              "snapshot. With --snapshot-dir too, snapshots go to both and "
              "the newest of either is loaded")
    only("--snapshot-keep", type=_positive_int, default=3,
         help="newest snapshots kept in the directory and in the bucket "
              "(default: %(default)s)")
    only("--snapshot-interval", type=_positive_seconds, default=60.0,
         help="seconds between snapshots; also one on shutdown. Keep it well "
              "under the stream's retention (default: %(default)s)")
    only("--replica-name", default="",
         help="names this replica in logs and snapshot files (default: host "
              "name and port)")
    return tuple(event_log_only)


def _cluster_config(args: argparse.Namespace) -> ClusterConfig | None:
    if not args.event_log:
        return None
    return ClusterConfig(
        servers=tuple(url.strip() for url in args.event_log.split(",") if url.strip()),
        stream=args.event_log_stream, replicas=args.event_log_replicas,
        max_bytes=args.event_log_max_bytes, max_msgs=args.event_log_max_msgs,
        max_age_s=args.event_log_max_age, snapshot_dir=args.snapshot_dir,
        snapshot_bucket=f"{args.event_log_stream}-snapshots" if args.snapshot_store else "",
        snapshot_keep=args.snapshot_keep, snapshot_interval_s=args.snapshot_interval,
        replica_name=args.replica_name, connect_timeout_s=args.event_log_connect_timeout)


def _needs_event_log(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag of the event-log group means something only with --event-log: given
    without it, refuse (it would be accepted and do nothing)."""
    if args.event_log:
        return
    given = [action.option_strings[0] for action in args._event_log_only
             if getattr(args, action.dest) != action.default]
    if given:
        parser.error(f"{', '.join(given)}: given without --event-log, where they would do "
                     f"nothing (one coordinator keeps everything in memory and takes no "
                     f"snapshots); add --event-log nats://HOST:PORT or drop them")


def parse_args(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> CoordinatorConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    _needs_event_log(parser, args)
    try:
        access_tokens = tokens_from(args.auth_token_file, environ)
        return CoordinatorConfig(
            host=args.host, port=args.port, enable_blend_lookup=args.enable_blend_lookup,
            chunk_size=args.chunk_size, blend_probe_stride=args.blend_probe_stride,
            trust_shared_hashes=args.trust_shared_hashes,
            max_body_bytes=args.max_body_bytes, max_query_tokens=args.max_query_tokens,
            max_ingest_bytes=args.max_ingest_bytes,
            match_workers=args.match_workers, idle_timeout_s=args.idle_timeout,
            body_timeout_s=args.body_timeout, max_connections=args.max_connections,
            max_instances_per_scope=args.max_instances_per_scope,
            access_tokens=access_tokens, tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            instance_timeout=args.instance_timeout,
            health_check_interval=args.health_check_interval,
            score_shared_weight=args.score_shared_weight,
            score_peer_weight=args.score_peer_weight,
            enable_metrics=not args.disable_metrics, log_level=args.log_level,
            cluster=_cluster_config(args))
    except ValueError as exc:
        build_parser().error(str(exc))
        raise  # unreachable: error() exits
