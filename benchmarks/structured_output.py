"""Per-token cost of grammar-constrained sampling: llguidance against outlines-core.

    python -m benchmarks.structured_output [--tokenizer tokenizer.json] [--vocab 129280] [--runs 20]

Without --tokenizer, a byte-level BPE of --vocab tokens (V4.1's vocabulary size) is trained on
this Python's standard library sources, so the masks are as wide as V4.1's. For each library and
schema, --runs generations sample uniformly among the tokens the grammar allows until it accepts
(a stand-in for a model: every allowed path gets taken). Per token we time what the server's
sampler does with each library: the allowed set as a mask of the vocabulary, the masked logits
(mx.where over [1, V]), and the step to the next state; plus each grammar's compile time. Every
output is checked with jsonschema. The report is dated, under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.hardware import describe, to_markdown  # noqa: E402

SCHEMAS = {
    "tool call": {"type": "object", "properties": {
        "name": {"enum": ["read_file", "write_file", "run_tests"]},
        "arguments": {"type": "object", "properties": {
            "path": {"type": "string", "maxLength": 24}, "line": {"type": "integer", "minimum": 0, "maximum": 9999},
            "force": {"type": "boolean"}}, "required": ["path", "line", "force"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "list of records": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999}, "tags": {"type": "array", "maxItems": 3,
                                                                          "items": {"type": "string", "maxLength": 8}}},
        "required": ["id", "tags"], "additionalProperties": False}},
}
MAX_TOKENS = 400


def train_tokenizer(vocab: int):
    """A byte-level BPE trained on the standard library's sources (about 30 MB of their lines of
    code: ASCII, under 200 characters; the codec tables would make tokens of a thousand bytes)."""
    from dsv4.testing import train_tokenizer as train

    files, size, text = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")), 0, []
    for path in files:
        try:
            lines = [line for line in path.read_text(encoding="utf-8").splitlines()
                     if line.isascii() and len(line) < 200]
        except (UnicodeDecodeError, OSError):
            continue
        text += lines
        size += sum(map(len, lines))
        if size > 30_000_000:
            break
    return train(vocab, "\n".join(text))


def token_bytes(tokenizer) -> list[bytes]:
    """Each id's bytes (byte-level BPE: the GPT-2 byte alphabet undone)."""
    from tokenizers import pre_tokenizers

    alphabet = {c: b for b, c in enumerate(_gpt2_bytes())}
    out = []
    for i in range(tokenizer.get_vocab_size()):
        piece = tokenizer.id_to_token(i)
        out.append(bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode())
    assert len(pre_tokenizers.ByteLevel.alphabet()) == 256
    return out


