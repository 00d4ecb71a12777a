"""The worker's small HTTP endpoint: ``/healthz`` (liveness), ``/readyz`` (readiness) and ``/metrics``.

For systemd watchdogs, Kubernetes probes and Prometheus. It runs on the worker's own event loop (asyncio streams,
no web framework, no thread): if the loop is stuck, the probe times out, which is exactly what a liveness probe
must notice.

* ``/healthz`` answers 200 while the process works: every Temporal worker in it is running (or shutting down
  on purpose). A worker that crashed makes it 500, so the supervisor restarts the process.
* ``/readyz`` answers 200 when the process can do its job now: Temporal answers its health check, the chain
  answers, and it is not shutting down (SIGTERM turns it 503 at once, so a load balancer or an orchestrator
  stops counting on it while running activities hand over).
* ``/metrics`` is the Prometheus exposition (``workers/metrics.py``).

Bodies are small JSON documents saying which check failed; nothing secret is in them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from virtengine_hpc.errors import ConfigError

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[None]]
"""A readiness check: returns when fine, raises (any exception, whose text is shown) when not."""

MAX_REQUEST_BYTES = 8192


@dataclass
class Probes:
    """What the endpoint asks. ``live`` returns problems (empty: alive); ``checks`` are the readiness checks."""

    live: Callable[[], list[str]] = lambda: []
    checks: dict[str, Check] = field(default_factory=dict)
    metrics: Callable[[], Awaitable[bytes]] | None = None
    stopping: Callable[[], bool] = lambda: False
    check_timeout: float = 5.0
    cache_seconds: float = 1.0


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:9464`` for IPv6) into its parts."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"metrics.listen: {listen!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - an empty host means every interface


class HealthServer:
    def __init__(self, listen: str, probes: Probes) -> None:
        self.host, self.port = parse_listen(listen)
        self.probes = probes
        self._server: asyncio.Server | None = None
        self._ready_cache: tuple[float, int, dict[str, Any]] | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as exc:
            raise ConfigError(
                f"metrics.listen: cannot listen on {self.host}:{self.port}: {exc.strerror}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health and metrics on http://%s:%s (/healthz /readyz /metrics)", self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ---- the answers --------------------------------------------------------------------------------------------

    def liveness(self) -> tuple[int, dict[str, Any]]:
        problems = self.probes.live()
        if problems:
            return 500, {"status": "failing", "problems": problems}
        return 200, {"status": "ok"}

    async def readiness(self) -> tuple[int, dict[str, Any]]:
        if self.probes.stopping():
            return 503, {"status": "stopping"}
        cached = self._ready_cache
        if cached is not None and time.monotonic() - cached[0] < self.probes.cache_seconds:
            return cached[1], cached[2]
        results = await asyncio.gather(*(self._run(check) for check in self.probes.checks.values()))
        checks = dict(zip(self.probes.checks, results, strict=True))
        problems = self.probes.live()
        ok = all(r == "ok" for r in results) and not problems
        body: dict[str, Any] = {"status": "ready" if ok else "not ready", "checks": checks}
        if problems:
            body["problems"] = problems
        status = 200 if ok else 503
        self._ready_cache = (time.monotonic(), status, body)
        return status, body

    async def _run(self, check: Check) -> str:
        try:
            await asyncio.wait_for(check(), timeout=self.probes.check_timeout)
        except TimeoutError:
            return f"timed out after {self.probes.check_timeout:g} s"
        except Exception as exc:
            return (str(exc) or type(exc).__name__)[:300]
        return "ok"

    # ---- HTTP ---------------------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return
            if len(head) > MAX_REQUEST_BYTES:
                await _send(writer, 431, b"request too large\n", "text/plain")
                return
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) != 3:
                await _send(writer, 400, b"bad request\n", "text/plain")
                return
            method, target, _ = parts
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                await _send(writer, 405, b"only GET\n", "text/plain", head_only=False)
                return
            await self._route(writer, path, head_only=method == "HEAD")
        except ConnectionError:
            pass
        except Exception:
            log.exception("health endpoint failed")
            with contextlib.suppress(Exception):
                await _send(writer, 500, b"internal error\n", "text/plain")
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _route(self, writer: asyncio.StreamWriter, path: str, *, head_only: bool) -> None:
        if path in ("/healthz", "/livez"):
            status, body = self.liveness()
            await _send_json(writer, status, body, head_only=head_only)
        elif path == "/readyz":
            status, body = await self.readiness()
            await _send_json(writer, status, body, head_only=head_only)
        elif path == "/metrics" and self.probes.metrics is not None:
            text = await self.probes.metrics()
            await _send(writer, 200, text, "text/plain; version=0.0.4; charset=utf-8", head_only=head_only)
        else:
            await _send(
                writer, 404, b"not found: /healthz /readyz /metrics\n", "text/plain", head_only=head_only
            )


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 431: "Too Large"}
_REASONS |= {500: "Internal Server Error", 503: "Service Unavailable"}


async def _send_json(
    writer: asyncio.StreamWriter, status: int, body: dict[str, Any], *, head_only: bool
) -> None:
    await _send(writer, status, json.dumps(body).encode() + b"\n", "application/json", head_only=head_only)


async def _send(
    writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str, *, head_only: bool = False
) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head if head_only else head + body)
    await writer.drain()
