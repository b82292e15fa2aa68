"""How many bytes V4.1's decode cache keeps per token: what the prefix cache holds per session.

    python benchmarks/cache_bytes.py [--out benchmarks/results/DATE-cache-bytes.md]

The cache (dsv4/cache.py) grows only by the compressed rows and index keys of the kv-source
layers (one row per `ratio` tokens) and by the token ids; the window rows of every layer and the
compressor inputs of the pooling layers are bounded (window + 2 * reserve rows at most: they are
cut back to window + reserve in batches). `growing_bytes_per_token` and `bounded_bytes` are that
arithmetic from a config; `measured` splits a real cache the same way, and the tests check the
two agree on the tiny checkpoint, so the numbers reported for V4.1 Flash's config follow from
the same code that holds the cache.
"""

from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from dsv4.config import ModelArgs  # noqa: E402
from dsv4.testing import tiny_config  # noqa: E402

# V4.1 Flash's cache-shaping fields (reference/model-spec.md §1.1): 40 layers, the first two
# window only, 2..19 ratio 2, 20..39 ratio 1; kv sources 2, 8, 14, 20, which are index sources too.
V41_FLASH = dict(num_hidden_layers=40, head_dim=512, index_head_dim=128, sliding_window=128,
                 compress_ratios=[0, 0] + [2] * 18 + [1] * 20, kv_source_layer_ids=[2, 8, 14, 20],
                 index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], candidate_source_layer_id=20,
                 max_position_embeddings=1048576)
ACTIVATION_BYTES = 2   # bf16 rows
TOKEN_BYTES = 8        # int64 token ids (Engram's history and the prefix cache's key)
GROWING = ("compressed", "index_keys")


def _kv_sources(args: ModelArgs) -> list[int]:
    return [l for l in args.kv_source_layer_ids if l < args.num_hidden_layers and args.ratio(l)]


def growing_bytes_per_token(args: ModelArgs) -> float:
    """Bytes added per token once a group completes: compressed rows (+ index keys where the
    kv source is also an index source) of each kv source, and the token id."""
    total = float(TOKEN_BYTES)
    for layer in _kv_sources(args):
        width = args.head_dim + (args.index_head_dim if layer in args.index_source_layer_ids else 0)
        total += width * ACTIVATION_BYTES / args.ratio(layer)
    return total


def bounded_bytes(args: ModelArgs, reserve: int = 256) -> int:
    """The most the bounded part holds: window rows of every layer and the fp32 compressor
    inputs (kv and gate) of kv sources with ratio > 1, window + 2 * reserve rows each."""
    rows = args.sliding_window + 2 * reserve
    window = args.num_hidden_layers * rows * args.head_dim * ACTIVATION_BYTES
    pooling = sum(1 for l in _kv_sources(args) if args.ratio(l) > 1)
    return window + pooling * rows * args.head_dim * 4 * 2


def measured(cache) -> tuple[int, int]:
    """(growing, bounded) bytes of a real dsv4 Cache."""
    growing = int(cache.tokens.nbytes)
    bounded = 0
    for layer in cache.layers:
        for name in layer.FIELDS:
            array = getattr(layer, name)
            if array is not None:
                if name in GROWING:
                    growing += array.nbytes
                else:
                    bounded += array.nbytes
    return growing, bounded


def expected_growing(args: ModelArgs, tokens: int) -> int:
    """The growing part after `tokens` tokens exactly (whole groups only)."""
    total = TOKEN_BYTES * tokens
    for layer in _kv_sources(args):
        width = args.head_dim + (args.index_head_dim if layer in args.index_source_layer_ids else 0)
        total += (tokens // args.ratio(layer)) * width * ACTIVATION_BYTES
    return total


def v41_flash() -> ModelArgs:
    return ModelArgs.from_dict(tiny_config(**V41_FLASH))


def report(model_path=None) -> str:
    import dsv4
    from dsv4.generation import prefill

    args = v41_flash()
    per_token = growing_bytes_per_token(args)
    fixed = bounded_bytes(args)
    lines = [f"# V4.1 Flash: bytes the decode cache keeps per token ({date.today().isoformat()})", "",
             "Made by `python benchmarks/cache_bytes.py`. The arithmetic is checked against real caches "
             "of the tiny checkpoint by tests/test_server_prefix_cache.py.", "",
             f"- growing: **{per_token:.0f} B per token** (compressed rows + index keys of kv sources "
             f"{_kv_sources(args)} at ratios {[args.ratio(l) for l in _kv_sources(args)]}, bf16, + 8 B token id)",
             f"- bounded: at most {fixed / 2**20:.1f} MiB per session (window rows of {args.num_hidden_layers} "
             f"layers and fp32 compressor inputs, window {args.sliding_window} + 2 x reserve 256 rows)", "",
             "| context | cache (growing + bounded at most) | DeepSeek V3's MLA cache (61 layers x 576 bf16 per token) |",
             "|---:|---:|---:|"]
    for tokens in (8192, 65536, 131072, 1048576):
        ours = per_token * tokens + fixed
        dense = 61 * 576 * 2 * tokens
        lines.append(f"| {tokens:,} | {ours / 2**20:,.0f} MiB | {dense / 2**20:,.0f} MiB |")
    model, tokenizer = dsv4.load(model_path)
    cache = model.make_cache()
    n = 1000
    prefill(model, np.arange(n).reshape(1, n) % model.args.vocab_size, cache)
    growing, bounded = measured(cache)
    lines += ["", f"Checked on {'the bundled demo' if model_path is None else model_path} after a {n}-token "
              f"prefill: growing {growing} B (the arithmetic says {expected_growing(model.args, n)}), "
              f"bounded {bounded} B (at most {bounded_bytes(model.args)}); "
              f"Cache.nbytes() = {cache.nbytes()} B."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint to check the arithmetic on (default: the demo)")
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    options = parser.parse_args(argv)
    text = report(options.model)
    print(text)
    if options.out:
        options.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
