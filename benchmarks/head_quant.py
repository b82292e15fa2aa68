"""Logit error added by keeping the output head quantized (DSV4_HEAD_QUANT).

    python -m benchmarks.head_quant [--model DIR] [--tokens 256]

Teacher-forces the same text through the model with the head as loaded (bf16) and with
the head quantized to mxfp8 and affine 8-bit (group 32); reports, per mode, the relative
logit error (max |diff| / max |logit| over all positions, and RMS diff / RMS logit), the
argmax agreement and the head's bytes. Writes a dated report to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

TEXT = ("Errors should never pass silently. Unless explicitly silenced. In the face of "
        "ambiguity, refuse the temptation to guess. There should be one obvious way to do it. "
        "The with statement is used to wrap the execution of a block with methods defined by a "
        "context manager. A class definition defines a class object. ") * 4


def logits(model, ids):
    return model(ids, model.make_cache()).astype(mx.float32)[0]


def main(argv=None) -> int:
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from dsv4 import load
    from dsv4.loader import quantize_head

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the bundled demo)")
    p.add_argument("--tokens", type=int, default=256)
    a = p.parse_args(argv)
    model, tok = load(a.model)
    ids = np.array([tok.encode(TEXT)[: a.tokens]])
    head = model.head
    ref = logits(model, ids)
    rows = []
    for mode in ("mxfp8", "affine8"):
        model.head = head
        quantize_head(model, mode)
        out = logits(model, ids)
        diff = out - ref
        max_rel = float(mx.max(mx.abs(diff)) / mx.max(mx.abs(ref)))
        rms_rel = float(mx.sqrt(mx.mean(diff * diff)) / mx.sqrt(mx.mean(ref * ref)))
        same = float(mx.mean(mx.argmax(out, -1) == mx.argmax(ref, -1)).item())
        nbytes = sum(v.nbytes for k, v in model.head.items() if k in ("weight", "scales", "biases"))
        rows.append(f"| {mode} | {max_rel:.2e} | {rms_rel:.2e} | {same:.1%} | {nbytes / 1e6:.2f} |")
    model.head = head
    when = datetime.now()
    lines = ["# Quantized output head: added logit error", "",
             f"{when:%Y-%m-%d %H:%M}; model `{a.model or 'bundled demo'}`, {ids.shape[1]} teacher-forced "
             f"tokens; reference: the head as loaded ({head.weight.dtype}, {head.weight.nbytes / 1e6:.2f} MB).", "",
             "| mode | max rel error | RMS rel error | argmax agreement | head MB |", "|---|---|---|---|---|",
             *rows, "", to_markdown(describe())]
    write_dated(Path(__file__).parent / "results", when, "head-quant", lines, shown=8 + len(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
