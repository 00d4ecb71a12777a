"""Latency to the configured targets, measured without ICMP: TCP connection set-up time.

A probe opens a TCP connection to ``host:port`` (default port 6818, ``slurmd``, which every SLURM compute node
listens on) and measures the time until the target's kernel answers, with SYN-ACK (port open) or RST (port
closed): both take one network round trip, so both count as an answer. A probe that times out or whose host is
unreachable counts as lost. ICMP would need raw sockets (root or CAP_NET_RAW); TCP needs nothing. The reported
latency is the median of the answered probes, in microseconds.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time

from virtengine_hpc.node.heartbeat import LatencySample

DEFAULT_PORT = 6818


def split_target(target: str) -> tuple[str, int]:
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else DEFAULT_PORT
    host, sep, port = target.rpartition(":")
    if sep and port.isdigit():
        return host, int(port)
    return target, DEFAULT_PORT


async def _connect_once(family: int, address: tuple[object, ...], timeout: float) -> float | None:
    loop = asyncio.get_running_loop()
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    started = time.perf_counter()
    try:
        await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
    except ConnectionRefusedError:
        pass  # an RST is an answer: one round trip
    except (TimeoutError, OSError):
        return None
    finally:
        sock.close()
    return time.perf_counter() - started


async def probe(target: str, *, probes: int = 3, timeout: float = 1.0) -> LatencySample:
    """Measure one target; never raises (an unresolvable name is reported in ``error``)."""
    host, port = split_target(target)
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout=max(timeout, 2.0)
        )
    except (OSError, TimeoutError, UnicodeError) as exc:
        return LatencySample(target=target, probes=0, lost=0, error=f"cannot resolve {host}: {exc}"[:200])
    family, _, _, _, address = infos[0]
    answered = []
    for _ in range(probes):
        elapsed = await _connect_once(family, address, timeout)
        if elapsed is not None:
            answered.append(elapsed)
    lost = probes - len(answered)
    return LatencySample(
        target=target,
        latency_us=round(statistics.median(answered) * 1_000_000) if answered else None,
        probes=probes,
        lost=lost,
        error=None if answered else "no answer (timeout or unreachable)",
    )


async def probe_all(targets: list[str], *, probes: int = 3, timeout: float = 1.0) -> list[LatencySample]:
    return list(await asyncio.gather(*(probe(t, probes=probes, timeout=timeout) for t in targets)))
