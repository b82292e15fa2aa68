// A small stand-in for <metal_stdlib> and MLX's Metal utils, enough for clang to parse and
// type-check dsv4's kernel bodies as C++17 (tools/metal_syntax_check.py). It declares only what
// the bodies use, with Metal's signatures; nothing here is ever executed.
#pragma once
#include <cstddef>
#include <cstdint>

#define device
#define threadgroup
#define constant
#define thread
#define INFINITY __builtin_inff()

using uint = unsigned int;
using ushort = unsigned short;

struct half {
  half(float);
  operator float() const;
};
struct bfloat16_t {
  bfloat16_t(float);
  operator float() const;
};
using float16_t = half;

struct uint3 { uint x, y, z; };
struct uint2 { uint x, y; };
struct uint4 { uint x, y, z, w; };
struct half2 { half x, y; };
half2 operator-(half2, half2);
struct float2 {
  float x, y;
  float2(float, float);
  explicit float2(half2);
};
struct float4 {
  float x, y, z, w;
  float4(float, float, float, float);
};

template <typename T, typename U>
T as_type(U);

enum memory_order { memory_order_relaxed };
struct atomic_uint { uint value; };
uint atomic_fetch_add_explicit(threadgroup atomic_uint*, uint, memory_order);
uint atomic_load_explicit(threadgroup atomic_uint*, memory_order);
void atomic_store_explicit(threadgroup atomic_uint*, uint, memory_order);

float simd_sum(float);
float simd_max(float);
int simd_shuffle(int, ushort);
float simd_shuffle_xor(float, ushort);

enum class mem_flags { mem_none, mem_device, mem_threadgroup };
void threadgroup_barrier(mem_flags);

namespace metal {
float exp(float);
float exp2(float);
float log(float);
float rsqrt(float);
float sqrt(float);
float rint(float);
float abs(float);
uint popcount(uint);   // MSL integer function: set bits
float max(float, float);
float min(float, float);
int max(int, int);
int min(int, int);
uint max(uint, uint);
uint min(uint, uint);
namespace precise {
float divide(float, float);   // MSL: correctly rounded whatever the fast-math setting
float cos(float);
float sin(float);
}  // namespace precise
}  // namespace metal
using namespace metal;