def _gpt2_bytes() -> list[str]:
    """The printable character byte-level BPE writes for each byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: int):
        from llguidance import LLTokenizer

        self.tokenizer, self.vocab = LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos), vocab

    def compile(self, schema: dict):
        from llguidance import LLMatcher

        from dsv4.serve.structured import JSON_STYLE

        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
        return lambda: LLMatcher(self.tokenizer, grammar)

    def allowed(self, state) -> np.ndarray:
        words = np.frombuffer(state.compute_bitmask(), np.uint8)
        return np.unpackbits(words, bitorder="little")[:self.vocab].astype(bool)

    def advance(self, state, token: int) -> None:
        assert state.consume_token(token), state.get_error()

    def done(self, state) -> bool:
        return state.is_stopped()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab: int, eos: int):
        from outlines_core import Vocabulary

        spelled: dict[bytes, list[int]] = {}
        for i, piece in enumerate(token_bytes(tokenizer)):
            if i != eos and i >= 3:   # DeepSeek's special tokens sit at 0..2 (bos, eos, pad)
                spelled.setdefault(piece, []).append(i)
        self.vocabulary, self.vocab, self.eos = Vocabulary(eos, spelled), vocab, eos

    def compile(self, schema: dict):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        index = Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?"), self.vocabulary)
        return lambda: Guide(index)

    def allowed(self, state) -> np.ndarray:
        mask = np.zeros((self.vocab + 31) // 32, np.int32)
        state.write_mask_into(mask.ctypes.data, mask.size, 4)
        return np.unpackbits(mask.view(np.uint8), bitorder="little")[:self.vocab].astype(bool)

    def advance(self, state, token: int) -> None:
        if token != self.eos:
            state.advance(token, return_tokens=False)

    def done(self, state) -> bool:
        return False   # the driver stops at end of sentence


def generate(library, make, decode, eos: int, rng) -> tuple[str, np.ndarray]:
    """One sampled generation: (its text, seconds per token [tokens, 3] of the allowed mask, the
    masked logits and the step)."""
    state, logits, tokens, times = make(), mx.zeros((1, library.vocab)), [], []
    for _ in range(MAX_TOKENS):
        begin = time.perf_counter()
        allowed = library.allowed(state)
        masked_at = time.perf_counter()
        mx.eval(mx.where(mx.array(allowed), logits, -mx.inf))
        applied_at = time.perf_counter()
        token = int(rng.choice(np.flatnonzero(allowed)))
        stepped_at = time.perf_counter()
        library.advance(state, token)
        times.append((masked_at - begin, applied_at - masked_at, time.perf_counter() - stepped_at))
        if token == eos:
            break
        tokens.append(token)
        if library.done(state):   # llguidance stops once nothing but end of sentence may follow
            break
    return decode(tokens), np.array(times)


def main(argv=None) -> int:
    import jsonschema
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json (default: train one)")
    parser.add_argument("--vocab", type=int, default=129280, help="vocabulary of the trained tokenizer")
    parser.add_argument("--runs", type=int, default=20, help="generations per library and schema")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    options = parser.parse_args(argv)
    begin = time.perf_counter()
    tokenizer = Tokenizer.from_file(str(options.tokenizer)) if options.tokenizer else train_tokenizer(options.vocab)
    made = time.perf_counter() - begin
    vocab, eos = tokenizer.get_vocab_size(), 1
    decode = lambda ids: tokenizer.decode(ids)
    rows, failures = [], []
    for kind in (Llguidance, OutlinesCore):
        begin = time.perf_counter()
        library = kind(tokenizer, vocab, eos)
        setup = time.perf_counter() - begin
        for name, schema in SCHEMAS.items():
            begin = time.perf_counter()
            make = library.compile(schema)
            compiled = time.perf_counter() - begin
            rng, per_token, lengths, invalid = np.random.default_rng(0), [], [], 0
            for _ in range(options.runs):
                text, times = generate(library, make, decode, eos, rng)
                try:
                    jsonschema.validate(json.loads(text), schema)
                except (ValueError, jsonschema.ValidationError) as error:
                    invalid += 1
                    failures.append(f"{library.name} / {name}: {str(error)[:120]}: {text[:120]!r}")
                per_token.append(times)
                lengths.append(len(times))
            times = np.concatenate(per_token) * 1e6
            mask, apply, step = np.median(times, axis=0)
            rows.append((library.name, name, setup, compiled, mask, apply, step, np.median(times.sum(axis=1)),
                         statistics.mean(lengths), invalid))
            print(f"{library.name:>14} {name:>16}: {rows[-1][7]:8.0f} us/token median", file=sys.stderr, flush=True)
    stamp = datetime.now().strftime("%Y-%m-%d-%H%M")
    source = str(options.tokenizer) if options.tokenizer else \
        f"a byte-level BPE of {vocab} tokens trained on the standard library ({made:.0f} s)"
    lines = [f"# Structured output: per-token cost of the constraint ({stamp})", "", to_markdown(describe()), "",
             f"`python -m benchmarks.structured_output --runs {options.runs}`; tokenizer: {source}; "
             f"{options.runs} generations per schema sampling uniformly among the allowed tokens; per token: "
             "the allowed mask over the vocabulary, mx.where on [1, V] logits, the step to the next state.", "",
             "| library | schema | tokenizer setup s | compile s | mask us | apply us | step us | "
             "total us/token (median) | tokens/output | invalid outputs |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for library, name, setup, compiled, mask, apply, step, total, length, invalid in rows:
        lines.append(f"| {library} | {name} | {setup:.2f} | {compiled:.3f} | {mask:.0f} | {apply:.0f} | {step:.0f} | "
                     f"{total:.0f} | {length:.0f} | {invalid} of {options.runs} |")
    lines += ["", "mask: the library's allowed set as a bool mask of the vocabulary; apply: mx.where on the "
              "[1, V] logits, evaluated on its own here (in the server it is evaluated with the sampler); "
              "step: advancing the grammar by the sampled token."]
    if failures:
        lines += ["", "Outputs that do not validate (the first of each):", ""]
        lines += [f"- {f}" for f in dict((f.split(":")[0], f) for f in failures).values()]
    options.out_dir.mkdir(parents=True, exist_ok=True)
    out = options.out_dir / f"{stamp}-structured-output.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
