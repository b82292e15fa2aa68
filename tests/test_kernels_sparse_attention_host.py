"""The 8-row sparse-attention kernels (dsv4/kernels/sparse_attention.py, flag
`kernel_attention_rows8`) run on the host, CPU, in CI.

The partial and merge bodies are compiled with clang under test_kernels_matvec's threadgroup
emulator (a thread per lane, the SIMD exchanges between the 32 threads of a SIMD group) and run
as the dispatcher launches them: `sparse_attention_kernel` runs inside `pretend_gpu`, so its
grid, template and split count are the ones a GPU gets. The output must match the plain-MLX
reference within the bound the GPU tests use (both round probabilities to bf16, relative to
different running maxima), and the float64 oracle of model-spec §3.7 within bf16 rounding.
"""

import subprocess

import numpy as np
import pytest

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import attention_decode_staged as staged
from dsv4.kernels import dialect
from dsv4.kernels import sparse_attention as sa
from tests.mma_emulator import CP_ASYNC_EMULATOR, MMA_EMULATOR
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_experts_host import BF16
from tests.test_kernels_matvec import EMULATOR
from tests.test_kernels_sparse_attention import as_np, oracle

MAX = "using std::max;\n"

# Inputs on stdin: the input shapes, sizes, then the arrays in the kernel's input order.
PARTIAL_MAIN = r"""
void body(const T* q, const T* window_kv, const int* window_idx, const T* compressed_kv, const int* topk_idx,
          const float* params, const float* rope_cos, const float* rope_sin, float* part_acc, float* part_ml,
          const int* q_shape, const int* window_kv_shape, const int* window_idx_shape,
          const int* compressed_kv_shape, const int* topk_idx_shape,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  int qs[4], ws[3], wis[3], cs[3], tis[3];
  for (int* shape : {qs, ws, wis, cs, tis})
    for (int i = 0; i < (shape == qs ? 4 : 3); ++i) shape[i] = read_int();
  const int n_rope = read_int(), n_acc = read_int(), gy = read_int(), gz = read_int(), threads = read_int();
  std::vector<T> q((size_t)qs[0] * qs[1] * qs[2] * qs[3]), wkv((size_t)ws[0] * ws[1] * ws[2]);
  std::vector<T> ckv((size_t)cs[0] * cs[1] * cs[2]);
  std::vector<int> wi((size_t)wis[0] * wis[1] * wis[2]), ti((size_t)tis[0] * tis[1] * tis[2]);
  std::vector<float> params(1), cosv(n_rope), sinv(n_rope), acc(n_acc, NAN), ml(n_acc / D * 2, NAN);
  read(q); read(wkv); read(wi); read(ckv); read(ti); read(params); read(cosv); read(sinv);
  launch(threads, gy, gz, [&](int t, int g, int z, int n) {
    body(q.data(), wkv.data(), wi.data(), ckv.data(), ti.data(), params.data(), cosv.data(), sinv.data(),
         acc.data(), ml.data(), qs, ws, wis, cs, tis, t, g, z, n);
  });
  std::fwrite(acc.data(), 4, acc.size(), stdout);
  std::fwrite(ml.data(), 4, ml.size(), stdout);
  return 0;
}
"""

# The staged partial kernel (attention_decode_staged.py) names its queries as the prefill's do.
STAGED_MAIN = (PARTIAL_MAIN.replace("const T* q,", "const T* queries,").replace("const int* q_shape", "const int* queries_shape"))

MERGE_MAIN = r"""
void body(const float* part_acc, const float* part_ml, const float* sinks, const float* rope_cos,
          const float* rope_sin, T* out, uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int n_acc = read_int(), n_rope = read_int(), n_out = read_int(), gy = read_int(), gz = read_int();
  const int threads = read_int();
  std::vector<float> acc(n_acc), ml(n_acc / D * 2), sinks(H), cosv(n_rope), sinv(n_rope);
  std::vector<T> out(n_out, T(NAN));
  read(acc); read(ml); read(sinks); read(cosv); read(sinv);
  launch(threads, gy, gz, [&](int t, int g, int z, int n) {
    body(acc.data(), ml.data(), sinks.data(), cosv.data(), sinv.data(), out.data(), t, g, z, n);
  });
  std::fwrite(out.data(), 2, out.size(), stdout);
  return 0;
}
"""


