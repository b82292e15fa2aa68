"""Prefill's sparse attention on tensor cores (dsv4/kernels/attention_prefill.py) runs on the host,
CPU, in CI: the body compiled with clang under the threadgroup emulator (test_kernels_matvec)
and the mma.sync emulator (tests/mma_emulator.py, its bf16 variant), launched by the
dispatcher itself (`sparse_attention` under dialect.pretend_gpu, each launch running the host
build; test_kernels_attention_prefill_staged runs its kernel the same way), so the choice of
path, the rotations around the kernel, the index broadcast and the stand-in for a missing
compressed cache are checked with the body. The output must match the
plain-MLX reference within the GPU tests' bound (both round the probabilities to bf16, against
maxima that may differ in their last fp32 bit) and the float64 oracle of model-spec §3.7 within
bf16 rounding; a mutated fragment layout must fail. Unverified here: the real instruction and
the speed (the H200)."""

import subprocess
import warnings

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import attention_prefill as ap
from dsv4.kernels import dialect
from dsv4.kernels import sparse_attention as sa
from tests.mma_emulator import CP_ASYNC_EMULATOR, MMA_EMULATOR, MUTATIONS
from tests.test_kernels_decode_host import build_kernel
from tests.test_kernels_experts_host import BF16
from tests.test_kernels_matvec import EMULATOR
from tests.test_kernels_sparse_attention import as_np, oracle
from tests.test_kernels_sparse_attention_host import bf16_bytes, case, f32_bytes, i32_bytes

MAIN = r"""
#define DIV_RN(a, b) ((a) / (b))
void body(const T* queries, const T* window_kv, const int* window_idx, const T* compressed_kv, const int* topk_idx,
          const float* sinks, const float* params, T* out, const int* queries_shape, const int* window_kv_shape,
          const int* compressed_kv_shape, uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  int qs[4], ws[3], cs[3];
  for (int& v : qs) v = read_int();
  for (int& v : ws) v = read_int();
  for (int& v : cs) v = read_int();
  const size_t queries = (size_t)qs[0] * qs[1];
  std::vector<T> q(queries * H * D), wkv((size_t)ws[0] * ws[1] * D), ckv((size_t)cs[0] * cs[1] * D);
  std::vector<T> out(q.size(), T(NAN));
  std::vector<int> wi(queries * NW), ti(queries * NK);
  std::vector<float> sinks(H), params(1);
  read(q); read(wkv); read(wi); read(ckv); read(ti); read(sinks); read(params);
  launch(THREADS, GROUPS_Y, (int)queries, [&](int t, int g, int z, int n) {
    body(q.data(), wkv.data(), wi.data(), ckv.data(), ti.data(), sinks.data(), params.data(), out.data(),
         qs, ws, cs, t, g, z, n);
  });
  std::fwrite(out.data(), 2, out.size(), stdout);
  return 0;
}
"""


def check(got, c):
    """The GPU tests' bound against the plain-MLX reference: 2^-7 max|kv| + 2^-8 |out|."""
    want = np.array(sa.sparse_attention_reference(**c).astype(mx.float32))
    assert np.isfinite(got).all(), "an output left unwritten (NaN) or non-finite"
    kv_max = max(float(mx.max(mx.abs(c[n].astype(mx.float32)))) for n in ("window_kv", "compressed_kv")
                 if c[n] is not None)
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * kv_max + 2.0 ** -8 * np.abs(want)), np.abs(got - want).max()


class Emulated:
    """pretend_gpu's launch of `module`'s kernel (attention_prefill or attention_prefill_staged):
    built and run on the host; `mutation` goes before the body's source,
    `replace` are (old, new) edits of the kernel's header and body. `launches` holds each launch's
    template values, grid and threadgroup."""

    def __init__(self, folder, mutation="", module=ap, replace=()):
        self.folder, self.mutation, self.module, self.replace = folder, mutation, module, replace
        self.launches = []

    def __call__(self, kernel, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template, **_):
        assert kernel is self.module.KERNEL and dict(template)["T"] == mx.bfloat16
        q, wkv, wi, ckv, ti, sinks, params = inputs
        B, S, H, D = q.shape
        assert grid[0] == threadgroup[0] and grid[2] == B * S and output_shapes == [q.shape]
        self.launches.append(dict(template, grid=grid, threadgroup=threadgroup))
        exe = build_kernel(self.folder, kernel, template,
                           EMULATOR + BF16 + self.mutation + MMA_EMULATOR + CP_ASYNC_EMULATOR,
                           MAIN.replace("GROUPS_Y", str(grid[1])), after=f"constexpr int THREADS = {threadgroup[0]};\n",
                           edits=self.replace)
        data = (i32_bytes(*q.shape, *wkv.shape, *ckv.shape) + bf16_bytes(q) + bf16_bytes(wkv)
                + np.array(wi).tobytes() + bf16_bytes(ckv) + np.array(ti).tobytes() + f32_bytes(sinks)
                + f32_bytes(params))
        out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
        return [mx.array(np.frombuffer(out, np.uint16).reshape(q.shape)).view(mx.bfloat16)]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return Emulated(tmp_path_factory.mktemp("attention_prefill"))


def run(emulated, c, switch="kernel_prefill_attention_mma"):
    """sparse_attention itself, as prefill calls it, with `switch` on and every launch on the host."""
    emulated.launches.clear()
    with (flags.override(**{switch: True}), dialect.pretend_gpu("cuda", emulated), warnings.catch_warnings()):
        warnings.simplefilter("error")   # a fall-back to the reference would be a failure
        got = sa.sparse_attention(**c)
    assert len(emulated.launches) == 1
    return np.array(got.astype(mx.float32))


