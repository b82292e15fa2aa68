"""One kernel source, two GPU dialects: Metal (`mx.fast.metal_kernel`) and CUDA (`mx.fast.cuda_kernel`).

A kernel body is written once against the small vocabulary below; the backend's prelude
(helper functions in the header, a few variable declarations at the top of the body) gives
it meaning. Launch parameters mean the same on both: `grid` counts threads, `threadgroup`
is the block; threadgroups are one-dimensional (x) and a multiple of 32 threads, so a
SIMD group (Metal) is a warp (CUDA), 32 lanes on every GPU MLX supports.

Vocabulary available to bodies:
  tid, lane, warp            thread index in its threadgroup, lane in its SIMD group, SIMD group index
  <input>_shape[i]           dimension i of an input (MLX passes it when the body names it)
  group_x, group_y, group_z  threadgroup position in the grid
  group_threads              threads per threadgroup
  KFN                        qualifier of helper functions defined in a kernel's header
  GLOBAL                     read-only global memory, for pointers into inputs of >= 8 elements
  SHARED, BARRIER()          threadgroup/shared memory declaration and barrier
  LOCAL                      address space of a pointer to a thread's own array (helper arguments)
  simd_sum_f, simd_max_f     sum/max over the 32 lanes, result in every lane
  simd_shuffle_i(v, src)     int v of lane src
  simd_xor_f(v, mask)        float v of lane (lane ^ mask)
  EXP, EXP2, LOG, RSQRT, SQRT, FMAX, FMIN, RINT, FABS   fp32 math
  POPCOUNT(u32)              set bits of a uint32_t
  DP4A(a, b, c)              c + the dot product of the four signed bytes of int a and of int b
  BYTE_PERM(a, b, s)         the bytes of b:a (a's bytes 0-3, b's 4-7) the 4 low nibbles of s
                             pick, byte k by nibble k (each 0-7: CUDA's __byte_perm, no sign mode)
  COS, SIN                   fp32 cosine and sine, the accurate ones (MLX's mx.cos/mx.sin's)
  DIV_RN(a, b)               a / b correctly rounded (IEEE), whatever the fast-math setting
  SHARED_ATOMIC_U32 x[n];    threadgroup/shared uint32 counters, used only through
  ATOMIC_ADD(x, v), ATOMIC_LOAD(x), ATOMIC_STORE(x, v)   (relaxed; order them with BARRIER())
  AS_FLOAT(u32), AS_UINT(f)  bit casts
  half2_bits_to_float2(u32)  two fp16 bit patterns (low half first) -> float2
  F2H_BITS(f)                (CUDA) the fp16 bit pattern of f rounded to nearest even, as uint32
  H2_SUB_BITS(a, b)          the fp16 pairs a - b (rounded to nearest even), as bits
  H2_MUL_BF16_BITS(a, b)     (CUDA) the bf16 pairs a * b (rounded to nearest even), as bits
  mma_16816(d, a, b)         (CUDA) d[4] += A B of one warp-wide mma.sync m16n8k16 (fp16 a[4], b[2])
  mma_16816_bf16(d, a, b)    (CUDA) the same with bf16 a and b
  LOAD_U4(ptr, i)            the i-th 16-byte word at ptr (ptr must be 16-byte aligned)
  cp_async16(dst, src)       (CUDA) copy 16 bytes from global src to shared dst without the
                             registers (both 16-byte aligned), in flight until waited for
  cp_async_commit()          (CUDA) close the thread's copies issued since the last commit into a group
  cp_async_wait<N>()         (CUDA) wait until at most the N newest groups are in flight (then a
                             BARRIER() before reading what other threads copied)
  DEVICE_FENCE()             (CUDA) this thread's global writes are seen by every threadgroup
                             that sees its later ones (__threadfence)
  DEVICE_ARRIVE(c, i)        (CUDA) the uint32 c[i] (an input: a counter the launch owns) plus
                             one, atomically on the device; gives the value before
  DEVICE_RESET(c, i)         (CUDA) c[i] back to 0, atomically
  LOAD_CG(p)                 (CUDA) *p read from L2 (not this SM's L1): another threadgroup's
                             write after its DEVICE_FENCE
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterator

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import cuda_cache, source_files

cuda_cache.configure()   # before MLX's first build reads $MLX_PTX_CACHE_DIR

METAL_HEADER = r"""
#define KFN inline
#define LOCAL thread
#define GLOBAL const device
#define SHARED threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define EXP(x) metal::exp(x)
#define EXP2(x) metal::exp2(x)
#define LOG(x) metal::log(x)
#define RSQRT(x) metal::rsqrt(x)
#define SQRT(x) metal::sqrt(x)
#define FMAX(a, b) metal::max(a, b)
#define FMIN(a, b) metal::min(a, b)
#define RINT(x) metal::rint(x)
#define COS(x) metal::precise::cos(x)
#define SIN(x) metal::precise::sin(x)
#define DIV_RN(a, b) metal::precise::divide(a, b)
#define SHARED_ATOMIC_U32 threadgroup atomic_uint
#define ATOMIC_ADD(x, v) atomic_fetch_add_explicit(&(x), (v), memory_order_relaxed)
#define ATOMIC_LOAD(x) atomic_load_explicit(&(x), memory_order_relaxed)
#define ATOMIC_STORE(x, v) atomic_store_explicit(&(x), (v), memory_order_relaxed)
#define FABS(x) metal::abs(x)
#define POPCOUNT(x) metal::popcount(x)
inline int dp4a(int a, int b, int c) {   // byte k sign-extended by shifts
  for (int k = 0; k < 4; ++k) c += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24);
  return c;
}
#define DP4A(a, b, c) dp4a(a, b, c)
inline uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t r = 0u;
  for (int k = 0; k < 4; ++k) {
    const uint32_t i = (s >> (4 * k)) & 7u;
    r |= (((i < 4u ? a : b) >> (8u * (i & 3u))) & 255u) << (8 * k);
  }
  return r;
}
#define BYTE_PERM(a, b, s) byte_perm(a, b, s)
#define AS_FLOAT(u) as_type<float>(u)
#define AS_UINT(f) as_type<uint32_t>(f)
#define LOAD_U4(p, i) (((const device uint4*)(p))[i])
inline float simd_sum_f(float x) { return simd_sum(x); }
inline int simd_shuffle_i(int x, int src) { return simd_shuffle(x, ushort(src)); }
inline float simd_max_f(float x) { return simd_max(x); }
inline float simd_xor_f(float x, int mask) { return simd_shuffle_xor(x, ushort(mask)); }
inline float2 half2_bits_to_float2(uint32_t b) { return float2(as_type<half2>(b)); }
inline uint32_t h2_sub_bits(uint32_t a, uint32_t b) { return as_type<uint32_t>(as_type<half2>(a) - as_type<half2>(b)); }
#define H2_SUB_BITS(a, b) h2_sub_bits(a, b)
"""

METAL_BODY_PRELUDE = r"""
  const uint32_t tid = thread_position_in_threadgroup.x;
  const uint32_t lane = tid & 31u;
  const uint32_t warp = tid >> 5;
  const uint32_t group_x = threadgroup_position_in_grid.x;
  const uint32_t group_y = threadgroup_position_in_grid.y;
  const uint32_t group_z = threadgroup_position_in_grid.z;
  const uint32_t group_threads = threads_per_threadgroup.x;
  (void)lane; (void)warp; (void)group_x; (void)group_y; (void)group_z; (void)group_threads;
