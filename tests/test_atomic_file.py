"""atomic_file: whole or not at all, also with two writers of the same file at once."""

import pytest

from dsv4.atomic_file import atomic_file


def test_a_file_appears_whole_or_not_at_all(tmp_path):
    dst = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_file(dst) as f:
            f.write(b"half")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_file(dst) as f:
        f.write(b"whole")
        assert not dst.exists()
    assert dst.read_bytes() == b"whole" and list(tmp_path.iterdir()) == [dst]


def test_two_writers_of_one_file_at_once_each_finish_whole(tmp_path):
    """Interleaved as two processes building the same kernel are: the second's open must not
    truncate the first's file, nor its rename find nothing to rename."""
    dst = tmp_path / "kernel.ptx"
    first, second = atomic_file(dst), atomic_file(dst)
    a = first.__enter__()
    a.write(b"A" * 1000)
    b = second.__enter__()
    b.write(b"B" * 10)
    a.write(b"A" * 1000)
    first.__exit__(None, None, None)
    assert dst.read_bytes() == b"A" * 2000
    b.write(b"B" * 10)
    second.__exit__(None, None, None)
    assert dst.read_bytes() == b"B" * 20 and list(tmp_path.iterdir()) == [dst]
