"""End to end: a converted ds4 GGUF runs in dsv4 and gives the logits of the same file
converted at full precision (gguf's own dequantisation, `--dequantize`).

Teacher-forced prefill of one token sequence in f32 (MLX's CPU kernels accumulate f16/bf16
activations in reduced precision, ~1e-2), with the fp8/fp4 QDQ roundings off (they turn a
1e-7 difference into an occasional flipped rounding, DESIGN.md "Numerics").
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
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
    out = {}
    for recipe in ("q4", "q2"):
        for mode in (None, "f32", "bf16"):
            dst = root / f"{recipe}-{mode or 'affine'}"
            report = conv.convert(root / f"{recipe}.gguf", dst, conv.Options(dequantize=mode),
                                  workers=1, progress=False)
            out[recipe, mode] = (dst, report)
    return out


def _logits(path, perturb=None) -> np.ndarray:
    """Prefill logits; `perturb(name, weight) -> weight` may change parameters first."""
    model, _ = dsv4.load(path, dtype=mx.float32)  # f32 compute: differences are the weights
    if perturb is not None:
        model.load_weights([(n, perturb(n, p)) for n, p in tree_flatten(model.parameters())],
                           strict=False)
    if isinstance(model.head, nn.QuantizedLinear):
        # dsv4.model multiplies by head.weight directly (a plain head, as the official
        # checkpoint has); ds4 files carry a Q8_0 head. Same values, as a plain Linear.
        h = model.head
        w = mx.dequantize(h.weight, h.scales.astype(mx.float32), h.biases.astype(mx.float32),
                          group_size=h.group_size, bits=h.bits, dtype=mx.float32)
        model.head = nn.Linear(w.shape[1], w.shape[0], bias=False)
        model.head.weight = w
    with flags.override(kv_qdq=False, act_quant=False):
        logits = model(mx.array(TOKENS)[None], cache=model.make_cache())
    return np.array(logits.astype(mx.float32))[0]


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def test_exact_file_matches_full_precision(files):
    """q4 (Q4_K experts, Q8_0 projections): every tensor is mapped exactly, so the weights
    equal the f32 reference's bit for bit and only summation order differs (quantized vs
    dense matmul, ~1e-7 relative per op). 1e-4 leaves room for the model's amplification of
    such differences and still fails for any mapping or naming error (>= 1e-2)."""
    got, ref = _logits(files["q4", None][0]), _logits(files["q4", "f32"][0])
    assert np.isfinite(got).all() and np.abs(ref).max() > 0.1
    assert _relative(got, ref) < 1e-4


def test_exact_file_matches_bf16_reference(files):
    """Against the bf16 reference the issue asks for: that reference rounds every dequantized
    weight to bf16 (relative error <= 2^-9, RMS ~1e-3), which the logits inherit roughly
    once per matmul along the path; 2e-2 is ~10x that."""
    got, ref = _logits(files["q4", None][0]), _logits(files["q4", "bf16"][0])
    assert _relative(got, ref) < 2e-2


def test_lossy_file_behaves_like_noise_of_its_reported_error(files):
    """q2: IQ2_XXS -> 3-bit and Q2_K -> 4-bit add the reported relative weight error e to the
    routed experts. A random tiny model is chaotic (routing flips), so no first-order bound
    holds; the control is the f32 reference with Gaussian noise of relative RMS e added to
    the same expert tensors. The mapping's structured error may be worse than random noise,
    but not by more than 2x."""
    dst, report = files["q2", None]
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
