"""dsv4 vs mlx-lm's deepseek_v41: prefill and decode tokens/s on the same random checkpoint.

    python -m benchmarks.vs_mlx_lm                 # writes the checkpoint, runs both through ab.py
    python -m benchmarks.vs_mlx_lm --child dsv4 --model DIR   # one measured run (used by ab.py)

The checkpoint is a medium-size random official-layout model (no Engram: mlx-lm has none),
built with dsv4.testing. Both implementations run the same greedy loop: prefill the prompt
in one call, then one token per call with a host sync for the sampled id. QDQ and
activation rounding: each implementation's defaults (dsv4 rounds matmul inputs to fp8 like
the official model; mlx-lm does not), so tokens are not expected to match.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MEDIUM = dict(hidden_size=512, num_attention_heads=8, head_dim=128, q_lora_rank=256,
              qk_rope_head_dim=64, o_groups=4, o_lora_rank=128, moe_intermediate_size=256,
              n_routed_experts=16, num_experts_per_tok=4, sliding_window=128, index_n_heads=8,
              index_head_dim=64, index_topk=128, candidate_topk_blocks=16, candidate_block_size=8,
              engram_layer_ids=[])


def child(impl: str, model_dir: str, prompt_tokens: int, gen_tokens: int) -> None:
    import mlx.core as mx

    if impl == "dsv4":
        import dsv4

        model, _ = dsv4.load(model_dir)
        cache = model.make_cache()
        forward = lambda ids: model(ids, cache)  # noqa: E731
    else:
        from mlx_lm.utils import load_model

        model, _ = load_model(Path(model_dir))
        cache = model.make_cache()
        forward = lambda ids: model(mx.array(ids), cache=cache)  # noqa: E731
    prompt = np.random.default_rng(0).integers(7, 500, (1, prompt_tokens))
    start = time.perf_counter()
    token = int(mx.argmax(forward(prompt)[0, -1]).item())
    ttft = time.perf_counter() - start
    tokens = [token]
    t0 = time.perf_counter()
    for _ in range(gen_tokens - 1):
        token = int(mx.argmax(forward(np.array([[token]]))[0, -1]).item())
        tokens.append(token)
    gen = time.perf_counter() - t0
    print("DSV4_RESULT " + json.dumps({
        "prompt_tokens": prompt_tokens, "prompt_tps": prompt_tokens / ttft, "ttft_s": ttft,
        "generation_tokens": len(tokens), "generation_tps": (len(tokens) - 1) / gen,
        "peak_memory_gb": mx.get_peak_memory() / 1e9, "tokens": tokens,
        "tokens_md5": hashlib.md5(",".join(map(str, tokens)).encode()).hexdigest()}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=["dsv4", "mlx-lm"])
    p.add_argument("--model", default="/tmp/dsv4-bench-medium")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--generation-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    if a.child:
        child(a.child, a.model, a.prompt_tokens, a.generation_tokens)
        return 0
    from dsv4.testing import write_tiny_checkpoint

    if not (Path(a.model) / "config.json").is_file():
        write_tiny_checkpoint(a.model, seed=0, shards=4, config_overrides=MEDIUM)
    cmd = [sys.executable, "-m", "benchmarks.vs_mlx_lm", "--model", a.model,
           "--prompt-tokens", str(a.prompt_tokens), "--generation-tokens", str(a.generation_tokens)]
    return subprocess.call([sys.executable, "-m", "benchmarks.ab", "--runs", str(a.runs), "--warmup", "1",
                            "--label", "dsv4-vs-mlx-lm", "--note",
                            f"medium random checkpoint {json.dumps(MEDIUM)}, 8 layers, every V4.1 role; "
                            f"prompt {a.prompt_tokens}, {a.generation_tokens} generated",
                            "--variant", "mlx-lm: --child mlx-lm", "--variant", "dsv4: --child dsv4",
                            "--", *cmd])


if __name__ == "__main__":
    sys.exit(main())