def bf16_bytes(a) -> bytes:
    return np.array(a.astype(mx.bfloat16).view(mx.uint16)).tobytes()


def f32_bytes(a) -> bytes:
    return np.array(a.astype(mx.float32)).tobytes()


def i32_bytes(*values) -> bytes:
    return np.array(values, np.int32).tobytes()


class Emulated:
    """pretend_gpu's launch: each 8-row kernel instantiation built once, run on the host."""

    def __init__(self, folder):
        self.folder, self.built, self.launches = folder, {}, []

    def exe(self, kernel, template, main):
        key = (kernel.name, tuple(template))
        if key not in self.built:
            consts = "".join(f"constexpr int {k} = {int(v)};\n" for k, v in template if k != "T")
            mma = MMA_EMULATOR + CP_ASYNC_EMULATOR if kernel is staged.KERNEL else ""
            self.built[key] = build_host(self.folder, f"{kernel.name}_{len(self.built)}",
                                         EMULATOR + BF16 + MAX + mma + consts + kernel.header
                                         + main.replace("BODY", kernel.body))
        return self.built[key]

    def __call__(self, kernel, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value=None):
        assert grid[0] == threadgroup[0] and dict(template)["T"] == mx.bfloat16
        self.launches.append((kernel.name, grid, threadgroup))
        if kernel in (sa.ROWS8_PARTIAL_KERNEL, staged.KERNEL):
            q, wkv, wi, ckv, ti, params, cos, sin = inputs
            n_acc = output_shapes[0][0]
            head = i32_bytes(*q.shape, *wkv.shape, *wi.shape, *ckv.shape, *ti.shape, cos.size, n_acc,
                             grid[1], grid[2], threadgroup[0])
            data = (head + bf16_bytes(q) + bf16_bytes(wkv) + np.array(wi).tobytes() + bf16_bytes(ckv)
                    + np.array(ti).tobytes() + f32_bytes(params) + f32_bytes(cos) + f32_bytes(sin))
            out = self.run(kernel, template, STAGED_MAIN if kernel is staged.KERNEL else PARTIAL_MAIN, data)
            acc = np.frombuffer(out, np.float32)
            return [mx.array(acc[:n_acc]), mx.array(acc[n_acc:])]
        assert kernel is sa.ROWS8_MERGE_KERNEL, kernel.name
        part_acc, part_ml, sinks, cos, sin = inputs
        n_out = int(np.prod(output_shapes[0]))
        data = (i32_bytes(part_acc.size, cos.size, n_out, grid[1], grid[2], threadgroup[0]) + f32_bytes(part_acc)
                + f32_bytes(part_ml) + f32_bytes(sinks) + f32_bytes(cos) + f32_bytes(sin))
        out = self.run(kernel, template, MERGE_MAIN, data)
        return [mx.array(np.frombuffer(out, np.uint16).reshape(output_shapes[0])).view(mx.bfloat16)]

    def run(self, kernel, template, main, data):
        return subprocess.run([str(self.exe(kernel, template, main))], input=data, capture_output=True,
                              check=True).stdout


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return Emulated(tmp_path_factory.mktemp("attention_rows8"))


def case(rng, B, S, H, D, W, N, w, k, invalid=0.25, rope=0, rotate_queries=False):
    f = lambda *shape: mx.array((rng.standard_normal(shape) * 2).astype(np.float32)).astype(mx.bfloat16)
    wi = rng.integers(0, W, (B, S, w)).astype(np.int32)
    ti = rng.integers(0, N, (B, S, k)).astype(np.int32)
    wi[rng.random(wi.shape) < invalid] = -1
    ti[rng.random(ti.shape) < invalid] = -1
    c = dict(q=f(B, S, H, D), window_kv=f(B, W, D), window_idx=mx.array(wi), compressed_kv=f(B, N, D),
             topk_idx=mx.array(ti), sinks=mx.array(rng.standard_normal(H).astype(np.float32)), scale=D ** -0.5)
    if rope:
        theta = rng.uniform(-np.pi, np.pi, (B, S, rope)).astype(np.float32)
        c.update(rope_cos=mx.array(np.cos(theta)), rope_sin=mx.array(np.sin(theta)), rotate_queries=rotate_queries)
    return c


