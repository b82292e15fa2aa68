"""Files that appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_file(dst: Path | str) -> Iterator[BinaryIO]:
    """Open `<dst>.partial` for writing; when the block ends, flush, fsync and rename it to
    `dst`. If the block raises (or is interrupted), the partial file is removed."""
    dst = Path(dst)
    partial = dst.with_name(dst.name + ".partial")
    try:
        with open(partial, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, dst)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
