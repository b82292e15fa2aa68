"""A custom kernel that fails to build or launch falls back to its plain-MLX reference
(dialect.falls_back): one warning naming the kernel and its switch, then the reference's
numbers for the rest of the process. On the CPU: the dispatchers see a GPU backend
(dialect.pretend_gpu) whose every kernel launch raises, as MLX does for a kernel it cannot
build."""

import warnings

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags
from dsv4.attention import RMSNorm, Rotation, finish_rows
from dsv4.kernels import dialect, matvec, rows
from dsv4.kernels.experts import QuantizedMatrix
from dsv4.quant import qdq_fp8

KERNEL_SWITCHES_OFF = {n: False for n in flags.FLAGS if n.startswith("kernel_")}


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Every test starts with no kernel fallen back yet and no first launch run."""
    monkeypatch.setattr(dialect, "_fallen", set())
    monkeypatch.setattr(dialect, "_launched", set())


class Unbuildable:
    """A GPU backend on which no kernel builds: counts the attempts."""

    def __init__(self):
        self.attempts = []

    def __call__(self, kernel, **_):
        self.attempts.append(kernel.name)
        raise RuntimeError(f"[metal::Device] Unable to build metal library {kernel.name}")


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def forward_logits(model, ids):
    """Logits of a prefill of all but 3 tokens (more than 8: the kernels of a few tokens sit it
    out), a draft-sized chunk of 2, and a decode step of 1 (enough rows for the indexer to
    score)."""
    cache = model.make_cache()
    return [np.array(model(mx.array([chunk]), cache=cache)) for chunk in (ids[:-3], ids[-3:-1], ids[-1:])]


def test_model_on_a_gpu_whose_kernels_fail_computes_what_the_switches_off_compute(tiny_dir):
    """Every op of a forward (mHC, sparse attention, the indexer's scores and top-k, the
    router, the experts, the head's and compressor's products, the fp8 rounding) tries its
    kernel once, warns once, then runs its reference: the logits are those of the same forward
    with every kernel switch off."""
    model, _ = dsv4.load(tiny_dir)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 500, 24)]
    backend = Unbuildable()
    with dialect.pretend_gpu("metal", backend), flags.override(compile=False, **{"kernel_matvec": False}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = forward_logits(model, ids)
        with flags.override(**KERNEL_SWITCHES_OFF):
            want = forward_logits(model, ids)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    messages = fallback_warnings(caught)
    assert len(messages) == len(backend.attempts) == len(set(backend.attempts)), messages   # once each
    assert {"dsv4_hc_project", "dsv4_sparse_attention_partial", "dsv4_indexer_scores", "dsv4_indexer_topk",
            "dsv4_router_topk", "dsv4_experts_routed_gate_up", "dsv4_head_logits",
            "dsv4_qdq_fp8_pow2"} <= set(backend.attempts)
    for kernel, message in zip(backend.attempts, messages):
        assert f"kernel {kernel} could not be built or launched" in message
        assert "Unable to build metal library" in message and "DSV4_KERNEL_" in message


def test_one_warning_then_the_reference_without_trying_again():
    rng = np.random.default_rng()
    w = mx.array(rng.standard_normal((96, 256)).astype(np.float32))
    q = QuantizedMatrix(*mx.quantize(w, group_size=32, bits=8, mode="mxfp8"), None, 32, 8, "mxfp8")
    x = mx.array(rng.standard_normal((2, 256)).astype(np.float32)).astype(mx.bfloat16)
    backend = Unbuildable()
    with dialect.pretend_gpu("metal", backend), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert matvec.kernel_supports(x, q)
        outs = [matvec.quantized_matvec(x, q, True) for _ in range(3)]
    want = matvec.matvec_reference(x, q, True)
    assert all(mx.array_equal(o, want).item() for o in outs)
    # The reference's fp8 rounding tries its own kernel (once); the matvec is not tried again.
    assert backend.attempts == ["dsv4_quantized_matvec", "dsv4_qdq_fp8_pow2"]
    message, rounding = fallback_warnings(caught)
    assert "kernel dsv4_quantized_matvec could not be built or launched" in message
    assert "quantized_matvec runs its plain-MLX reference" in message and "DSV4_KERNEL_MATVEC=0" in message
    assert "dsv4_qdq_fp8_pow2" in rounding and "DSV4_KERNEL_QDQ=0" in rounding


def test_projection_tail_falls_back_to_the_unfused_tail():
    """The fixed step's fused tail (rows.row_tail) falling back gives what the unfused tail
    (dsv4.attention.finish_rows: norm, RoPE, rounding as separate ops) gives: the same
    numbers for norm and fp8 rounding; with RoPE within a bf16 step of each pair's size
    (mx.fast.rope's angles are not mx.cos/mx.sin's)."""
    rng = np.random.default_rng()
    x = mx.array(rng.standard_normal((1, 1, 512)).astype(np.float32)).astype(mx.bfloat16)
    norm = RMSNorm(512, 1e-6)
    norm.weight = mx.array(rng.uniform(0.5, 1.5, 512).astype(np.float32)).astype(mx.bfloat16)
    freqs = mx.array(10000.0 ** (np.arange(32) / 32)).astype(mx.float32)
    offset = mx.array([37], mx.int32)
    rot = Rotation(offset, freqs, angles=rows.rope_angles_reference(offset, freqs, 1.0))
    backend = Unbuildable()
    with dialect.pretend_gpu("metal", backend), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rounded = finish_rows(x, norm, None, qdq_fp8, fused=True)
        rotated = finish_rows(x, norm, rot, None, fused=True)
    assert backend.attempts == ["dsv4_row_tail", "dsv4_qdq_fp8_pow2"]   # the reference's rounding: its own
    assert "DSV4_KERNEL_ROWS=0" in fallback_warnings(caught)[0]
    assert mx.array_equal(rounded, finish_rows(x, norm, None, qdq_fp8, fused=False)).item()
    f32 = lambda a: np.array(a.astype(mx.float32))
    want, unrotated = f32(finish_rows(x, norm, rot, None, fused=False)), f32(finish_rows(x, norm, None, None, fused=False))
    pair = np.abs(unrotated).reshape(-1, 2).sum(-1).repeat(2).reshape(want.shape)   # |a| + |b| of each pair
    assert np.all(np.abs(f32(rotated) - want) <= 2.0 ** -7 * pair)   # one bf16 step of |v| <= |a| + |b|
    assert not np.array_equal(f32(rotated), unrotated)   # it rotated


def test_an_error_that_is_not_a_kernel_failure_is_not_hidden():
    """A dispatcher's own mistake (here a negative template value) raises as before."""
    kernel = dialect.Kernel(name="probe", input_names=("x",), output_names=("y",), body="")
    with dialect.pretend_gpu("metal", Unbuildable()), pytest.raises(ValueError, match=">= 0"):
        kernel(inputs=[mx.zeros(8)], output_shapes=[(8,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
               threadgroup=(32, 1, 1), template=[("N", -1)])


def test_a_kernel_that_fails_at_its_first_launch_falls_back(monkeypatch):
    """MLX compiles a kernel's source (Metal) at the first eval, after the call returned: the
    first launch of each instantiation runs inside the call, so a build error there still
    becomes the reference's result and one warning; later calls of that instantiation are
    not evaluated early."""
    rng = np.random.default_rng()
    w = mx.array(rng.standard_normal((64, 256)).astype(np.float32))
    q = QuantizedMatrix(*mx.quantize(w, group_size=32, bits=8, mode="mxfp8"), None, 32, 8, "mxfp8")
    x = mx.array(rng.standard_normal((1, 256)).astype(np.float32)).astype(mx.bfloat16)
    launched = []

    def lazy_launch(kernel, output_shapes, output_dtypes, **_):
        launched.append(kernel.name)
        if kernel.name != "dsv4_quantized_matvec":   # the reference's rounding: its plain ops
            raise RuntimeError(f"{kernel.name}: not this test's kernel")
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]   # the call succeeds

    def evaluate(arrays):
        if any(a.dtype == mx.bfloat16 and a.shape == (1, 64) for a in arrays):   # the matvec's output
            raise RuntimeError("[metal::Device] Unable to build metal library dsv4_quantized_matvec")
        mx.eval(arrays)

    monkeypatch.setattr(dialect, "evaluate", evaluate)
    with dialect.pretend_gpu("metal", lazy_launch, first_launches=True), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = matvec.quantized_matvec(x, q, True)
        again = matvec.quantized_matvec(x, q, True)
        want = matvec.matvec_reference(x, q, True)   # its fp8 rounding's kernel pretends too
    assert launched[0] == "dsv4_quantized_matvec" and launched.count("dsv4_quantized_matvec") == 1
    messages = fallback_warnings(caught)
    assert "Unable to build metal library" in messages[0] and "DSV4_KERNEL_MATVEC=0" in messages[0]
    assert len(messages) == 2 and "DSV4_KERNEL_QDQ=0" in messages[1]   # then the rounding's kernel
    assert mx.array_equal(got, again).item() and mx.array_equal(got, want).item()
    assert mx.any(want != 0).item()   # real numbers: the plain-MLX reference's