def run_rows8(emulated, c, threadgroups):
    emulated.launches.clear()
    with flags.override(kernel_attention_rows8=True, attention_threadgroups=threadgroups), \
            dialect.pretend_gpu("cuda", emulated):
        got = sa.sparse_attention_kernel(**c)
    assert [name for name, *_ in emulated.launches] == [sa.ROWS8_PARTIAL_KERNEL.name, sa.ROWS8_MERGE_KERNEL.name]
    return np.array(got.astype(mx.float32))


def check(got, c):
    """The GPU tests' bound against the plain-MLX reference: 2^-7 max|kv| + 2^-8 |out|."""
    want = np.array(sa.sparse_attention_reference(**c).astype(mx.float32))
    assert np.isfinite(got).all(), "an output left unwritten (NaN) or non-finite"
    kv_max = max(np.abs(as_np(c)[1]).max(), np.abs(as_np(c)[3]).max())
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * kv_max + 2.0 ** -8 * np.abs(want)), np.abs(got - want).max()


# (B, S, H, D, W, N, w, k, threadgroups): 11 heads = a full and a partial group of 8; one split
# of 29 rows (4 steps, the last of 5 rows) or of 70 (3 index fetches of 32); splits of 8 rows;
# D = 512 with 2 striped chunks a lane.
@pytest.mark.parametrize("B,S,H,D,W,N,w,k,threadgroups", [
    (1, 1, 11, 256, 13, 37, 9, 20, 1),
    (1, 2, 11, 256, 20, 70, 16, 54, 1),
    (2, 1, 3, 512, 21, 50, 16, 43, 64),
])
def test_rows8_kernels_match_reference_and_oracle(emulated, B, S, H, D, W, N, w, k, threadgroups):
    rng = np.random.default_rng()
    c = case(rng, B, S, H, D, W, N, w, k)
    got = run_rows8(emulated, c, threadgroups)
    check(got, c)
    # Spec §3.7 in float64 (probabilities unrounded): the bf16 probabilities and output only.
    kv_max = max(np.abs(as_np(c)[1]).max(), np.abs(as_np(c)[3]).max())
    assert np.abs(got - oracle(*as_np(c))).max() <= 2.0 ** -7 * kv_max


def test_rows8_edge_cases_no_row_one_row_out_of_range(emulated):
    rng = np.random.default_rng()
    c = case(rng, 1, 4, 8, 256, 8, 9, 5, 4, invalid=0.0)
    wi, ti = np.array(c["window_idx"]), np.array(c["topk_idx"])
    wi[0, 0] = -1; ti[0, 0] = -1                   # no valid row -> zeros
    wi[0, 1] = [3, -1, -1, -1, -1]; ti[0, 1] = -1  # exactly one row
    ti[0, 2] = [100, -5, 2, 2]                     # out of range = none; a repeated row counts twice
    wi[0, 3] = [8, 9, -1, 7, 0]                    # window indices >= W = none
    c.update(window_idx=mx.array(wi), topk_idx=mx.array(ti))
    got = run_rows8(emulated, c, 256)
    assert np.all(got[0, 0] == 0)
    check(got, c)


def test_rows8_fused_query_rotation_and_inverse_rope(emulated):
    """Queries rotated as they load (striped dims: pairs stay adjacent) and the output de-rotated
    by the merge's 4 dims a lane, against the reference's rope_reference on both sides."""
    rng = np.random.default_rng()
    c = case(rng, 1, 2, 3, 512, 17, 40, 16, 24, rope=32, rotate_queries=True)
    check(run_rows8(emulated, c, 64), c)
    c = case(rng, 1, 1, 2, 256, 9, 20, 8, 12, rope=8)
    check(run_rows8(emulated, c, 16), c)


def run_staged(emulated, c):
    """sparse_attention's kernel path with DSV4_KERNEL_ATTENTION_STAGED_DECODE: the staged partial
    launch (emulated mma.sync and cp.async) and the 8-row merge, each on the host."""
    emulated.launches.clear()
    with flags.override(kernel_attention_staged_decode=True), dialect.pretend_gpu("cuda", emulated):
        got = sa.sparse_attention_kernel(**c)
    names = [name for name, *_ in emulated.launches]
    assert names == [staged.KERNEL.name, sa.ROWS8_MERGE_KERNEL.name]
    rows = c["window_idx"].shape[-1] + c["topk_idx"].shape[-1]
    assert emulated.launches[0][1][1] == staged.splits(rows)
    return np.array(got.astype(mx.float32))


