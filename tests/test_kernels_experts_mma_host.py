"""The tensor-core bodies (dsv4/kernels/experts_mma.py: the experts' gate/up and down) run on the
host, CPU, in CI.

mma.sync runs under tests/mma_emulator.py. The body is compiled with
clang under it and test_kernels_matvec's threadgroup emulator and run over the
dispatcher's launch grid; h must match hidden_reference and y down_reference (plain MLX) within
the portable kernels' bounds. Its MUTATIONS must fail the same check. Unverified here: the real instruction (ptxas and
the GPU: the NVRTC gate compiles it, tests/test_kernels_gpu-style runs come with the H200).
"""

import subprocess

import numpy as np
import pytest

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import dialect
from dsv4.kernels import experts as ex
from dsv4.kernels import experts_mma
from tests.mma_emulator import MMA_EMULATOR, MUTATIONS
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_experts import check_down, check_hidden, hidden_expected, quantized
from tests.test_kernels_experts_host import (BF16, DOWN_MAIN, GATE_UP_MAIN, bf16_bits, from_bf16_bits, layout,
                                             matrix_bytes)
from tests.test_kernels_matvec import EMULATOR

def run_body(tmp_path, name, x, idx, rw, gate, up, shared, limit, act_quant, mutation=""):
    tokens, D = x.shape
    E, I = gate.weight.shape[0], gate.out_features
    K = idx.shape[-1]
    s_gate, s_up, _ = shared
    consts = dict(K=K, HS=1, I=I, D=D, **layout("", gate), **layout("S", s_gate), KSPLIT=experts_mma.KSPLIT,
                  ACTQ=act_quant, ROWS=4, LANES=32)   # ROWS * 32 / LANES = 4: GATE_UP_MAIN launches 256 threads
    assert 32 * 32 // 4 == experts_mma.THREADS
    source = (EMULATOR + BF16 + mutation + MMA_EMULATOR
              + "".join(f"constexpr int {k} = {int(v)};\n" for k, v in consts.items())
              + ex._HEADER + experts_mma.HEADER
              + GATE_UP_MAIN.replace("BODY", ex.MMA_GATE_UP_KERNEL.body).replace("SSCALE", "uint8_t")
              .replace("SCALE", "uint8_t"))
    exe = build_host(tmp_path, name, source)
    data = (np.array([tokens, E], np.int32).tobytes() + bf16_bits(x) + np.array(idx).tobytes()
            + np.array(rw).tobytes() + np.array([limit], np.float32).tobytes()
            + matrix_bytes(gate, gate, E * I, D) + matrix_bytes(up, gate, E * I, D)
            + matrix_bytes(s_gate, s_gate, I, D) + matrix_bytes(s_up, s_gate, I, D))
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    return from_bf16_bits(out, (tokens, K + 1, I))


