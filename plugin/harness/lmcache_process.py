"""Real LMCache MP servers loading the plugin, and an engine-side client, for tests,
the LMCache demo and benchmarks (not loaded by `import plugin`; needs LMCache and torch).

Which LMCache: by default the one this process imports (the venv's 0.5.6, or 0.5.7rc2
when this process runs with `LMCACHE_057_DIR` first on its path, as tests/e2e/test_lmcache057.py
runs the LMCache tests), or the one `lmcache_dir` names (`lmcache_dir_for(version)`). The
engine client speaks this process's LMCache, so a server of the other version needs a
process of its own (`lmcache_env(version)`).

- `start_lmcache_server(...)` starts `lmcache server` (HTTP front end: coordinator
  registration, heartbeats, LMCache's own cache-event reporting) or the ZMQ-only
  `python -m lmcache.v1.multiprocess.server`, blend engine, CPU device, on free loopback
  ports, with `--server-module` loading `plugin.lmcache_adapter` (unless `plugin_module` is
  False: a stock server, which may also run `engine_type="default"`). It waits until the
  server answers an RPC, or fails with the log tail. Usage telemetry is off and its URL
  points at a dead loopback port (`quiet_lmcache_env`; use it for `lmcache_command`, the
  argv of LMCache's CLI, too).
- `ServerFleet` keeps named servers, each with its engine client, and stops them all;
  `start_many` starts several side by side (each spends seconds importing torch and
  LMCache), then connects their clients in the order given.
- `EngineClient` is what a serving engine does, over LMCache's own client API: register a
  small CPU KV cache in shared memory, store token ranges, run `cb_unified_lookup` (ours, or
  LMCache's built-in through the adapter's server-module method), retrieve, end sessions.
  Every KV byte it stores is random and kept, so a retrieve can be checked byte for byte.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

ADAPTER_MODULE = "plugin.lmcache_adapter"
ROOT = Path(__file__).resolve().parents[2]
#: `make test` installs LMCache 0.5.7rc2 here (`pip install --no-deps --target`), beside
#: the venv's 0.5.6.
LMCACHE_057_DIR = ROOT / ".lmcache-0.5.7"
LMCACHE_057 = "0.5.7rc2"
READY_TIMEOUT_S = 90.0  # a cold numba cache costs ~15 s per server on a shared 2-core box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dead_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}/"  # nothing listens there


def lmcache_command(*args: str) -> list[str]:
    """The argv of LMCache's CLI (`lmcache ARGS`): its console script beside this interpreter,
    or the module when the script is not installed."""
    script = Path(sys.executable).with_name("lmcache")
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-m", "lmcache.cli.main", *args]


def lmcache_dir_for(version: str) -> str | None:
    """Where LMCache `version` is importable from: None for the venv's (0.5.6), the target
    directory for 0.5.7rc2 (an error saying how to install it when it is not there)."""
    if version == "0.5.6":
        return None
    if version != LMCACHE_057:
        raise ValueError(f"no LMCache {version} here: use 0.5.6 or {LMCACHE_057}")
    if not (LMCACHE_057_DIR / "lmcache" / "__init__.py").exists():
        raise FileNotFoundError(
            f"LMCache {LMCACHE_057} is not installed in {LMCACHE_057_DIR}; run `make "
            f"lmcache-057` (make test does it), or with an existing venv `python -m pip "
            f"install --no-deps --target {LMCACHE_057_DIR} lmcache=={LMCACHE_057}`")
    return str(LMCACHE_057_DIR)


def lmcache_env(version: str, extra: dict | None = None) -> dict:
    """The environment of a Python process importing LMCache `version` and this checkout."""
    path = _python_path(lmcache_dir_for(version), str(ROOT), inherit_lmcache=False)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def _python_path(lmcache_dir: str | None, root: str, *, inherit_lmcache: bool) -> str:
    """`lmcache_dir` (if any), this checkout, then the inherited path, which keeps an
    LMCache directory only with `inherit_lmcache` (a server running this process's LMCache)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not inherit_lmcache:
        inherited = [p for p in inherited if Path(p).resolve() != LMCACHE_057_DIR.resolve()]
    first = [lmcache_dir] if lmcache_dir else []
    return os.pathsep.join(first + [root] + [p for p in inherited if p != root])


def running_lmcache_version() -> str:
    """Which supported LMCache this process imports (found, not imported: cheap)."""
    spec = importlib.util.find_spec("lmcache")
    origin = Path(spec.origin).resolve() if spec and spec.origin else None
    inside = origin is not None and LMCACHE_057_DIR.resolve() in origin.parents
    return LMCACHE_057 if inside else "0.5.6"


def run_under(version: str | None) -> None:
    """Re-run this program (same argv) in a process importing LMCache `version`, unless it
    already does: what a demo or benchmark does for `--lmcache VERSION` (the engine client
    speaks its own process's LMCache)."""
    if version is None or version == running_lmcache_version():
        return
    env = lmcache_env(version)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def quiet_lmcache_env(extra: dict | None = None) -> dict:
    """The environment for an LMCache process that never phones home."""
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
           "LMCACHE_USAGE_TRACK_URL": _dead_port_url(), "LMCACHE_DISABLE_BANNER": "1",
           "PYTHONUNBUFFERED": "1"}
    env.update(extra or {})
    return env


