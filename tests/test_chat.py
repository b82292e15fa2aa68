"""`python -m dsv4.chat` driven through stdin on a tiny random checkpoint, checked against
direct generation in this process: each turn's answer, how many prompt tokens each turn
took from the cache, /reset, /save and /load, /think."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dsv4.encoding import encode_messages, parse_completion
from dsv4.generation import stream_generate
from dsv4.prompt_cache import common_prefix

MAX_TOKENS = 4
TURN = re.compile(r"(?:\[thinking\]\n)?(.*)\n\[(\d+) prompt tokens \((\d+) from cache, (\d+) prefilled\)", re.S)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dsv4.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=1)


def run_chat(checkpoint, script: str, *options: str) -> str:
    result = subprocess.run([sys.executable, "-m", "dsv4.chat", "--model", str(checkpoint),
                             "--max-tokens", str(MAX_TOKENS), *options],
                            input=script, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_turns_reuse_the_cache_and_match_direct_generation(checkpoint, tmp_path):
    import dsv4

    model, tokenizer = dsv4.load(str(checkpoint))
    saved = tmp_path / "conversation.safetensors"
    script = "\n".join(["/save " + str(saved), "Hello there", "How are you?", "/save " + str(saved),
                        "/reset", "Hi again", "/load " + str(saved), "Go on", "/think on", "Think now",
                        "/think maybe", "/nonsense", "/quit", "never read"]) + "\n"
    out = run_chat(checkpoint, script, "--system", "Be brief.")
    found = [TURN.match(segment) for segment in out.split(">> ")]
    turns = [(m[1], int(m[2]), int(m[3]), int(m[4])) for m in found if m]
    assert len(turns) == 5, out
    assert "[/save failed: nothing to save yet" in out
    assert "usage: /think on|off" in out and "unknown command /nonsense" in out

    def generate(tokens):
        responses = list(stream_generate(model, tokenizer, tokens, max_tokens=MAX_TOKENS))
        return "".join(r.text for r in responses), [r.token for r in responses]

    def encode(messages, mode="chat"):
        return tokenizer.encode(encode_messages(messages, mode), add_special_tokens=False)

    def check_turn(turn, messages, cached_tokens, mode="chat"):
        """The turn printed what direct generation gives and took `cached_tokens` from the
        cache; returns the assistant message, the prompt and the generated ids."""
        tokens = encode(messages, mode)
        text, ids = generate(tokens)
        expected = parse_completion(text, mode)
        shown = expected.content
        if mode == "thinking" and expected.reasoning:  # printed as [thinking]\n...\n[/thinking]\n
            shown = expected.reasoning + ("\n[/thinking]\n" + expected.content if expected.content else "")
        assert turn[0] == shown
        assert turn[1:] == (len(tokens), cached_tokens, len(tokens) - cached_tokens)
        return {"role": "assistant", "content": expected.content}, tokens, ids

    def reused(held, tokens):
        return min(common_prefix(held, tokens), len(tokens) - 1)

    system = [{"role": "system", "content": "Be brief."}]
    first = system + [{"role": "user", "content": "Hello there"}]
    answer1, tokens1, ids1 = check_turn(turns[0], first, 0)
    second = first + [answer1, {"role": "user", "content": "How are you?"}]
    # The cache holds the prompt and every generated token but the last.
    answer2, tokens2, ids2 = check_turn(turns[1], second, reused(tokens1 + ids1[:-1], encode(second)))
    assert turns[1][2] >= len(tokens1)
    # /reset starts from an empty cache.
    check_turn(turns[2], system + [{"role": "user", "content": "Hi again"}], 0)
    # /load brings back the conversation saved after the second turn, with its cache.
    third = second + [answer2, {"role": "user", "content": "Go on"}]
    answer3, tokens3, ids3 = check_turn(turns[3], third, reused(tokens2 + ids2[:-1], encode(third)))
    assert turns[3][2] >= len(tokens2)
    # /think on re-encodes the conversation in thinking mode.
    fourth = third + [answer3, {"role": "user", "content": "Think now"}]
    assert "[thinking]" in out
    check_turn(turns[4], fourth, reused(tokens3 + ids3[:-1], encode(fourth, "thinking")), mode="thinking")


def test_help_and_end_of_input(checkpoint):
    out = run_chat(checkpoint, "/help\n")
    assert "/save FILE" in out and "/think on|off" in out
    assert out.rstrip().endswith(">>")
