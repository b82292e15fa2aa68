"""The slice benchmark's harness at toy widths (the speed numbers themselves are measured, not
tested): variants added with --ab, the report and its primitive counts."""

import collections
import json

from benchmarks import graph_ops, slice_decode


def test_launches_leave_out_only_the_view_primitives():
    counts = collections.Counter({"Reshape": 5, "View int32": 2, "Broadcast": 1, "Depends": 3,
                                  "AsType": 4, "CustomKernel": 6, "Matmul": 1,
                                  "CompiledBroadcastAdd": 2})
    assert graph_ops.launches(counts) == {"AsType": 4, "CustomKernel": 6, "Matmul": 1,
                                          "CompiledBroadcastAdd": 2}


def test_ab_variants_run_and_the_report_counts_primitives(tmp_path):
    assert slice_decode.main(["--small", "--contexts", "16", "--steps", "2", "--repeats", "1",
                              "--variants", "dsv4", "--ab", "fixed_decode=off",
                              "--ab", "compile=off+async_decode=off", "--out", str(tmp_path)]) == 0
    report = next(tmp_path.glob("*-slice-decode-small.md")).read_text()
    results = json.loads(next(tmp_path.glob("*-slice-decode-small.json")).read_text())
    names = ["dsv4", "dsv4 fixed_decode=off", "dsv4 compile=off+async_decode=off"]
    assert sorted(results) == sorted(f"16/{n}" for n in names)
    for name in names:
        assert results[f"16/{name}"]["ms"] > 0
        assert f"| 16 | {name} | " in report
    assert "without the view-only primitives" in report
