"""benchmarks/report.py: the dated report's name, its JSON beside it, what it prints."""

import json
from datetime import datetime

from benchmarks.report import write_dated

WHEN = datetime(2026, 12, 3, 18, 41, 59)


def test_writes_the_dated_report_and_its_json(tmp_path, capsys):
    path = write_dated(tmp_path / "new", WHEN, "slice-decode-small", ["# a", "", "b"], data={"x": [1]}, shown=-1)
    assert path == tmp_path / "new" / "2026-12-03-1841-slice-decode-small.md"
    assert path.read_text() == "# a\n\nb\n"
    assert json.loads(path.with_suffix(".json").read_text()) == {"x": [1]}
    assert capsys.readouterr().out == f"# a\n\nreport: {path}\n"


def test_prints_all_lines_or_none(tmp_path, capsys):
    path = write_dated(tmp_path, WHEN, "all", ["a", "b"])
    assert capsys.readouterr().out == f"a\nb\nreport: {path}\n"
    assert not path.with_suffix(".json").exists()
    path = write_dated(tmp_path, WHEN, "none", ["a", "b"], shown=0)
    assert capsys.readouterr().out == f"report: {path}\n"
