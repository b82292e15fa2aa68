"""The GGUF-block kernels (matvec and fused experts over gguf_dot's rows_dot) on a GPU, against
their plain-MLX references (exact decoding, fp32 matmuls), at V4.1's shapes: gate/up 5120 ->
2304 for 6 routed experts + the shared one, down 2304 -> 5120, the dense projections, 1-8
tokens; ds4's q2 (IQ2_XXS gate/up, Q2_K down, Q8_0 shared) and q4 (Q4_K, Q8_0 shared) recipes.

Run on the GPU machine: `pytest -m gpu tests/test_kernels_gguf_gpu.py`. Every output starts as
NaN (`kernels_poisoned`); TF32 off (tests/conftest.py) so the references' fp32 matmuls are fp32.
"""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import experts as ex
from dsv4.kernels import matvec as mv
from dsv4.kernels import mhc
from tests.test_kernels_experts import check_down, check_hidden, hidden_expected
from tests.test_kernels_gguf_host import gguf_matrix, limbs_values, variant_flags

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_poisoned")]

RNG = np.random.default_rng()
RECIPES = {"q2": (("IQ2_XXS", "IQ2_XXS", "Q2_K"), "Q8_0"), "q4": (("Q4_K", "Q4_K", "Q4_K"), "Q8_0")}


def f32(a):
    return np.array(a.astype(mx.float32))


def arr(a, dtype=mx.float32):
    return mx.array(np.asarray(a, np.float32)).astype(dtype)


@pytest.fixture(scope="module", params=sorted(RECIPES))
def experts(request):
    """V4.1's widths with 24 experts (each kernel reads only its 6 rows of experts)."""
    (g, u, d), s = RECIPES[request.param]
    E, I, D = 24, 2304, 5120
    gate, up, down = gguf_matrix(RNG, (E, I, D), g), gguf_matrix(RNG, (E, I, D), u), gguf_matrix(RNG, (E, D, I), d)
    shared = tuple(gguf_matrix(RNG, shape, s) for shape in ((I, D), (I, D), (D, I)))
    mx.eval(gate.weight, up.weight, down.weight, *[m.weight for m in shared])
    return gate, up, down, shared


@pytest.mark.parametrize("tokens", [1, 4, 8])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("wide", [False, True, "halves", "hsub", "dp4a", "limbs"])
def test_gguf_experts_against_their_stages(experts, tokens, act_quant, wide):
    """`wide`: the 16-byte-load units (DSV4_KERNEL_GGUF_WIDE); "halves": with the codes as fp16
    subnormals (DSV4_KERNEL_GGUF_HALVES); "hsub": halves and the Q8_0 shared expert's int8s by
    int8s2 (DSV4_KERNEL_GGUF_Q8_HSUB); "dp4a": hsub and the gate/up (q2's IQ2_XXS, q4's Q4_K) in
    the integer units where act_quant rounds x (DSV4_KERNEL_GGUF_DP4A); "limbs": dp4a and h handed
    over as limbs, the down launch (q2's Q2_K, q4's Q4_K, the Q8_0 shared expert's) in the integer
    units (DSV4_KERNEL_GGUF_DP4A_DOWN)."""
    integer = wide in ("dp4a", "limbs")
    with flags.override(kernel_gguf_wide=bool(wide), kernel_gguf_halves=wide in ("halves", "hsub", "dp4a", "limbs"),
                        kernel_gguf_q8_hsub=wide in ("hsub", "dp4a", "limbs"), kernel_gguf_dp4a=integer,
                        kernel_gguf_dp4a_down=wide == "limbs"):
        gate, _, down, shared = experts
        assert ex.integer_kinds(gate, shared[0], act_quant) == (integer and act_quant,) * 2
        assert ex.limbs_between(down, shared[2], act_quant) == (wide == "limbs" and act_quant)
        experts_against_their_stages(experts, tokens, act_quant)


def experts_against_their_stages(experts, tokens, act_quant):
    gate, up, down, shared = experts
    E, D = gate.weight.shape[0], gate.in_features
    x = arr(RNG.standard_normal((tokens, D)) * 3, mx.bfloat16)
    idx = mx.array(np.stack([RNG.choice(E, 6, replace=False) for _ in range(tokens)]).astype(np.int32))
    rw = arr(RNG.uniform(0.05, 1.0, (tokens, 6)))
    limit = 10.0
    assert ex.kernel_supports(x, gate, up, down, shared)
    limbs = ex.limbs_between(down, shared[2], act_quant)
    h_given, _ = ex.gate_up_kernel(x, idx, rw, gate, up, shared, limit, act_quant, limbs=limbs)
    h = limbs_values(np.array(h_given).tobytes(), (tokens, 7, gate.out_features)) if limbs else h_given
    check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared, limit, act_quant), act_quant)
    y = ex.down_kernel(h_given, idx, down, shared[2])
    check_down(y, h, idx, down, shared[2])
    if limbs:   # the fused call hands h over the same way
        np.testing.assert_array_equal(f32(ex.experts_kernel(x, idx, rw, gate, up, down, shared, limit, act_quant)), f32(y))


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("splits", [0, 4])
def test_gguf_down_with_the_shared_expert_split(experts, tokens, splits):
    """The down launch with the Q8_0 shared expert's rows over several SIMD groups
    (DSV4_KERNEL_MOE_SHARED_SPLITS; 0: by its row's bytes, q2 3 and q4 2), the default units."""
    with flags.override(kernel_moe_shared_splits=splits):
        gate, _, down, shared = experts
        assert ex.shared_splits(down, shared[2], 6) == (splits or {"Q2_K": 3, "Q4_K": 2}.get(down.qtype, 1))
        experts_against_their_stages(experts, tokens, True)


