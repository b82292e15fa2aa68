"""Every command in the README's code blocks runs as written: each bash line is matched to the way
this test runs it (placeholders such as PATH and SRC filled with tiny models this test makes,
the long-running ones told to stop), and a README line no runner claims fails the test, so a
command added to the README is a command tested here."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DEMO = ROOT / "dsv4" / "demo"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def commands() -> list[str]:
    """The README's bash lines, comments off."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line:
                out.append(line)
    return out


def run(argv, timeout=600, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)
    assert out.returncode == 0, f"{shlex.join(argv)}: exit {out.returncode}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr
    return out


def python(command: str, **fill) -> list[str]:
    """`python -m ...` of the README as argv for this interpreter, placeholders filled."""
    argv = shlex.split(command)
    assert argv[0] == "python"
    return [sys.executable] + [fill.get(a, a) for a in argv[1:]]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """What the README's placeholders stand for: an official checkpoint, a ds4 GGUF, an EXL3 pack."""
    from dsv4.testing import write_tiny_checkpoint
    from tests.gguf_fixtures import write_ds4_gguf
    from tests.test_exl3_convert import make_pack

    root = tmp_path_factory.mktemp("readme")
    official = write_tiny_checkpoint(root / "official", seed=2)
    write_ds4_gguf(root / "q2.gguf", "q2", seed=2)
    make_pack(official, root / "pack")
    return root, official


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_demo(command, inputs):                    # pip install -e . && python -m dsv4.generate
    out = run(python(command.split("&& ", 1)[1]))      # the install is what CI's venv did
    assert "Generation:" in out.stdout


def pytest_suite(command, inputs):                     # this test runs inside that command
    assert command.endswith("python -m pytest -q -n auto")


def generate(command, inputs):
    out = run(python(command, PATH_OR_REPO=str(DEMO)))
    assert "Prompt:" in out.stdout and "Peak memory:" in out.stdout


def chat(command, inputs):
    out = run(python(command, PATH=str(DEMO)) + ["--max-tokens", "8"], input="Hello there\n/quit\n")
    assert "tokens" in out.stdout


@contextmanager
def demo_server(port: int, command: str = "python -m dsv4.server --model PATH --port 8080"):
    """The README's server command on the demo model and `port`, up (it answers /health) while
    the block runs, then stopped by Ctrl-C (exit status 0)."""
    argv = python(command.replace("8080", str(port)), PATH=str(DEMO))
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(f"the server did not come up: {proc.stderr.read()[-2000:]}")
                time.sleep(0.5)
        yield
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def several_ranks(command, inputs):                   # mlx.launch: ranks of this machine on loopback
    argv = shlex.split(command)
    from dsv4.distributed.ranks import free_ports

    argv = [str(Path(sys.executable).with_name("mlx.launch")), "--starting-port", str(free_ports(2))] + \
        argv[1:argv.index("python")] + python(shlex.join(argv[argv.index("python"):]), PATH=str(DEMO))
    out = run(argv, timeout=300)
    # mlx.launch exits 0 when a rank fails: both ranks finished, and only rank 0 printed
    assert out.stdout.count("Generation:") == 1 and out.stdout.count("Distributed:") == 1, out.stdout


def chat_ranks(command, inputs):                       # rank 0 reads the piped chat, rank 1 follows
    from dsv4.distributed.ranks import free_ports

    argv = shlex.split(command)
    argv = [str(Path(sys.executable).with_name("mlx.launch")), "--starting-port", str(free_ports(2))] + \
        argv[1:argv.index("python")] + python(shlex.join(argv[argv.index("python"):]), PATH=str(DEMO))
    out = run(argv + ["--max-tokens", "4"], timeout=300, input="Hello\n/quit\n")
    assert out.stdout.count(" generated") == 1 and "error" not in out.stderr, out.stdout + out.stderr


def server(command, inputs):
    with demo_server(free_port(), command):
        pass