"""

CUDA_HEADER = r"""
#define KFN __device__ inline
#define LOCAL
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#define GLOBAL const
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define EXP(x) expf(x)
#define EXP2(x) exp2f(x)
#define LOG(x) logf(x)
#define RSQRT(x) rsqrtf(x)
#define SQRT(x) sqrtf(x)
#define FMAX(a, b) fmaxf(a, b)
#define FMIN(a, b) fminf(a, b)
#define RINT(x) rintf(x)
#define COS(x) cosf(x)
#define SIN(x) sinf(x)
#define DIV_RN(a, b) __fdiv_rn(a, b)
#define SHARED_ATOMIC_U32 __shared__ uint32_t
#define ATOMIC_ADD(x, v) atomicAdd(&(x), (v))
#define ATOMIC_LOAD(x) (x)
#define ATOMIC_STORE(x, v) ((x) = (v))
#define FABS(x) fabsf(x)
#define POPCOUNT(x) ((uint32_t)__popc(x))
#define DP4A(a, b, c) __dp4a((int)(a), (int)(b), (int)(c))
#define BYTE_PERM(a, b, s) __byte_perm((uint32_t)(a), (uint32_t)(b), (uint32_t)(s))
#define AS_FLOAT(u) __uint_as_float(u)
#define AS_UINT(f) __float_as_uint(f)
#define LOAD_U4(p, i) (reinterpret_cast<const uint4*>(p)[i])
__device__ inline float simd_sum_f(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ inline int simd_shuffle_i(int x, int src) { return __shfl_sync(0xffffffffu, x, src); }
__device__ inline float simd_xor_f(float x, int mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }
__device__ inline float simd_max_f(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ inline float2 half2_bits_to_float2(uint32_t b) {
  __half2 h = *reinterpret_cast<__half2*>(&b);
  return __half22float2(h);
}
#define F2H_BITS(x) ((uint32_t)__half_as_ushort(__float2half_rn(x)))
__device__ inline uint32_t h2_sub_bits(uint32_t a, uint32_t b) {
  const __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
#define H2_SUB_BITS(a, b) h2_sub_bits(a, b)
__device__ inline uint32_t h2_mul_bf16_bits(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
#define H2_MUL_BF16_BITS(a, b) h2_mul_bf16_bits(a, b)

__device__ inline void mma_16816(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline void mma_16816_bf16(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
#define DEVICE_FENCE() __threadfence()
#define DEVICE_ARRIVE(c, i) atomicAdd((unsigned int*)(c) + (i), 1u)
#define DEVICE_RESET(c, i) atomicExch((unsigned int*)(c) + (i), 0u)
#define LOAD_CG(p) __ldcg(p)
"""

CUDA_BODY_PRELUDE = r"""
  const uint32_t tid = threadIdx.x;
  const uint32_t lane = tid & 31u;
  const uint32_t warp = tid >> 5;
  const uint32_t group_x = blockIdx.x;
  const uint32_t group_y = blockIdx.y;
  const uint32_t group_z = blockIdx.z;
  const uint32_t group_threads = blockDim.x;
  (void)lane; (void)warp; (void)group_x; (void)group_y; (void)group_z; (void)group_threads;
"""


# What one launch may use. Apple GPUs: 32 KB of threadgroup memory, 1024 threads per
# threadgroup, 32-lane SIMD groups; CUDA: 48 KB of static shared memory, 1024 threads, 32-lane
# warps. Dispatchers size their launches within these; tools/launch_limits.py checks every
# launch they make at V4.1's widths against them.
SHARED_MEMORY_BYTES = {"metal": 32 * 1024, "cuda": 48 * 1024}
MAX_THREADS = 1024
SIMD_WIDTH = 32

_poison = False
_pretend = None   # (dialect, launch) inside `pretend_gpu`


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Tests: fill every kernel output with NaN before the kernel runs, so that an element the
    kernel forgets to write cannot pass for a right answer."""
    global _poison
    saved, _poison = _poison, True
    try:
        yield
    finally:
        _poison = saved


@contextlib.contextmanager
def pretend_gpu(dialect: str, launch: Callable, first_launches: bool = False) -> Iterator[None]:
    """Checks on any machine (a CPU in CI): dispatchers see `dialect`'s GPU backend, and each
    kernel launch becomes launch(kernel, inputs=..., output_shapes=..., output_dtypes=...,
    grid=..., threadgroup=..., template=..., init_value=...), which returns the outputs,
    instead of a kernel MLX builds and runs. `first_launches`: run each instantiation's first
    launch at the call, as on a real GPU (off: checks that only record launches at V4.1's
    widths need not evaluate their inputs)."""
    global _pretend
    saved, _pretend = _pretend, (dialect, launch, first_launches)
    try:
        yield
    finally:
        _pretend = saved


def shared_memory_limit(dialect: str | None) -> int:
    """Bytes of threadgroup memory a launch may use on `dialect` (the least of all for None)."""
    return SHARED_MEMORY_BYTES.get(dialect, min(SHARED_MEMORY_BYTES.values()))


def backend() -> str | None:
    """'metal' or 'cuda' when custom kernels can run on the default device, else None (CPU)."""
    if _pretend is not None:
        return _pretend[0]
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


@lru_cache(maxsize=256)
def constant(values: tuple, dtype=mx.float32) -> mx.array:
    """A small parameter array, made once per value: creating host arrays on every call costs
    more than the kernels they feed (tens of µs each on CUDA)."""
    return mx.array(list(values), dtype)


@dataclass(frozen=True)
class Kernel:
    """A kernel body written once; `source(dialect)` gives the (header, body) for that backend.

    `checks` lists instantiations for the offline compile gates: each is
    (input dtypes, output dtypes, template args), with inputs assumed to hold >= 8 elements.
    `dialects`: the backends the body is written for (the CUDA-only vocabulary above: CUDA).
    """

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    body: str
    header: str = ""
    checks: tuple = field(default=(), compare=False)
    dialects: tuple = field(default=("metal", "cuda"), compare=False)
    max_threads: int = 0   # CUDA: the threadgroup's most threads, as launch bounds (see `launch_bounds`)

    def source(self, dialect: str) -> tuple[str, str]:
        """(header, body) as the backend gets them: compacted, and the header cut to what the
        body uses (see `compact` and `used_only`)."""
        if dialect not in self.dialects:
            raise ValueError(f"kernel {self.name} is written for {', '.join(self.dialects)}, not {dialect}")
        if dialect == "metal":
            header, body = METAL_HEADER + self.header, METAL_BODY_PRELUDE + self.body
        elif dialect == "cuda":
            header, body = CUDA_HEADER + self.header + launch_bounds(self.max_threads), CUDA_BODY_PRELUDE + self.body
        else:
            raise ValueError(f"unknown kernel dialect {dialect!r}; expected 'metal' or 'cuda'")
        body = compact(body)
        return used_only(compact(header), body), body

    def launch_source(self, dialect: str, files: bool) -> tuple[str, str]:
        """(header, body) as MLX gets them: `source`, or with `files` (CUDA only) two #include
        lines of it (dsv4/kernels/source_files.py)."""
        header, body = self.source(dialect)
        if not files:
            return header, body
        if dialect != "cuda":
            raise ValueError(f"kernel {self.name}: source files are for CUDA, not {dialect}")
        return source_files.stub(self.name, header, body, self.input_names)

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=(), init_value=None):
        dialect = backend()
        if dialect is None:
            raise RuntimeError(f"kernel {self.name}: no GPU backend (Metal or CUDA) on the default device")
        if self.max_threads and threadgroup[0] > self.max_threads:
            raise ValueError(f"kernel {self.name}: a threadgroup of {threadgroup[0]} threads, past its launch bounds "
                             f"({self.max_threads})")
        bad = [(k, v) for k, v in template if isinstance(v, int) and not isinstance(v, bool) and v < 0]
        if bad:
            # CUDA names the instantiation after its template values: a minus sign breaks the name.
            raise ValueError(f"kernel {self.name}: template values must be >= 0, got {bad}")
        key = (self.name, dialect, tuple(template), tuple(map(tuple, output_shapes)))
        if dialect == "cuda" and _pretend is None and key not in _cached:
            cuda_cache.ensure(self, inputs, output_dtypes, template)
            _cached.add(key)
        try:
            fn = functools.partial(_pretend[1], self) if _pretend is not None else \
                _compiled(self, dialect, dialect == "cuda" and source_files.in_use())
            outputs = fn(inputs=list(inputs), output_shapes=list(output_shapes),
                         output_dtypes=list(output_dtypes), grid=grid, threadgroup=threadgroup,
                         template=list(template), init_value=float("nan") if _poison else init_value)
        except Exception as e:
            raise KernelFailed(self.name) from e
        if key not in _launched and (_pretend[2] if _pretend is not None else
                                     flags.switch("kernel_first_launch_check", dialect == "metal")):
            self._first_launch(outputs, inputs, key)
        return outputs

    def _first_launch(self, outputs, inputs, key) -> None:
        """Run an instantiation's first launch now: MLX compiles the source (Metal, NVRTC) and
        the GPU takes the launch shape only at the first eval, after the call has returned, so
        this is where their errors can still become KernelFailed (and the reference's result).
        Inside mx.compile's tracing nothing can be evaluated: a later call tries again."""
        try:
            evaluate(list(inputs))
            evaluate(list(outputs))
        except ValueError:   # MLX refuses to evaluate while tracing (mx.compile, vmap): not now
            return
        except Exception as e:
            raise KernelFailed(self.name) from e
        _launched.add(key)


class KernelFailed(RuntimeError):
    """A custom kernel could not be built or launched (its cause is the exception MLX raised)."""

    def __init__(self, kernel: str):
        super().__init__(f"kernel {kernel} could not be built or launched")
        self.kernel = kernel


_fallen: set = set()   # kernel paths that failed in this process: their references run instead
_launched: set = set()   # instantiations (kernel, dialect, template, shapes) whose first launch ran
_cached: set = set()     # CUDA instantiations whose build cuda_cache has seen to
evaluate = mx.eval       # how a first launch is run (tests make it fail as a Metal build would)


def falls_back(reference: Callable, *switches: str) -> Callable:
    """Decorator of an op's kernel path (every function that launches its kernels): once one
    of them fails to build or launch, one warning names the kernel and the switches that turn
    it off, and `reference` (the same arguments, the same contract, plain MLX) runs in its
    place for the rest of the process, so that a kernel error never stops a user.

    What is caught: making the kernel object, MLX's checks of the launch, and the first launch
    of each instantiation, which Kernel.__call__ runs at once (MLX compiles the source and the
    GPU takes the launch shape at the first eval). A first launch inside mx.compile's tracing
    cannot run until the compiled function does: there the offline gates are the net
    (tools/metal_syntax_check.py: every body compiles; tools/launch_limits.py: every launch at
    V4.1's widths fits the GPU's limits), and the reference path's first forward (a prefill,
    a warm-up) has run most instantiations before."""
    envs = " or ".join(f"{flags.FLAGS[s].env}=0" for s in switches)

    def wrap(kernel_path: Callable) -> Callable:
        @functools.wraps(kernel_path)
        def call(*args, **kwargs):
            if call not in _fallen:
                try:
                    return kernel_path(*args, **kwargs)
                except KernelFailed as e:
                    _fallen.add(call)
                    warnings.warn(f"{e} ({e.__cause__!r}): {kernel_path.__name__} runs its plain-MLX "
                                  f"reference from now on (the kernel's switch: {envs})",
                                  RuntimeWarning, stacklevel=2)
            return reference(*args, **kwargs)
        return call
    return wrap


# MLX's CUDA backend hashes a custom kernel's whole source at every launch (on the H200's
# host ~1.6 µs per launch with the full headers and comments, 6% of a decode step's encoding),
# so the text a kernel is built from is kept to what it needs.

def compact(code: str) -> str:
    """C++ source without comments, indentation or blank lines."""
    code = re.sub(r"/\*.*?\*/", "", code, flags=re.S)
    code = re.sub(r"//[^\n]*", "", code)
    return "\n".join(line.strip() for line in code.splitlines() if line.strip())


def _top_level_items(code: str) -> list[str]:
    """Compacted code split into its top-level items: preprocessor lines, and definitions or
    declarations (up to the brace that closes them, or a semicolon outside braces)."""
    items, depth, start, i = [], 0, 0, 0
    while i < len(code):
        c = code[i]
        if depth == 0 and i == start and c == "#":
            end = code.find("\n", i)
            end = len(code) if end < 0 else end
            items.append(code[start:end])
            start = i = end + 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if depth == 0 and c in "};":
            if c == "}" and code.startswith(";", i + 1):
                i += 1
            items.append(code[start:i + 1].strip())
            start = i + 1
            while start < len(code) and code[start] in " \n":
                start += 1
            i = start
            continue
        i += 1
    if code[start:].strip():
        items.append(code[start:].strip())
    return items


def _defined_name(item: str):
    """The name a top-level item defines (function, struct or constant), or None."""
    if item.startswith("#"):
        return None
    head = re.split(r"[{;]", item, maxsplit=1)[0]
    head = re.sub(r"^template\s*<[^>]*>\s*", "", head)
    struct = re.match(r"(?:struct|class)\s+(\w+)", head)
    if struct:
        return struct.group(1)
    call = re.search(r"(\w+)\s*\(", head)
    assign = re.search(r"(\w+)\s*(?:\[[^]]*\])?\s*=", head)
    if assign and (not call or assign.start() < call.start()):
        return assign.group(1)
    return call.group(1) if call else None


def launch_bounds(max_threads: int) -> str:
    """CUDA header lines that give the kernel __launch_bounds__(max_threads, 1), so that NVRTC keeps
    its registers within what one threadgroup of max_threads may have (65536 / max_threads; without
    them a launch of 512 threads fails past 128). MLX declares the kernel `__global__ void name(`
    right after the header and takes no launch bounds itself: __global__ redefined at the header's
    end reaches that declaration alone. Empty for 0."""
    if not max_threads:
        return ""
    return f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({max_threads}, 1)\n"


def used_only(header: str, body: str) -> str:
    """The header's top-level items that the body needs, directly or through other items
    (preprocessor lines and items whose name is not recognised are always kept), in order."""
    items = [(item, _defined_name(item)) for item in _top_level_items(header)]
    keep = [name is None for _, name in items]
    text = body + "\n" + "\n".join(item for (item, _), k in zip(items, keep) if k)
    grew = True
    while grew:
        grew = False
        for j, (item, name) in enumerate(items):
            if not keep[j] and re.search(rf"\b{name}\b", text):
                keep[j], grew = True, True
                text += "\n" + item
    return "\n".join(item for (item, _), k in zip(items, keep) if k) + "\n"


@lru_cache(maxsize=None)
def _compiled(kernel: Kernel, dialect: str, files: bool):
    header, body = kernel.launch_source(dialect, files)
    make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
    return make(name=kernel.name, input_names=list(kernel.input_names),
                output_names=list(kernel.output_names), source=body, header=header)
