"""Files that appear whole or not at all."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import BinaryIO, Iterator

_writers = itertools.count()   # next() is atomic: each writer of this process gets its own number


@contextlib.contextmanager
def atomic_file(dst: Path | str) -> Iterator[BinaryIO]:
    """Open `<dst>.<writer>.partial` for writing; when the block ends, flush, fsync and rename
    it to `dst`. If the block raises (or is interrupted), the partial file is removed. Each
    writer has a partial file of its own (`<writer>`: the process and a number): two writing
    the same `dst` at once (two processes building the same CUDA kernel into the shared cache)
    would otherwise truncate each other's file, and the second rename would find none."""
    dst = Path(dst)
    partial = dst.with_name(f"{dst.name}.{os.getpid()}-{next(_writers)}.partial")
    try:
        with open(partial, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, dst)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
