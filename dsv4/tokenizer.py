"""The tokenizer: `tokenizers.Tokenizer` from tokenizer.json, with the ids dsv4 needs
and a streaming detokenizer that never emits half a UTF-8 character."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from .config import read_json
from .safetensors_file import CheckpointError


class StreamingDetokenizer:
    """Feed token ids one at a time; `last_segment` is the text completed since the
    previous call (held back while the tail is an incomplete UTF-8 sequence)."""

    def __init__(self, tokenizer: "Tokenizer"):
        self._tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.text = ""
        self._emitted = 0
        self._segment = ""

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        text = self._tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return
        self.text = text
        self._segment += text[self._emitted:]
        self._emitted = len(text)

    def finalize(self) -> None:
        text = self._tokenizer.decode(self.tokens)
        self._segment += text[self._emitted:]
        self.text, self._emitted = text, len(text)

    @property
    def last_segment(self) -> str:
        seg, self._segment = self._segment, ""
        return seg


class Tokenizer:
    def __init__(self, path: Path | str):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(f"{file}: not found (the model directory needs its tokenizer)")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise CheckpointError(f"{file}: not a tokenizer file ({str(e).splitlines()[0]})") from None
        config_file = file.parent / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        model_config_file = file.parent / "config.json"
        model_config = read_json(model_config_file) if model_config_file.is_file() else {}
        text = {**model_config, **model_config.get("text_config", {})}

        def token_id(name: str, fallback: Optional[int]) -> Optional[int]:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            found = self._tok.token_to_id(token) if isinstance(token, str) else None
            return found if found is not None else fallback

        self.bos_token_id = token_id("bos_token", text.get("bos_token_id", 0))
        self.eos_token_id = token_id("eos_token", text.get("eos_token_id", 1))
        self.eos_token_ids = {self.eos_token_id}
        self.bos_token = self._tok.id_to_token(self.bos_token_id)
        self.eos_token = self._tok.id_to_token(self.eos_token_id)
        self.vocab_size = self._tok.get_vocab_size()

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer` (Engram builds its token map from it)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    @property
    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)
