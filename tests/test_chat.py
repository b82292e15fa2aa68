"""`python -m dsv4.chat` driven through stdin on a tiny random checkpoint, checked against
direct generation in this process: each turn's answer, how many prompt tokens each turn
took from the cache, /reset, /save and /load, /think; the command line's checks; and, in
this process, what a save survives and what a stopped turn leaves behind.
(tests/test_chat_terminal.py drives it through a terminal.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dsv4.chat import ChatSession
from dsv4.encoding import encode_messages, parse_completion
from dsv4.errors import InputError
from dsv4.generation import PREFILL_CHUNK, stream_generate
from dsv4.prompt_cache import common_prefix

MAX_TOKENS = 4
TURN = re.compile(r"(?:\[thinking\]\n)?(.*)\n\[(\d+) prompt tokens \((\d+) from cache, (\d+) prefilled\)", re.S)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dsv4.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    import dsv4

    return dsv4.load(str(checkpoint))


def run_chat(checkpoint, script: str, *options: str, status: int = 0, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "dsv4.chat", "--model", str(checkpoint),
                             "--max-tokens", str(MAX_TOKENS), *options],
                            input=script, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **(env or {})})
    assert result.returncode == status, result.stdout + result.stderr
    return result


def test_turns_reuse_the_cache_and_match_direct_generation(checkpoint, tmp_path):
    import dsv4

    model, tokenizer = dsv4.load(str(checkpoint))
    saved = tmp_path / "conversation.safetensors"
    script = "\n".join(["/save " + str(saved), "Hello there", "How are you?", "/save " + str(saved),
                        "/reset", "Hi again", "/load " + str(saved), "Go on", "/think on", "Think now",
                        "/think maybe", "/nonsense", "/quit", "never read"]) + "\n"
    out = run_chat(checkpoint, script, "--system", "Be brief.").stdout
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
    out = run_chat(checkpoint, "/help\n").stdout
    assert "/save NAME" in out and "/think on|off" in out
    assert '"""' in out and "Ctrl-C while the model answers" in out
    assert out.rstrip().endswith(">>")


@pytest.mark.parametrize("options, env, words", [
    # Checked before the model is loaded: the bad model path is not what gets reported.
    (["--max-tokens", "0"], {}, ["--max-tokens=0", "expected an integer >= 1"]),
    (["--temp", "-1"], {}, ["--temp=-1.0", "expected a number >= 0"]),
    (["--top-p", "0"], {}, ["--top-p=0.0", "> 0 and <= 1"]),
    (["--seed", "-1"], {}, ["--seed=-1", "expected an integer >= 0"]),
    ([], {"DSV4_KV_QDQ": "maybe"}, ["DSV4_KV_QDQ"]),
    ([], {}, ["/nonexistent/model: no such directory"]),
])
def test_bad_command_lines_get_one_error_line(options, env, words):
    result = run_chat("/nonexistent/model", "", *options, status=2, env=env)
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and all(w in error for w in words), result.stderr


def test_long_turns_show_prefill_progress_and_too_long_ones_are_refused(checkpoint, loaded):
    model, tokenizer = loaded
    context = model.args.max_position_embeddings
    long, too_long = "word " * PREFILL_CHUNK, "word " * context
    assert PREFILL_CHUNK < len(tokenizer.encode(long)) < context - 100 < context <= len(tokenizer.encode(too_long))
    result = run_chat(checkpoint, "\n".join([long, too_long, "Hi"]) + "\n")
    assert re.search(r"prefill: \d+ of \d+ tokens", result.stderr)
    assert "[not answered: the prompt has" in result.stdout
    assert f"the model's context is {context} tokens" in result.stdout
    turns = [TURN.match(segment) for segment in result.stdout.split(">> ")]
    assert len([t for t in turns if t]) == 2  # the refused one left no trace: the third is a normal turn


def test_an_interrupted_save_leaves_the_previous_one(loaded, tmp_path, monkeypatch):
    import mlx.core as mx

    session = ChatSession(*loaded, max_tokens=2)
    session.ask("Hello")
    path = tmp_path / "conversation.safetensors"
    session.save(path)
    before = path.read_bytes()
    session.ask("More")
    real_save = mx.save_safetensors

    def interrupted(file, arrays, metadata=None):
        file.write(before[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(mx, "save_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]
    monkeypatch.setattr(mx, "save_safetensors", real_save)
    session.save(path)  # replacing an earlier save is fine
    again = ChatSession(*loaded)
    again.load(path)
    assert again.messages == session.messages and again.prompt_cache.tokens == session.prompt_cache.tokens


def test_a_save_from_a_model_of_another_shape_is_refused(loaded, tmp_path):
    import dsv4

    session = ChatSession(*loaded, max_tokens=2)
    session.ask("Hello")
    path = tmp_path / "tiny.safetensors"
    session.save(path)
    demo = ChatSession(*dsv4.load(), max_tokens=2)
    demo.ask("Hi")
    messages, tokens = list(demo.messages), list(demo.prompt_cache.tokens)
    with pytest.raises(InputError, match="saved with a model of another shape"):
        demo.load(path)
    assert demo.messages == messages and demo.prompt_cache.tokens == tokens


def test_stopping_during_prefill_drops_the_message_and_keeps_the_cache_true(loaded):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS)
    _, stats = session.ask("word " * PREFILL_CHUNK, stop=lambda: True)
    assert stats.stopped and stats.generated == [] and session.messages == []
    held = list(session.prompt_cache.tokens)
    assert 0 < len(held) == session.prompt_cache.cache.offset < stats.prompt_tokens
    prompt = tokenizer.encode(encode_messages([{"role": "user", "content": "word " * PREFILL_CHUNK}]))
    assert held == prompt[:len(held)]
    # The next turn reuses only what the cache really holds and answers as a fresh start does.
    message, stats = session.ask("word word Hi")
    tokens = tokenizer.encode(encode_messages([{"role": "user", "content": "word word Hi"}]))
    direct = "".join(r.text for r in stream_generate(model, tokenizer, tokens, max_tokens=MAX_TOKENS))
    assert message.content == parse_completion(direct).content
    assert stats.cached_tokens == min(common_prefix(held, tokens), len(tokens) - 1) > 0
