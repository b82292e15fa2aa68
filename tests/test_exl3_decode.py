"""EXL3 trellis decoding: numpy reference properties, and the MLX decoder against the reference."""

import numpy as np
import pytest

from convert import exl3_decode as mlx_dec
from convert import exl3_reference as ref

KS = range(1, 9)


def random_trellis(rng, k_bits, tiles_k=8, tiles_n=8):
    return rng.integers(-32768, 32768, size=(tiles_k, tiles_n, 16 * k_bits), dtype=np.int16)


def pack_symbols(symbols, k_bits):
    """Pack K-bit symbols [tiles..., 256] the way exllamav3's pack kernel is described
    (exl3.md §1.3): MSB first into a uint16 buffer, then the two halves of each uint32 swapped."""
    lead = symbols.shape[:-1]
    bits = ((symbols[..., :, None] >> np.arange(k_bits - 1, -1, -1)) & 1).reshape(*lead, -1)
    u16 = (bits.reshape(*lead, -1, 16) << np.arange(15, -1, -1)).sum(-1).astype(np.uint16)
    swapped = u16.reshape(*lead, -1, 2)[..., ::-1].reshape(*lead, -1)
    return np.ascontiguousarray(swapped).view(np.int16)


@pytest.mark.parametrize("k_bits", KS)
def test_states_follow_the_shift_register(k_bits):
    rng = np.random.default_rng(k_bits)
    symbols = rng.integers(0, 1 << k_bits, size=(3, 2, 256))
    states = ref.trellis_states(pack_symbols(symbols, k_bits)).astype(np.int64)
    # state_p = (state_{p-1} << K | sym_p) & 0xFFFF, with the tail wrapping into the head
    expect = np.zeros_like(symbols)
    for p in range(256):
        for back in range(0, 16, k_bits):
            shift = back
            take = min(k_bits, 16 - shift)
            expect[..., p] |= (symbols[..., (p - back // k_bits) % 256] & ((1 << take) - 1)) << shift
    assert np.array_equal(states, expect)


@pytest.mark.parametrize("k_bits", KS)
def test_tail_biting_invariant(k_bits):
    states = ref.trellis_states(random_trellis(np.random.default_rng(0), k_bits)).astype(np.int64)
    assert np.array_equal(states[..., 0] >> k_bits, states[..., 255] & ((1 << (16 - k_bits)) - 1))


def test_tensor_core_perm():
    perm = ref.tensor_core_perm()
    assert sorted(perm) == list(range(256))
    assert list(perm[:8]) == [0, 16, 128, 144, 8, 24, 136, 152]


@pytest.mark.parametrize("codebook,rms", [("3inst", 1.24371088), ("mul1", 1.0)])
def test_codebook_scale(codebook, rms):
    # exllamav3 scales 3INST inputs by codebook_scale = 1.24371088 and MUL1 by 1.0
    values = ref.codebook_values(codebook).astype(np.float64)
    assert abs(np.sqrt(np.mean(values**2)) - rms) < 1e-3
    assert np.all(np.abs(values) < 4)


def test_hadamard_is_orthonormal_and_fwht_agrees():
    h = ref.sylvester()
    assert np.allclose(h @ h, np.eye(128)) and np.array_equal(h, h.T)
    x = np.random.default_rng(0).standard_normal((256, 3)).astype(np.float32)
    dense = (h @ x.reshape(2, 128, 3).astype(np.float64)).reshape(256, 3) * np.sqrt(128)
    assert np.allclose(ref.fwht(x, axis=0), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
def test_mlx_codebook_equals_reference(codebook):
    ours = np.array(mlx_dec.codebook_table(codebook)).view(np.uint16)
    assert np.array_equal(ours, ref.codebook_values(codebook).view(np.uint16))


@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
@pytest.mark.parametrize("k_bits", KS)
def test_mlx_decoder_equals_reference_bit_for_bit(k_bits, codebook):
    rng = np.random.default_rng(100 * k_bits + ref.CODEBOOKS.index(codebook))
    trellis = random_trellis(rng, k_bits, tiles_k=8, tiles_n=16)
    suh = (rng.standard_normal(128) * 0.1).astype(np.float16)
    svh = (rng.standard_normal(256) * 0.1).astype(np.float16)

    w_hat = np.array(mlx_dec.reconstruct(trellis, codebook))
    assert np.array_equal(w_hat.view(np.uint16), ref.reconstruct(trellis, codebook).view(np.uint16))

    w_t = np.array(mlx_dec.linear_weight(trellis, suh, svh, codebook))
    w = ref.weight(trellis, suh, svh, codebook)
    assert w_t.shape == (256, 128)
    assert np.array_equal(w_t.view(np.uint32), w.T.view(np.uint32))
    dense = ref.weight_dense(trellis, suh, svh, codebook)
    assert np.abs(w - dense).max() <= 1e-6 * np.abs(dense).max()


def test_swapped_scales_are_caught_by_the_dense_oracle():
    # negative control: the oracle distinguishes input-side from output-side scales
    rng = np.random.default_rng(5)
    trellis = random_trellis(rng, 3)
    suh, svh = (rng.standard_normal((2, 128)) * 0.1).astype(np.float16)
    dense = ref.weight_dense(trellis, suh, svh, "mcg")
    swapped = ref.weight_dense(trellis, svh, suh, "mcg")
    assert np.linalg.norm(dense - swapped) / np.linalg.norm(dense) > 0.5


def test_bad_trellis_is_refused_with_its_shape():
    with pytest.raises(ValueError, match=r"int16 \[in/16, out/16, 16\*K\].*\[8, 8, 144\]"):
        mlx_dec.reconstruct(np.zeros((8, 8, 144), np.int16), "mcg")
    with pytest.raises(ValueError, match="unknown EXL3 codebook 'q4'"):
        ref.codebook_values("q4")


def test_mlx_input_equals_numpy_input():
    import mlx.core as mx

    trellis = random_trellis(np.random.default_rng(9), 5)
    a = np.array(mlx_dec.reconstruct(mx.array(trellis), "mul1")).view(np.uint16)
    assert np.array_equal(a, ref.reconstruct(trellis, "mul1").view(np.uint16))
