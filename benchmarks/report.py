"""The dated Markdown report a benchmark writes: `<out>/<YYYY-MM-DD-HHMM>-<name>.md`."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


def write_dated(out: Path, when: datetime, name: str, lines: list[str], *, data=None,
                shown: int | None = None) -> Path:
    """Writes the lines to <out>/<when's YYYY-MM-DD-HHMM>-<name>.md (and `data`, if given, as
    JSON beside it, same stem), prints them (the first `shown` only, if given) and the path. A
    report already there is kept: the name takes -2, -3, ... (two runs within a minute, e.g. one
    device call comparing switches in two processes)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{when:%Y-%m-%d-%H%M}-{name}"
    path, n = out / f"{stem}.md", 1
    while path.exists() or path.with_suffix(".json").exists():
        n += 1
        path = out / f"{stem}-{n}.md"
    path.write_text("\n".join(lines) + "\n")
    if data is not None:
        path.with_suffix(".json").write_text(json.dumps(data, indent=1))
    if lines[:shown]:
        print("\n".join(lines[:shown]))
    print(f"report: {path}", flush=True)
    return path