# (B, S, H, D, W, N, w, k, rope): 29 rows = one split of two tiles (the second partly past the
# rows); 70 rows = splits of 2, 2 and 1 tiles over 4 queries of 32 heads (two head groups); D = 512
# (four 32-dim QK steps and two PV blocks a SIMD group) with the queries rotated in the launch.
@pytest.mark.parametrize("B,S,H,D,W,N,w,k,rope", [
    (1, 1, 16, 256, 13, 37, 9, 20, 0),
    (2, 2, 32, 256, 20, 70, 16, 54, 16),
    (1, 1, 16, 512, 21, 50, 16, 43, 32),
])
def test_staged_decode_kernel_matches_reference_and_oracle(emulated, B, S, H, D, W, N, w, k, rope):
    rng = np.random.default_rng([B, S, H, D])
    c = case(rng, B, S, H, D, W, N, w, k, rope=rope, rotate_queries=rope > 0)
    got = run_staged(emulated, c)
    check(got, c)
    if not rope:   # spec §3.7 in float64: the bf16 probabilities and output only
        kv_max = max(np.abs(as_np(c)[1]).max(), np.abs(as_np(c)[3]).max())
        assert np.abs(got - oracle(*as_np(c))).max() <= 2.0 ** -7 * kv_max


def test_staged_decode_window_only_layer(emulated):
    """A layer without compressed rows: the dispatcher's stand-in row (never selected) makes 9
    tiles of the window's 128 rows and it, in 5 splits."""
    rng = np.random.default_rng(4)
    c = dict(case(rng, 1, 1, 16, 256, 128, 1, 128, 1, rope=16, rotate_queries=True), compressed_kv=None, topk_idx=None)
    emulated.launches.clear()
    with flags.override(kernel_attention_staged_decode=True), dialect.pretend_gpu("cuda", emulated):
        got = np.array(sa.sparse_attention_kernel(**c).astype(mx.float32))
    assert [(name, grid[1]) for name, grid, _ in emulated.launches][0] == (staged.KERNEL.name, 5)
    want = np.array(sa.sparse_attention_reference(**c).astype(mx.float32))
    kv_max = float(mx.max(mx.abs(c["window_kv"].astype(mx.float32))))
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * kv_max + 2.0 ** -8 * np.abs(want))


def test_staged_decode_edge_cases_no_row_one_row_out_of_range(emulated):
    rng = np.random.default_rng(3)
    c = case(rng, 1, 4, 16, 256, 8, 40, 5, 36, invalid=0.0)
    wi, ti = np.array(c["window_idx"]), np.array(c["topk_idx"])
    wi[0, 0] = -1; ti[0, 0] = -1                              # no valid row -> zeros
    wi[0, 1] = [3, -1, -1, -1, -1]; ti[0, 1] = -1             # exactly one row, in the first split
    ti[0, 2] = -1; ti[0, 2, 30] = 7; wi[0, 2] = -1            # exactly one row, in the second split
    ti[0, 3, :4] = [100, -5, 2, 2]; wi[0, 3] = [8, 9, -1, 7, 0]   # out of range = none; a repeat counts twice
    c.update(window_idx=mx.array(wi), topk_idx=mx.array(ti))
    got = run_staged(emulated, c)
    assert np.all(got[0, 0] == 0)
    check(got, c)


def test_rows8_applies_only_to_its_shapes(monkeypatch):
    q = lambda D, dtype=mx.bfloat16: mx.zeros((1, 1, 2, D), dtype)
    with flags.override(kernel_attention_rows8=True):
        assert sa.rows8_applies(q(512)) and sa.rows8_applies(q(256))
        assert not sa.rows8_applies(q(512, mx.float32)) and not sa.rows8_applies(q(128))
        assert not sa.rows8_applies(q(1024))
    # auto: on under CUDA only, where an H100 measured it faster (no Mac has)
    for gpu, default in (("cuda", True), ("metal", False), (None, False)):
        monkeypatch.setattr(sa, "backend", lambda: gpu)
        assert bool(sa.rows8_applies(q(512))) is default
        with flags.override(kernel_attention_rows8="off"):
            assert not sa.rows8_applies(q(512))