# (B, S, H, D, W, N, w, k): 9 and 12 queries (more than the decode kernel takes); 36 rows (two
# tiles a SIMD group, the last partly past the rows) and 48 in two batches; 32 heads = two
# head groups; D = 64 (2 steps of 32, 2 dims a lane in pass 2) and 128.
@pytest.mark.parametrize("B,S,H,D,W,N,w,k", [
    (1, 12, 16, 64, 30, 50, 16, 20),
    (2, 9, 32, 128, 20, 70, 8, 40),
])
def test_prefill_kernel_matches_reference_and_oracle(emulated, B, S, H, D, W, N, w, k):
    rng = np.random.default_rng()
    c = case(rng, B, S, H, D, W, N, w, k)
    got = run(emulated, c)
    check(got, c)
    kv_max = max(np.abs(as_np(c)[1]).max(), np.abs(as_np(c)[3]).max())
    assert np.abs(got - oracle(*as_np(c))).max() <= 2.0 ** -7 * kv_max


def check_edge_rows(run, emulated, D):
    """Indices [1, S, w] shared by the batch; a window-only layer (no compressed cache: one
    never-selected row stands in); a query with no row (zeros), one with one row, out-of-range
    indices (none), a repeated row (counted twice, as the reference does)."""
    rng = np.random.default_rng()
    c = case(rng, 2, 10, 16, D, 12, 9, 6, 4, invalid=0.0)
    wi, ti = np.array(c["window_idx"])[:1], np.array(c["topk_idx"])[:1]
    wi[0, 0] = -1; ti[0, 0] = -1
    wi[0, 1] = [3, -1, -1, -1, -1, -1]; ti[0, 1] = -1
    ti[0, 2] = [100, -5, 2, 2]
    wi[0, 3] = [12, 13, -1, 7, 0, 0]
    c.update(window_idx=mx.array(wi), topk_idx=mx.array(ti))
    got = run(emulated, c)
    assert np.all(got[:, 0] == 0)
    check(got, c)
    c.update(compressed_kv=None, topk_idx=None)
    got = run(emulated, c)
    assert emulated.launches[0]["NK"] == 1
    check(got, c)


def test_shared_indices_no_compressed_cache_and_edge_rows(emulated):
    check_edge_rows(run, emulated, 64)


def test_rotations_around_the_kernel(emulated):
    """Queries rotated before the kernel and the output de-rotated after it, as the reference."""
    rng = np.random.default_rng()
    c = case(rng, 1, 11, 16, 64, 17, 40, 16, 24, rope=8, rotate_queries=True)
    check(run(emulated, c), c)


@pytest.mark.parametrize("mutation", list(MUTATIONS), ids=list(MUTATIONS))
def test_a_wrong_fragment_layout_fails(tmp_path, mutation):
    rng = np.random.default_rng()
    c = case(rng, 1, 9, 16, 64, 20, 30, 8, 12)
    got = run(Emulated(tmp_path, MUTATIONS[mutation]), c)
    with pytest.raises(AssertionError):
        check(got, c)


def test_the_switch_takes_bf16_prefill_on_cuda_only():
    q = lambda H=64, D=512, dtype=mx.bfloat16: mx.zeros((1, 16, H, D), dtype)
    kv = mx.zeros((1, 4, 512), mx.bfloat16)
    with flags.override(kernel_prefill_attention_mma=True):
        with dialect.pretend_gpu("cuda", None):
            assert ap.applies(q(), kv, kv, 640) and ap.applies(q(), kv, None, 128)
            assert not ap.applies(q(dtype=mx.float32), kv, kv, 640)         # bf16 only
            assert not ap.applies(q(H=8), kv, kv, 640)                      # whole groups of 16 heads
            assert not ap.applies(q(), kv, kv, 4096)                        # P past shared memory
        with dialect.pretend_gpu("metal", None):
            assert not ap.applies(q(), kv, kv, 640)
    with dialect.pretend_gpu("cuda", None):
        assert ap.applies(q(), kv, kv, 640)                                 # auto (default): on
        with flags.override(kernel_prefill_attention_mma="off"):
            assert not ap.applies(q(), kv, kv, 640)
    assert ap.shared_bytes(512, 640) <= dialect.shared_memory_limit("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["kernel_prefill_attention_mma", "kernel_prefill_attention_staged"])
@pytest.mark.parametrize("ratio", [True, False])
def test_prefill_attention_on_the_gpu(ratio, switch):
    """Each launch's CUDA build (this file's kernel; the staged one of attention_prefill_staged.py)
    at V4.1's widths (64 heads of 512, window 128, top-512 of 1024 compressed rows, or none)
    against the reference, 64 queries."""
    if dialect.backend() != "cuda":
        pytest.skip("CUDA only")
    rng = np.random.default_rng()
    c = case(rng, 1, 64, 64, 512, 191, 1024, 128, 512, invalid=0.1, rope=32, rotate_queries=True)
    if not ratio:
        c.update(compressed_kv=None, topk_idx=None)
    with flags.override(**{switch: True}), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = np.array(sa.sparse_attention(**c).astype(mx.float32))
    check(got, c)


@pytest.mark.parametrize("rows", [129, 640])
def test_shared_bytes_are_what_the_body_declares(rows):
    """applies() sizes a launch as tools/launch_limits.py reads the body's arrays."""
    from tools.launch_limits import threadgroup_bytes

    template = [("T", mx.bfloat16), ("D", 512), ("H", 64), ("NW", 128), ("NK", rows - 128),
                ("RT", ap.row_tiles(rows)), ("PAD", ap.PAD)]
    assert threadgroup_bytes(ap.KERNEL, template) == ap.shared_bytes(512, rows)
