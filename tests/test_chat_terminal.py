"""`python -m dsv4.chat` on a pseudo-terminal with the bundled demo model, as a person at
a keyboard drives it (readline, Ctrl-C, Ctrl-D, pastes): a failed /load or /save changes
nothing, /save NAME then /load NAME continues the conversation exactly, Ctrl-C stops an
answer and keeps the conversation and its cache consistent, and a pasted or multi-line
message is one turn. Saved files are read back here to see what the session holds."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest

from dsv4.encoding import encode_messages, parse_completion
from dsv4.safetensors_file import read_header

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z~]")
HINT = "(Ctrl-C again, Ctrl-D or /quit to leave)"
STATS = r"\[(\d+) prompt tokens \((\d+) from cache, (\d+) prefilled\)[^\n]*\]\n"


class Terminal:
    """The chat REPL on a pseudo-terminal; `expect` reads its output with the terminal's
    escape sequences and carriage returns removed."""

    def __init__(self, home, *options: str):
        master, slave = os.openpty()
        env = dict(os.environ, HOME=str(home), TERM="xterm", INPUTRC=os.devnull)
        # Started as a shell starts it, SIGINT at its default (not whatever this process has).
        self.process = subprocess.Popen([sys.executable, "-m", "dsv4.chat", *options], stdin=slave,
                                        stdout=slave, stderr=slave, env=env, start_new_session=True,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        os.close(slave)
        self.master, self.text, self.read_to = master, "", 0
        self.expect(r">> ", timeout=120)

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:  # the child closed the terminal
            data = b""
        self.text += ESCAPES.sub("", data.decode(errors="replace")).replace("\r", "")
        return bool(data)

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        """The first match of `pattern` in the output after the previous match."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern, re.S).search(self.text, self.read_to)
            if found:
                self.read_to = found.end()
                return found
            left = deadline - time.monotonic()
            if left <= 0 or (not self._read(min(left, 0.5)) and self.process.poll() is not None):
                raise AssertionError(f"no {pattern!r} in the output:\n{self.text[self.read_to:]}"
                                     f"\n(exit status {self.process.poll()})")

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def line(self, text: str, then: str = r">> ") -> re.Match:
        """Type a line and wait for `then`."""
        self.send(text + "\r")
        return self.expect(re.escape(text.split("\n")[-1]) + r"\n(.*?)" + then)

    def turn(self, text: str) -> tuple[str, int, int]:
        """Type a message and wait for its answer -> (answer, prompt tokens, cached tokens)."""
        found = self.line(text, r"\n" + STATS + ">> ")
        return found[1], int(found[2]), int(found[3])

    def interrupt(self) -> None:
        self.process.send_signal(signal.SIGINT)

    def interrupt_at_prompt(self) -> None:
        """Ctrl-C at the prompt, repeated until the REPL answers: CPython's readline loop
        checks for signals only when its select() is interrupted, so one that lands between
        the prompt being drawn and select() starting waits there for a key."""
        for _ in range(10):
            self.interrupt()
            try:
                self.expect(re.escape(HINT) + r"\n>> ", timeout=2)
                return
            except AssertionError:
                continue
        raise AssertionError(f"Ctrl-C at the prompt was not answered:\n{self.text[self.read_to:]}")

    def exit_status(self, timeout: float = 60) -> Optional[int]:
        """The child's exit status, or None if it is still running after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            self._read(0.2)  # keep the terminal drained so the child can finish writing
        return self.process.poll()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        os.close(self.master)


@pytest.fixture
def terminal(tmp_path):
    """-> start(*options), a Terminal with HOME at tmp_path; closed after the test."""
    opened = []

    def start(*options: str) -> Terminal:
        opened.append(Terminal(tmp_path, *options))
        return opened[-1]

    yield start
    for t in opened:
        t.close()


@pytest.fixture(scope="module")
def demo():
    import dsv4

    return dsv4.load()


def saved_state(path) -> dict:
    return json.loads(read_header(path)[1]["dsv4_chat"])


def test_failed_load_and_save_change_nothing_and_save_then_load_continues(terminal, tmp_path):
    questions = ["Hello there", "How are you?", "Go on"]
    reference = terminal("--max-tokens", "4")
    expected = [reference.turn(q) for q in questions]
    reference.line("/quit", r"$")
    assert reference.exit_status() == 0

    not_a_save = tmp_path / "notes.safetensors"
    not_a_save.write_text("my notes")
    truncated = tmp_path / "cut.safetensors"
    (tmp_path / "folder.safetensors").mkdir()
    chat = terminal("--max-tokens", "4")
    assert chat.turn(questions[0]) == expected[0]
    failures = {
        "/load ~/missing": "missing.safetensors: file not found",
        "/load ~": "a directory, not a saved conversation",
        "/load ~/notes": "header length",
        "/save ~/notes": "exists and is not a saved conversation",
        "/save ~/nowhere/conversation": "nowhere/conversation.safetensors: cannot write it",
        "/save ~/folder": "folder.safetensors: a directory",
    }
    for command, reason in failures.items():
        shown = chat.line(command)[1]
        assert shown.startswith(f"[{command.split()[0]} failed: ") and reason in shown, shown
        assert shown.count("\n") == 1
    assert not_a_save.read_text() == "my notes"
    assert chat.turn(questions[1]) == expected[1]

    assert f"[saved to {tmp_path}/conversation.safetensors: 4 messages" in chat.line("/save ~/conversation")[1]
    data = (tmp_path / "conversation.safetensors").read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    assert "truncated" in chat.line("/load ~/cut")[1]
    chat.line("/reset")
    chat.turn("Something else")
    assert f"[loaded {tmp_path}/conversation.safetensors: 4 messages" in chat.line("/load ~/conversation")[1]
    assert chat.turn(questions[2]) == expected[2]
    assert not list(tmp_path.glob("*.partial"))
    chat.line("/quit", r"$")
    assert chat.exit_status() == 0


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(terminal, tmp_path, demo):
    from dsv4.generation import stream_generate

    model, tokenizer = demo
    max_tokens = 120
    question = [{"role": "user", "content": "Tell me everything about lists."}]
    prompt = tokenizer.encode(encode_messages(question), add_special_tokens=False)
    full = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
    assert len(full) == max_tokens and not set(full) & set(tokenizer.eos_token_ids), \
        "the demo's answer must be long enough to be interrupted"

    chat = terminal("--max-tokens", str(max_tokens))
    chat.send(question[0]["content"] + "\r")
    chat.expect(re.escape(question[0]["content"]) + r"\n.{20}")  # the answer is under way
    chat.interrupt()
    chat.expect(r"\[stopped\]\n" + STATS + ">> ")
    chat.line("/save ~/stopped")
    state = saved_state(tmp_path / "stopped.safetensors")
    partial = state["messages"][1]
    assert state["messages"][0] == question[0] and partial["role"] == "assistant"
    # The cache holds the prompt and the tokens generated before the stop (all but the last).
    assert state["tokens"][:len(prompt)] == prompt
    generated = state["tokens"][len(prompt):]
    assert 0 < len(generated) < max_tokens - 1 and generated == full[:len(generated)]
    assert partial["content"] == tokenizer.decode(full[:len(generated) + 1])

    # The next turn sees the stopped answer, with the cache reused as it claims.
    follow_up = "And then?"
    _, prompt_tokens, cached = chat.turn(follow_up)
    messages = question + [{"role": "assistant", "content": partial["content"]},
                           {"role": "user", "content": follow_up}]
    second = tokenizer.encode(encode_messages(messages), add_special_tokens=False)
    assert prompt_tokens == len(second) and cached > len(prompt)
    chat.line("/save ~/after")
    answer = saved_state(tmp_path / "after.safetensors")["messages"][-1]["content"]
    direct = "".join(r.text for r in stream_generate(model, tokenizer, second, max_tokens=max_tokens))
    assert answer == parse_completion(direct).content

    chat.interrupt_at_prompt()  # a hint, the REPL stays
    chat.line("/quit", r"$")
    assert chat.exit_status() == 0


@pytest.mark.parametrize("keys", ["ctrl-d", "ctrl-c twice"])
def test_leaving_from_the_prompt(terminal, keys):
    chat = terminal()
    if keys == "ctrl-d":
        chat.send("\x04")
    else:
        chat.interrupt_at_prompt()
        for _ in range(10):  # again, as long as it waits for readline's select() (see above)
            chat.interrupt()
            if chat.exit_status(timeout=2) is not None:
                break
    assert chat.exit_status() == 0
    assert "Traceback" not in chat.text


def test_multi_line_messages_are_one_turn_each(terminal, tmp_path):
    import readline

    if "libedit" in (readline.__doc__ or ""):
        pytest.skip("bracketed paste is read by GNU readline; this Python has editline")
    chat = terminal("--max-tokens", "2")
    chat.send("\x1b[200~pasted one\rpasted two\x1b[201~\r")
    chat.expect(STATS + ">> ")
    chat.send('"""\r')
    chat.expect(r"\.\. ")
    chat.send("block one\rblock two\r")
    chat.turn('"""')
    chat.send("continued \\\r")
    chat.expect(r"\.\. ")
    chat.turn("line")
    chat.line("/save ~/lines")
    users = [m["content"] for m in saved_state(tmp_path / "lines.safetensors")["messages"] if m["role"] == "user"]
    assert users == ["pasted one\npasted two", "block one\nblock two", "continued \nline"]
