"""Readings of this host for heartbeats: CPU, memory, storage, GPUs, health (psutil and ``nvidia-smi``).

* CPUs available = logical CPUs x (1 - utilisation over the time since the previous reading), rounded.
* Memory: ``MemAvailable``; storage: the filesystem holding ``storage-path``.
* GPUs come from ``nvidia-smi`` when it is on ``PATH`` (none otherwise): a GPU is available when no compute
  process runs on it; GPU utilisation is the mean over the GPUs.
* Health: ``unhealthy`` when memory or disk is nearly exhausted (< 2 % free) or a watched daemon that the node
  runs (``slurmd``, ``munged``) died; ``degraded`` when load exceeds 2x the CPUs, or memory/disk < 10 % free.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from virtengine_hpc.node.heartbeat import NodeCapacity, NodeHealth, two_places

log = logging.getLogger(__name__)
WATCHED_SERVICES = ("slurmd", "munged")
_GPU_QUERY = "--query-gpu=uuid,name,memory.total,memory.used,utilization.gpu"


@dataclass(frozen=True)
class GPU:
    uuid: str
    name: str
    memory_mb: int
    utilization: float


def parse_gpu_csv(text: str) -> list[GPU]:
    """Parse ``nvidia-smi --query-gpu=uuid,name,memory.total,memory.used,utilization.gpu``

    output with ``--format=csv,noheader,nounits``.
    """
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5 or not parts[0]:
            continue
        try:
            utilization = float(parts[4])
        except ValueError:  # "[N/A]" on some boards
            utilization = 0.0
        try:
            memory = int(float(parts[2]))
        except ValueError:
            memory = 0
        gpus.append(GPU(uuid=parts[0], name=parts[1], memory_mb=memory, utilization=utilization))
    return gpus


def parse_busy_gpus(text: str) -> set[str]:
    """Parse ``nvidia-smi --query-compute-apps=gpu_uuid --format=csv,noheader``: GPUs with a process."""
    return {line.strip() for line in text.splitlines() if line.strip()}


class MetricsCollector:
    """Collects capacity and health; keep one instance so CPU utilisation covers the time between calls."""

    def __init__(
        self,
        storage_path: Path = Path("/"),
        *,
        nvidia_smi: str | None = None,
        services: tuple[str, ...] = WATCHED_SERVICES,
    ) -> None:
        self.storage_path = storage_path
        self.nvidia_smi = nvidia_smi if nvidia_smi is not None else shutil.which("nvidia-smi")
        self.services = services
        self._seen_services: set[str] = set()
        psutil.cpu_percent(interval=None)  # the first reading is meaningless; start the interval now

    def _run_smi(self, *args: str) -> str | None:
        if not self.nvidia_smi:
            return None
        try:
            done = subprocess.run(
                [self.nvidia_smi, *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("nvidia-smi failed: %s", exc)
            return None
        if done.returncode != 0:
            log.warning("nvidia-smi exited %s: %s", done.returncode, done.stderr.strip()[:200])
            return None
        return done.stdout

    def gpus(self) -> tuple[list[GPU], set[str]]:
        listing = self._run_smi(_GPU_QUERY, "--format=csv,noheader,nounits")
        if listing is None:
            return [], set()
        busy = self._run_smi("--query-compute-apps=gpu_uuid", "--format=csv,noheader") or ""
        return parse_gpu_csv(listing), parse_busy_gpus(busy)

    def _services(self) -> dict[str, bool]:
        running = set()
        for proc in psutil.process_iter(["name"]):
            name = proc.info.get("name") or ""
            if name in self.services:
                running.add(name)
        return {name: name in running for name in self.services}

    def collect(self) -> tuple[NodeCapacity, NodeHealth]:
        cpus = psutil.cpu_count(logical=True) or os.cpu_count() or 1
        cpu_percent = psutil.cpu_percent(interval=None)
        memory = psutil.virtual_memory()
        disk = psutil.disk_usage(str(self.storage_path))
        gpus, busy = self.gpus()
        load1, load5, load15 = os.getloadavg()
        services = self._services()
        self._seen_services |= {name for name, up in services.items() if up}

        mem_free = memory.available / memory.total * 100
        disk_free = disk.free / disk.total * 100 if disk.total else 100.0
        problems = []
        if mem_free < 2:
            problems.append(f"memory nearly exhausted ({mem_free:.1f} % free)")
        if disk_free < 2:
            problems.append(f"disk {self.storage_path} nearly full ({disk_free:.1f} % free)")
        problems += [f"{name} stopped" for name in sorted(self._seen_services) if not services.get(name)]
        status = "unhealthy" if problems else "healthy"
        if status == "healthy":
            if load1 > 2 * cpus:
                problems.append(f"load {load1:.2f} exceeds twice the {cpus} CPUs")
            if mem_free < 10:
                problems.append(f"memory low ({mem_free:.1f} % free)")
            if disk_free < 10:
                problems.append(f"disk {self.storage_path} low ({disk_free:.1f} % free)")
            status = "degraded" if problems else "healthy"

        capacity = NodeCapacity(
            cpu_cores_total=cpus,
            cpu_cores_available=max(0, min(cpus, round(cpus * (1 - cpu_percent / 100)))),
            memory_mb_total=memory.total // (1024 * 1024),
            memory_mb_available=memory.available // (1024 * 1024),
            gpus_total=len(gpus),
            gpus_available=sum(1 for gpu in gpus if gpu.uuid not in busy),
            gpu_type=gpus[0].name if gpus else None,
            storage_gb_total=disk.total // 10**9,
            storage_gb_available=disk.free // 10**9,
        )
        health = NodeHealth(
            status=status,
            uptime_seconds=max(0, int(time.time() - psutil.boot_time())),
            load_1m=two_places(load1),
            load_5m=two_places(load5),
            load_15m=two_places(load15),
            cpu_utilization_percent=two_places(cpu_percent),
            memory_utilization_percent=two_places(memory.percent),
            disk_utilization_percent=two_places(disk.percent),
            gpu_utilization_percent=two_places(sum(g.utilization for g in gpus) / len(gpus))
            if gpus
            else None,
            services=services,
            problems=problems[:16],
        )
        return capacity, health
