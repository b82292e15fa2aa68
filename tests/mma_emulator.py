"""mma.sync m16n8k16 (and cp.async) as the host runs them, for the host tests of the tensor-core
bodies (test_kernels_experts_prefill_host, test_kernels_attention_prefill_host,
test_kernels_experts_host's mma gate/up), compiled with clang after test_kernels_matvec's
threadgroup emulator.

mma.sync is warp-wide: here each lane posts its fragment registers and every lane computes its D
elements from the whole A, B and C, which it reassembles by the PTX ISA's layout tables for
m16n8k16 ("Matrix Fragments for mma.m16n8k16 with floating point type"), transcribed in
MMA_EMULATOR with the products of the fp16 (bf16: mma_16816_bf16) values summed in fp32.
MUTATIONS swap a register, a half or an output position of those tables: a body checked under
each must fail, so its pass is no accident of symmetric data (the placement of weights, x and
sums depends on the layout). Unverified here: the real instruction (ptxas and the GPU).
"""

MMA_EMULATOR = r"""
#ifndef A_REG
#define A_REG(row, k) (((row) >= 8 ? 1 : 0) + ((k) >= 8 ? 2 : 0))
#endif
#ifndef B_HALF
#define B_HALF(k) ((k) & 1)
#endif
#ifndef D_ROW
#define D_ROW(i) ((i) >= 2 ? 8 : 0)
#endif
uint32_t mma_a[32][32][4], mma_b[32][32][2];
inline float frag_half(uint32_t reg, int high) { return half_bits(high ? reg >> 16 : reg & 0xffffu); }
inline float frag_bf16(uint32_t reg, int high) { return host_as_float((high ? reg >> 16 : reg & 0xffffu) << 16); }
template <float (*VALUE)(uint32_t, int)>
inline void mma_emulated(float* d, const uint32_t* a, const uint32_t* b) {
  for (int i = 0; i < 4; ++i) mma_a[t_warp][t_lane][i] = a[i];
  for (int i = 0; i < 2; ++i) mma_b[t_warp][t_lane][i] = b[i];
  warp_bar[t_warp]->arrive_and_wait();
  const int q = t_lane >> 2, t = t_lane & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = q + D_ROW(i), col = 2 * t + (i & 1);
    float s = d[i];
    for (int k = 0; k < 16; ++k) {
      // A (row, k): lane 4 (row % 8) + (k % 8) / 2; B (k, col): lane 4 col + (k % 8) / 2
      const float av = VALUE(mma_a[t_warp][4 * (row % 8) + (k % 8) / 2][A_REG(row, k)], k & 1);
      const float bv = VALUE(mma_b[t_warp][4 * col + (k % 8) / 2][(k) >= 8 ? 1 : 0], B_HALF(k));
      s += av * bv;
    }
    out[i] = s;
  }
  warp_bar[t_warp]->arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
inline void mma_16816(float* d, const uint32_t* a, const uint32_t* b) { mma_emulated<frag_half>(d, a, b); }
inline void mma_16816_bf16(float* d, const uint32_t* a, const uint32_t* b) { mma_emulated<frag_bf16>(d, a, b); }
inline uint32_t host_f2h_bits(float f) { _Float16 h = (_Float16)f; uint16_t u; std::memcpy(&u, &h, 2); return u; }
#define F2H_BITS(x) host_f2h_bits(x)
inline uint32_t host_bf16_rn(float f) { const uint32_t u = host_as_uint(f); return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; }
inline uint32_t host_h2_mul_bf16_bits(uint32_t a, uint32_t b) {
  return host_bf16_rn(frag_bf16(a, 0) * frag_bf16(b, 0)) | host_bf16_rn(frag_bf16(a, 1) * frag_bf16(b, 1)) << 16;
}
#define H2_MUL_BF16_BITS(a, b) host_h2_mul_bf16_bits(a, b)
"""

# cp.async as the host runs it, at the two ends of what the GPU may do: each thread's copies wait
# in its queue until a cp_async_wait lets them land (all but the newest N committed groups), so a
# body that reads a buffer before waiting for it, or before the barrier after the others' waits,
# reads what was there before; or, with CP_ASYNC_EARLY defined, they land as they are issued.
CP_ASYNC_EMULATOR = r"""
struct PendingCopy { void* dst; const void* src; };
std::vector<PendingCopy> cp_queue[1024];
std::vector<size_t> cp_groups[1024];   // each committed group's end in the thread's queue
inline int cp_thread() { return (int)(t_warp * 32 + t_lane); }
inline void cp_async16(void* dst, const void* src) {
#ifdef CP_ASYNC_EARLY
  std::memcpy(dst, src, 16);
#else
  cp_queue[cp_thread()].push_back({dst, src});
#endif
}
inline void cp_async_commit() { cp_groups[cp_thread()].push_back(cp_queue[cp_thread()].size()); }
template <int N> inline void cp_async_wait() {
  std::vector<PendingCopy>& queue = cp_queue[cp_thread()];
  std::vector<size_t>& groups = cp_groups[cp_thread()];
  if ((int)groups.size() <= N) return;
  const size_t landed = groups[groups.size() - 1 - N];
  for (size_t i = 0; i < landed; ++i) std::memcpy(queue[i].dst, queue[i].src, 16);
  queue.erase(queue.begin(), queue.begin() + landed);
  groups.erase(groups.begin(), groups.end() - N);
  for (size_t& end : groups) end -= landed;
}
"""

MUTATIONS = {
    "A rows and k halves swapped": "#define A_REG(row, k) (((row) >= 8 ? 2 : 0) + ((k) >= 8 ? 1 : 0))\n",
    "B halves swapped": "#define B_HALF(k) (1 - ((k) & 1))\n",
    "D rows taken for columns": "#define D_ROW(i) ((i) & 1 ? 8 : 0)\n",
}
