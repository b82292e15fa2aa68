"""The slice benchmark's harness at toy widths (the speed numbers themselves are measured, not
tested): variants added with --ab, the report and its primitive counts."""

import collections
import json

import pytest

from benchmarks import graph_ops, slice_decode


def test_launches_leave_out_only_the_view_primitives():
    counts = collections.Counter({"Reshape": 5, "View int32": 2, "Broadcast": 1, "Depends": 3,
                                  "AsType": 4, "CustomKernel": 6, "Matmul": 1,
                                  "CompiledBroadcastAdd": 2})
    assert graph_ops.launches(counts) == {"AsType": 4, "CustomKernel": 6, "Matmul": 1,
                                          "CompiledBroadcastAdd": 2}


def test_two_slices_and_ab_variants_interleave_in_one_report(tmp_path):
    """One run (a slice build costs the most here): two slices, each with dsv4, its --ab variants
    and no mlx-lm (which has no GGUF blocks); the report counts primitives."""
    assert slice_decode.main(["--small", "--experts", "q4,mxfp4", "--dense", "q8_0", "--routed-experts", "16", "--contexts", "16",
                              "--steps", "2", "--repeats", "1", "--variants", "dsv4,mlx-lm", "--ab", "fixed_decode=off",
                              "--ab", "compile=off+async_decode=off", "--out", str(tmp_path)]) == 0
    report = next(tmp_path.glob("*-slice-decode-q4-q8_0-mxfp4-q8_0-small.md")).read_text()
    results = json.loads(next(tmp_path.glob("*-slice-decode-q4-q8_0-mxfp4-q8_0-small.json")).read_text())
    names = ["dsv4", "dsv4 fixed_decode=off", "dsv4 compile=off+async_decode=off"]
    assert sorted(results) == sorted(f"16/{s}/q8_0 {n}" for s in ("q4", "mxfp4") for n in names)
    for name, result in results.items():
        assert result["ms"] > 0
        assert f"| 16 | {name.split('/', 1)[1]} | " in report
    assert "without the view-only primitives" in report
    assert "q4/q8_0: weights read per step" in report and "mxfp4/q8_0: weights read per step" in report
    assert "of 16 routed experts" in report
    # each slice's bandwidth from its own bytes: q4's routed experts (4.5 bits a weight) outweigh mxfp4's (4.25)
    step_mb = {name: r["gbs"] * r["ms"] for name, r in results.items()}
    assert step_mb["16/q4/q8_0 dsv4"] > step_mb["16/mxfp4/q8_0 dsv4"]


@pytest.mark.parametrize("args,message", [
    (["--experts", "q3"], "--experts q3 --dense mxfp8"),
    (["--experts", "q2,q4", "--dense", "q8_0,mxfp8,mxfp8"], "--experts q2,q4 --dense q8_0,mxfp8,mxfp8"),
    (["--experts", "q2,q2", "--dense", "q8_0"], "--experts q2,q2 --dense q8_0"),
    (["--routed-experts", "5"], "--routed-experts 5: expected 6..32")])
def test_bad_options_refused(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        slice_decode.main(["--small", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
