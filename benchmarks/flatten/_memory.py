"""Current and peak memory of a process: the CUDA allocator on a GPU, the RSS on the host."""

from __future__ import annotations

import ctypes
import math

import torch


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class Meter:
    """Current and peak memory of this process: CUDA allocator on a GPU, RSS on the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_ok = True

    def reset(self) -> None:
        """Start a new peak from the current level."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # Writing 5 resets the kernel's peak-RSS mark (VmHWM) to the current RSS; where
        # that is not allowed, host peaks are reported as n/a rather than guessed.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.host_ok = False

    def device_now(self) -> int:
        """Bytes in use on the device (the host RSS on a CPU device)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _status_bytes("VmRSS")

    def device_peak(self) -> float:
        """Peak bytes on the device since `reset()`."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.host_peak()

    @staticmethod
    def host_now() -> int:
        """Resident host memory now."""
        return _status_bytes("VmRSS")

    def host_peak(self) -> float:
        """Peak resident host memory since `reset()` (NaN where it cannot be reset)."""
        return _status_bytes("VmHWM") if self.host_ok else math.nan


def return_freed_host_memory() -> None:
    """Make glibc serve every allocation over 64 KiB from mmap, so a free returns it.

    Otherwise freed heap memory stays resident and the next method's RSS peak is hidden
    inside it: host peaks would be meaningless.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
