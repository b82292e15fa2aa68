"""Reading bytes where they lie: the one pool of pread workers, and files that may be split.

Two stores read the model's files in place with `pread`: the Engram tables (dsv4/engram_store.py,
rows of 264 bytes) and the streamed routed experts (dsv4/expert_store.py, ~6 MB pieces). Both
submit their reads to one persistent thread pool (`executor`), so the machine has one set of
reader threads whatever reads, and a read never waits for a thread to be made:

    pool = executor(16)                       # grown (never shrunk) to at least 16 threads
    reads = Reads([pool.submit(work, ...) for ...], finish)
    result = reads.wait()                     # joins every worker, then raises or finishes

`executor(1)` is the one serial reader thread, shared by all users, so that serial reads are
serial across them too. `Reads.wait()` lets every worker finish before it raises the first
error (in submission order): nothing is left writing into a caller's buffer after an error.

`PartedFile` is one file, or the byte concatenation of a file's parts (a GGUF split into raw
.part1, .part2, ...); a region may straddle two parts and its offsets run over the whole.
`OpenFiles` opens each path once (a model's tensors share a few shard files) and closes them
all when closed or garbage-collected. A short read (the file ends early) is reported by the
byte count `pread` returns, never padded.

`OpenFiles(direct=True)` (Linux) also opens each path with O_DIRECT, and `PartedFile.pread`
then reads through it: the disk's DMA goes to a page-aligned buffer of the reading thread (the
request widened to DIRECT_ALIGN), and numpy copies the bytes asked for to the caller's buffer,
without the GIL. Tensors in a safetensors file or a GGUF start at any byte, so a direct read
straight into the caller's memory would not be aligned; the copy is cheaper than the page
cache's insert and eviction of the same bytes.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import itertools
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

# O_DIRECT wants offsets, lengths and memory aligned to the device's logical block (512 or 4096).
DIRECT_ALIGN = 4096

_pool_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_size = 0
_serial = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pread-serial")


def executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The shared pool, grown (never shrunk) to at least `workers` threads; one: the serial thread."""
    global _pool, _pool_size
    if workers == 1:
        return _serial
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            old = _pool
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="pread")
            _pool_size = workers
            if old is not None:
                old.shutdown(wait=False)  # its running reads finish; new ones go to the new pool
        return _pool


class Reads:
    """Reads running on the pool; `wait()` joins every worker, then returns finish() or raises."""

    def __init__(self, futures: Sequence[concurrent.futures.Future], finish: Callable[[], object]):
        self._futures = list(futures)
        self._finish = finish
        self._result = None

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self):
        if self._result is None:
            errors = [f.exception() for f in self._futures]  # every worker joins first
            for error in errors:
                if error is not None:
                    raise error
            self._result = self._finish()
        return self._result


