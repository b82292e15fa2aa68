"""benchmarks/ncu_experts.py's report: ncu's raw CSV rows paired with the ORDER line of `run`."""

import csv
import io

import pytest

from benchmarks import ncu_experts as ne


def ncu_csv(values: list[dict], order: list[str]) -> str:
    """ncu's --csv --page raw layout: a header row, a units row, a row a launch; the profiled
    program's own output (the ORDER line) mixed in."""
    names = ["ID", "Kernel Name"] + ne.metrics().split(",")
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(names)
    w.writerow(["", ""] + ["unit"] * (len(names) - 2))
    for i, v in enumerate(values):
        w.writerow([str(i), "dsv4_experts_gate_up"] + [v.get(n, "0") for n in names[2:]])
    return "==PROF== Connected\n" + "ORDER " + ";".join(order) + "\n" + out.getvalue()


def test_report_keeps_each_variants_second_call_with_its_numbers(tmp_path):
    stall = ne.STALL_METRIC.format("long_scoreboard")
    rows = [{stall: "9.99", "gpu__time_duration.sum": "1,000,000"},   # the first call: left out
            {stall: "1.70", "gpu__time_duration.sum": "79,584", "smsp__inst_executed.sum": "32,906,736"}]
    path = tmp_path / "ncu.csv"
    path.write_text(ncu_csv(rows, ["q2|default|1|0", "q2|default|1|1"]))
    text = ne.report(path, tmp_path, "gate_up").read_text()
    row = [ln for ln in text.splitlines() if ln.startswith("| q2 |")]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert cells[:4] == ["q2", "default", "1", "1.70"]
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    assert cells[header.index("µs")] == "79.6" and cells[header.index("warp instructions (M)")] == "32.9"


def test_report_refuses_rows_that_do_not_match_the_calls(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text(ncu_csv([{}], ["q2|default|1|0", "q2|default|1|1"]))
    with pytest.raises(ValueError, match="1 profiled launches for 2 calls"):
        ne.report(path, tmp_path, "gate_up")
