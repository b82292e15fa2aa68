"""Engram: hashed n-gram memory added to the residual streams (model-spec §6).

Host side (numpy, exact int64): token ids -> compressed ids (the tokenizer's
normaliser folds case, accents and whitespace) -> for each position the 2-, 3- and
4-gram hashes, one row id per (order, head) in each layer's table. Device side:
the rows, a fp8 projection to one key per residual copy and a shared value, and a
signed-sqrt sigmoid gate per copy.

A table is anything with `rows`, `name` and `start(ids) -> request` whose
`request.wait()` gives the rows as bf16 `[*ids.shape, 256]` (dsv4.engram_store).
Reads start as soon as the token ids are known; the layer waits only for its own.
"""

from __future__ import annotations

import unicodedata
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import flags
from .config import ConfigError, ModelArgs
from .linear import Linear
from .quant import qdq_fp8

DEAD = -1  # a position no n-gram may span (image tokens)
_INT64_MAX = np.iinfo(np.int64).max


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def layer_primes(args: ModelArgs) -> dict[int, np.ndarray]:
    """For each Engram layer, its [orders, heads] primes: consecutive primes above
    engram_vocab_size - 1, taken in (layer, order, head) order."""
    orders, heads = args.engram_max_ngram_size - 1, args.engram_n_heads
    candidate = args.engram_vocab_size - 1
    out = {}
    for layer in args.engram_layer_ids:
        primes = np.zeros((orders, heads), np.int64)
        for o in range(orders):
            for h in range(heads):
                candidate += 1
                while not _is_prime(candidate):
                    candidate += 1
                primes[o, h] = candidate
        out[layer] = primes
    return out


def layer_multipliers(args: ModelArgs, layer: int) -> np.ndarray:
    """The odd int64 multipliers of one layer, from numpy's PCG64 seeded 10007 * layer."""
    bound = (_INT64_MAX // args.engram_compressed_vocab_size) // 2
    rng = np.random.default_rng(10007 * layer)
    return 2 * rng.integers(0, bound, size=args.engram_max_ngram_size, dtype=np.int64) + 1


def normalize_token_text(text: str) -> str:
    """NFKC -> NFD -> strip accents -> lowercase -> whitespace runs to one space ->
    a lone space kept, other text stripped (model-spec 6.2)."""
    import re

    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) != "Mn").lower()
    text = re.sub(r"[ \t\r\n]+", " ", text)
    return " " if text == " " else text.strip()


def build_token_map(tokenizer) -> np.ndarray:
    """compressed id of every token id, numbered by first appearance (model-spec 6.2).
    `tokenizer` is a `tokenizers.Tokenizer`."""
    keys: dict[str, int] = {}
    out = np.zeros(tokenizer.get_vocab_size(), np.int64)
    for i in range(len(out)):
        text = tokenizer.decode([i], skip_special_tokens=False)
        raw = tokenizer.id_to_token(i) or ""
        key = raw if "\ufffd" in text else (normalize_token_text(text) or text)
        out[i] = keys.setdefault(key, len(keys))
    return out