@dataclass
class LMCacheServer:
    """One running LMCache MP server process."""

    name: str
    rpc_port: int
    http_port: int | None
    process: subprocess.Popen
    log_path: Path
    command: list[str]
    instance_id: str
    _terminating: bool = field(default=False, repr=False)
    #: A log directory made for this server alone (no `log_dir` given): removed on stop.
    _own_log_dir: str | None = field(default=None, repr=False)

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.rpc_port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def terminate(self) -> None:
        """Ask for a graceful stop (SIGTERM), once: a second SIGTERM would cut LMCache's
        shutdown short (no deregistration). `stop` then waits for it."""
        if self.process.poll() is None and not self._terminating:
            self._terminating = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0, kill: bool = False) -> int:
        """SIGTERM (or SIGKILL with `kill`), then wait; SIGKILL if it lingers; then the log
        directory made for it alone is removed. Idempotent."""
        if self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._own_log_dir is not None:
            shutil.rmtree(self._own_log_dir, ignore_errors=True)
            self._own_log_dir = None
        return self.process.returncode


class _PortTaken(RuntimeError):
    """A port picked as free was taken before the server bound it (another process won)."""


def start_lmcache_server(name: str, *, attempts: int = 3, **options) -> LMCacheServer:
    """Start one blend-engine LMCache server on free loopback ports; return when it serves.

    LMCache cannot bind port 0, so ports are picked free and handed over; another process
    may take one in between, and then the start is retried on fresh ports.
    """
    for attempt in range(attempts):
        try:
            return _start_once(name, **options)
        except _PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start_once(name: str, *, front_end: bool = True, plugin_module: bool = True,
                engine_type: str = "blend",
                module_config: dict | None = None, coordinator_url: str | None = None,
                event_reporting: bool = True, l2_dir: str | None = None,
                instance_id: str | None = None, chunk_size: int = 256,
                l1_size_gb: float = 0.25, extra_flags: Sequence[str] = (),
                env: dict | None = None, log_dir: str | None = None,
                cwd: str | None = None, lmcache_dir: str | None = None) -> LMCacheServer:
    rpc_port = free_port()
    http_port = free_port() if front_end else None
    instance_id = instance_id or name
    if front_end and lmcache_dir:
        command = [sys.executable, "-m", "lmcache.cli.main", "server"]
    elif front_end:
        command = lmcache_command("server")
    else:
        command = [sys.executable, "-m", "lmcache.v1.multiprocess.server"]
    command += ["--host", "127.0.0.1", "--port", str(rpc_port), "--chunk-size", str(chunk_size),
                "--engine-type", engine_type, "--l1-size-gb", str(l1_size_gb),
                "--eviction-policy", "LRU", "--disable-metrics", "--instance-id", instance_id,
                "--max-workers", "2"]
    if front_end:
        command += ["--http-host", "127.0.0.1", "--http-port", str(http_port)]
    if coordinator_url:
        command += ["--coordinator-url", coordinator_url]
        if event_reporting:
            command += ["--coordinator-event-reporting",
                        "--coordinator-event-flush-interval", "0.05"]
    if l2_dir:
        command += ["--l2-adapter", json.dumps({"type": "fs", "base_path": l2_dir})]
    if plugin_module:
        command += ["--server-module", json.dumps({"module_path": ADAPTER_MODULE,
                                                   "config": module_config or {}})]
    command += list(extra_flags)
    own_log_dir = None if log_dir else tempfile.mkdtemp(prefix="lmcache-logs-")
    log_path = Path(log_dir or own_log_dir) / f"{name}-{rpc_port}.log"
    log = open(log_path, "w")
    root = cwd or str(ROOT)
    path = _python_path(lmcache_dir, root, inherit_lmcache=lmcache_dir is None)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                               env=quiet_lmcache_env({"PYTHONPATH": path, **(env or {})}),
                               )
    log.close()
    server = LMCacheServer(name, rpc_port, http_port, process, log_path, command, instance_id,
                           _own_log_dir=own_log_dir)
    try:
        _wait_ready(server)
    except BaseException:  # not ready, or interrupted (a signal, Ctrl-C): nothing outlives it
        server.stop(kill=True)
        raise
    return server


