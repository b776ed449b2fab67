"""The 2-norm of a gradient shard on the CPU, on every core.

[Note: host gradient norm]
torch's CPU `vector_norm` of one contiguous tensor down to a scalar runs on one thread:
its reduction over the last dimension is parallel over output elements only, and there
is one. Clipping an offloaded 7B model spent seconds a step in it. Here a shard is cut into
rows of `NORM_ROW` elements (the last row: the rest), the rows' norms are reduced in one
call, one output per row and so in parallel, and the shard's norm is the norm of the rows'.
The bits depend on the elements and `NORM_ROW` only, never on the thread count: each row
goes through the same sequential kernel. The CPU shards of the step without offload use
it too, so clipping with offload and without gives the same norm bit for bit.
"""

from __future__ import annotations

import torch

# Elements per row: enough rows for every core (16 per 1M elements), each row long enough
# that its per-row overhead is small beside its 256 KiB of fp32.
NORM_ROW = 1 << 16


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """The 2-norms of the rows of a contiguous fp32 CPU tensor (the last row: the rest). A
    shard's rows are the rows of its pieces where every piece but the last is whole rows."""
    x = x.view(-1)
    full = x.numel() // NORM_ROW * NORM_ROW
    rows = [torch.linalg.vector_norm(x[:full].view(-1, NORM_ROW), dim=1)]
    if full < x.numel():
        rows.append(torch.linalg.vector_norm(x[full:]).reshape(1))
    return torch.cat(rows)


def norm_of_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """A shard's 2-norm from its rows' norms, in order."""
    norm: torch.Tensor = torch.linalg.vector_norm(torch.cat(rows))
    return norm


def shard_norm(x: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a contiguous fp32 CPU tensor, as the norm of its rows' norms."""
    return norm_of_rows([row_norms(x)])
