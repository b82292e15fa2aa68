"""A `tokenizers` tokenizer.json rebuilt from a GGUF's `tokenizer.ggml.*` metadata.

ds4 writes DeepSeek's byte-level BPE as `tokens` (every id's string), `token_type`
(3 = control for DeepSeek's special tokens, 1 = normal), `merges` ("a b") and the
pre-tokenizer name `joyai-llm`, which llama.cpp treats as DeepSeek V3's: digits in runs of
at most three, CJK runs isolated, then a word/punctuation/whitespace split, then byte level.

DeepSeek's tokenizer also has added tokens that are not special; ds4 types those 1 like any
vocabulary entry. They are recovered by a property of BPE: a token that no merge produces
(and that is not a single byte symbol) can only ever be emitted as an added token. In
DeepSeek's vocabulary every other entry is a merge result (128,000 entries = 256 bytes +
3 specials + 127,741 merges), so the rule only picks tokens the source added.
"""

from __future__ import annotations

from dsv4.errors import InputError

# DeepSeek V3's pre-tokenizer (deepseek-ai/DeepSeek-V3 tokenizer.json, which llama.cpp
# transcribes for its "deepseek-v3" and "joyai-llm" pre-types): each split Isolated.
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
PRE_TOKENIZERS = {"joyai-llm": DEEPSEEK_V3_SPLITS, "deepseek-v3": DEEPSEEK_V3_SPLITS}
CONTROL, USER_DEFINED = 3, 4


class TokenizerMetadataError(InputError):
    """The GGUF's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


def _byte_symbols() -> set[str]:
    from tokenizers import pre_tokenizers

    return set(pre_tokenizers.ByteLevel.alphabet())


def build(tokens: list[str], token_types: list[int], merges: list[str], pre: str,
          bos_id: int, eos_id: int, add_bos: bool, add_eos: bool, source: str = "GGUF"):
    """A `tokenizers.Tokenizer` equal in encode/decode to the tokenizer ds4 took these from;
    BOS/EOS added by its post-processor as `add_bos`/`add_eos` say."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, Regex

    if pre not in PRE_TOKENIZERS:
        raise TokenizerMetadataError(
            f"{source}: tokenizer.ggml.pre is {pre!r}; only DeepSeek's pre-tokenisation "
            f"({sorted(PRE_TOKENIZERS)}) is supported")
    if len(token_types) != len(tokens):
        raise TokenizerMetadataError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} "
                                     f"entries for {len(tokens)} tokens")
    for name, i in (("bos", bos_id), ("eos", eos_id)):
        if not 0 <= i < len(tokens):
            raise TokenizerMetadataError(f"{source}: tokenizer.ggml.{name}_token_id {i} is outside "
                                         f"the {len(tokens)} tokens")
    pairs = []
    for k, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise TokenizerMetadataError(f"{source}: tokenizer.ggml.merges[{k}] = {merge!r} is not "
                                         f"two symbols separated by one space")
        pairs.append((parts[0], parts[1]))

    vocab: dict[str, int] = {}
    added: list[tuple[int, str, bool]] = []   # (id, content, special)
    produced = {a + b for a, b in pairs}
    symbols = _byte_symbols()
    for i, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind in (CONTROL, USER_DEFINED) or token in vocab or \
                (token not in produced and token not in symbols):
            added.append((i, token, kind == CONTROL))
        if token not in vocab:
            vocab[token] = i
    for a, b in pairs:
        for part in (a, b, a + b):
            if part not in vocab:
                raise TokenizerMetadataError(f"{source}: merge {a!r} {b!r} uses {part!r}, which is "
                                             f"not among tokenizer.ggml.tokens")

    tok = Tokenizer(models.BPE(vocab, pairs, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for i, c, s in added if s])
    tok.add_tokens([AddedToken(c, special=False, normalized=False) for i, c, s in added if not s])
    for i, content, _ in added:
        if tok.token_to_id(content) != i:
            raise TokenizerMetadataError(f"{source}: added token {content!r} should be id {i}, the "
                                         f"tokenizer gives it id {tok.token_to_id(content)}")
    bos, eos = tokens[bos_id], tokens[eos_id]
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special = [(t, i) for t, i, on in ((bos, bos_id, add_bos), (eos, eos_id, add_eos)) if on]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                       special_tokens=special)
    return tok


def tokenizer_config(tokens: list[str], bos_id: int, eos_id: int, add_bos: bool, add_eos: bool,
                     pad_id: int | None = None, max_length: int | None = None) -> dict:
    """tokenizer_config.json for transformers-style loaders."""
    config = {"bos_token": tokens[bos_id], "eos_token": tokens[eos_id],
              "add_bos_token": bool(add_bos), "add_eos_token": bool(add_eos),
              "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if pad_id is not None:
        config["pad_token"] = tokens[pad_id]
    if max_length:
        config["model_max_length"] = int(max_length)
    return config

