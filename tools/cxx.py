"""The C++ compiler of the kernel gates (tools/metal_syntax_check.py) and the host kernel tests.

The clang inside the `ziglang` wheel comes first: the test extra installs it (Linux x86-64 and
aarch64, macOS), so the tests need nothing from the system and see one known clang (22 for
ziglang 0.17) wherever they run. Elsewhere a clang++ on PATH stands in.

Two things to know about zig's driver: its first link of a C++ program builds libc++ into its
cache (~/.cache/zig, ~50 s on 2 cores, once; later links take ~0.1 s), and it cannot run
`-fsyntax-only` (it always expects an object file to move into its cache), so a check compiles
to an object file instead.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys


# The environment variable naming a test session's folder of host-built kernel executables
# (tests/conftest.py makes it, tests/test_kernels_decode_host.py's build_host fills it).
HOST_BUILDS = "DSV4TESTS_HOST_BUILDS"   # not DSV4_: dsv4 warns of unknown switches


def cxx_command() -> list[str]:
    """The command that compiles C++ (clang's flags): zig's clang, else clang++ on PATH."""
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang", "c++"]
    exe = shutil.which("clang++")
    if exe is not None:
        return [exe]
    raise RuntimeError("no C++ compiler for the kernel gates and host tests: pip install -e '.[test]' "
                       "installs one (the ziglang wheel, on Linux x86-64/aarch64 and macOS); "
                       "elsewhere install clang")
