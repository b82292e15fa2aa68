"""Dense quantized matvec with fused fp8 input rounding (dsv4/kernels/matvec.py), what the CPU
can check: the plain-MLX reference against a numpy transcription (the independent decoder of
test_kernels_experts, the fp8 rounding of test_quant), `fp8_linear`'s CPU path, the kernel's
dispatch rules and work split, and the kernel body compiled and run on the host (fp32 x)
against numpy. The kernel on the device: tests/test_kernels_matvec_gpu.py."""

import subprocess
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import matvec as mv
from dsv4.kernels.experts import MODE_IDS, X_STRIDE
from dsv4.linear import Linear, fp8_linear
from dsv4.quant import qdq_fp8
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_experts import bf16, dequantize_np, quantized
from tests.test_quant import ref_qdq_fp8

MODES = [("mxfp8", 8, 32), ("mxfp4", 4, 32), ("affine", 4, 64), ("affine", 3, 32)]


def inputs(rng, tokens, K):
    """Blocks of 32 over many magnitudes (the fp8 scale differs per block) and a zero block."""
    x = rng.standard_normal((tokens, K)) * 10.0 ** rng.integers(-3, 3, (tokens, K // 32)).repeat(32, -1)
    x[0, :32] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("mode,bits,gs", MODES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("act_quant", [False, True])
def test_reference_matches_numpy_transcription(mode, bits, gs, dtype, act_quant):
    rng = np.random.default_rng()
    N, K, T = 48, 256, 3
    q = quantized(rng, (N, K), mode, bits, gs, mx.float32)
    x = mx.array(inputs(rng, T, K)).astype(dtype)
    got = np.array(mv.matvec_reference(x, q, act_quant).astype(mx.float32)).astype(np.float64)
    xs = np.array(x.astype(mx.float32))
    xin = (ref_qdq_fp8(xs) if act_quant else xs).astype(np.float64)
    exact = xin @ dequantize_np(q).T                          # float64: the exact product
    want = bf16(exact) if dtype == mx.bfloat16 else exact.astype(np.float32).astype(np.float64)
    # The reference sums in fp32: error <= K * 2^-24 * sum|w x| (summation), then one rounding
    # of the output to x's dtype that may fall on the other side of a boundary (1 ulp, <= 2^-7
    # relative in bf16).
    mag = np.abs(xin) @ np.abs(dequantize_np(q)).T
    ulp = 2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -23
    assert np.all(np.abs(got - want) <= ulp * np.abs(want) + K * 2.0 ** -24 * mag)
    assert got.shape == (T, N) and mv.matvec_reference(x, q, act_quant).dtype == dtype


@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_linear_on_cpu_is_the_layer_on_the_rounded_input(act_quant):
    layer = Linear(128, 40, bias=False).to_quantized(32, 8, "mxfp8")
    x = mx.array(inputs(np.random.default_rng(), 2, 128)).astype(mx.bfloat16)
    with flags.override(act_quant=act_quant, kernel_matvec=True):
        got = fp8_linear(layer, x)
    want = layer(qdq_fp8(x) if act_quant else x)
    assert mx.array_equal(got, want).item() and got.dtype == x.dtype
    if act_quant:   # the rounding is applied (a test that cannot pass with it left out)
        assert not mx.array_equal(got, layer(x)).item()


def test_fp8_linear_takes_the_kernel_only_where_it_applies():
    layer = Linear(64, 32, bias=False).to_quantized(32, 4, "mxfp4")
    x = mx.ones((1, 64), mx.bfloat16)
    sentinel = mx.zeros((1, 32), mx.bfloat16)
    with mock.patch("dsv4.linear.kernel_supports", return_value=True), \
            mock.patch("dsv4.linear.quantized_matvec", return_value=sentinel) as kernel:
        with flags.override(kernel_matvec=True, act_quant=True):
            assert fp8_linear(layer, x) is sentinel
        assert kernel.call_args.args[2] is True and kernel.call_args.args[1].mode == "mxfp4"
        with flags.override(kernel_matvec=False):
            assert fp8_linear(layer, x) is not sentinel
        dense = Linear(64, 32, bias=False)
        assert fp8_linear(dense, x) is not sentinel
        assert kernel.call_count == 1


def test_auto_takes_the_kernel_where_it_measured_faster():
    """kernel_matvec=auto: only for an input still to be rounded and >= MATVEC_AUTO_MIN_ROWS
    rows (wo_b); not for a plain projection, a pre-rounded input or a small one."""
    from dsv4.linear import MATVEC_AUTO_MIN_ROWS, fp8_linears
    big = Linear(64, MATVEC_AUTO_MIN_ROWS, bias=False).to_quantized(32, 8, "mxfp8")
    small = Linear(64, MATVEC_AUTO_MIN_ROWS - 32, bias=False).to_quantized(32, 8, "mxfp8")
    x = mx.ones((1, 64), mx.bfloat16)
    sentinel = mx.zeros((1, 1), mx.bfloat16)
    with mock.patch("dsv4.linear.kernel_supports", return_value=True), \
            mock.patch("dsv4.linear.quantized_matvec", return_value=sentinel) as kernel, \
            flags.override(kernel_matvec="auto", act_quant=True):
        assert fp8_linear(big, x) is sentinel
        assert fp8_linear(small, x) is not sentinel
        assert fp8_linears(x, big, rounded=qdq_fp8(x))[0] is not sentinel
        assert big(x) is not sentinel
        with flags.override(act_quant=False):
            assert fp8_linear(big, x) is not sentinel
        assert kernel.call_count == 1
    with flags.override(kernel_matvec="sometimes"), pytest.raises(ValueError, match="auto, on or off"):
        fp8_linear(big, x)

def test_kernel_supports_refuses_what_the_kernel_cannot_do():
    rng = np.random.default_rng()
    q = quantized(rng, (64, 128), "mxfp8", 8, 32)
    x = mx.ones((2, 128), mx.bfloat16)
    assert not mv.kernel_supports(x, q), "the CPU has no kernel backend"
    with mock.patch.object(mv, "backend", return_value="cuda"):
        assert mv.kernel_supports(x, q)
        assert mv.kernel_supports(mx.ones((128,), mx.bfloat16), q), "one token, no leading dims"
        assert mv.kernel_supports(mx.ones((2, 4, 128), mx.float32), q)
        grouped = mx.ones((3, 2, 128), mx.bfloat16)   # MLX's packs: grouped only in the multi-token launch
        assert not mv.kernel_supports(grouped, q, groups=2)
        with flags.override(kernel_matvec_tokens=True):
            assert mv.kernel_supports(grouped, q, groups=2) and not mv.kernel_supports(grouped[:1], q, groups=2)
        assert not mv.kernel_supports(mx.ones((9, 128), mx.bfloat16), q), "more than 8 tokens"
        assert not mv.kernel_supports(mx.ones((3, 3, 128), mx.bfloat16), q), "more than 8 tokens"
        assert not mv.kernel_supports(mx.ones((2, 96), mx.bfloat16), q), "K differs from the matrix's"
        assert not mv.kernel_supports(mx.ones((2, 128), mx.int32), q), "not a float dtype"
        assert not mv.kernel_supports(mx.ones((0, 128), mx.bfloat16), q), "no tokens"
        stacked = quantized(rng, (2, 64, 128), "mxfp8", 8, 32)
        assert not mv.kernel_supports(x, stacked), "stacked experts"
        wide = quantized(rng, (32, 16384), "mxfp4", 4, 32)
        assert not mv.kernel_supports(mx.ones((1, 16384), mx.bfloat16), wide), "x's copy too large"
        affine5 = quantized(rng, (64, 128), "affine", 5, 32)
        assert not mv.kernel_supports(x, affine5), "5-bit packing"


@pytest.mark.parametrize("long_threadgroups", ["on", "off"])
@pytest.mark.parametrize("n,k,gs", [(1280, 5120, 32), (512, 5120, 32), (32768, 1280, 32), (5120, 8192, 32),
                                    (96, 64, 32), (96, 128, 64), (96, 128, 128), (32, 32, 32), (200, 96, 32)])
def test_work_split_keeps_what_the_kernel_assumes(n, k, gs, long_threadgroups):
    """Slices of K whole packs and whole scale groups, one row per SIMD group when split, rows
    of a threadgroup within its shared partial sums, enough SIMD groups for small n, and more
    rows a SIMD group only while the threadgroups stay at the policy's floor."""
    with flags.override(kernel_matvec_long_threadgroups=long_threadgroups):
        split, rows = mv.work_split(n, k, gs)
        in_flight, floor = mv.split_limits()
    assert (in_flight, floor) == ((mv.LONG_THREADGROUPS * mv.WARPS, mv.LONG_THREADGROUPS)
                                  if long_threadgroups == "on" else (mv.IN_FLIGHT_ROWS, 128))
    assert split in (1, 2, 4) and rows in (1, 2, 4)
    assert k % (split * max(32, gs)) == 0
    assert split == 1 or rows == 1
    assert mv.WARPS <= 32
    if split == 1 and k % (2 * max(32, gs)) == 0:
        assert n >= in_flight / 2, "small n with K divisible should split"
    if rows > 1:
        assert n // (mv.WARPS * rows) >= floor, "fewer threadgroups than the floor"
    else:
        assert n < 2 * floor * mv.WARPS, "a large n should take more rows a SIMD group"
    assert mv.split_fits(n, k, gs, 1, split, rows), "work_split's pick is a shape the launch runs"


def test_split_fits_what_the_launch_runs():
    """benchmarks/matvec_split.py's shapes: a split row takes one row a SIMD group and whole packs
    (and scale groups) a slice; a grouped projection's threadgroups stay in one group."""
    assert mv.split_fits(1280, 5120, 32, 1, 4, 1) and mv.split_fits(1280, 5120, 32, 1, 1, 4)
    assert not mv.split_fits(1280, 5120, 32, 1, 2, 2), "a split row with 2 rows"
    assert not mv.split_fits(96, 64, 32, 1, 4, 1), "slices of half a pack"
    assert not mv.split_fits(96, 128, 64, 1, 4, 1), "slices of half a scale group"
    assert not mv.split_fits(1280, 5120, 32, 1, 8, 1) and not mv.split_fits(1280, 5120, 32, 1, 1, 8)
    assert mv.split_fits(8192, 4096, 32, 8, 1, 4) and not mv.split_fits(48, 64, 32, 3, 1, 4)


# rows: a SIMD group's, as mv.tokens_rows gives them (2 from TOKENS_ROWS2_MIN rows, here on fewer
# rows: the emulator's time grows with n).
@pytest.mark.parametrize("n,k,mode,bits,gs,act_quant,tokens,rows", [
    (37, 1280, "mxfp8", 8, 32, True, 2, 1),      # 40 packs: a segment of 32, then 8 (lanes 8.. idle)
    (40, 512, "mxfp4", 4, 32, False, mv.MAX_TOKS, 1),
    (33, 128, "affine", 3, 64, True, 3, 1),      # 3-bit words straddling packs, x's sums per pack
    (68, 64, "mxfp8", 8, 32, True, 4, 2),        # 2 rows a SIMD group; the last threadgroup clamps
])
def test_tokens_body_gives_the_one_token_bodys_sums(tmp_path, n, k, mode, bits, gs, act_quant, tokens, rows):
    """DSV4_KERNEL_MATVEC_TOKENS' body on the host: every token's outputs equal, bit for bit, the
    one-token body's at SPLIT 1 (each row's packs in the same order per lane, each weight decoded
    once for all the tokens), and lie within the fp32 bound of the float64 product."""
    rng = np.random.default_rng()
    q = quantized(rng, (n, k), mode, bits, gs, mx.float32)
    x = inputs(rng, tokens, k)
    assert rows == 1 or mv.tokens_rows(mv.TOKENS_ROWS2_MIN) == rows
    got = emulated_kernel(tmp_path, q, x, act_quant, 1, rows, tokens_launch=True)
    np.testing.assert_array_equal(got, emulated_kernel(tmp_path, q, x, act_quant, 1, 1))
    xin = (ref_qdq_fp8(x) if act_quant else x).astype(np.float64)
    want, mag = xin @ dequantize_np(q).T, np.abs(xin) @ np.abs(dequantize_np(q)).T
    assert np.all(np.abs(got - want) <= 2 * k * 2.0 ** -24 * mag + 1e-30), np.abs(got - want).max()


@pytest.mark.parametrize("n,k,groups,tokens,rows", [
    (64, 256, 4, 3, 1),      # 4 groups of 16 rows: 2 threadgroups a group
    (256, 64, 8, 5, 2),      # V4.1's wo_a's 8 groups (of 1024 rows there) at 2 rows a SIMD group
])
def test_grouped_tokens_body_gives_the_one_token_bodys_sums(tmp_path, n, k, groups, tokens, rows):
    """A grouped projection of MLX's packs (V4.1's wo_a, without the input's rounding) through the
    multi-token body: each threadgroup copies its group's x, and the outputs equal the grouped
    one-token body's at SPLIT 1 bit for bit, within the fp32 bound of the float64 product."""
    rng = np.random.default_rng()
    q = quantized(rng, (n, k), "mxfp8", 8, 32, mx.float32)
    x = np.stack([inputs(rng, groups, k) for _ in range(tokens)])                 # [tokens, G, K]
    assert rows == 1 or mv.tokens_rows(mv.TOKENS_ROWS2_MIN) == rows
    assert mv.grouped_fits(n, groups, 1, rows) and mv.grouped_fits(n, groups, 1, 1)
    got = emulated_kernel(tmp_path, q, x, False, 1, rows, tokens_launch=True, groups=groups)
    np.testing.assert_array_equal(got, emulated_kernel(tmp_path, q, x, False, 1, 1, groups=groups))
    w = dequantize_np(q).reshape(groups, n // groups, k)
    want = np.einsum("tgk,gnk->tgn", x.astype(np.float64), w).reshape(tokens, n)
    mag = np.einsum("tgk,gnk->tgn", np.abs(x.astype(np.float64)), np.abs(w)).reshape(tokens, n)
    assert np.all(np.abs(got - want) <= 2 * k * 2.0 ** -24 * mag + 1e-30), np.abs(got - want).max()


def test_tokens_launch_only_where_it_applies():
    """The multi-token launch over MLX's packs: with its switch, 2..MAX_TOKS tokens; never one
    token or more than MAX_TOKS; grouped, only where each threadgroup's rows lie in one group
    (GGUF blocks: test_kernels_gguf_host.test_gguf_tokens_launch_only_where_it_applies)."""
    rng = np.random.default_rng()
    q = quantized(rng, (64, 128), "mxfp8", 8, 32)
    with flags.override(kernel_matvec_tokens=True):
        assert mv.tokens_applies(q, 2) and mv.tokens_applies(q, mv.MAX_TOKS)
        assert not mv.tokens_applies(q, 1) and not mv.tokens_applies(q, mv.MAX_TOKS + 1)
        assert mv.tokens_applies(q, 4, groups=2) and not mv.tokens_applies(q, 4, groups=16), "4 rows a group"
    assert not mv.tokens_applies(q, 4), "off by default"


# --- the kernel body itself, run on the host --------------------------------------------------
# The body and header are compiled with clang under test_kernels_decode_host's host prelude
# and run as a threadgroup of threads, each a fiber (ucontext) taking turns on one OS thread, so
# a wait costs a context switch and not a futex: SHARED is a static shared by the threads of the
# threadgroup in flight (threadgroups run one after another, `launch`), BARRIER a barrier of
# fibers, and simd_sum_f / simd_max_f / simd_xor_f exchanges between the 32 threads of a SIMD
# group; a body wrapper starts with EMULATED_IDS(tid) and reads its inputs with `read`. This
# checks the kernel's own indexing (rows per SIMD group, K slices, partial sums, the last
# threadgroup's clamped rows) for fp32 x; the GPU test runs the same body on the device.

EMULATOR = r"""
// Fibers: every thread of the threadgroup in flight is a ucontext with its own stack, run in
// turn on one OS thread. A thread runs until it waits at a barrier, then the next one runs.
struct EmulatedThread { ucontext_t context; uint32_t lane = 0, warp = 0; bool done = false; };
uint32_t t_lane, t_warp;   // the running thread's ids (EMULATED_IDS), restored at each resume
EmulatedThread* running;
ucontext_t scheduler;
unsigned long progress;    // arrivals and finished threads: a pass without any is a deadlock
inline void yield_thread() {
  EmulatedThread* self = running;
  self->lane = t_lane;
  self->warp = t_warp;
  swapcontext(&self->context, &scheduler);
  t_lane = self->lane;
  t_warp = self->warp;
}
// std::barrier's arrive_and_wait for fibers: the last to arrive goes on, the others wait.
struct EmulatedBarrier {
  int n, count = 0;
  unsigned generation = 0;
  explicit EmulatedBarrier(int n) : n(n) {}
  void arrive_and_wait() {
    const unsigned g = generation;
    ++progress;
    if (++count == n) { count = 0; ++generation; return; }
    while (generation == g) yield_thread();
  }
};
float warp_vals[32][32];
std::unique_ptr<EmulatedBarrier> warp_bar[32], group_bar;
// Every lane of the SIMD group posts v, then reads what it needs: the lanes' values in order
// (a sum in lane order, a max) or one lane's.
template <typename F>
inline float emulated_warp_op(float v, F read) {
  warp_vals[t_warp][t_lane] = v;
  warp_bar[t_warp]->arrive_and_wait();
  const float r = read(warp_vals[t_warp]);
  warp_bar[t_warp]->arrive_and_wait();
  return r;
}
inline float emulated_simd_sum(float v) {
  return emulated_warp_op(v, [](const float* w) { float s = 0.0f; for (int i = 0; i < 32; ++i) s += w[i]; return s; });
}
inline float emulated_simd_max(float v) {
  return emulated_warp_op(v, [](const float* w) { float m = w[0]; for (int i = 1; i < 32; ++i) m = std::fmax(m, w[i]); return m; });
}
inline float emulated_simd_xor(float v, int mask) {
  return emulated_warp_op(v, [mask](const float* w) { return w[t_lane ^ (uint32_t)mask]; });
}
// A lane's int from lane src (through the lanes' exchange, as bits).
inline int emulated_simd_shuffle(int v, int src) {
  return (int)host_as_uint(emulated_warp_op(host_as_float((uint32_t)v), [src](const float* w) { return w[src]; }));
}
#undef simd_sum_f
#define simd_shuffle_i emulated_simd_shuffle
#define simd_sum_f emulated_simd_sum
#define simd_max_f emulated_simd_max
#define simd_xor_f emulated_simd_xor
#define SHARED static
#define BARRIER() group_bar->arrive_and_wait()
struct Shape2 { int v[2]; int operator[](int i) const { return v[i]; } };
// The body's lane and SIMD group ids, also told to the exchanges above.
#define EMULATED_IDS(tid) const uint32_t lane = (tid) & 31u, warp = (tid) >> 5; t_lane = lane; t_warp = warp;
// Inputs on stdin: an int, or a whole vector.
inline int read_int() {
  int v;
  if (std::fread(&v, 4, 1, stdin) != 1) std::exit(2);
  return v;
}
template <class V> void read(V& v) {
  if (std::fread(v.data(), sizeof(v[0]), v.size(), stdin) != v.size()) std::exit(2);
}
std::function<void(int)> thread_body;
void start_thread(int t) {
  thread_body(t);
  running->done = true;
  ++progress;
}
// run(thread, group_y, group_z, threads) for every thread of the grid, a threadgroup at a time.
// A threadgroup whose threads all wait with none arriving is stuck: exit 3, where real threads
// would hang.
template <class F> void launch(int threads, int groups_y, int groups_z, F run) {
  constexpr size_t STACK = 1 << 20;
  static std::vector<std::unique_ptr<char[]>> stacks;
  while ((int)stacks.size() < threads) stacks.emplace_back(new char[STACK]);
  std::vector<EmulatedThread> pool(threads);
  for (int i = 0; i < threads / 32; ++i) warp_bar[i] = std::make_unique<EmulatedBarrier>(32);
  for (int z = 0; z < groups_z; ++z)
    for (int g = 0; g < groups_y; ++g) {
      group_bar = std::make_unique<EmulatedBarrier>(threads);
      thread_body = [&](int t) { run(t, g, z, threads); };
      for (int t = 0; t < threads; ++t) {
        pool[t] = EmulatedThread();
        getcontext(&pool[t].context);
        pool[t].context.uc_stack.ss_sp = stacks[t].get();
        pool[t].context.uc_stack.ss_size = STACK;
        pool[t].context.uc_link = &scheduler;
        makecontext(&pool[t].context, (void (*)())start_thread, 1, t);
      }
      for (int left = threads; left > 0;) {
        const unsigned long before = progress;
        for (auto& thread : pool) {
          if (thread.done) continue;
          running = &thread;
          swapcontext(&scheduler, &thread.context);
          left -= thread.done;
        }
        if (left > 0 && progress == before) {
          std::fprintf(stderr, "emulated threadgroup (%d, %d) stuck at a barrier\n", g, z);
          std::exit(3);
        }
      }
    }
}
"""

EMULATOR_MAIN = r"""
void body(const float* x, const uint32_t* w, Shape2 w_shape, const SCALE* s, const SCALE* b, float* y,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  using T = float;
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int n = read_int(), tokens = read_int();
  std::vector<float> x(tokens * GROUPS * K), y(tokens * n, NAN);
  std::vector<uint32_t> w((size_t)n * K * BITS / 32);
  std::vector<SCALE> s((size_t)n * K / GS), b((size_t)n * K / GS);
  read(x); read(w); read(s);
  if (MODE == 0) read(b);
  launch(32 * WARPS, (n * SPLIT + WARPS * ROWS - 1) / (WARPS * ROWS), tokens, [&](int t, int g, int z, int threads) {
    body(x.data(), w.data(), Shape2{{n, 0}}, s.data(), b.data(), y.data(), t, g, z, threads);
  });
  std::fwrite(y.data(), 4, y.size(), stdout);
  return 0;
}
"""


def emulated_kernel(tmp_path, q, x, act_quant, split, rows, tokens_launch=False, groups=1):
    """quantized_matvec's body run on the host for fp32 x [tokens, K] (or [tokens, groups, K]: row r
    of q takes group r // (N / groups)) with the given work split, or (`tokens_launch`) the
    multi-token body (DSV4_KERNEL_MATVEC_TOKENS: one launch for every token)."""
    tokens, K = x.shape[0], x.shape[-1]
    N = q.out_features
    consts = dict(WARPS=mv.WARPS, MODE=MODE_IDS[q.mode], BITS=q.bits, GS=q.group_size, SPLIT=split,
                  ROWS=rows, K=K, XS=X_STRIDE, ACTQ=int(bool(act_quant)), GROUPS=groups, TOKS=tokens)
    scale = "uint8_t" if q.mode != "affine" else "float"
    main, kernel = EMULATOR_MAIN, mv.MATVEC_KERNEL
    if tokens_launch:   # one threadgroup row for all the tokens
        main, kernel = main.replace("(WARPS * ROWS), tokens, [&]", "(WARPS * ROWS), 1, [&]"), mv.TOKENS_MATVEC_KERNEL
    exe = build_host(tmp_path, "matvec", EMULATOR + "".join(f"constexpr int {k} = {v};\n" for k, v in consts.items())
                     + kernel.header + main.replace("BODY", kernel.body).replace("SCALE", scale))
    scales = np.array(q.scales.astype(mx.float32) if q.mode == "affine" else q.scales)
    biases = np.array(q.biases.astype(mx.float32)).tobytes() if q.mode == "affine" else b""
    data = (np.array([N, tokens], np.int32).tobytes() + np.asarray(x, np.float32).tobytes()
            + np.array(q.weight).tobytes() + scales.tobytes() + biases)
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    return np.frombuffer(out, np.float32).reshape(tokens, N)


def test_the_emulator_reports_a_thread_that_never_reaches_a_barrier(tmp_path):
    """Real threads would wait there forever; the emulator's fibers exit 3, naming the
    threadgroup (the second of the launch: the first passes)."""
    source = EMULATOR + r"""
int main() {
  launch(64, 2, 1, [&](int t, int g, int, int) {
    EMULATED_IDS(t)
    if (g == 1 && t == 37) return;
    simd_sum_f(1.0f);
    BARRIER();
  });
  return 0;
}"""
    result = subprocess.run([str(build_host(tmp_path, "stuck", source))], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3 and "threadgroup (1, 0) stuck at a barrier" in result.stderr


@pytest.mark.parametrize("n,k,mode,bits,gs,act_quant", [
    (40, 512, "mxfp8", 8, 32, True),        # K in 4 slices; 10 threadgroups of 2 rows
    (37, 128, "mxfp4", 4, 32, False),       # 4 slices of one pack; the last threadgroup has 1 row of 2
    (96, 128, "affine", 4, 64, True),       # 2 slices of one scale group each
    (2100, 64, "affine", 3, 32, True),      # 2 rows per SIMD group, 3-bit words; last group clamps
    (4100, 32, "mxfp8", 8, 32, False),      # 4 rows per SIMD group, one pack per row
])
def test_kernel_body_on_the_host(tmp_path, n, k, mode, bits, gs, act_quant):
    rng = np.random.default_rng()
    q = quantized(rng, (n, k), mode, bits, gs, mx.float32)
    split, rows = mv.work_split(n, k, gs)
    x = inputs(rng, 2, k)
    got = emulated_kernel(tmp_path, q, x, act_quant, split, rows).astype(np.float64)
    xin = (ref_qdq_fp8(x) if act_quant else x).astype(np.float64)
    want = xin @ dequantize_np(q).T
    mag = np.abs(xin) @ np.abs(dequantize_np(q)).T
    # fp32 sums in some order: within 2 K 2^-24 sum|w x| of the exact float64 product.
    assert np.all(np.abs(got - want) <= 2 * k * 2.0 ** -24 * mag + 1e-30), np.abs(got - want).max()


def two_layers(layout: str, rng):
    """wq_a and wkv as a model holds them, at toy widths (96 and 32 rows of 256), in `layout`."""
    from dsv4.linear import GGUFLinear
    from dsv4.testing import gguf_block_weight
    if layout == "Q8_0":
        layers = [GGUFLinear(256, n, "Q8_0") for n in (96, 32)]
        for layer in layers:
            layer.weight = mx.array(gguf_block_weight(rng, layer.weight.shape[:1] + (256,), "Q8_0"))
        return layers
    return [Linear(256, n, bias=False).to_quantized(32, 8, layout) for n in (96, 32)]


@pytest.mark.parametrize("layout", ["mxfp8", "Q8_0"])
@pytest.mark.parametrize("pre_rounded", [False, True])
def test_joined_projections_are_one_launch_over_the_stacked_rows(layout, pre_rounded):
    """DSV4_KERNEL_MATVEC_JOINED: a one-token x's wq_a and wkv as one matvec over their rows
    stacked, each output the reference matvec by its own layer's weight; the layers keep views of
    the stacked matrix (their values, no memory added), made once."""
    from dsv4.linear import fp8_linears, join_rows, matrix_operand
    rng = np.random.default_rng(3)
    a, b = two_layers(layout, rng)
    x = mx.array(inputs(rng, 1, 256)).astype(mx.bfloat16).reshape(1, 1, 256)
    rounded = qdq_fp8(x) if pre_rounded else None
    want = [mv.matvec_reference(x, matrix_operand(layer), True) for layer in (a, b)]
    weights = [np.array(layer["weight"]) for layer in (a, b)]
    calls = []

    def kernel(x, q, act_quant, groups=1):
        calls.append((q.out_features, act_quant))
        return mv.matvec_reference(x, q, act_quant, groups)

    mx.eval(want)
    with mock.patch("dsv4.linear.kernel_supports", return_value=True), \
            mock.patch("dsv4.linear.quantized_matvec", side_effect=kernel), \
            flags.override(kernel_matvec_joined=True, act_quant=True):
        before = mx.get_active_memory()
        q, ends = join_rows((a, b))
        assert mx.get_active_memory() - before < weights[0].nbytes / 2, "the layers' weights held twice"
        got = fp8_linears(x, a, b, rounded=rounded)
        mx.eval(got)
        assert calls == [(128, not pre_rounded)]
        for g, w in zip(got, want):
            assert g.shape == w.shape and mx.array_equal(g, w).item()
        for layer, w in zip((a, b), weights):
            np.testing.assert_array_equal(np.array(layer["weight"]), w)
        assert ends == (96, 128) and join_rows((a, b))[0] is q
        fp8_linears(x, a, b)
        assert len(calls) == 2 and calls[-1][0] == 128
        a.weight = mx.array(weights[0]) if layout == "Q8_0" else a.weight + 0   # replaced: joined again
        assert join_rows((a, b))[0] is not q


def test_joined_projections_only_where_one_launch_can_make_them():
    """Not joined: two tokens (the outputs' rows would not be contiguous), layers of two layouts,
    the switch off, or the kernel switched off; each layer then takes its own path."""
    from dsv4.linear import fp8_linears
    rng = np.random.default_rng(4)
    a, b = two_layers("mxfp8", rng)
    c = Linear(256, 32, bias=False).to_quantized(32, 4, "mxfp4")
    one, two = (mx.array(inputs(rng, n, 256)).astype(mx.bfloat16).reshape(1, n, 256) for n in (1, 2))
    calls = []

    def kernel(x, q, act_quant, groups=1):
        calls.append(q.out_features)
        return mv.matvec_reference(x, q, act_quant, groups)

    with mock.patch("dsv4.linear.kernel_supports", return_value=True), \
            mock.patch("dsv4.linear.quantized_matvec", side_effect=kernel), \
            flags.override(kernel_matvec_joined=True, kernel_matvec="on", act_quant=True):
        for x, layers in ((two, (a, b)), (one, (a, c))):
            fp8_linears(x, *layers)
        with flags.override(kernel_matvec_joined=False):
            fp8_linears(one, a, b)
        assert calls == [96, 32, 96, 32, 96, 32]
        with flags.override(kernel_matvec="off"):
            fp8_linears(one, a, b)
        assert len(calls) == 6 and "_joined_rows" not in a.__dict__
