"""The token ids a model produced, put back where a client sends that output back.

A client that continues a conversation sends the assistant's earlier turns as text (content,
reasoning, tool calls as name + JSON arguments). Re-tokenized, that text is often not the ids
the model generated: a tool call re-rendered as DSML differs in spacing or number formatting,
and a byte-level BPE spells many strings more than one way. The prompt would then leave the
cached prefix at the first such turn. So each finished generation is remembered by how the
encoder will render it in the next prompt (`encoding.render_output` of the parsed message, with
and without its reasoning) together with the ids that produced it; a prompt's output segments
found here take those ids, everything else is tokenized as text. The model reads exactly what
it wrote, and the prefix cache holds exactly that.

Segments next to an output are split at special tokens (see `encoding.encode_segments`), so
tokenizing the text between them separately gives what tokenizing the whole prompt would.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from ..encoding import THINK_CLOSE, Segment, parse_completion, render_output

Record = tuple[str, list[int]]   # (rendered output, the ids the model produced for it)


class Replay:
    """An LRU of records, shared by the handlers (tokenizing prompts) and the scheduler (adding
    what it generated)."""

    def __init__(self, tokenizer, limit: int = 4096):
        self.tokenizer, self.limit = tokenizer, limit
        self._records: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._think_close = tokenizer.token_to_id(THINK_CLOSE)   # None: no such single token

    def records(self, produced: Sequence[int], mode: str) -> list[Record]:
        """What to remember of one finished generation (its ids, end of sentence left out) in
        `mode` ("chat" or "thinking"): the parsed message rendered as the next prompt will
        render it. In thinking mode, earlier turns may be rendered without their reasoning: the
        ids after `</think>` stand for that rendering."""
        ids = [t for t in produced if t not in self.tokenizer.eos_token_ids]
        if not ids:
            return []
        message = parse_completion(self.tokenizer.decode(ids), mode)
        as_sent = {"role": "assistant", "content": message.content, "reasoning_content": message.reasoning,
                   "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in message.tool_calls]}
        if mode != "thinking":
            return [(render_output(as_sent, show_reasoning=False), ids)]
        out = [(render_output(as_sent, show_reasoning=True), ids)]
        if self._think_close is not None and self._think_close in ids:
            after = ids[ids.index(self._think_close) + 1:]
            if after:
                out.append((render_output(as_sent, show_reasoning=False), after))
        return out

    def remember(self, records: Iterable[Record]) -> None:
        with self._lock:
            for text, ids in records:
                self._records[text] = list(ids)
                self._records.move_to_end(text)
            while len(self._records) > self.limit:
                self._records.popitem(last=False)

    def lookup(self, text: str) -> Optional[list[int]]:
        with self._lock:
            ids = self._records.get(text)
            if ids is not None:
                self._records.move_to_end(text)
            return ids

    def __len__(self) -> int:
        return len(self._records)

    def tokenize(self, segments: Sequence[Segment]) -> tuple[list[int], list[Record]]:
        """The prompt's ids: remembered outputs as the model produced them, the rest as text
        (runs of text tokenized together, so a prompt without remembered outputs is tokenized
        exactly as its whole text would be); and the records used, which a cache of this
        prompt must keep to be found again after a restart (disk_cache.py stores them)."""
        ids: list[int] = []
        used: list[Record] = []
        text: list[str] = []
        for segment in segments:
            produced = self.lookup(segment.text) if segment.output else None
            if produced is None:
                text.append(segment.text)
                continue
            if text:
                ids += self.tokenizer.encode("".join(text), add_special_tokens=False)
                text = []
            ids += produced
            used.append((segment.text, produced))
        if text:
            ids += self.tokenizer.encode("".join(text), add_special_tokens=False)
        return ids, used