def claude_code(command, inputs):
    """The settings given to Claude Code, used by the anthropic client (what Claude Code is built
    on) against the server: a streamed answer with a tool offered."""
    import anthropic

    env = dict(word.split("=", 1) for word in shlex.split(command) if "=" in word)
    port = free_port()
    with demo_server(port):
        client = anthropic.Anthropic(base_url=env["ANTHROPIC_BASE_URL"].replace("8080", str(port)),
                                     auth_token=env["ANTHROPIC_AUTH_TOKEN"], max_retries=0, timeout=120)
        tool = {"name": "read_file", "description": "Read a file.",
                "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
        with client.messages.stream(model=env["ANTHROPIC_MODEL"], max_tokens=8, tools=[tool],
                                    messages=[{"role": "user", "content": "Hello"}]) as stream:
            message = stream.get_final_message()
        assert message.stop_reason in ("end_turn", "max_tokens", "tool_use") and message.usage.output_tokens >= 1


def convert(command, inputs):
    root, official = inputs
    kind = shlex.split(command)[3]
    source = {"official": official, "gguf": root / "q2.gguf", "exl3": root / "pack"}[kind]
    dst = root / f"out-{kind}"
    run(python(command, SRC=str(source), FILE=str(source), DST=str(dst)))
    run([sys.executable, "-m", "dsv4.generate", "--model", str(dst), "-m", "3"])


def convert_with_draft(command, inputs):             # ds4's DSpark support file beside its text GGUF
    from tests.gguf_fixtures import draft_fixture_config, source_tokenizer, write_dspark_gguf

    root, _ = inputs
    support, dst = root / "dspark-support.gguf", root / "out-gguf-draft"
    write_dspark_gguf(support, draft_fixture_config(source_tokenizer()), "native", seed=2)
    run(python(command, FILE=str(root / "q2.gguf"), DST=str(dst), SUPPORT=str(support)))
    out = run([sys.executable, "-m", "dsv4.generate", "--model", str(dst), "-m", "3", "--draft", "on"])
    assert "Speculative:" in out.stdout + out.stderr


def train(command, inputs):                            # ~30 minutes: its options parse, it starts
    run(python(command.split(" --")[0]) + ["--help"])


RUNNERS = [
    (r"^pip install -e \. && python -m dsv4\.generate$", generate_demo),
    (r'^pip install -e "\.\[test\]" && python -m pytest -q -n auto$', pytest_suite),
    (r"^python -m dsv4\.generate --model PATH_OR_REPO ", generate),
    (r"^python -m dsv4\.chat --model PATH$", chat),
    (r"^python -m dsv4\.server --model PATH --port 8080$", server),
    (r"^mlx\.launch -n 2 --backend ring -- python -m dsv4\.generate --model PATH ", several_ranks),
    (r"^mlx\.launch -n 2 --backend ring -- python -m dsv4\.chat --model PATH ", chat_ranks),
    (r"^ANTHROPIC_BASE_URL=http://127\.0\.0\.1:8080 .* claude$", claude_code),
    (r"^python -m dsv4_convert (official|gguf|exl3) (SRC|FILE) DST$", convert),
    (r"^python -m dsv4_convert gguf FILE DST --draft SUPPORT$", convert_with_draft),
    (r"^python training/train_demo\.py ", train),
]


def runner(command):
    found = [fn for pattern, fn in RUNNERS if re.search(pattern, command)]
    assert len(found) == 1, f"README command {command!r}: no way to run it here (add one to RUNNERS)"
    return found[0]


@pytest.mark.parametrize("command", commands())
def test_readme_command_runs(command, inputs):
    runner(command)(command, inputs)


def test_readme_python_example_runs(tmp_path):
    (code,) = blocks("python")
    code = code.replace('"path/to/model"', repr(str(DEMO)))
    script = tmp_path / "example.py"
    script.write_text(code.replace('cache.save("prompt.safetensors")', f'cache.save({str(tmp_path / "p.safetensors")!r})'))
    run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(ROOT)})
