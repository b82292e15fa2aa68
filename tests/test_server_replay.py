"""Replay: prompts as segments (encoding.encode_segments) and the ids put back for model outputs.

On every official encoder fixture the segments join to the official prompt, and each output
segment is an assistant message's text between its header's think marker and end of sentence
(special tokens, so tokenizing around it changes nothing). A Replay without records tokenizes a
prompt exactly as the whole text would be; with the records of a generation, the next prompt
holds that generation's ids where its output goes back."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import dsv4
from dsv4.encoding import (ASSISTANT, EOS, THINK_CLOSE, THINK_OPEN, encode_messages, encode_segments,
                           render_output)
from dsv4.serve.replay import Replay

CASES = json.loads((Path(__file__).parent / "fixtures" / "encoding" / "encode_cases.json").read_text(
    encoding="utf-8"))["cases"]


@pytest.mark.parametrize("fixture", CASES, ids=[c["name"] for c in CASES])
def test_segments_join_to_the_official_prompt(fixture):
    segments = encode_segments(copy.deepcopy(fixture["messages"]), **fixture["options"])
    assert "".join(s.text for s in segments) == fixture["prompt"]
    assistants = [m for m in fixture["messages"] if m.get("role") == "assistant"]
    outputs = [i for i, s in enumerate(segments) if s.output]
    assert len(outputs) == len(assistants)
    for i in outputs:
        before = "".join(s.text for s in segments[:i])
        assert before.endswith((ASSISTANT + THINK_OPEN, ASSISTANT + THINK_CLOSE, THINK_CLOSE)), before[-40:]
        assert segments[i + 1].text == EOS


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return dsv4.load(str(tiny_dir))[1]


def test_without_records_a_prompt_is_tokenized_as_its_text(tokenizer):
    for fixture in CASES:
        segments = encode_segments(copy.deepcopy(fixture["messages"]), **fixture["options"])
        ids, used = Replay(tokenizer).tokenize(segments)
        assert ids == tokenizer.encode(fixture["prompt"]) and used == []


def test_a_generation_comes_back_as_its_ids(tokenizer):
    question = [{"role": "user", "content": "What is up?"}]
    # Ids that spell an answer another way than its text tokenizes to: a token per character.
    answer = "Flat is better than nested."
    produced = [i for c in answer for i in tokenizer.encode(c)] + [tokenizer.eos_token_id]
    assert tokenizer.decode(produced[:-1]) == answer and produced[:-1] != tokenizer.encode(answer)
    replay = Replay(tokenizer)
    records = replay.records(produced, "chat")
    assert records == [(render_output({"role": "assistant", "content": answer}, False), produced[:-1])]
    replay.remember(records)
    follow = question + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    ids, used = replay.tokenize(encode_segments(follow))
    head = tokenizer.encode(encode_messages(question))
    assert ids[:len(head) + len(produced) - 1] == head + produced[:-1]
    assert tokenizer.decode(ids) == encode_messages(follow) and used == records
