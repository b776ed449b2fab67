"""Waiting for a device and emptying it between the runs of one process."""

from __future__ import annotations

import gc

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Drop every reference cycle (engines and hooks form them), then empty the CUDA cache,
    so the next run starts from the same empty device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
