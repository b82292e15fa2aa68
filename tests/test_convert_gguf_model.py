"""End to end: a converted ds4 GGUF runs in dsv4 and gives the logits of the same file
converted at full precision (`--dequantize f32`: every block decoded exactly).

Conversions: GGUF blocks kept and referenced in the GGUF (the default), kept and copied
(`--copy-weights`), mapped into MLX affine (`--affine`), dequantized to f32 and bf16.

Teacher-forced prefill of one token sequence in f32 (MLX's CPU kernels accumulate f16/bf16
activations in reduced precision, ~1e-2), with the fp8/fp4 QDQ roundings off (they turn a
1e-7 difference into an occasional flipped rounding, DESIGN.md "Numerics").
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

import dsv4
from convert import gguf as conv
from dsv4 import flags
from tests.gguf_fixtures import write_ds4_gguf

TOKENS = [0, 5, 17, 3, 99, 100, 101, 7, 250, 251, 252, 64, 65, 66, 67, 300, 12, 13, 14, 2,
          40, 41, 42, 43]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-model")
    made = write_ds4_gguf(root / "q4.gguf", "q4", seed=5)
    write_ds4_gguf(root / "q2.gguf", "q2", seed=5, tokenizer=made["tokenizer"], config=made["config"])
    modes = {"native": conv.Options(), "copied": conv.Options(copy_weights=True),
             "affine": conv.Options(affine=True), "f32": conv.Options(dequantize="f32"),
             "bf16": conv.Options(dequantize="bf16")}
    out = {}
    for recipe in ("q4", "q2"):
        for mode, options in modes.items():
            dst = root / f"{recipe}-{mode}"
            report = conv.convert(root / f"{recipe}.gguf", dst, options, workers=1, progress=False)
            out[recipe, mode] = (dst, report)
    return out


def _model(path):
    model, _ = dsv4.load(path, dtype=mx.float32)  # f32 compute: differences are the weights
    if isinstance(model.head, nn.QuantizedLinear):
        # dsv4.model multiplies by head.weight directly (a plain head, as the official
        # checkpoint has); ds4 files carry a Q8_0 head. Same values, as a plain Linear.
        h = model.head
        w = mx.dequantize(h.weight, h.scales.astype(mx.float32), h.biases.astype(mx.float32),
                          group_size=h.group_size, bits=h.bits, dtype=mx.float32)
        model.head = nn.Linear(w.shape[1], w.shape[0], bias=False)
        model.head.weight = w
    return model


def _logits(path, perturb=None) -> np.ndarray:
    """Prefill logits; `perturb(name, weight) -> weight` may change parameters first."""
    model = _model(path)
    if perturb is not None:
        model.load_weights([(n, perturb(n, p)) for n, p in tree_flatten(model.parameters())],
                           strict=False)
    with flags.override(kv_qdq=False, act_quant=False):
        logits = model(mx.array(TOKENS)[None], cache=model.make_cache())
    return np.array(logits.astype(mx.float32))[0]


def _greedy(path, steps: int = 64) -> tuple[list[int], np.ndarray]:
    """Tokens chosen by argmax, one decode step at a time after a prefill of TOKENS[:8], and
    the logits each choice was made from [steps, vocab]."""
    model = _model(path)
    cache = model.make_cache()
    chosen, seen = [], []
    with flags.override(kv_qdq=False, act_quant=False):
        logits = model(mx.array(TOKENS[:8])[None], cache=cache)
        for _ in range(steps):
            seen.append(np.array(logits[0, -1].astype(mx.float32)))
            chosen.append(int(mx.argmax(logits[0, -1]).item()))
            logits = model(mx.array([[chosen[-1]]]), cache=cache)
    return chosen, np.stack(seen)


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


@pytest.mark.parametrize("recipe", ["q2", "q4"])
@pytest.mark.parametrize("mode", ["native", "copied"])
def test_kept_blocks_match_full_precision(files, recipe, mode):
    """GGUF blocks kept as they are (referenced in the GGUF or copied) decode to exactly the
    f32 reference's weights, for IQ2_XXS/Q2_K (q2) as for Q4_K (q4) and the Q8_0
    projections: only summation order differs (~1e-7 relative per op). 1e-4 leaves room
    for the model's amplification of that and fails for any layout or naming error (the
    lossy affine mapping of q2 moves them by more than 1e-3, see below)."""
    got, ref = _logits(files[recipe, mode][0]), _logits(files[recipe, "f32"][0])
    assert np.isfinite(got).all() and np.abs(ref).max() > 0.1
    assert _relative(got, ref) < 1e-4
    # greedy decoding: the same 64 tokens (q2: 62 distinct ones), and the decode steps'
    # logits as close as the prefill's (q4's greedy choice is one token throughout: its
    # logits carry that part)
    (tokens, step_logits), (ref_tokens, ref_step_logits) = (
        _greedy(files[recipe, mode][0]), _greedy(files[recipe, "f32"][0]))
    assert tokens == ref_tokens
    assert _relative(step_logits, ref_step_logits) < 1e-4


def test_mxfp4_experts_match_full_precision(tmp_path):
    """MXFP4 routed experts in the text file (ds4's engine runs them; its native DSpark files
    carry them) become MLX mxfp4, whose logits are the f32 reference's as kept blocks' are."""
    write_ds4_gguf(tmp_path / "mx.gguf", "q4", seed=5, expert_types={l: (T.MXFP4,) * 3 for l in (2, 5)})
    for mode, options in (("native", conv.Options()), ("f32", conv.Options(dequantize="f32"))):
        conv.convert(tmp_path / "mx.gguf", tmp_path / mode, options, workers=1, progress=False)
    quantization = json.loads((tmp_path / "native" / "config.json").read_text())["quantization"]
    assert quantization["layers.5.ffn.experts.w2"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    got, ref = _logits(tmp_path / "native"), _logits(tmp_path / "f32")
    assert np.abs(ref).max() > 0.1 and _relative(got, ref) < 1e-4


def test_exact_affine_file_matches_full_precision(files):
    """q4 through --affine: Q4_K and Q8_0 map into MLX affine exactly (f32 scales), so the
    same bound holds."""
    got, ref = _logits(files["q4", "affine"][0]), _logits(files["q4", "f32"][0])
    assert _relative(got, ref) < 1e-4


def test_exact_file_matches_bf16_reference(files):
    """Against the bf16 reference the issue asks for: that reference rounds every dequantized
    weight to bf16 (relative error <= 2^-9, RMS ~1e-3), which the logits inherit roughly
    once per matmul along the path; 2e-2 is ~10x that."""
    got, ref = _logits(files["q4", "native"][0]), _logits(files["q4", "bf16"][0])
    assert _relative(got, ref) < 2e-2


def test_lossy_file_behaves_like_noise_of_its_reported_error(files):
    """q2: IQ2_XXS -> 3-bit and Q2_K -> 4-bit add the reported relative weight error e to the
    routed experts. A random tiny model is chaotic (routing flips), so no first-order bound
    holds; the control is the f32 reference with Gaussian noise of relative RMS e added to
    the same expert tensors. The mapping's structured error may be worse than random noise,
    but not by more than 2x."""
    dst, report = files["q2", "affine"]
    error = {kind.split(" ")[0].rsplit(".", 1)[1]: r["added_relative_rms_error"]
             for kind, r in report.items() if "added_relative_rms_error" in r}
    assert set(error) == {"w1", "w2", "w3"} and 0.01 < max(error.values()) < 0.06
    ref = _logits(files["q2", "f32"][0])
    got = _relative(_logits(dst), ref)
    controls = []
    for seed in (0, 1):
        rng = np.random.default_rng(seed)

        def noisy(name, p):
            if ".ffn.experts.w" not in name:
                return p
            a = np.array(p)
            e = error[name.split(".experts.")[1].split(".")[0]]
            return mx.array(a + rng.normal(0, np.sqrt(np.mean(a ** 2)) * e, a.shape).astype(np.float32))

        controls.append(_relative(_logits(files["q2", "f32"][0], noisy), ref))
    assert 1e-3 < got < 2 * max(controls), (got, controls)


def test_float16_tensors_load_in_the_official_dtypes(files):
    """ds4 stores the official BF16 tensors (and float copies of fp8 ones) as F16, and its F32 mHC
    projections too. They load back in the official dtypes, value for value, so that the model
    computes in bf16 as the official one does (not in fp16, whose range is 65504) and its MoE
    layers take the fused GGUF experts kernels (bf16 only), as a GPU backend would run them."""
    from dsv4.kernels import dialect

    path = files["q2", "native"][0]
    src = conv.GGUFSource(path.parent / "q2.gguf")
    model, _ = dsv4.load(path)
    for gguf_name, name, dtype in (("token_embd.weight", "embed.weight", mx.bfloat16),
                                   ("blk.0.hc_attn_fn.weight", "layers.0.hc_attn_fn", mx.float32)):
        t = src.tensors[gguf_name]
        assert t.qtype.name == "F16"
        got = dict(tree_flatten(model.parameters()))[name]
        assert got.dtype == dtype
        want = np.asarray(src.raw(t)).view(np.float16).reshape(t.shape).astype(np.float32)
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    launched = []

    def stand_in(kernel, *, output_shapes, output_dtypes, **_):
        launched.append(kernel.name)
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    with flags.override(fixed_decode="off", dequant_matmul="off"), dialect.pretend_gpu("cuda", stand_in):
        mx.eval(model(mx.array([TOKENS[:3]]), cache=model.make_cache()))
    assert launched.count("dsv4_experts_routed_gate_up_gguf") == launched.count("dsv4_experts_down_gguf") > 0


@pytest.mark.parametrize("recipe", ["q2", "q4"])
def test_dp4a_takes_both_recipes_gate_up(files, recipe):
    """Under DSV4_KERNEL_GGUF_DP4A a converted ds4 file's MoE layers run their gate/up in the
    integer units on a GPU backend: q2's IQ2_XXS and q4's Q4_K routed experts with the Q8_0 shared
    expert, over x's limbs; the down launch keeps the float units (its h is read as bf16)."""
    from dsv4.kernels import dialect, gguf_dot
    from dsv4.kernels.experts import X_INTS

    model, _ = dsv4.load(files[recipe, "native"][0])
    launched = []

    def stand_in(kernel, *, output_shapes, output_dtypes, template, **_):
        launched.append((kernel.name, dict(template)))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    with flags.override(fixed_decode="off", dequant_matmul="off", kernel_gguf_dp4a=True), \
            dialect.pretend_gpu("cuda", stand_in):
        mx.eval(model(mx.array([TOKENS[:2]]), cache=model.make_cache()))
    ints = set(gguf_dot.INT_MODE_IDS.values())
    gate_up = [t for name, t in launched if name == "dsv4_experts_routed_gate_up_gguf"]
    down = [t for name, t in launched if name == "dsv4_experts_down_gguf"]
    assert gate_up and len(gate_up) == len(down)
    assert all(t["MODE"] in ints and t["SMODE"] == gguf_dot.INT_MODE_IDS["Q8_0"] and t["XS"] == X_INTS for t in gate_up)
    assert {t["MODE"] for t in gate_up} == {gguf_dot.INT_MODE_IDS["IQ2_XXS" if recipe == "q2" else "Q4_K"]}
    assert not any(t["MODE"] in ints for t in down)
