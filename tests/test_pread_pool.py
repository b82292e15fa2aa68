"""The pread pool's files (dsv4/pread_pool.py): byte-split files read buffered and through
O_DIRECT give the bytes the test wrote, at any offset and length; short reads say how short;
a batch of reads joins every worker before it raises.

Oracle: the bytes written, concatenated."""

import os
import threading
import time

import numpy as np
import pytest

from dsv4.pread_pool import DIRECT_ALIGN, OpenFiles, Reads, executor


@pytest.fixture
def parts(tmp_path):
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, 3 * DIRECT_ALIGN * 7 + 1234, dtype=np.uint8)
    cut = DIRECT_ALIGN * 5 + 321                     # a part boundary off the alignment
    paths = [tmp_path / "m.part1", tmp_path / "m.part2"]
    paths[0].write_bytes(data[:cut].tobytes())
    paths[1].write_bytes(data[cut:].tobytes())
    return paths, data


@pytest.mark.parametrize("direct", [False, True])
def test_windows_read_the_bytes_written(parts, direct):
    paths, data = parts
    files = OpenFiles(random_uncached=True, direct=direct)
    file = files.file(paths)
    if direct:
        assert all(fd is not None for fd in file.direct), "O_DIRECT unsupported where tmp_path lies"
    rng = np.random.default_rng(5)
    windows = [(0, len(data)), (DIRECT_ALIGN * 5, 700), (DIRECT_ALIGN * 5 + 300, 50),   # across the cut
               (1, DIRECT_ALIGN), (len(data) - 10, 10)]
    windows += [(int(o), int(n)) for o, n in zip(rng.integers(0, len(data) - 1, 40),
                                                 rng.integers(1, 3 * DIRECT_ALIGN, 40))]
    for offset, n in windows:
        n = min(n, len(data) - offset)
        out = np.zeros(n, np.uint8)
        assert file.pread(memoryview(out), offset) == n
        np.testing.assert_array_equal(out, data[offset:offset + n], err_msg=f"{offset}+{n}")
    files.close()


@pytest.mark.parametrize("direct", [False, True])
def test_a_read_past_the_end_says_how_much_it_got(parts, direct):
    paths, data = parts
    file = OpenFiles(True, direct).file(paths)
    out = np.full(5000, 7, np.uint8)
    assert file.pread(memoryview(out), len(data) - 1000) == 1000
    np.testing.assert_array_equal(out[:1000], data[-1000:])
    assert (out[1000:] == 7).all()                  # nothing written past what was read


def test_reads_join_every_worker_before_raising():
    finished = []

    def slow(i):
        time.sleep(0.2)
        finished.append(i)

    def bad():
        raise OSError(5, "boom")

    pool = executor(4)
    futures = [pool.submit(bad)] + [pool.submit(slow, i) for i in range(3)]
    with pytest.raises(OSError, match="boom"):
        Reads(futures, lambda: None).wait()
    assert sorted(finished) == [0, 1, 2]             # all had finished when it raised
    assert all(f.done() for f in futures)


def test_closing_closes_every_descriptor(parts):
    paths, _ = parts
    files = OpenFiles(True, direct=True)
    file = files.file(paths)
    fds = [fd for _, fd, _ in file.parts] + [fd for fd in file.direct if fd is not None]
    files.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
