"""Prefill's routed experts on tensor cores (dsv4/kernels/experts_prefill.py) run on the host, CPU,
in CI: the body compiled with clang under the threadgroup emulator (test_kernels_matvec) and
the mma.sync emulator (tests/mma_emulator.py), and launched by the dispatcher itself
(`prefill_experts` under dialect.pretend_gpu, each launch running the host build), so the pairs'
sorting, the tiles and the order of the result are checked with the body. Each pair's row must
match the float64 product of its x and its expert's dequantized weights, rounded to bf16,
within fp32 summation's bound; a mutated fragment layout must fail. Unverified here: the real
instruction and the speed (the H200)."""

import subprocess
import warnings

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import dialect, experts_prefill
from dsv4.linear import ExpertLinear
from tests.mma_emulator import CP_ASYNC_EMULATOR, MMA_EMULATOR, MUTATIONS
from tests.test_kernels_decode_host import build_kernel
from tests.test_kernels_experts import dequantize_np
from tests.test_kernels_experts_host import BF16, bf16_bits, from_bf16_bits
from tests.test_kernels_matvec import EMULATOR
from dsv4.kernels import experts as ex

MAIN = r"""
void body(const T* x, const uint32_t* w, const uint8_t* s, const int* tiles, const int* x_rows, const int* y_rows,
          T* y, uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int pairs = read_int(), x_count = read_int(), rows = read_int(), n_tiles = read_int();
  std::vector<T> x((size_t)x_count * K), y((size_t)pairs * N, T(NAN));
  std::vector<uint32_t> w((size_t)rows * K * BITS / 32);
  std::vector<uint8_t> s((size_t)rows * K / 32);
  std::vector<int> tiles(3 * n_tiles), x_rows(pairs), y_rows(pairs);
  read(x); read(w); read(s); read(tiles); read(x_rows); read(y_rows);
  launch(THREADS, (N + ROWS - 1) / ROWS, n_tiles, [&](int t, int g, int z, int threads) {
    body(x.data(), w.data(), s.data(), tiles.data(), x_rows.data(), y_rows.data(), y.data(), t, g, z, threads);
  });
  std::fwrite(y.data(), 2, y.size(), stdout);
  return 0;
}
"""


