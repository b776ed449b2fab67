"""`Agreement`: small collectives that bring every rank to the same outcome.

A step that fails on one rank only (its file is damaged, its disk is full, its argument
differs) must not let the others carry on, nor leave them waiting in a collective the
failed rank will never join. Every rule of that kind is one of these calls, each a few
all-gathers of small int64 vectors over a `Group`, bounded by the group's timeout.
Without a process group (one process) the same calls are local.

[Note: one outcome]
`outcome` all-gathers each rank's error (an index into the caller's error classes and
the first bytes of its message), and every rank raises the same error, naming the
failing ranks and what the first of them saw, or every rank goes on. A `try: load /
except: start fresh` loop then cannot train with weights loaded on some ranks only.

[Note: the same value on every rank]
`check_same` compares, across ranks, a list of (field, value) strings that must match
(a config, a model's parameters, a call's arguments). One all-gather of two integers (a
hash of the list, its length) settles the common case; only when they differ do two
more find the first differing field and bring every rank's value of it, so each rank
raises the same `ValueError` naming the field and which ranks hold which value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from zeroshard.comm._group import Group

T = TypeVar("T")

MESSAGE_BYTES = 1024
_ABSENT = "(absent)"


def _hash(text: str) -> int:
    # 7 bytes: a non-negative int64.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _text_row(text: str) -> list[int]:
    data = text.encode()[:MESSAGE_BYTES]
    return [len(data), *data, *([0] * (MESSAGE_BYTES - len(data)))]


def _row_text(row: Sequence[int]) -> str:
    return bytes(row[1 : 1 + row[0]]).decode(errors="replace")


class Agreement:
    """Agreement collectives over `group` (None: the default process group if there is
    one, else this process alone)."""

    def __init__(self, group: Group | None) -> None:
        if group is None and dist.is_available() and dist.is_initialized():
            group = Group()
        self._group = group

    @property
    def rank(self) -> int:
        """This process's rank (0 without a process group)."""
        return 0 if self._group is None else self._group.rank

    @property
    def size(self) -> int:
        """The number of ranks (1 without a process group)."""
        return 1 if self._group is None else self._group.size

    def gather(self, values: Sequence[int], label: str) -> list[list[int]]:
        """Every rank's `values` (same length everywhere), in rank order; also a barrier."""
        if self._group is None:
            return [[int(v) for v in values]]
        g = self._group
        send = torch.tensor(list(values), dtype=torch.int64, device=g.device)
        recv = torch.empty(len(values) * g.size, dtype=torch.int64, device=g.device)
        g.all_gather_into(recv, send, label=label).wait()
        rows = recv.view(g.size, len(values)).tolist()
        return [[int(x) for x in row] for row in rows]

    def outcome(
        self,
        error: BaseException | None,
        label: str,
        kinds: Sequence[type[Exception]] = (RuntimeError,),
    ) -> None:
        """Raise on every rank the first failing rank's error, or return on every rank.

        The error raised is of the failing rank's class when it is one of `kinds`, else
        of `kinds[0]`, with the message "{label} failed on rank(s) [...]; rank r: ...".
        See [Note: one outcome]. The failing rank raises it chained to its own error.
        """
        code, text = 0, ""
        if error is not None:
            known = [k for k in kinds if type(error) is k]
            code = 1 + (list(kinds).index(known[0]) if known else 0)
            text = f"{type(error).__name__}: {error}"
        rows = self.gather([code, *_text_row(text)], f"{label}: outcome")
        bad = [r for r, got in enumerate(rows) if got[0]]
        if not bad:
            return
        first = rows[bad[0]]
        cls = kinds[first[0] - 1]
        raise cls(f"{label} failed on rank(s) {bad}; rank {bad[0]}: {_row_text(first[1:])}") from (
            error
        )

    def check_same(
        self, fields: Sequence[tuple[str, str]], what: str, label: str, hint: str = ""
    ) -> None:
        """Raise the same ValueError on every rank if `fields` differ between ranks.

        The message reads "ranks disagree {what} on {field}: rank(s) [..]: {field} =
        {value}; .... {hint}". See [Note: the same value on every rank].
        """
        if self.size == 1:
            return
        hashes = [_hash(f"{k}={v}") for k, v in fields]
        total = _hash(",".join(map(str, hashes)))
        rows = self.gather([total, len(fields)], label)
        if all(row == rows[0] for row in rows):
            return
        longest = max(row[1] for row in rows)
        padded = hashes + [0] * (longest - len(hashes))
        per_field = self.gather(padded, f"{label}: which field differs")
        first = next(i for i in range(longest) if len({row[i] for row in per_field}) > 1)
        key, value = fields[first] if first < len(fields) else (_ABSENT, _ABSENT)
        texts = self.gather(_text_row(f"{key}\0{value}"), f"{label}: the differing values")
        seen: dict[str, list[int]] = {}
        for rank, got in enumerate(texts):
            k, _, v = _row_text(got).partition("\0")
            seen.setdefault(f"{k} = {v}" if k != _ABSENT else _ABSENT, []).append(rank)
        names = sorted({k.split(" = ")[0] for k in seen if k != _ABSENT})
        holders = "; ".join(f"rank(s) {ranks}: {held}" for held, ranks in seen.items())
        text = f"ranks disagree {what} on {' / '.join(names) or key}: {holders}"
        raise ValueError(f"{text}. {hint}" if hint else text)

    def from_rank0(self, text: str | None, label: str) -> str:
        """Rank 0's `text` on every rank (the other ranks pass None or anything)."""
        if self._group is None:
            return text or ""
        g = self._group
        data = (text or "").encode() if g.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=g.device)
        g.broadcast(size, 0, label=f"{label}: size").wait()
        if not size.item():
            return ""
        sent = torch.zeros(int(size.item()), dtype=torch.uint8, device=g.device)
        if data:
            sent.copy_(torch.tensor(list(data), dtype=torch.uint8))
        g.broadcast(sent, 0, label=label).wait()
        return bytes(sent.cpu().tolist()).decode()


def agreed(
    group: Group | None,
    label: str,
    fn: Callable[[], T],
    kinds: Sequence[type[Exception]] = (RuntimeError,),
) -> T:
    """`fn()` on every rank, with one outcome: its result everywhere, or the same error
    (of one of `kinds`: see `Agreement.outcome`)."""
    ag = Agreement(group)
    try:
        result = fn()
    except Exception as e:
        ag.outcome(e, label, kinds)
        raise  # unreachable: outcome raised for this failing rank
    ag.outcome(None, label, kinds)
    return result
