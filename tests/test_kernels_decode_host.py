"""The fused-experts kernel's own decoding and fp8 rounding code, compiled for the CPU.

The kernel header (dsv4.kernels.experts._HEADER) is compiled with clang (tools/cxx.py: the test
extra's ziglang wheel) under a host prelude that gives the dialect names plain C++ meanings (fp16
decoded in software), then run on random packs: the decoded values must equal MLX's
`mx.dequantize` codes bit for bit, and the fp8 act-quant rounding must equal
dsv4.quant.qdq_fp8. Without a compiler the tests fail rather than skip.
"""

import atexit
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx

from dsv4.kernels.experts import _HEADER
from dsv4.quant import qdq_fp8
from tools.cxx import HOST_BUILDS, cxx_command

# The standard headers of every host build (the prelude's and the threadgroup emulator's, which
# runs its threads as ucontext fibers: macOS declares those only under _XOPEN_SOURCE). Parsing
# them took half of each build, so each process compiles them once into a precompiled header.
HOST_HEADERS = r"""
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700
#endif
""" + "".join(f"#include <{h}>\n" for h in ("cmath", "cstdint", "cstdio", "cstdlib", "cstring", "algorithm",
                                              "functional", "memory", "vector", "ucontext.h"))

HOST_PRELUDE = HOST_HEADERS + r"""
#define KFN inline
#define LOCAL
#define GLOBAL const
#define AS_FLOAT(u) host_as_float(u)
#define AS_UINT(f) host_as_uint(f)
#define FABS(x) std::fabs(x)
#define POPCOUNT(x) ((uint32_t)__builtin_popcount(x))
inline int host_dp4a(int a, int b, int c) {
  for (int k = 0; k < 4; ++k) c += (int)(int8_t)(a >> (8 * k)) * (int)(int8_t)(b >> (8 * k));
  return c;
}
#define DP4A(a, b, c) host_dp4a(a, b, c)
inline uint32_t host_byte_perm(uint32_t a, uint32_t b, uint32_t s) {   // CUDA's __byte_perm, no sign mode
  const uint64_t ab = ((uint64_t)b << 32) | a;
  uint32_t r = 0u;
  for (int k = 0; k < 4; ++k) r |= (uint32_t)((ab >> (8 * ((s >> (4 * k)) & 7u))) & 255u) << (8 * k);
  return r;
}
#define BYTE_PERM(a, b, s) host_byte_perm(a, b, s)
#define FMAX(a, b) std::fmax(a, b)
#define FMIN(a, b) std::fmin(a, b)
#define RINT(x) std::nearbyint(x)
#define EXP(x) std::exp(x)
#define LOG(x) std::log(x)
#define SQRT(x) std::sqrt(x)
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
inline uint32_t host_h2_sub_bits(uint32_t a, uint32_t b) {
  uint32_t out = 0;
  for (int i = 0; i < 2; ++i) {
    const uint16_t ua = (uint16_t)(a >> (16 * i)), ub = (uint16_t)(b >> (16 * i));
    _Float16 x, y;
    std::memcpy(&x, &ua, 2); std::memcpy(&y, &ub, 2);
    const _Float16 r = x - y;
    uint16_t ur;
    std::memcpy(&ur, &r, 2);
    out |= (uint32_t)ur << (16 * i);
  }
  return out;
}
#define H2_SUB_BITS(a, b) host_h2_sub_bits(a, b)
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


HOST_FLAGS = ["-std=c++20", "-O2", "-ffp-contract=off"]


@functools.cache
def _precompiled_headers() -> list[str]:
    """The flags that include HOST_HEADERS precompiled (built once per process, removed at its
    exit), or none where the compiler cannot precompile them: the builds then parse them."""
    folder = Path(tempfile.mkdtemp(prefix="dsv4-host-headers-"))
    atexit.register(shutil.rmtree, folder, True)
    header, pch = folder / "host.hpp", folder / "host.hpp.pch"
    header.write_text(HOST_HEADERS)
    result = subprocess.run(cxx_command() + HOST_FLAGS + ["-x", "c++-header", str(header), "-o", str(pch)],
                            capture_output=True)
    return ["-include-pch", str(pch)] if result.returncode == 0 else []


def build_host(folder, name: str, source: str):
    """source (C++, after HOST_PRELUDE) compiled in folder -> the executable's path. C++20: the
    kernels' headers use it. No FMA contraction: the bit-exact tests check fp32 arithmetic as
    written, and zig's clang targets the host CPU, which has FMA. A source is built once a test
    session: tests repeat instantiations over other inputs, and the executables are kept in the
    session's folder (tools/cxx.py HOST_BUILDS, made by tests/conftest.py), which xdist's workers share."""
    text = HOST_PRELUDE + source
    builds = os.environ.get(HOST_BUILDS)
    kept = Path(builds) / hashlib.sha256(f"{HOST_FLAGS}\n{text}".encode()).hexdigest() if builds else None
    if kept is not None and kept.exists():
        return kept
    src, exe = folder / f"{name}.cpp", folder / name
    src.write_text(text)
    result = subprocess.run(cxx_command() + HOST_FLAGS + _precompiled_headers() + ["-o", str(exe), str(src)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[:3000]
    if kept is not None:   # whole or not at all: another worker may be building the same source
        partial = kept.with_name(f"{kept.name}.{os.getpid()}")
        shutil.copy2(exe, partial)
        os.replace(partial, kept)
    return exe


def build_kernel(folder, kernel, template, before: str, main: str, after: str = "", edits=()):
    """A dialect Kernel's body built on the host (build_host): `before` (the emulator and what it
    lacks), the template's integer values as the constants the body reads (its types are the
    callers' aliases), `after`, the kernel's header, then `main` with the body at BODY; `edits`:
    (old, new) replacements in that source, each of which must apply."""
    consts = "".join(f"constexpr int {k} = {int(v)};\n" for k, v in template if not isinstance(v, mx.Dtype))
    source = before + consts + after + kernel.header + main.replace("BODY", kernel.body)
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    return build_host(folder, f"{kernel.name}_{hashlib.sha256(source.encode()).hexdigest()[:12]}", source)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    exe = build_host(tmp_path_factory.mktemp("decode"), "decode", _HEADER + HOST_MAIN)

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

    extra = ("#define DIV_RN(a, b) ((a) / (b))\n"
             "inline float simd_max_f(float x) { return x; }\n"
             "inline int simd_shuffle_i(int x, int) { return x; }\n")
    exe = build_host(tmp_path, "qdq", extra + HEADER + QDQ_HOST_MAIN)
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


ROW_LOAD_MAIN = r"""
int main(int argc, char** argv) {
  if (argc > 2) {   // rotate_lane over a row of 512 (every lane's 16 values), R = 32, at angles cos/sin
    float row[512], c[32], s[32];
    if (std::fread(row, 4, 512, stdin) != 512 || std::fread(c, 4, 32, stdin) != 32 ||
        std::fread(s, 4, 32, stdin) != 32) return 1;
    for (int inverse = 0; inverse < 2; ++inverse)
      for (uint32_t lane = 0; lane < 32; ++lane) {
        float v[16];
        std::memcpy(v, row + 16 * lane, 64);
        if (inverse) rotate_lane<512, 16, 32, true>(v, (const float*)c, (const float*)s, 0, lane);
        else rotate_lane<512, 16, 32, false>(v, (const float*)c, (const float*)s, 0, lane);
        std::fwrite(v, 4, 16, stdout);
      }
    return 0;
  }
  const int rows = std::atoi(argv[1]);
  for (int r = 0; r < rows; ++r) {   // 16 bf16 values (as bits), then 16 fp32 values
    alignas(16) uint16_t b[16];
    alignas(16) float f[16];
    if (std::fread(b, 2, 16, stdin) != 16 || std::fread(f, 4, 16, stdin) != 16) return 1;
    float v[16], w[16];
    load_lane<16, true>((const uint16_t*)b, v);
    load_lane_f32<16>((const float*)f, w);
    std::fwrite(v, 4, 16, stdout);
    std::fwrite(w, 4, 16, stdout);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def attention_helpers(tmp_path_factory):
    from dsv4.kernels.sparse_attention import _HEADER as ATTENTION_HEADER
    exe = build_host(tmp_path_factory.mktemp("attention"), "rows", ATTENTION_HEADER + ROW_LOAD_MAIN)
    return lambda args, data: subprocess.run([str(exe), *args], input=data, capture_output=True, check=True).stdout


def test_attention_rotation_of_a_lane_slice(attention_helpers):
    """rotate_lane (the queries' RoPE and the output's inverse in the sparse-attention kernels)
    on every lane of a 512-value row: the last 64 dims turn by the angles in adjacent pairs, in
    fp32 as written; the others stay."""
    rng = np.random.default_rng()
    row = rng.standard_normal(512).astype(np.float32)
    theta = rng.uniform(-np.pi, np.pi, 32).astype(np.float32)
    c, s = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    out = np.frombuffer(attention_helpers(["1", "rotate"], row.tobytes() + c.tobytes() + s.tobytes()),
                        np.float32).reshape(2, 512)
    a, b = row[448::2], row[449::2]
    forward, back = row.copy(), row.copy()
    forward[448::2], forward[449::2] = a * c - b * s, a * s + b * c
    back[448::2], back[449::2] = a * c + b * s, b * c - a * s
    np.testing.assert_array_equal(out[0], forward)
    np.testing.assert_array_equal(out[1], back)


def test_attention_row_loads_read_what_scalar_loads_read(attention_helpers):
    """The sparse-attention kernels' 16-byte lane loads (dsv4.kernels.sparse_attention._HEADER),
    compiled for the CPU: 16 bf16 values 8 at a time and 16 fp32 partials 4 at a time give the
    values in order, exactly."""
    rng = np.random.default_rng()
    rows = 50
    vals = rng.standard_normal((rows, 16)).astype(np.float32) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
    bf16 = np.array(mx.array(vals).astype(mx.bfloat16).view(mx.uint16))
    f32 = rng.standard_normal((rows, 16)).astype(np.float32)
    data = b"".join(bf16[r].tobytes() + f32[r].tobytes() for r in range(rows))
    out = np.frombuffer(attention_helpers([str(rows)], data), np.float32).reshape(rows, 2, 16)
    np.testing.assert_array_equal(out[:, 0], np.array(mx.array(bf16).view(mx.bfloat16).astype(mx.float32)))
    np.testing.assert_array_equal(out[:, 1], f32)