def host_launch(folder, mutation="", body_mutations=()):
    """A pretend_gpu launch that builds and runs the body on the host; `body_mutations`: (old, new)
    replacements in the source built."""

    def exe(kernel, values, main):
        return build_kernel(folder, kernel, {**values, "ROWS": launch_rows(kernel)}.items(),
                            EMULATOR + BF16 + mutation + MMA_EMULATOR + CP_ASYNC_EMULATOR, main,
                            after=f"constexpr int THREADS = {experts_prefill.THREADS};\n", edits=body_mutations)

    def launch(kernel, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template, **_):
        launch.kernels.append(kernel.name)
        values = {n: v for n, v in template if isinstance(v, int)}
        assert kernel in (experts_prefill.KERNEL, experts_prefill.KERNEL_BF16, experts_prefill.KERNEL_STREAM)
        assert threadgroup == (experts_prefill.THREADS, 1, 1)
        x, w, s, tiles, x_rows, y_rows = inputs
        (pairs, n), = output_shapes
        assert grid == (experts_prefill.THREADS, -(-n // launch_rows(kernel)), tiles.shape[0])
        assert x_rows.dtype == y_rows.dtype == mx.int32 and x_rows.shape == y_rows.shape == (pairs,)
        head = np.array([pairs, x.shape[0], w.shape[0] * w.shape[1], tiles.shape[0]], np.int32).tobytes()
        data = head + bf16_bits(x) + b"".join(np.array(a).tobytes() for a in (w, s, tiles, x_rows, y_rows))
        out = subprocess.run([str(exe(kernel, values, MAIN))], input=data, capture_output=True, check=True).stdout
        return [from_bf16_bits(out, (pairs, n))]

    launch.kernels = []
    return launch


def launch_rows(kernel) -> int:
    bf16_tiles = kernel in (experts_prefill.KERNEL_BF16, experts_prefill.KERNEL_STREAM)
    return experts_prefill.BF16_TILE_ROWS if bf16_tiles else experts_prefill.TILE_ROWS


def problem(rng, mode, experts, n, k, pairs, tile=experts_prefill.TILE_PAIRS):
    """Stacked MX experts [experts, n, k] and `pairs` rows of bf16 x spanning 2^-20..2^2 across
    their packs, each through a random expert (one of them unused, one with more than a tile of
    `tile` pairs)."""
    stack = ExpertLinear(k, n, experts)
    stack.weight = mx.array(rng.standard_normal((experts, n, k)).astype(np.float32) * 0.05)
    layer = stack.to_quantized(group_size=32, bits=experts_prefill.MX_MODES[mode], mode=mode)
    ids = np.concatenate([np.full(tile + 5, 1), rng.integers(2, experts, pairs - tile - 5)])
    ids = rng.permutation(ids).astype(np.uint32)
    spread = 2.0 ** rng.integers(-20, 3, (pairs, k // 32, 1))
    x = mx.array((rng.standard_normal((pairs, k // 32, 32)) * spread).reshape(pairs, 1, k).astype(np.float32))
    return layer, x.astype(mx.bfloat16), ids


def check(y, layer, x, ids):
    w = dequantize_np(ex.QuantizedMatrix(layer.weight, layer.scales, None, 32, layer.bits, layer.mode))
    xs = np.array(x.astype(mx.float32)).astype(np.float64)[:, 0]
    want, mag = np.zeros((len(ids), w.shape[1])), np.zeros((len(ids), w.shape[1]))
    for e in np.unique(ids):
        rows = ids == e
        want[rows], mag[rows] = xs[rows] @ w[e].T, np.abs(xs[rows]) @ np.abs(w[e]).T
    got = np.array(y.astype(mx.float32)).astype(np.float64)[:, 0]
    k = xs.shape[-1]
    assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 2 * k * 2.0 ** -24 * mag), \
        np.max(np.abs(got - want) - 2.0 ** -8 * np.abs(want))


# N = 40: one threadgroup of 64 rows, its rows 40-63 clamped; K = 256 / 384: 2 and 3 chunks of
# 128; 70 pairs: expert 1's 37 (a full tile and 5), the others' short tiles (bf16: N = 136, two
# threadgroups of 128 rows; 134 pairs, expert 1's 69). The pairs in any
# order (sorted by the dispatcher) or sorted by expert, as RoutedExperts passes them.
# The launch in fp16 ("launch"), or the mma in bf16 (DSV4_KERNEL_PREFILL_EXPERTS_BF16), whose tiles
# are 64 pairs by 128 rows, or the bf16 tiles fed by cp.async and loads a chunk ahead
# (DSV4_KERNEL_PREFILL_EXPERTS_STREAM); `default` leaves every switch as it is (under CUDA: the
# stream launch).
STAGINGS = {"launch": dict(kernel_prefill_experts_bf16=False),
            "bf16": dict(kernel_prefill_experts_bf16=True, kernel_prefill_experts_stream=False),
            "stream": dict(kernel_prefill_experts_bf16=True, kernel_prefill_experts_stream=True), "default": {}}
LAUNCHES = {"launch": [experts_prefill.KERNEL.name],
            "bf16": [experts_prefill.KERNEL_BF16.name], "stream": [experts_prefill.KERNEL_STREAM.name],
            "default": [experts_prefill.KERNEL_STREAM.name]}


def host_prefill(tmp_path, layer, x, ids, sort, staging):
    launch = host_launch(tmp_path)
    # dequant_matmul off: on the CPU device its auto mode would multiply dense copies instead
    with (flags.override(kernel_prefill_experts_mma=True, dequant_matmul="off", **STAGINGS[staging]),
          dialect.pretend_gpu("cuda", launch), warnings.catch_warnings()):
        warnings.simplefilter("error")   # a fall-back to the reference would be a failure
        assert experts_prefill.applies(layer, x, mx.array(ids))
        y = layer(x, mx.array(ids), sorted_indices=sort)
        mx.eval(y)   # the launches run now
    assert launch.kernels == LAUNCHES[staging]
    return y


@pytest.mark.parametrize("mode,n,k,sort,staging", [("mxfp4", 40, 256, False, "launch"), ("mxfp8", 72, 384, False, "launch"),
                                                   ("mxfp4", 40, 256, True, "launch"), ("mxfp4", 136, 256, False, "bf16"),
                                                   ("mxfp8", 72, 384, True, "bf16"), ("mxfp4", 136, 384, False, "stream"),
                                                   ("mxfp8", 72, 256, True, "stream"),
                                                   ("mxfp4", 40, 256, True, "default")])
def test_prefill_experts_on_the_host(tmp_path, mode, n, k, sort, staging):
    rng = np.random.default_rng()
    bf16_tiles = LAUNCHES[staging] in (LAUNCHES["bf16"], LAUNCHES["stream"])
    tile = experts_prefill.BF16_TILE_PAIRS if bf16_tiles else experts_prefill.TILE_PAIRS
    layer, x, ids = problem(rng, mode, 6, n, k, 2 * tile + 6, tile)
    if sort:
        order = np.argsort(ids, kind="stable")
        x, ids = x[mx.array(order)], ids[order]
    y = host_prefill(tmp_path, layer, x, ids, sort, staging)
    assert y.shape == (2 * tile + 6, 1, n) and y.dtype == mx.bfloat16
    check(y, layer, x, ids)


@pytest.mark.parametrize("staging", ["launch", "bf16", "stream"])
def test_pairs_read_their_tokens_rows_and_land_in_token_order(tmp_path, staging):
    """As RoutedExperts calls the layer at prefill: pairs sorted by expert, each reading its
    token's row of x (x_rows: tokens shared by several pairs, not copied per pair) and its product
    put at its place in (token, slot) order (out_rows), by the launch itself."""
    rng = np.random.default_rng(11)
    bf16_tiles = staging != "launch"
    tile = experts_prefill.BF16_TILE_PAIRS if bf16_tiles else experts_prefill.TILE_PAIRS
    pairs = 2 * tile + 6
    layer, x, ids = problem(rng, "mxfp4", 6, 136 if bf16_tiles else 40, 256, pairs, tile)
    tokens = rng.integers(0, pairs // 3, pairs)          # x's first pairs / 3 rows are the tokens
    order = np.argsort(ids, kind="stable")
    launch = host_launch(tmp_path)
    with (flags.override(kernel_prefill_experts_mma=True, dequant_matmul="off", **STAGINGS[staging]),
          dialect.pretend_gpu("cuda", launch), warnings.catch_warnings()):
        warnings.simplefilter("error")
        y = layer(x[: pairs // 3], mx.array(ids[order]), True, x_rows=mx.array(tokens[order]),
                  out_rows=mx.array(order.astype(np.int32)))
        mx.eval(y)
    assert launch.kernels == LAUNCHES[staging]
    check(y, layer, x[mx.array(tokens)], ids)


@pytest.mark.parametrize("staging", ["bf16", "stream"])
@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
def test_the_bf16_launch_takes_every_scale(tmp_path, mode, staging):
    """Scale codes 100-199 (weights from 2^-27 to 2^72): those past 128 (134) take the bf16
    launch's second power of two, and each group's weights meet x at their own scale."""
    rng = np.random.default_rng(7)
    layer, x, ids = problem(rng, mode, 3, 40, 256, 70, experts_prefill.BF16_TILE_PAIRS)
    layer.scales = mx.array(rng.integers(100, 200, layer.scales.shape).astype(np.uint8))
    check(host_prefill(tmp_path, layer, x, ids, False, staging), layer, x, ids)


EARLY = "#define CP_ASYNC_EARLY\n"
# (The barrier that keeps a buffer until every SIMD group has read it is not among them: the
# emulator's SIMD groups take turns an exchange at a time, so none runs a chunk ahead of another.)
STREAM_MUTATIONS = {"no wait for the chunk": [("cp_async_wait<1>();", "")],
                    "the last chunk not waited for": [("cp_async_wait<0>();", "cp_async_wait<1>();")]}


def stream_on_the_host(tmp_path, layer, x, ids, mutation="", body_mutations=()):
    launch = host_launch(tmp_path, mutation, body_mutations)
    with (flags.override(kernel_prefill_experts_mma=True, **STAGINGS["stream"]),
          dialect.pretend_gpu("cuda", launch)):
        return experts_prefill.prefill_experts(x, layer.weight, layer.scales, mx.array(ids), 32, 4, "mxfp4")


def test_the_stream_launch_with_copies_landing_early(tmp_path):
    rng = np.random.default_rng(3)
    layer, x, ids = problem(rng, "mxfp4", 3, 40, 384, 70, experts_prefill.BF16_TILE_PAIRS)
    check(stream_on_the_host(tmp_path, layer, x, ids, EARLY), layer, x, ids)


@pytest.mark.parametrize("mutation", list(STREAM_MUTATIONS), ids=list(STREAM_MUTATIONS))
def test_the_stream_launch_needs_its_waits(tmp_path, mutation):
    """The stream launch without one of its waits must fail the same check, its copies landing
    at the waits: the passes above are no accident of when the copies land."""
    rng = np.random.default_rng(3)
    layer, x, ids = problem(rng, "mxfp4", 3, 40, 384, 70, experts_prefill.BF16_TILE_PAIRS)
    with pytest.raises(AssertionError):
        check(stream_on_the_host(tmp_path, layer, x, ids, body_mutations=STREAM_MUTATIONS[mutation]), layer, x, ids)


@pytest.mark.parametrize("mutation", list(MUTATIONS), ids=list(MUTATIONS))
def test_a_wrong_fragment_layout_fails(tmp_path, mutation):
    rng = np.random.default_rng()
    layer, x, ids = problem(rng, "mxfp4", 4, 16, 128, 40)
    with dialect.pretend_gpu("cuda", host_launch(tmp_path, MUTATIONS[mutation])):
        y = experts_prefill.prefill_experts(x, layer.weight, layer.scales, mx.array(ids), 32, 4, "mxfp4")
    with pytest.raises(AssertionError):
        check(y, layer, x, ids)


def test_tiles_cut_each_experts_run():
    """Made on the device: the tiles in order, then empty slots up to the most there can be."""
    sorted_ids = mx.array(np.array([0] * 3 + [2] * 70 + [5], np.uint32))
    got = np.array(experts_prefill.tiles(sorted_ids, 6))
    assert len(got) == experts_prefill.max_tiles(74, 6) == 3 + 6
    assert got[:5].tolist() == [[0, 0, 3], [2, 3, 32], [2, 35, 32], [2, 67, 6], [5, 73, 1]]
    assert np.all(got[5:, 2] == 0)


@pytest.mark.parametrize("experts,pairs", [(384, 3072), (6, 64), (40, 33)])
def test_tiles_cover_every_pair_once(experts, pairs):
    """Random sorted pairs: the tiles' pairs are each expert's, every pair in exactly one tile,
    within the bound the grid is sized for."""
    ids = np.sort(np.random.default_rng().integers(0, experts, pairs)).astype(np.uint32)
    got = np.array(experts_prefill.tiles(mx.array(ids), experts))
    seen = np.zeros(pairs, int)
    for expert, first, count in got:
        assert 0 <= count <= experts_prefill.TILE_PAIRS
        if count:
            assert np.all(ids[first:first + count] == expert)
            seen[first:first + count] += 1
    assert np.all(seen == 1)


def test_the_switch_takes_prefill_chunks_on_cuda_only():
    rng = np.random.default_rng()
    layer, x, ids = problem(rng, "mxfp4", 4, 16, 128, 64)
    idx = mx.array(ids)
    with flags.override(kernel_prefill_experts_mma="on"):
        with dialect.pretend_gpu("cuda", None):
            assert experts_prefill.applies(layer, x, idx)
            assert not experts_prefill.applies(layer, x[:63], idx[:63])            # decode, verification
            assert not experts_prefill.applies(layer, x.astype(mx.float32), idx)    # bf16 only
        with dialect.pretend_gpu("metal", None):
            assert not experts_prefill.applies(layer, x, idx)
    with dialect.pretend_gpu("cuda", None):   # auto (default): a full tile an expert on average
        assert flags.get("kernel_prefill_experts_mma") == "auto"
        assert not experts_prefill.applies(layer, x, idx)                          # 16 pairs an expert
        many = mx.concatenate([idx, idx])
        assert experts_prefill.applies(layer, mx.concatenate([x, x]), many)       # 32
        with flags.override(kernel_prefill_experts_mma="off"):
            assert not experts_prefill.applies(layer, mx.concatenate([x, x]), many)


@pytest.mark.gpu
@pytest.mark.parametrize("staging", list(STAGINGS))
@pytest.mark.parametrize("mode,n,k", [("mxfp4", 2304, 5120), ("mxfp4", 5120, 2304), ("mxfp8", 2304, 5120)])
def test_prefill_experts_on_the_gpu(mode, n, k, staging):
    """The CUDA build at V4.1's expert shapes against the same float64 products."""
    if dialect.backend() != "cuda":
        pytest.skip("CUDA only")
    rng = np.random.default_rng()
    layer, x, ids = problem(rng, mode, 8, n, k, 300)
    with flags.override(kernel_prefill_experts_mma=True, **STAGINGS[staging]), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert experts_prefill.applies(layer, x, mx.array(ids))
        y = layer(x, mx.array(ids))
    check(y, layer, x, ids)


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
def test_the_reference_is_each_pairs_product(mode):
    """The plain-MLX reference the kernel falls back to (CPU here) against the same float64
    products, with and without the pairs' rows."""
    rng = np.random.default_rng()
    layer, x, ids = problem(rng, mode, 5, 24, 128, 40)
    y = experts_prefill.reference(x, layer.weight, layer.scales, mx.array(ids), 32, layer.bits, mode)
    assert y.shape == (40, 1, 24) and y.dtype == mx.bfloat16
    check(y, layer, x, ids)
    tokens, order = rng.integers(0, 40, 40), rng.permutation(40)
    y = experts_prefill.reference(x, layer.weight, layer.scales, mx.array(ids[order]), 32, layer.bits, mode,
                                  x_rows=mx.array(tokens[order]), out_rows=mx.array(order))
    check(y, layer, x[mx.array(tokens)], ids)