def _wait_ready(server: LMCacheServer) -> None:
    marker = "LMCache HTTP server initialized" if server.http_port else \
        "LMCache cache server is running..."
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"LMCache server {server.name} exited with code "
                               f"{server.process.returncode}:\n{server.log_tail()}")
        log = server.log_path.read_text(errors="replace")
        if marker in log:
            return
        if "Address already in use" in log:
            raise _PortTaken(f"LMCache server {server.name}: a port was taken before it bound")
        time.sleep(0.1)
    raise RuntimeError(f"LMCache server {server.name} not ready within {READY_TIMEOUT_S:.0f} s:\n"
                       f"{server.log_tail()}")


# --- the engine side ---------------------------------------------------------------------------

@dataclass
class _Stored:
    blocks: list[int]


@dataclass
class EngineClient:
    """One engine worker (TP 1) on one server: a CPU KV cache in shared memory and the RPCs a
    serving engine sends. Small KV shape (2 layers, 2 heads x 16) keeps transfers cheap."""

    rpc_url: str
    model: str = "fleet-model"
    num_blocks: int = 1024
    block_size: int = 16
    num_layers: int = 2
    instance_id: int = 1000
    rpc_timeout_s: float = 20.0
    # LMCache 0.5.7: negotiate the chunk size against this model alignment (the server rounds
    # its --chunk-size up to a multiple of it), as vLLM's connector does; None: ask for it.
    chunk_alignment: int | None = None
    _next_block: int = 0
    _stored: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        import torch
        import zmq
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import create_transfer_context
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self._torch = torch
        self._zmq = zmq.Context()
        self._zmq.setsockopt(zmq.LINGER, 0)
        self.rpc = RequestClientFactory.create(self.rpc_url, context=self._zmq)
        size = (self.rpc.get_chunk_size() if self.chunk_alignment is None
                else self.rpc.negotiate_chunk_size(self.chunk_alignment))
        self.chunk_size = int(size.result(timeout=self.rpc_timeout_s))
        self.blocks_in_chunk = self.chunk_size // self.block_size
        generator = torch.Generator().manual_seed(self.instance_id)
        self.kv = {f"layer.{i}": torch.randn((2, self.num_blocks, self.block_size, 2, 16),
                                             dtype=torch.float16, generator=generator)
                   for i in range(self.num_layers)}
        self.transfer = create_transfer_context(self.kv, mode="lmcache_driven",
                                                instance_id=self.instance_id, req_client=self.rpc)
        self.transfer.register(
            self.kv, self.model, 1, self.blocks_in_chunk, self.rpc_timeout_s,
            layout_hints={"kv_layout": "NHD"},
            engine_group_infos=[EngineGroupInfo(engine_group_id=0,
                                                layer_indices=tuple(range(self.num_layers)),
                                                tokens_per_block=self.block_size)],
            engine_type=EngineType.VLLM)
        # CacheBlend's retrieve needs rope state; a NoPE model sends no rope caches.
        self.rpc.cb_register_rope(self.instance_id, [], 16, True, [], [], [], ""
                                  ).result(timeout=self.rpc_timeout_s)

    def key(self, tokens: Sequence[int], request_id: str, *, start: int = 0,
            end: int | None = None, worker: int | None = 0, salt: str = "",
            model: str | None = None):
        from plugin.lmcache.rpc import make_key  # the key's token field moved in 0.5.7
        return make_key(model_name=model or self.model, world_size=1, worker_id=worker,
                        token_ids=[int(t) for t in tokens], start=start,
                        end=len(tokens) if end is None else end,
                        request_id=request_id, cache_salt=salt, num_kv_readers=1)

    def _blocks(self, count: int) -> list[int]:
        if self._next_block + count > self.num_blocks:
            self._next_block = 0  # wrap: old blocks are only kept for byte checks
        blocks = list(range(self._next_block, self._next_block + count))
        self._next_block += count
        return blocks

    def store(self, tokens: Sequence[int], request_id: str, *, salt: str = "",
              model: str | None = None) -> bool:
        """Store every full chunk of `tokens` (from position 0), as an engine after prefill."""
        full = len(tokens) // self.chunk_size * self.chunk_size
        blocks = self._blocks(full // self.block_size)
        for b in blocks:  # fresh KV content for these blocks
            for tensor in self.kv.values():
                tensor[:, b].normal_()
        key = self.key(tokens, request_id, end=full, salt=salt, model=model)
        event = self.transfer.create_recorded_event()
        future = self.transfer.submit_store(request_id, key, self.kv, [blocks], event,
                                            self.blocks_in_chunk)
        ok = bool(future.result(timeout=self.rpc_timeout_s))
        if ok:
            self._stored[request_id] = _Stored(blocks)
        return ok

    def chunk_kv(self, request_id: str, chunk: int):
        """The KV this client stored for chunk `chunk` of request `request_id` (layer 0)."""
        blocks = self._stored[request_id].blocks[chunk * self.blocks_in_chunk:
                                                 (chunk + 1) * self.blocks_in_chunk]
        return self.kv["layer.0"][:, blocks].clone()

    def lookup(self, tokens: Sequence[int], request_id: str, *, salt: str = "",
               model: str | None = None, builtin: bool = False, timeout: float = 30.0):
        """Poll `cb_unified_lookup` like a scheduler until it answers; (result, seconds, calls)."""
        key = self.key(tokens, request_id, worker=None, salt=salt, model=model)
        started, calls = time.perf_counter(), 0
        while True:
            calls += 1
            result = self.lookup_once(key, builtin=builtin)
            if result is not None:
                return result, time.perf_counter() - started, calls
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"lookup {request_id} did not complete in {timeout} s")
            time.sleep(0.0005)

    def lookup_once(self, key, *, builtin: bool = False):
        if not builtin:
            return self.rpc.cb_unified_lookup(key, 1).result(timeout=self.rpc_timeout_s)
        from plugin.lmcache.rpc import (BUILTIN_LOOKUP_METHOD, decode_lookup_result,
                                        encode_lookup_call)
        return decode_lookup_result(self.module_call(BUILTIN_LOOKUP_METHOD,
                                                     encode_lookup_call(key, 1)))

    def retrieve_blend(self, tokens: Sequence[int], request_id: str, segments) -> bool:
        """`cb_retrieve_pre_computed` for a completed lookup: (scatter ran) as the server says."""
        key = self.key(tokens, request_id, worker=0)
        blocks = self._blocks(-(-len(tokens) // self.block_size))
        from lmcache.v1.platform.base.event_ipc import get_event_ipc_backend
        device = self._torch.device("cpu")
        event = self.transfer.create_recorded_event()
        handle = get_event_ipc_backend(device).export_event(event, device)
        _, ran = self.rpc.cb_retrieve_pre_computed(key, list(segments), [blocks],
                                                   self.instance_id, handle
                                                   ).result(timeout=self.rpc_timeout_s)
        return bool(ran)

    def retrieve_prefix(self, tokens: Sequence[int], request_id: str, chunks: int):
        """LOOKUP + RETRIEVE of the first `chunks` chunks of `tokens` into fresh blocks; the
        retrieved layer-0 KV of each chunk (None if the server did not deliver them)."""
        end = chunks * self.chunk_size
        key = self.key(tokens, request_id, end=end, worker=None)
        self.rpc.lookup(key, 1).result(timeout=self.rpc_timeout_s)
        deadline = time.monotonic() + self.rpc_timeout_s
        while (hit := self.rpc.query_prefetch_status(request_id).result(
                timeout=self.rpc_timeout_s)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("prefix lookup did not complete")
            time.sleep(0.002)
        if hit < chunks:
            return None
        blocks = self._blocks(end // self.block_size)
        for tensor in self.kv.values():
            tensor[:, blocks].zero_()
        event = self.transfer.create_recorded_event()
        ok = self.transfer.submit_retrieve(request_id, self.key(tokens, request_id, end=end),
                                           self.kv, [blocks], event, self.blocks_in_chunk
                                           ).result(timeout=self.rpc_timeout_s)
        if not ok:
            return None
        return [self.kv["layer.0"][:, blocks[c * self.blocks_in_chunk:
                                              (c + 1) * self.blocks_in_chunk]].clone()
                for c in range(chunks)]

    def end_session(self, request_id: str) -> None:
        self.rpc.end_session(request_id).result(timeout=self.rpc_timeout_s)

    def clear_l1(self) -> None:
        """LMCache's CLEAR: drops every unlocked L1 object (L2 copies stay)."""
        self.rpc.clear(False).result(timeout=self.rpc_timeout_s)

    def module_call(self, method: str, payload: bytes = b"") -> bytes:
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest
        reply = self.rpc.server_module_call(ServerModuleCallRequest(method=method, payload=payload)
                                            ).result(timeout=self.rpc_timeout_s)
        if not reply.success:
            raise RuntimeError(f"server module method {method} failed: {reply.error}")
        return reply.payload

    def status(self) -> dict:
        from plugin.lmcache.rpc import STATUS_METHOD
        return json.loads(self.module_call(STATUS_METHOD))

    def close(self) -> None:
        """Close the transfer context and the RPC client, and free the KV cache: its POSIX
        shared-memory segments (`/dev/shm/lmcache_kv_<pid>_*`) are unlinked when the last
        tensor mapping them goes. Idempotent."""
        if self.transfer is None:
            return
        for closer in (self.transfer.close, self.rpc.close, self._zmq.term):
            try:
                closer()
            except Exception:
                pass
        self.kv.clear()
        self.transfer = None
        gc.collect()  # reference cycles inside LMCache's transfer context may hold a tensor


# --- servers with their clients ------------------------------------------------------------

class ServerFleet:
    """Named servers, each with one `EngineClient` (what tests, the demo and benchmarks run).

    `start(name, **options)` starts a server with the fleet's options (the call's win) and
    connects a client (`client_options` for all); `start_many({name: options})` starts
    several side by side, then connects their clients; `restart(name)` stops it gracefully and
    starts it again as before; `close()` closes every client, then stops every server (side
    by side, each gracefully). A fleet whose start fails part-way closes what it started (as
    a context manager, or by the caller's `close()`): no process outlives it.
    """

    def __init__(self, *, client_options: dict | None = None, **server_options) -> None:
        self.servers: dict[str, LMCacheServer] = {}
        self.clients: dict[str, EngineClient] = {}
        self._server_options = server_options
        self._client_options = client_options or {}
        self._started_with: dict[str, dict] = {}
        self._engine_ids: dict[str, int] = {}  # a client keeps its id (and KV seed) on restart

    def start(self, name: str, **options) -> EngineClient:
        options = {**self._server_options, **options}
        self._started_with[name] = options
        self.servers[name] = start_lmcache_server(name, **options)
        return self._connect(name)

    def start_many(self, servers: dict[str, dict]) -> list[EngineClient]:
        """`start` for several servers (name -> options), their processes side by side: each
        spends seconds importing torch and LMCache, mostly on one core, so two or three
        starting together are ready in little more than one's time. Clients connect once
        every server is ready, one by one in the given order (engine ids as with `start`).
        If one fails, those that started are kept, for `close()` to stop, and its error
        is raised; so too when this thread is interrupted (a signal, Ctrl-C): the starts
        under way are waited for and kept, as no process may outlive the fleet."""
        for name, options in servers.items():
            self._started_with[name] = {**self._server_options, **options}
        pool = ThreadPoolExecutor(max(1, len(servers)))
        starting = {name: pool.submit(start_lmcache_server, name, **self._started_with[name])
                    for name in servers}
        try:
            wait(starting.values())
        finally:
            pool.shutdown(wait=True)
            for name, future in starting.items():
                if future.exception() is None:
                    self.servers[name] = future.result()
        for future in starting.values():
            if future.exception() is not None:
                raise future.exception()
        return [self._connect(name) for name in servers]

    def _connect(self, name: str) -> EngineClient:
        engine_id = self._engine_ids.setdefault(name, 1000 + len(self._engine_ids))
        self.clients[name] = EngineClient(self.servers[name].rpc_url, instance_id=engine_id,
                                          **self._client_options)
        return self.clients[name]

    def restart(self, name: str, stop_timeout: float = 60.0) -> EngineClient:
        """SIGTERM (LMCache deregisters on the way out), then the same start again."""
        self.clients.pop(name).close()
        self.servers.pop(name).stop(timeout=stop_timeout)
        return self.start(name, **self._started_with[name])

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for server in self.servers.values():
            server.terminate()  # all shut down side by side
        for server in self.servers.values():
            server.stop()
        self.clients.clear()
        self.servers.clear()

    def __enter__(self) -> "ServerFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