@pytest.mark.parametrize("tokens", [1, 3])
def test_gguf_routed_experts_with_expand(experts, tokens):
    """The router's tail and the mHC expand fused around the GGUF experts: the same as routing
    with the router kernel, then the two launches, then hc_expand."""
    from dsv4.kernels import router
    gate, up, down, shared = experts
    E, D = gate.weight.shape[0], gate.in_features
    x = arr(RNG.standard_normal((tokens, D)) * 3, mx.bfloat16)
    logits, bias = arr(RNG.standard_normal((tokens, E))), arr(RNG.standard_normal(E) * 0.1)
    routing = (6, 1.0, 1.5, True)
    expand = (arr(RNG.standard_normal((tokens, 4, D)), mx.bfloat16), arr(RNG.uniform(0, 2, (tokens, 4))),
              arr(RNG.uniform(0, 1, (tokens, 4, 4))))
    got = ex.routed_experts(x, logits, bias, *routing, gate, up, down, shared, 10.0, True, expand)
    ids, weights = router.route_kernel(logits, bias, *routing)
    y = ex.experts_kernel(x, ids, weights, gate, up, down, shared, 10.0, True)
    want = f32(mhc.hc_expand(y, *expand))
    np.testing.assert_allclose(f32(got), want, rtol=2.0 ** -7, atol=1e-6)
    assert np.mean(f32(got) == want) > 0.99


# The dense projections of a ds4 file (Q8_0: wq_a, wq_b, wkv, wo_b, the shared expert's) and the
# Q4_K of its q4 attention option, at V4.1's shapes.
@pytest.mark.parametrize("qtype,n,k", [("Q8_0", 1280, 5120), ("Q8_0", 32768, 1280), ("Q8_0", 512, 5120),
                                       ("Q8_0", 5120, 8192), ("Q4_K", 1280, 5120), ("Q2_K", 512, 5120),
                                       ("IQ2_XXS", 2304, 5120), ("Q8_0 pairs", 1280, 5120),
                                       ("Q8_0 pairs", 32768, 1280), ("Q8_0 pairs", 5120, 8192),
                                       ("Q8_0 wide", 1280, 5120), ("Q8_0 wide", 32768, 1280),
                                       ("Q8_0 wide", 5120, 8192), ("Q2_K wide", 512, 5120),
                                       ("Q2_K wide", 5120, 2304), ("IQ2_XXS wide", 2304, 5120),
                                       ("IQ2_XXS halves", 2304, 5120), ("Q2_K halves", 5120, 2304),
                                       ("Q4_K halves", 1280, 5120), ("Q8_0 hsub", 1280, 5120),
                                       ("Q8_0 hsub", 32768, 1280), ("Q8_0 hsub", 5120, 8192),
                                       ("Q8_0 dp4a", 1280, 5120), ("Q8_0 dp4a", 32768, 1280),
                                       ("IQ2_XXS dp4a", 2304, 5120), ("Q4_K dp4a", 1280, 5120)])
@pytest.mark.parametrize("tokens", [1, 5, 8])
def test_gguf_matvec(qtype, n, k, tokens):
    """'Q8_0 pairs': read two blocks at a time (DSV4_KERNEL_GGUF_Q8_PAIRS); 'wide': 16-byte
    loads (DSV4_KERNEL_GGUF_WIDE); 'halves': codes as fp16 subnormals (DSV4_KERNEL_GGUF_HALVES);
    'hsub': the wide Q8_0 unit with its int8s by int8s2 (DSV4_KERNEL_GGUF_Q8_HSUB); 'dp4a': the
    integer units over x's limbs (DSV4_KERNEL_GGUF_DP4A)."""
    q = gguf_matrix(RNG, (n, k), qtype.split()[0])
    x = arr(RNG.standard_normal((tokens, k)) * 2, mx.bfloat16)
    assert mv.kernel_supports(x, q)
    with flags.override(**variant_flags(qtype)):
        got = f32(mv.quantized_matvec(x, q, True))
    want = f32(mv.matvec_reference(x, q, True))
    # both round an fp32 sum to bf16: one bf16 step apart at most, a few ulps of cancellation
    scale = np.abs(want).max(-1, keepdims=True)
    assert (np.abs(got - want) <= 2.0 ** -7 * np.abs(want) + 2.0 ** -12 * scale).all()
    assert np.mean(got == want) > 0.9


