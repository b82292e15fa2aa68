"""benchmarks/host_graph.py's harness (the times themselves are measured, not tested)."""

import json

from benchmarks import host_graph


def test_report_times_the_call_and_its_parts(tmp_path):
    assert host_graph.main(["--steps", "5", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("*-host-graph.json")).read_text())
    assert set(data) == {"median", "min"} and all(set(t) == {"call", "snapshot", "compiled call"}
                                                   for t in data.values())
    # the call holds a snapshot and a compiled call of its own: so do the fastest steps (a median
    # of 5 is not safe from a loaded machine: a CI run saw the compiled call alone at 2x the call)
    t = data["min"]
    assert 0 < t["snapshot"] < t["call"] and 0 < t["compiled call"] < t["call"]
    assert all(data["min"][k] <= data["median"][k] for k in t)
    assert "| decoder call |" in next(tmp_path.glob("*-host-graph.md")).read_text()
