"""Every script in benchmarks/ starts both ways the docs name: `python -m benchmarks.X` from the
checkout and `python benchmarks/X.py` from anywhere (it then puts the checkout on sys.path
itself). `--help` imports the whole script and parses its arguments, without running anything."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "report"))


@pytest.mark.parametrize("how", ["module", "file"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_help(script, how, tmp_path):
    if how == "module":
        cmd, cwd = [sys.executable, "-m", f"benchmarks.{script}", "--help"], ROOT
    else:
        cmd, cwd = [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--help"], tmp_path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage" in result.stdout.lower(), result.stdout[-3000:]
