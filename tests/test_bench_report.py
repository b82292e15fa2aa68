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


def test_a_report_of_the_same_minute_and_name_is_kept(tmp_path):
    """Two runs within a minute (one device call, a switch on and off in two processes) write two
    reports: the second takes -2, then -3, and neither overwrites the earlier ones."""
    first = write_dated(tmp_path, WHEN, "step-profile", ["first"])
    (tmp_path / "2026-12-03-1841-other.json").write_text("{}")   # a JSON alone holds its name too
    second = write_dated(tmp_path, WHEN, "step-profile", ["second"], data={"x": 2})
    third = write_dated(tmp_path, WHEN, "step-profile", ["third"])
    other = write_dated(tmp_path, WHEN, "other", ["other"])
    assert first.name == "2026-12-03-1841-step-profile.md" and first.read_text() == "first\n"
    assert second.name == "2026-12-03-1841-step-profile-2.md" and second.read_text() == "second\n"
    assert json.loads(second.with_suffix(".json").read_text()) == {"x": 2}
    assert third.name == "2026-12-03-1841-step-profile-3.md" and third.read_text() == "third\n"
    assert other.name == "2026-12-03-1841-other-2.md"
