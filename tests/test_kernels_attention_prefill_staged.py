"""Prefill's sparse attention with rows staged for all heads (dsv4/kernels/attention_prefill_staged.py)
runs on the host, CPU, in CI: the body compiled with clang under the threadgroup emulator, the
mma.sync emulator and the cp.async emulator (copies land only when waited for), launched by the
dispatcher itself (`sparse_attention` under dialect.pretend_gpu). The output must match the
plain-MLX reference within the GPU tests' bound and the float64 oracle of model-spec §3.7 within
bf16 rounding, at one, two and four head groups a threadgroup; a mutated fragment layout, a
staged row read from another chunk than it was written to and a tile read before it landed must
fail. Its CUDA build runs at V4.1's widths in test_kernels_attention_prefill_host's GPU test."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import attention_prefill_staged as st
from dsv4.kernels import dialect
from tests.mma_emulator import MUTATIONS
from tests.test_kernels_attention_prefill_host import Emulated, check, check_edge_rows
from tests.test_kernels_attention_prefill_host import run as run_with
from tests.test_kernels_sparse_attention import as_np, oracle
from tests.test_kernels_sparse_attention_host import case


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return Emulated(tmp_path_factory.mktemp("attention_prefill_staged"), module=st)


def run(emulated, c):
    """sparse_attention as prefill calls it, the staged kernel's launch on the host: one
    threadgroup of 128 threads per head group a query."""
    got = run_with(emulated, c, "kernel_prefill_attention_staged")
    launch = emulated.launches[0]
    H = c["q"].shape[2]
    assert launch["threadgroup"] == (128 * launch["HG"], 1, 1) and launch["grid"][1] == H // (16 * launch["HG"])
    return got


# (B, S, H, D, W, N, w, k): more queries than the decode kernel takes; 16, 32 and 64 heads (one,
# two, four head groups a threadgroup); D = 256 (a 64-dim block a SIMD group) and 512 (two); rows
# in several tiles, the last part-filled (36, 48, 72), in two batches.
@pytest.mark.parametrize("B,S,H,D,W,N,w,k", [
    (1, 9, 16, 256, 30, 50, 16, 20),
    (2, 5, 32, 512, 20, 70, 8, 40),
    (1, 9, 64, 256, 40, 90, 32, 40),
])
def test_staged_kernel_matches_reference_and_oracle(emulated, B, S, H, D, W, N, w, k):
    rng = np.random.default_rng()
    c = case(rng, B, S, H, D, W, N, w, k)
    got = run(emulated, c)
    assert emulated.launches[0]["HG"] == st.head_groups(H)
    check(got, c)
    kv_max = max(np.abs(as_np(c)[1]).max(), np.abs(as_np(c)[3]).max())
    assert np.abs(got - oracle(*as_np(c))).max() <= 2.0 ** -7 * kv_max


def test_shared_indices_no_compressed_cache_and_edge_rows(emulated):
    check_edge_rows(run, emulated, 256)


def test_rotations_around_the_kernel(emulated):
    rng = np.random.default_rng()
    c = case(rng, 1, 9, 16, 256, 17, 40, 16, 24, rope=8, rotate_queries=True)
    check(run(emulated, c), c)


# Each must fail: the mma's fragment layout changed; the staged rows read from the chunk they
# would sit at unswizzled; a tile read before its copies landed.
BROKEN = {name: (mutation, ()) for name, mutation in MUTATIONS.items()}
BROKEN["rows written unswizzled"] = ("", (("uint4* at = dst + r * CH + (c ^ staged_swizzle(r));",
                                           "uint4* at = dst + r * CH + c;"),))
BROKEN["no wait for the tile"] = ("", (("cp_async_wait<0>();", ""),))


@pytest.mark.parametrize("broken", list(BROKEN), ids=list(BROKEN))
def test_a_broken_body_fails(tmp_path, broken):
    mutation, replace = BROKEN[broken]
    rng = np.random.default_rng()
    c = case(rng, 1, 9, 16, 256, 20, 30, 8, 24)
    got = run(Emulated(tmp_path, mutation, st, replace), c)
    with pytest.raises(AssertionError):
        check(got, c)


def test_copies_landing_early_change_nothing(tmp_path):
    """cp.async may land as soon as it is issued: the result is the same bit for bit."""
    rng = np.random.default_rng()
    c = case(rng, 1, 9, 16, 256, 20, 30, 8, 24)
    for folder in ("late", "early"):
        (tmp_path / folder).mkdir()
    late = run(Emulated(tmp_path / "late", module=st), c)
    early = run(Emulated(tmp_path / "early", "#define CP_ASYNC_EARLY\n", st), c)
    assert np.array_equal(late, early)


def test_the_switch_takes_bf16_prefill_on_cuda_only():
    q = lambda H=64, D=512, dtype=mx.bfloat16: mx.zeros((1, 16, H, D), dtype)
    kv = mx.zeros((1, 4, 512), mx.bfloat16)
    with flags.override(kernel_prefill_attention_staged=True):
        with dialect.pretend_gpu("cuda", None):
            assert st.applies(q(), kv, kv) and st.applies(q(), kv, None)
            assert not st.applies(q(dtype=mx.float32), kv, kv)      # bf16 only
            assert not st.applies(q(H=8), kv, kv)                   # whole groups of 16 heads
            assert not st.applies(q(D=128), kv, kv)                 # D in steps of 256
        with dialect.pretend_gpu("metal", None):
            assert not st.applies(q(), kv, kv)
    with dialect.pretend_gpu("cuda", None):
        assert st.applies(q(), kv, kv)                              # default: auto, on under CUDA
        with flags.override(kernel_prefill_attention_staged="off"):
            assert not st.applies(q(), kv, kv)
    with dialect.pretend_gpu("metal", None):
        assert not st.applies(q(), kv, kv)
    assert st.shared_bytes(512, 64) <= dialect.shared_memory_limit("cuda")
    assert [st.head_groups(h) for h in (16, 32, 48, 64, 128)] == [1, 2, 1, 4, 4]


@pytest.mark.parametrize("H", [16, 64])
def test_shared_bytes_are_what_the_body_declares(H):
    """applies() sizes a launch as tools/launch_limits.py reads the body's arrays."""
    from tools.launch_limits import threadgroup_bytes

    template = [("T", mx.bfloat16), ("D", 512), ("H", H), ("NW", 128), ("NK", 512), ("HG", st.head_groups(H)),
                ("NT", st.tiles(640))]
    assert threadgroup_bytes(st.KERNEL, template) == st.shared_bytes(512, H)


def test_launch_bounds_cap_the_registers_of_512_threads():
    """The CUDA source ends its header with the launch bounds (MLX's declaration follows it), and
    a threadgroup past them is refused before MLX sees it."""
    header, _ = st.KERNEL.source("cuda")
    assert header.rstrip().endswith(f"__launch_bounds__({st.MAX_THREADS}, 1)")
    assert dialect.launch_bounds(0) == ""
    with dialect.pretend_gpu("cuda", lambda *a, **k: pytest.fail("launched")):
        with pytest.raises(ValueError, match="launch bounds"):
            st.KERNEL(inputs=[], output_shapes=[(1,)], output_dtypes=[mx.bfloat16], grid=(1024, 1, 1),
                      threadgroup=(1024, 1, 1), template=[("T", mx.bfloat16)])