def problem(rng, tokens, I, D):
    """V4.1's layouts (routed mxfp4, shared mxfp8) at small widths; x spans 2^-20..2^2 across
    its 32-value groups (each group's power of two, hi and lo parts at work)."""
    E, K = 5, 3
    gate, up = (quantized(rng, (E, I, D), "mxfp4", 4, 32, mx.bfloat16) for _ in range(2))
    shared = tuple(quantized(rng, s, "mxfp8", 8, 32, mx.bfloat16) for s in ((I, D), (I, D), (D, I)))
    spread = 2.0 ** rng.integers(-20, 3, (tokens, D // 32, 1))
    x = mx.array((rng.standard_normal((tokens, D // 32, 32)) * spread).reshape(tokens, D).astype(np.float32))
    x = x.astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32))
    rw = mx.array(rng.uniform(0.05, 1.0, (tokens, K)).astype(np.float32))
    return x, idx, rw, gate, up, shared


# D = 256: 2 chunks of 128 for 4 splits (two SIMD groups of each row set have none);
# D = 640: 5 chunks, uneven over the splits. I = 64: two threadgroups of 32 rows.
@pytest.mark.parametrize("tokens,D,act_quant", [(1, 640, True), (2, 256, False)])
def test_mma_gate_up_body_on_the_host(tmp_path, tokens, D, act_quant):
    rng = np.random.default_rng()
    x, idx, rw, gate, up, shared = problem(rng, tokens, 64, D)
    with flags.override(kernel_moe_mma=True):
        assert experts_mma.supports(x, gate, shared[0], "cuda")
        assert not experts_mma.supports(x, gate, shared[0], "metal")
    h = run_body(tmp_path, "mma", x, idx, rw, gate, up, shared, 0.3 if act_quant else 8.0, act_quant)
    check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared, 0.3 if act_quant else 8.0, act_quant),
                 act_quant)


def run_down(tmp_path, h, idx, down, s_down):
    tokens, slots, I = h.shape
    E, DO = down.weight.shape[0], down.out_features
    consts = dict(K=slots - 1, HS=1, I=I, DO=DO, HC=0, **layout("", down), **layout("S", s_down),
                  ROWS=16, LANES=32,   # ROWS * 32 / LANES = 16 rows per threadgroup, as DOWN_ROWS
                  GROUPS=slots)        # a SIMD group a slot (down_kernel's launch of it)
    assert experts_mma.DOWN_ROWS == 16
    source = (EMULATOR + BF16 + MMA_EMULATOR + "".join(f"constexpr int {k} = {int(v)};\n" for k, v in consts.items())
              + ex._HEADER + experts_mma.HEADER
              + DOWN_MAIN.replace("BODY", ex.MMA_DOWN_KERNEL.body).replace("SSCALE", "uint8_t").replace("SCALE", "uint8_t"))
    exe = build_host(tmp_path, "down", source)
    data = (np.array([tokens, E], np.int32).tobytes() + bf16_bits(h) + np.array(idx).tobytes()
            + matrix_bytes(down, down, E * DO, I) + matrix_bytes(s_down, s_down, DO, I))
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    return from_bf16_bits(out, (tokens, DO))


# I = 384: 3 chunks of 128 a row; DO = 40: the last threadgroup of 16 rows clamps its rows 40-47.
@pytest.mark.parametrize("tokens,act_quant", [(1, True), (2, False)])
def test_mma_down_body_on_the_host(tmp_path, tokens, act_quant):
    rng = np.random.default_rng()
    x, idx, rw, gate, up, shared = problem(rng, tokens, 384, 128)
    down = quantized(rng, (5, 40, 384), "mxfp4", 4, 32, mx.bfloat16)
    s_down = quantized(rng, (40, 384), "mxfp8", 8, 32, mx.bfloat16)
    shared = (*shared[:2], s_down)
    h = ex.hidden_reference(x, idx, rw, gate, up, shared, 8.0, act_quant)
    with flags.override(kernel_moe_mma=True), dialect.pretend_gpu("cuda", None):
        assert experts_mma.down_applies(h, down, s_down)
    check_down(run_down(tmp_path, h, idx, down, s_down), h, idx, down, s_down)


@pytest.mark.parametrize("mutation", list(MUTATIONS), ids=list(MUTATIONS))
def test_a_wrong_fragment_layout_fails(tmp_path, mutation):
    rng = np.random.default_rng()
    x, idx, rw, gate, up, shared = problem(rng, 1, 64, 256)
    h = run_body(tmp_path, "mutant", x, idx, rw, gate, up, shared, 8.0, False, MUTATIONS[mutation])
    with pytest.raises(AssertionError):
        check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared, 8.0, False), False)


def test_the_switch_picks_the_mma_launch_on_cuda_only():
    from tools.launch_limits import record

    rng = np.random.default_rng()
    x, idx, rw, gate, up, shared = problem(rng, 1, 128, 256)   # I = 128: the down launch's one chunk

    def calls():
        ex.experts(x, idx, rw, gate, up, quantized(rng, (5, 256, 128), "mxfp4", 4, 32, mx.bfloat16), shared, 8.0)

    for on in (False, True):
        with flags.override(kernel_moe_mma=on):
            names = {launch.kernel.name for launch in record("cuda", calls)}
            assert ("dsv4_experts_gate_up_mma" in names) == on and ("dsv4_experts_down_mma" in names) == on
            assert not {"dsv4_experts_gate_up_mma", "dsv4_experts_down_mma"} & {
                launch.kernel.name for launch in record("metal", calls)}