class NgramHasher:
    """Row ids of every Engram layer's table for a stream of tokens, chunk by chunk.

    The only state is the compressed ids of the last max_ngram-1 positions, kept in
    the cache so prefill chunks and decode steps hash as one long sequence would.
    """

    def __init__(self, args: ModelArgs, token_map: np.ndarray):
        if args.engram_compressed_vocab_size and token_map.max() + 1 != args.engram_compressed_vocab_size:
            raise ConfigError(
                f"the tokenizer's Engram token map has {token_map.max() + 1} compressed ids, "
                f"the config says engram_compressed_vocab_size={args.engram_compressed_vocab_size}")
        self.args = args
        self.token_map = token_map.astype(np.int64)
        self.pad = int(self.token_map[args.engram_pad_id])
        self.primes = layer_primes(args)
        self.multipliers = {l: layer_multipliers(args, l) for l in args.engram_layer_ids}
        self.offsets = {l: np.concatenate([[0], np.cumsum(p.reshape(-1))[:-1]]).astype(np.int64)
                        for l, p in self.primes.items()}
        self.table_rows = {l: int(p.sum()) for l, p in self.primes.items()}
        self._host = {l: (self.multipliers[l], self.primes[l], self.offsets[l]) for l in args.engram_layer_ids}
        self._device: Optional[dict] = None

    def compress(self, ids):
        """Compressed ids of token ids: numpy, or MLX arrays (gathered on the device)."""
        if isinstance(ids, mx.array):
            return self._on_device()["token_map"][ids]
        return self.token_map[ids]

    def _on_device(self) -> dict:
        """The hash's constants as MLX arrays, made once."""
        if self._device is None:
            self._device = {"token_map": mx.array(self.token_map)}
            for layer, constants in self._host.items():
                self._device[layer] = tuple(mx.array(c) for c in constants)
        return self._device

    def hash(self, compressed, history, start: int) -> dict:
        """compressed [B, S] ids of positions start..start+S-1, history [B, n-1] of the
        positions before (any value where start - k < 0) -> {layer: row ids [B, S, rows]}.
        Exact int64 in numpy, or lazily in MLX when given MLX arrays (the same operations)."""
        xp = mx if isinstance(compressed, mx.array) else np
        constants = self._on_device() if xp is mx else self._host
        n = self.args.engram_max_ngram_size
        batch, length = compressed.shape
        seq = xp.concatenate([history, compressed], axis=1)  # position start-(n-1) .. end-1
        pos = start + xp.arange(length)
        toks = []
        blocked = xp.zeros((batch, length), dtype=xp.bool_)
        for k in range(n):
            src = seq[:, n - 1 - k: n - 1 - k + length]
            blocked = blocked | (pos < k)[None, :] | (src == DEAD)
            toks.append(xp.where(blocked, self.pad, src))
        out = {}
        for layer in self.args.engram_layer_ids:
            mult, primes, offsets = constants[layer]
            rolling = toks[0] * mult[0]
            cols = []
            for order in range(1, n):
                rolling = rolling ^ (toks[order] * mult[order])
                cols.append(rolling[..., None] % primes[order - 1])
            out[layer] = xp.concatenate(cols, axis=-1) + offsets
        return out

    def row_ids(self, ids, past, offset: int) -> dict:
        """{layer: row ids [B, S, rows]} of the new tokens ids [B, S] after the tokens `past`
        [B, >= 0], the last of which sits at position offset - 1; numpy or MLX arrays."""
        xp = mx if isinstance(ids, mx.array) else np
        width = self.args.engram_max_ngram_size - 1
        batch = ids.shape[0]
        past = past[:, max(0, past.shape[1] - width):] if offset else past[:, :0]
        dead = xp.full((batch, width - past.shape[1]), DEAD, dtype=xp.int64)
        history = xp.concatenate([dead, self.compress(past).astype(xp.int64)], axis=1)
        return self.hash(self.compress(ids), history, offset)


class Engram(nn.Module):
    """One Engram layer: rows -> fp8 wkv -> per-copy keys + shared value -> gated add."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hc = args.hc_mult
        self.dim = args.hidden_size
        self.eps = args.rms_norm_eps
        width = args.engram_rows_per_token * args.engram_head_dim
        self.wkv = Linear(width, args.hidden_size * (args.hc_mult + 1), bias=False)
        self.q_weight = mx.zeros((args.hc_mult, args.hidden_size), mx.bfloat16)
        self.k_weight = mx.zeros((args.hc_mult, args.hidden_size), mx.bfloat16)

    def __call__(self, streams: mx.array, rows: mx.array, gate_mask: Optional[mx.array] = None) -> mx.array:
        """streams [B, S, hc, D]; rows [B, S, r, head_dim] -> streams with the gated value added."""
        b, s = streams.shape[:2]
        e = rows.reshape(b, s, -1).astype(streams.dtype)
        if flags.get("act_quant"):
            e = qdq_fp8(e)
        kv = self.wkv(e)
        key = kv[..., : self.hc * self.dim].reshape(b, s, self.hc, self.dim).astype(mx.float32)
        value = kv[..., self.hc * self.dim:].astype(mx.float32)
        x = streams.astype(mx.float32)
        # the product of the fp32 weights, as the reference takes it: a bf16 product keeps 8 of
        # its 16 significant bits
        wqk = self.q_weight.astype(mx.float32) * self.k_weight.astype(mx.float32)
        rstd = mx.rsqrt(mx.mean(x * x, axis=-1) + self.eps) * mx.rsqrt(mx.mean(key * key, axis=-1) + self.eps)
        dot = mx.sum(x * wqk * key, axis=-1) * rstd * (self.dim ** -0.5)
        root = mx.sqrt(mx.maximum(mx.abs(dot), 1e-6))
        gate = mx.sigmoid(mx.where(dot < 0, -root, root))  # the reference's copysign: 0 -> +root
        if gate_mask is not None:
            gate = gate * gate_mask[..., None]
        return (x + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)


def table_sizes(args: ModelArgs) -> Sequence[int]:
    primes = layer_primes(args)
    return [int(primes[l].sum()) for l in args.engram_layer_ids]