def pread_exact(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `offset`; the number of bytes read (less than asked only at end of file)."""
    got = 0
    while got < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[got:]], offset + got)
        else:
            data = os.pread(fd, len(view) - got, offset + got)
            n = len(data)
            view[got:got + n] = data
        if n == 0:
            break
        got += n
    return got


def open_for_reading(path: Path, random_uncached: bool) -> int:
    """A read-only descriptor; with `random_uncached` the OS is told that reads are random and
    should not fill its cache: F_NOCACHE and no read-ahead on macOS (a 95 GiB table or 150 GB
    of experts would push everything else out), POSIX_FADV_RANDOM on Linux."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if random_uncached:
        if sys.platform == "darwin":
            import fcntl
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
            fcntl.fcntl(fd, getattr(fcntl, "F_RDAHEAD", 45), 0)
        elif hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


_native: dict = {}


def native_reader():
    """dsv4/native/reads.cpp's module (reads on C++ threads, no GIL), or None where it cannot be
    built (said once; the Python threads read then)."""
    if "module" not in _native:
        from . import native
        try:
            _native["module"] = native.load("reads")
        except native.Unavailable as e:
            _native["module"] = None
            print(f"dsv4: Engram rows and streamed experts are read by Python threads (the native "
                  f"reader is unavailable: {e})", file=sys.stderr)
    return _native["module"]


class NativeRead:
    """A native HostRead as `Reads` takes a worker's future; `failure(index, errno)` gives the
    error for the row or range the read found bad."""

    def __init__(self, read, failure: Callable[[int, int], Exception]):
        self.read, self.failure = read, failure

    def done(self) -> bool:
        return self.read.done()

    def exception(self) -> Optional[Exception]:
        what, index, error = self.read.wait()
        return self.failure(index, error) if what else None


class PartedFile:
    """One file, or the byte concatenation of a file's parts. Offsets are into the whole."""

    def __init__(self, parts: Sequence[tuple[Path, int]], fds: dict[Path, int],
                 direct_fds: Optional[dict[Path, Optional[int]]] = None):
        self.parts = [(Path(p), fds[Path(p)], int(size)) for p, size in parts]
        self.direct = None if direct_fds is None else [direct_fds[Path(p)] for p, _ in parts]
        self.starts = list(itertools.accumulate([0] + [size for _, _, size in self.parts]))
        self.size = self.starts[-1]
        self.path = self.parts[0][0] if len(self.parts) == 1 else \
            Path(f"{self.parts[0][0]} (+{len(self.parts) - 1} parts)")

    def _pieces(self, offset: int, length: int):
        """(part, offset in that part, start in the request, length) covering the request."""
        k = max(0, bisect.bisect_right(self.starts, offset) - 1)
        done = 0
        while done < length and k < len(self.parts):
            size = self.parts[k][2]
            inner = offset + done - self.starts[k]
            n = min(length - done, size - inner)
            if n > 0:
                yield k, inner, done, n
                done += n
            k += 1

    def pread(self, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset`; the bytes read (fewer only at the end of the data)."""
        got = 0
        for k, inner, start, n in self._pieces(offset, len(view)):
            part = view[start:start + n]
            direct = None if self.direct is None else self.direct[k]
            read = pread_exact(self.parts[k][1], part, inner) if direct is None else \
                _pread_direct(direct, part, inner)
            got += read
            if read < n:
                break
        return got

    def native_parts(self) -> list[int]:
        """(fd, start in the whole, size) of each part, flat, as dsv4/native/reads.cpp takes a file."""
        return [v for (_, fd, size), start in zip(self.parts, self.starts) for v in (fd, start, size)]

    def will_need(self, offset: int, length: int) -> None:
        for k, inner, _, n in self._pieces(offset, length):
            os.posix_fadvise(self.parts[k][1], inner, n, os.POSIX_FADV_WILLNEED)

    def dont_need(self, offset: int, length: int) -> None:
        """Drop these bytes from the OS cache (Linux; macOS keeps them out with F_NOCACHE)."""
        if hasattr(os, "posix_fadvise"):
            for k, inner, _, n in self._pieces(offset, length):
                os.posix_fadvise(self.parts[k][1], inner, n, os.POSIX_FADV_DONTNEED)

    def where(self, offset: int) -> str:
        """"byte B of FILE" for an offset into the whole (the part holding it)."""
        k = max(0, bisect.bisect_right(self.starts, offset) - 1)
        if len(self.parts) == 1 or k >= len(self.parts):
            return f"byte {offset} of {self.path}"
        return f"byte {offset - self.starts[k]} of {self.parts[k][0]} (byte {offset} of the whole)"


_bounce = threading.local()


def _pread_direct(fd: int, view: memoryview, offset: int) -> int:
    """pread_exact through an O_DIRECT descriptor (see the module's notes)."""
    done = 0
    while done < len(view):
        at = offset + done
        lo = at - at % DIRECT_ALIGN
        want = min(len(view) - done, (1 << 22) - (at - lo))   # 4 MiB of bounce buffer at most
        hi = -(-(at + want) // DIRECT_ALIGN) * DIRECT_ALIGN
        buf = getattr(_bounce, "buffer", None)
        if buf is None or len(buf) < hi - lo:
            import mmap
            _bounce.buffer = buf = mmap.mmap(-1, max(hi - lo, (1 << 22) + DIRECT_ALIGN))  # page-aligned
            _bounce.array = np.frombuffer(buf, np.uint8)
        got = min(want, max(0, os.preadv(fd, [memoryview(buf)[:hi - lo]], lo) - (at - lo)))
        np.copyto(np.frombuffer(view[done:done + got], np.uint8), _bounce.array[at - lo:at - lo + got])
        done += got
        if got < want:
            break
    return done


def _open_direct(path: Path) -> Optional[int]:
    """An O_DIRECT descriptor, or None where the file system has none (tmpfs: EINVAL)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def _close_all(*fd_maps: dict[Path, Optional[int]]) -> None:
    for fds in fd_maps:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
        fds.clear()


class OpenFiles:
    """Descriptors opened once per path, closed together by `close()` (or when collected);
    with `direct` (where the OS has O_DIRECT) the files read through O_DIRECT ones too."""

    def __init__(self, random_uncached: bool, direct: bool = False):
        self.random_uncached = random_uncached
        self._fds: dict[Path, int] = {}
        self._direct: Optional[dict[Path, Optional[int]]] = {} if direct and hasattr(os, "O_DIRECT") else None
        self._finalizer = weakref.finalize(self, _close_all, self._fds,
                                           {} if self._direct is None else self._direct)

    def file(self, paths: Sequence[Path]) -> PartedFile:
        """The file made of `paths` in order (one path: the file itself); FileNotFoundError if
        one is missing."""
        paths = [Path(p) for p in paths]
        for path in paths:
            if path not in self._fds:
                self._fds[path] = open_for_reading(path, self.random_uncached)
                if self._direct is not None:
                    self._direct[path] = _open_direct(path)
        file = PartedFile([(p, os.fstat(self._fds[p]).st_size) for p in paths], self._fds, self._direct)
        file.owner = self   # the descriptors stay open while a file that reads them lives
        return file

    def close(self) -> None:
        self._finalizer()
