"""Device utilisation and memory readings: NVML on GPUs, psutil for the process otherwise.

Every reading degrades to None when its source is missing (no GPU, no NVML), never a crash.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch


def _nvml_handle(device_index: int = 0):
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except Exception:  # no driver, no GPU, no library: readings become None
        return None


def cpu_model() -> str:
    """The CPU's model name (e.g. "Intel(R) Xeon(R) Processor"), for reports and cache keys."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device | str | None = None) -> str:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def fragmentation(reserved: int | None, allocated: int | None) -> float | None:
    """(reserved - allocated) / reserved: allocator memory held but not in use."""
    if not reserved or allocated is None:
        return None
    return (reserved - allocated) / reserved


def reset_cuda_peaks(device: torch.device | str | None) -> None:
    """Start the allocator's peak readings afresh (no-op off CUDA)."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def cuda_memory(device: torch.device | str) -> dict | None:
    """Current and peak allocated/reserved bytes and fragmentation; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    alloc, res = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    peak_alloc, peak_res = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return {
        "allocated_bytes": alloc,
        "reserved_bytes": res,
        "peak_allocated_bytes": peak_alloc,
        "peak_reserved_bytes": peak_res,
        "fragmentation": fragmentation(res, alloc),
        "peak_fragmentation": fragmentation(peak_res, peak_alloc),
    }


class UtilizationProbe:
    """Instantaneous utilisation in [0, 1]: GPU busy fraction from NVML when the engine runs on
    CUDA, else this process's CPU time over wall time since the previous reading, per core
    that torch uses."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._nvml = _nvml_handle(self.device.index or 0) if self.device.type == "cuda" else None
        self._proc = psutil.Process()
        self._last = (time.perf_counter(), self._cpu_time())

    def _cpu_time(self) -> float:
        t = self._proc.cpu_times()
        return t.user + t.system

    def read(self) -> float | None:
        if self._nvml is not None:
            import pynvml

            try:
                return pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu / 100.0
            except Exception:
                return None
        now, cpu = time.perf_counter(), self._cpu_time()
        (t0, c0), self._last = self._last, (now, cpu)
        if now - t0 <= 1e-3:
            return None
        threads = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
        return max(0.0, min(1.0, (cpu - c0) / (now - t0) / threads))


@dataclass
class UtilizationReport:
    device: str
    gpu_util_mean: float | None
    gpu_mem_peak_bytes: int | None
    cpu_util_mean: float | None
    rss_peak_bytes: int
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, rss bytes)

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "gpu_util_mean": self.gpu_util_mean,
            "gpu_mem_peak_bytes": self.gpu_mem_peak_bytes,
            "cpu_util_mean": self.cpu_util_mean,
            "rss_peak_bytes": self.rss_peak_bytes,
        }


class UtilizationSampler:
    """Samples GPU utilisation/memory (NVML), process CPU use and RSS in a background thread.

    with UtilizationSampler(interval_s=0.5) as s: ...   then s.report
    """

    def __init__(self, interval_s: float = 0.5, device: torch.device | str | None = None) -> None:
        self.interval_s = interval_s
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = psutil.Process()
        self._gpu_utils: list[float] = []
        self._gpu_mem_peak: int | None = None
        self._rss: list[tuple[float, int]] = []
        self.report: UtilizationReport | None = None

    def _sample(self, handle, t0: float) -> None:
        rss = self._proc.memory_info().rss
        self._rss.append((time.perf_counter() - t0, rss))
        if handle is not None:
            import pynvml

            try:
                self._gpu_utils.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
                used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
                self._gpu_mem_peak = max(self._gpu_mem_peak or 0, int(used))
            except Exception:
                pass

    def _run(self) -> None:
        handle = _nvml_handle(self.device.index or 0) if self.device.type == "cuda" else None
        t0 = self._t0
        while not self._stop.is_set():
            self._sample(handle, t0)
            self._stop.wait(self.interval_s)
        self._sample(handle, t0)

    def start(self) -> "UtilizationSampler":
        self._t0 = time.perf_counter()
        cpu = self._proc.cpu_times()
        self._cpu0 = cpu.user + cpu.system
        self._thread = threading.Thread(target=self._run, name="dspark-util", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> UtilizationReport:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        wall = max(1e-9, time.perf_counter() - self._t0)
        cpu = self._proc.cpu_times()
        cores = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
        cpu_util = (cpu.user + cpu.system - self._cpu0) / wall / cores
        gpu_peak = self._gpu_mem_peak
        if self.device.type == "cuda" and torch.cuda.is_available():
            gpu_peak = max(gpu_peak or 0, torch.cuda.max_memory_reserved(self.device))
        self.report = UtilizationReport(
            device=device_name(self.device),
            gpu_util_mean=(sum(self._gpu_utils) / len(self._gpu_utils)) if self._gpu_utils else None,
            gpu_mem_peak_bytes=gpu_peak,
            cpu_util_mean=cpu_util,
            rss_peak_bytes=max((r for _, r in self._rss), default=self._proc.memory_info().rss),
            samples=list(self._rss),
        )
        return self.report

    def __enter__(self) -> "UtilizationSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
