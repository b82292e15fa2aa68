"""The fused-experts kernel's own decoding and fp8 rounding code, compiled for the CPU.

The kernel header (dsv4.kernels.experts._HEADER) is compiled with clang++ (or g++) under a
host prelude that gives the dialect names plain C++ meanings (fp16 decoded in software), then
run on random packs: the decoded values must equal MLX's `mx.dequantize` codes bit for bit,
and the fp8 act-quant rounding must equal dsv4.quant.qdq_fp8. Needs a C++ compiler: the
test fails (apt-get install clang) rather than skip.
"""

import shutil
import subprocess

import numpy as np
import pytest

import mlx.core as mx

from dsv4.kernels.experts import _HEADER
from dsv4.quant import qdq_fp8

HOST_PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#define KFN inline
#define LOCAL
#define GLOBAL const
#define AS_FLOAT(u) host_as_float(u)
#define AS_UINT(f) host_as_uint(f)
#define FABS(x) std::fabs(x)
#define FMAX(a, b) std::fmax(a, b)
#define FMIN(a, b) std::fmin(a, b)
#define RINT(x) std::nearbyint(x)
#define EXP(x) std::exp(x)
#define LOAD_U4(p, i) (reinterpret_cast<const uint4*>(p)[i])
using std::min;
struct uint4 { uint32_t x, y, z, w; };
struct float2 { float x, y; };
inline float host_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t host_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float simd_sum_f(float x) { return x; }
float simd_xor_f(float x, int mask);   // declared only: a body that shuffles needs an emulator
inline float half_bits(uint32_t h) {
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const int e = (h >> 10) & 31, m = h & 1023;
  if (e == 0) return sign * std::ldexp((float)m, -24);
  return sign * std::ldexp(1.0f + m / 1024.0f, e - 15);
}
inline float2 half2_bits_to_float2(uint32_t b) { return {half_bits(b & 0xffffu), half_bits(b >> 16)}; }
"""

HOST_MAIN = r"""
template <int MODE, int BITS>
void run(int packs) {
  for (int p = 0; p < packs; ++p) {
    uint32_t w[BITS];
    if (std::fread(w, 4, BITS, stdin) != (size_t)BITS) return;
    float v[32];
    for (int c = 0; c < 4; ++c) unpack8<MODE, BITS>(w, c, v + 8 * c);   // the kernel's 8-value chunks
    std::fwrite(v, 4, 32, stdout);
  }
}
int main(int argc, char** argv) {
  const int mode = std::atoi(argv[1]), bits = std::atoi(argv[2]), packs = std::atoi(argv[3]);
  if (mode == 1) run<1, 4>(packs);
  else if (mode == 2) run<2, 8>(packs);
  else if (mode == 3) {   // fp8 act-quant of packs of 32 floats
    for (int p = 0; p < packs; ++p) {
      float v[32];
      if (std::fread(v, 4, 32, stdin) != 32) return 1;
      qdq_fp8_32(v);
      std::fwrite(v, 4, 32, stdout);
    }
  }
  else if (bits == 2) run<0, 2>(packs);
  else if (bits == 3) run<0, 3>(packs);
  else if (bits == 4) run<0, 4>(packs);
  else if (bits == 8) run<0, 8>(packs);
  return 0;
}
"""


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    cxx = shutil.which("clang++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("no C++ compiler: install clang (apt-get install clang)")
    tmp = tmp_path_factory.mktemp("decode")
    src, exe = tmp / "decode.cpp", tmp / "decode"
    src.write_text(HOST_PRELUDE + _HEADER + HOST_MAIN)
    result = subprocess.run([cxx, "-std=c++17", "-O1", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

    def run(mode, bits, data: np.ndarray) -> np.ndarray:
        packs = data.size // (32 if mode == 3 else bits)
        out = subprocess.run([str(exe), str(mode), str(bits), str(packs)], input=data.tobytes(),
                             capture_output=True, check=True).stdout
        return np.frombuffer(out, np.float32).reshape(packs, 32)
    return run


@pytest.mark.parametrize("mode,bits", [("mxfp4", 4), ("mxfp8", 8), ("affine", 2), ("affine", 3),
                                       ("affine", 4), ("affine", 8)])
def test_kernel_unpack_matches_mlx(decoder, mode, bits):
    rng = np.random.default_rng()
    gs = 32
    w = mx.array(rng.standard_normal((64, 256)).astype(np.float32) * rng.uniform(0.01, 100))
    packed, scales, *rest = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    words = np.array(packed)
    got = decoder({"mxfp4": 1, "mxfp8": 2}.get(mode, 0), bits, words.reshape(-1))
    got = got.reshape(64, 256)
    if mode == "affine":
        # Codes: dequantize with scale 1 and bias 0 gives them back exactly.
        ones = mx.ones(scales.shape)
        want = mx.dequantize(packed, ones, mx.zeros(scales.shape), group_size=gs, bits=bits, mode=mode)
        np.testing.assert_array_equal(got, np.array(want))
    else:
        # Scale code 127 = 1.0; the kernel's fp16 decoding leaves a factor 2^-14 (fp4) or
        # 2^-8 (fp8) that pack_dot folds into the block scale.
        unit = mx.full(scales.shape, 127, mx.uint8)
        want = np.array(mx.dequantize(packed, unit, group_size=gs, bits=bits, mode=mode, dtype=mx.float32))
        factor = 2.0 ** 14 if mode == "mxfp4" else 2.0 ** 8
        finite = np.isfinite(want)   # e4m3 0x7f/0xff are NaN codes; fp16 has no such slot
        np.testing.assert_array_equal((got * factor)[finite], want[finite])


def test_kernel_fp8_act_quant_matches_model_numerics(decoder):
    rng = np.random.default_rng()
    x = rng.standard_normal((200, 32)).astype(np.float32) * rng.uniform(1e-3, 1e3, (200, 1)).astype(np.float32)
    x[0] = 0.0                      # all-zero block: amax floor 1e-4
    x[1, :5] = [448.0, -1e-9, 3e-5, 0.015625, 0.0146]   # saturation edge, subnormal range
    x = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))   # the kernel sees bf16 values
    got = decoder(3, 0, x.reshape(-1))
    want = np.array(qdq_fp8(mx.array(x)))
    np.testing.assert_array_equal(got, want)


QDQ_HOST_MAIN = r"""
// Compressed-KV rounding of blocks of 16 floats, the block amax taken here as the kernel's
// half-SIMD-group maximum takes it.
int main(int argc, char** argv) {
  const int blocks = std::atoi(argv[1]);
  for (int b = 0; b < blocks; ++b) {
    float v[16];
    if (std::fread(v, 4, 16, stdin) != 16) return 1;
    float amax = 0.0f;
    for (int i = 0; i < 16; ++i) amax = FMAX(amax, FABS(v[i]));
    for (int i = 0; i < 16; ++i) v[i] = fp4_e4m3_of(v[i], amax);
    std::fwrite(v, 4, 16, stdout);
  }
  return 0;
}
"""


def test_kernel_fp4_e4m3_rounding_matches_model_numerics(tmp_path):
    """dsv4.kernels.qdq's fp4_e4m3_of (row_tail's compressed-KV rounding) equals
    dsv4.quant.qdq_fp4_e4m3 bit for bit, over magnitudes, zeros, the amax floor and e2m1 ties."""
    from dsv4.kernels.qdq import HEADER
    from dsv4.quant import qdq_fp4_e4m3

    cxx = shutil.which("clang++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("no C++ compiler: install clang (apt-get install clang)")
    extra = ("#define DIV_RN(a, b) ((a) / (b))\n"
             "inline float simd_max_f(float x) { return x; }\n"
             "inline int simd_shuffle_i(int x, int) { return x; }\n")
    src, exe = tmp_path / "qdq.cpp", tmp_path / "qdq"
    src.write_text(HOST_PRELUDE + extra + HEADER + QDQ_HOST_MAIN)
    built = subprocess.run([cxx, "-std=c++17", "-O1", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    rng = np.random.default_rng()
    x = rng.standard_normal((400, 16)).astype(np.float32) * rng.uniform(1e-4, 1e2, (400, 1)).astype(np.float32)
    x[0] = 0.0                                        # amax floor
    x[1] = 6.0 * 2.0 ** -12 * rng.standard_normal(16)  # below the floor
    x[2, :8] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]   # scale 1: e2m1 ties
    x[3, :4] = [-0.25, -2.5, -0.0, 3.0]
    x = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))   # the kernel sees bf16 values
    out = subprocess.run([str(exe), str(len(x))], input=x.tobytes(), capture_output=True, check=True).stdout
    got = np.frombuffer(out, np.float32).reshape(x.shape)
    want = np.array(qdq_fp4_e4m3(mx.array(x)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
