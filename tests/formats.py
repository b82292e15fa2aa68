"""The fp8/fp4 formats decoded from their definitions: the tests' oracle, independent of MLX."""

import numpy as np

# e2m1 value of each 4-bit code (bit 3 = sign)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def e4m3_value(code: np.ndarray) -> np.ndarray:
    """e4m3 bit patterns (bias 7, no infinities; 0x7F/0xFF are NaN) -> float64."""
    c = np.asarray(code).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 0xF, c & 7
    return sign * np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))


def e2m1_packed_value(packed: np.ndarray) -> np.ndarray:
    """Two e2m1 codes per byte, low nibble first -> float64 [..., 2 * n]."""
    b = np.asarray(packed).view(np.uint8).astype(np.int64)
    return E2M1[np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)]


def e8m0_scale(code: np.ndarray) -> np.ndarray:
    """e8m0 exponent bytes -> 2**(code - 127) as float64."""
    return 2.0 ** (np.asarray(code).astype(np.float64) - 127)