@pytest.mark.parametrize("qtype", ["Q8_0", "Q8_0 blocks", "Q4_K"])
@pytest.mark.parametrize("tokens", [1, 5, 8])
def test_grouped_gguf_matvec(qtype, tokens):
    """V4.1's grouped wo_a in one launch (8 groups of heads, each through its own block of 1024 rows
    of 4096 inputs) against the reference's per-group products; the units the switches pick by
    default, and 'blocks': the narrow ones (DSV4_KERNEL_GGUF_WIDE off)."""
    q = gguf_matrix(RNG, (8 * 1024, 4096), qtype.split()[0])
    x = arr(RNG.standard_normal((tokens, 8, 4096)), mx.bfloat16)
    assert mv.kernel_supports(x, q, groups=8)
    with flags.override(**({"kernel_gguf_wide": False} if qtype.endswith("blocks") else {})):
        got = f32(mv.quantized_matvec(x, q, False, groups=8))
    want = f32(mv.matvec_reference(x, q, False, groups=8))
    scale = np.abs(want).max(-1, keepdims=True)
    assert (np.abs(got - want) <= 2.0 ** -7 * np.abs(want) + 2.0 ** -12 * scale).all()
    assert np.mean(got == want) > 0.9


@pytest.mark.parametrize("qtype,n,k,groups", [("Q8_0", 1280, 5120, 1), ("Q8_0", 32768, 1280, 1),
                                              ("Q8_0", 5120, 8192, 1), ("Q4_K", 1280, 5120, 1),
                                              ("Q2_K", 5120, 2304, 1), ("IQ2_XXS", 2304, 5120, 1),
                                              ("Q8_0", 8 * 1024, 4096, 8), ("Q8_0 dp4a", 1280, 5120, 1),
                                              ("Q8_0 dp4a", 32768, 1280, 1), ("IQ2_XXS dp4a", 2304, 5120, 1),
                                              ("Q8_0 dp4a", 8 * 1024, 4096, 8), ("Q4_K dp4a", 1280, 5120, 1)])
@pytest.mark.parametrize("tokens", [2, 4, 6])
def test_gguf_tokens_matvec(qtype, n, k, groups, tokens):
    """DSV4_KERNEL_MATVEC_TOKENS over GGUF rows at V4.1's shapes (ds4's dense Q8_0 projections, the
    grouped wo_a, Q4_K, Q2_K and IQ2_XXS rows; 'dp4a': the integer units), the units the CUDA
    defaults pick: within the reference's bounds, and equal to the one-token launch where a unit is
    one pack of x and that launch takes the whole K in one SIMD group (SPLIT 1; the same sums: the
    host emulation's test_gguf_tokens_matvec_body_on_the_host)."""
    q = gguf_matrix(RNG, (n, k), qtype.split()[0])
    x = arr(RNG.standard_normal((tokens, groups, k) if groups > 1 else (tokens, k)) * 2, mx.bfloat16)
    with flags.override(kernel_gguf_dp4a=qtype.endswith("dp4a")):
        assert mv.kernel_supports(x, q, groups)
        with flags.override(kernel_matvec_tokens=True):
            assert mv.tokens_applies(q, tokens, groups, q.integer)
            got = f32(mv.quantized_matvec(x, q, True, groups))
        one = f32(mv.quantized_matvec(x, q, True, groups))
    want = f32(mv.matvec_reference(x, q, True, groups))
    scale = np.abs(want).max(-1, keepdims=True)
    assert (np.abs(got - want) <= 2.0 ** -7 * np.abs(want) + 2.0 ** -12 * scale).all()
    assert np.mean(got == want) > 0.9
    if q.unit_values(q.integer) == 32 and mv.work_split(n, k, q.block_values, groups)[0] == 1:
        np.testing.assert_array_equal(got, one)


def test_gguf_layers_dispatch_to_the_kernels():
    """A GGUF model's layers reach the kernels: GGUFLinear for 1-8 tokens, and with the kernel
    switched off the same values from the reference."""
    from dsv4.linear import GGUFLinear, fp8_linear
    q = gguf_matrix(RNG, (1280, 5120), "Q8_0")
    layer = GGUFLinear(5120, 1280, "Q8_0")
    layer.weight = q.weight
    x = arr(RNG.standard_normal((2, 5120)), mx.bfloat16)
    fast = f32(fp8_linear(layer, x))
    with flags.override(kernel_matvec="off"):
        slow = f32(fp8_linear(layer, x))
    scale = np.abs(slow).max(-1, keepdims=True)
    assert (np.abs(fast - slow) <= 2.0 ** -7 * np.abs(slow) + 2.0 ** -12 * scale).all()
