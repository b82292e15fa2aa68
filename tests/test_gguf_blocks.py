"""dsv4.gguf_blocks decodes every block type bit for bit as gguf-py does (the oracle), on
random valid blocks that cover every IQ2_XXS grid entry and sign pattern, every Q2_K/Q4_K
scale and min code, and zero, subnormal, negative and extreme f16 scales."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from dsv4 import gguf_blocks
from dsv4.gguf_blocks import BLOCK_BYTES, BlockError

SPECIAL_F16 = np.array([0.0, -0.0, 6.1e-5, -6.1e-5, 5.96e-8, 65504.0, -65504.0, 1.0, -0.5, 3.0e-3],
                       np.float16)


def random_blocks(qtype: str, n: int, rng) -> np.ndarray:
    """n blocks of random bytes whose f16 fields are finite, some of them special values."""
    size = BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    offsets = {"Q8_0": (0,), "Q4_K": (0, 2), "Q2_K": (80, 82), "IQ2_XXS": (0,)}[qtype]
    for at in offsets:
        values = rng.normal(0, 0.02, n).astype(np.float16)
        special = rng.random(n) < 0.3
        values[special] = rng.choice(SPECIAL_F16, special.sum())
        blocks[:, at:at + 2] = values.view(np.uint8).reshape(n, 2)
    if qtype == "IQ2_XXS":
        # every grid entry and every sign index, in some block
        sub = blocks[:, 2:].reshape(n, 8, 8)
        grid = np.arange(n * 8 * 4) % 256
        sub[..., :4] = rng.permutation(grid).reshape(n, 8, 4).astype(np.uint8)
        words = sub[..., 4:].copy().view("<u4")[..., 0]
        signs = (rng.permutation(np.arange(n * 8 * 4) % 128).reshape(n, 8, 4)).astype(np.uint32)
        top = words & np.uint32(0xF0000000)
        packed = top | signs[..., 0] | (signs[..., 1] << 7) | (signs[..., 2] << 14) | (signs[..., 3] << 21)
        sub[..., 4:] = packed.astype("<u4")[..., None].view(np.uint8)
        blocks[:, 2:] = sub.reshape(n, 64)
    return blocks


@pytest.mark.parametrize("qtype", gguf_blocks.TYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 4), (2, 5, 2)])
def test_decoding_equals_gguf_py_bit_for_bit(qtype, shape):
    rng = np.random.default_rng(sum(map(ord, qtype)) + len(shape))
    lead, blocks_per_row = shape[:-1], shape[-1]
    n = int(np.prod(lead)) * blocks_per_row
    n = max(n, 64 if qtype == "IQ2_XXS" else n)   # 64 blocks x 32 grid slots cover 256 x 8
    rows = int(np.prod(lead))
    per_row = max(blocks_per_row, -(-n // rows))
    raw = random_blocks(qtype, rows * per_row, rng).reshape(*lead, per_row * BLOCK_BYTES[qtype])
    want = gguf_dequantize(raw, GGMLQuantizationType[qtype])
    got = np.array(gguf_blocks.dequantize(mx.array(raw), qtype))
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_every_q4_k_scale_and_min_code_decodes():
    """The 6-bit scale/min unpacking against a loop over ggml's get_scale_min_k4."""
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (512, 12), dtype=np.uint8)
    sc, mn = (np.array(a) for a in gguf_blocks.q4_k_scale_min(mx.array(packed)))
    for b in range(len(packed)):
        q = packed[b].astype(int)
        for j in range(8):
            if j < 4:
                want = (q[j] & 63, q[j + 4] & 63)
            else:
                want = ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
            assert (sc[b, j], mn[b, j]) == want
    assert set(sc.ravel()) == set(range(64)) and set(mn.ravel()) == set(range(64))


def test_sign_table_has_even_parity():
    signs = gguf_blocks.iq2_xxs_signs()
    assert len(set(signs)) == 128
    assert all(bin(int(s)).count("1") % 2 == 0 for s in signs)
    from gguf.quants import IQ2_XXS
    assert signs.tobytes() == IQ2_XXS.ksigns


def test_sizes_and_bad_rows():
    assert gguf_blocks.row_bytes("IQ2_XXS", 5120) == 20 * 66
    assert gguf_blocks.in_features("Q2_K", 9 * 84) == 2304
    assert gguf_blocks.bits_per_weight("IQ2_XXS") == 2.0625
    with pytest.raises(BlockError, match="multiples of 256"):
        gguf_blocks.row_bytes("Q4_K", 100)
    with pytest.raises(BlockError, match="multiples of 34 bytes"):
        gguf_blocks.dequantize(mx.zeros((2, 35), mx.uint8), "Q8_0")
    with pytest.raises(BlockError, match="expected one of"):
        gguf_blocks.dequantize(mx.zeros((2, 34), mx.uint8), "Q5_K")
