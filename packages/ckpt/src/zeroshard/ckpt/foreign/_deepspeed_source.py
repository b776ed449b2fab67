"""Reading flat pieces of tensors that live inside DeepSpeed's torch zip files.

`torch.load(mmap=True)` maps each file and hands back tensors that are views of the map;
their data is not read until touched. Copying out of the map would work, but every page
touched stays in the process's resident set until the map is dropped, so consolidating a
16 GB checkpoint that way peaks at 16 GB of RSS. Instead we find where each tensor's bytes
sit in the file (the kernel's `/proc/self/maps` says which file offset a mapped address
comes from) and `os.preadv` them straight into the output buffer: one copy, through the
page cache, never counted as ours. Where that cannot be done (no /proc, no preadv, an
output buffer that is not a contiguous CPU tensor of the same dtype) we copy from the map.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch

from zeroshard.ckpt._stfile import pread_into
from zeroshard.ckpt.foreign._unpickle import CorruptFileError


class OpenFile:
    """A read-only descriptor on one checkpoint file, closed when no source needs it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self._maps = _file_mappings(self.fd)
        weakref.finalize(self, os.close, self.fd)

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """The file offset of `tensor`'s first byte if it is a view of this file's memory map."""
        if tensor.numel() == 0:
            return None
        ptr = tensor.data_ptr()
        for start, end, file_offset in self._maps:
            if start <= ptr < end:
                offset = ptr - start + file_offset
                nbytes = tensor.numel() * tensor.element_size()
                return offset if offset + nbytes <= self.size else None
        return None


def _file_mappings(fd: int) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of every mapping of the file behind `fd` in this process."""
    if not hasattr(os, "preadv"):
        return []
    st = os.fstat(fd)
    maps: list[tuple[int, int, int]] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                # Match the inode only: on overlay file systems the device in the maps
                # differs from stat's. A tensor's address lies in exactly one mapping, and
                # the first bytes are compared below, so a stray match cannot slip through.
                if int(parts[4]) != st.st_ino:
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                maps.append((start, end, int(parts[2], 16)))
    except OSError:
        return []
    return maps


class FlatSource:
    """A 1-D tensor stored in a checkpoint file, read piecewise into output buffers."""

    def __init__(self, tensor: torch.Tensor, file: OpenFile | None, label: str) -> None:
        if tensor.dim() != 1:
            tensor = tensor.reshape(-1)
        self.tensor = tensor
        self.dtype = tensor.dtype
        self.numel = tensor.numel()
        self.label = label
        self._file = file
        self._offset: int | None = None
        if file is not None and tensor.is_contiguous():
            offset = file.offset_of(tensor)
            if offset is not None and _same_prefix(file, tensor, offset):
                self._offset = offset

    @property
    def uses_pread(self) -> bool:
        """Whether reads go through `os.preadv` rather than the memory map."""
        return self._offset is not None

    def read_into(self, out: torch.Tensor, dst: int, src: int, count: int) -> None:
        """Copy elements [src, src + count) of this source into out[dst : dst + count]."""
        if count <= 0:
            return
        if src < 0 or src + count > self.numel:
            raise CorruptFileError(
                f"{self.label}: elements [{src}, {src + count}) are outside its {self.numel}"
            )
        target = out[dst : dst + count]
        if (
            self._offset is not None
            and self._file is not None
            and target.device.type == "cpu"
            and target.dtype == self.dtype
            and target.is_contiguous()
        ):
            start = self._offset + src * self.tensor.element_size()
            pread_into(self._file.fd, target, start, self._file.path, CorruptFileError)
        else:
            target.copy_(self.tensor[src : src + count])


def _same_prefix(file: OpenFile, tensor: torch.Tensor, offset: int) -> bool:
    """Check the mapped offset by comparing the first bytes both ways (touches one page)."""
    n = min(64, tensor.numel() * tensor.element_size())
    head = os.pread(file.fd, n, offset)
    mapped = tensor.view(-1).view(torch.uint8)[:n] if tensor.element_size() else tensor
    return bytes(mapped.tolist()) == head
