"""Rank 0 talks to the user, the other ranks follow: what rank 0 read goes to every rank, so
every rank runs the same command on the same input and the model's forwards (with their
exchanges) line up. A message is two all_sums over int32 buffers, rank 0's values against
the others' zeros: its length (or END / INTERRUPT), then its UTF-8 bytes. These are not the
model's exchanges (not counted in `stats`); one message per line the user enters."""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx
import numpy as np

END, INTERRUPT = -1, -2   # rank 0's input ended (EOF) / was interrupted (Ctrl-C at the prompt)


class Channel:
    def __init__(self, group):
        self.group = group

    @property
    def leader(self) -> bool:
        return self.group.rank() == 0

    def _sum(self, values: np.ndarray) -> np.ndarray:
        return np.array(mx.distributed.all_sum(mx.array(values), group=self.group))

    def share(self, message: Union[str, int, None] = None) -> Union[str, int]:
        """Rank 0 passes `message` (text, END or INTERRUPT), the others nothing: every rank
        gets rank 0's message back."""
        data = message.encode() if self.leader and isinstance(message, str) else b""
        code = (len(data) if isinstance(message, str) else int(message)) if self.leader else 0
        code = int(self._sum(np.array([code], np.int32))[0])
        if code < 0:
            return code
        if code == 0:
            return ""
        body = np.frombuffer(data, np.uint8).astype(np.int32) if self.leader else np.zeros(code, np.int32)
        return self._sum(body).astype(np.uint8).tobytes().decode()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any of them (a stop that all obey)."""
        return bool(self._sum(np.array([int(bool(flag))], np.int32))[0])


def channel(group) -> Optional[Channel]:
    return None if group is None else Channel(group)
