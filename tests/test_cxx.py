"""tools/cxx.py: the one C++ compiler lookup of the kernel gates and the host kernel tests. The
test extra's ziglang wheel comes first (the same clang on every machine the README's install
reaches), a clang++ on PATH next; with neither, the error says what to install."""

import sys

import pytest

from tools import cxx
from tools import metal_syntax_check as gate


def test_the_test_extras_clang_comes_first(monkeypatch):
    monkeypatch.setattr(cxx.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert cxx.cxx_command() == [sys.executable, "-m", "ziglang", "c++"]


def test_a_clang_on_path_stands_in_without_ziglang(monkeypatch):
    monkeypatch.setattr(cxx.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(cxx.shutil, "which", lambda name: "/opt/llvm/bin/clang++" if name == "clang++" else None)
    assert cxx.cxx_command() == ["/opt/llvm/bin/clang++"]


def test_without_a_compiler_the_gate_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(cxx.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(cxx.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[test\]'"):
        cxx.cxx_command()
    monkeypatch.setattr(gate, "cxx_command", cxx.cxx_command)
    assert gate.main([]) == 2
    assert capsys.readouterr().err.startswith("error: no C++ compiler")
