"""Train the bundled demo checkpoint (dsv4/demo/) from scratch, on this CPU, with MLX autograd.

    python training/train_demo.py                 # train, write dsv4/demo/, evaluate
    python training/train_demo.py --steps 20 --out /tmp/demo   # a quick trial
    python training/train_demo.py --draft-only dsv4/demo       # only the DSpark draft stages

Model: `dsv4.testing.tiny_config` (every V4.1 layer role, mHC, MoE, two Engram layers)
with the overrides in CONFIG_OVERRIDES, trained in float32 with the fp8/fp4 emulation off
(`kv_qdq`, `act_quant`); the Engram tables are trained as float rows. The result is
quantized to the official storage formats (fp8 e4m3 + e8m0 32x32 blocks, fp4 experts
+ e8m0 per 32, Engram rows e4m3 + e8m0 per 32, BF16, F32) and written in the official
layout, so `dsv4.load()` packs it exactly as it would the real checkpoint and reads
the Engram tables from the shards through the Engram store. Then the DSpark draft stages
(`mtp.*`, dsv4/draft.py) are trained on the frozen backbone by self-distillation
(`train_draft`) and written with it.

Corpus: the topic texts of the Python reference manual that ship with CPython as
`pydoc_data.topics` (PSF licence, which allows redistribution), one document per topic,
plus one chat-encoded question/answer per training topic so that the chat encoding's
special tokens lead somewhere. Every 10th topic (sorted by name) is held out. The topics
differ between Python versions: the bundled checkpoint was trained on CPython 3.11.7's.

Deterministic given --seed (numpy and MLX seeds; same MLX version and machine type).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dsv4  # noqa: E402
import dsv4.attention  # noqa: E402
import dsv4.moe  # noqa: E402
from dsv4 import flags, layout  # noqa: E402
from dsv4.config import ModelArgs  # noqa: E402
from dsv4.draft import Draft  # noqa: E402
from dsv4.encoding import encode_messages  # noqa: E402
from dsv4.engram import NgramHasher, build_token_map, layer_primes  # noqa: E402
from dsv4.linear import fp8_linear  # noqa: E402
from dsv4.model import Model  # noqa: E402
from dsv4.safetensors_file import Checkpoint, view  # noqa: E402
from dsv4.testing import (SPECIAL_TOKENS, draft_config, encode_e4m3, fp4_weight,  # noqa: E402
                          fp8_block_weight, official_tensors, tiny_config, to_bf16_bits,
                          train_tokenizer, write_sharded)

VOCAB_SIZE = 1024
# Wider sliding window and top-k than the test config so the tiny model sees some
# context; one Engram head per n-gram order keeps the Engram projection affordable on a
# CPU (MLX's CPU matmul is the bottleneck); eps as the official model.
CONFIG_OVERRIDES = dict(rms_norm_eps=1e-6, sliding_window=16, index_topk=8,
                        engram_n_heads=1, engram_vocab_size=1000)
HELD_OUT_EVERY = 10
SHARDS = 3


# --- corpus ---------------------------------------------------------------------------------

def topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics as table

    return [(name, table[name]) for name in sorted(table)]


def split_topics(docs: list[tuple[str, str]]) -> tuple[list, list]:
    train = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return train, held


def chat_sample(text: str) -> str:
    """'Tell me about <title>.' answered by the topic's opening paragraphs."""
    lines = text.strip().splitlines()
    title, body = lines[0].strip(), "\n".join(lines[2:]).strip()
    answer = ""
    for para in re.split(r"\n\s*\n", body):
        answer = f"{answer}\n\n{para}" if answer else para
        if len(answer) >= 200:
            break
    return encode_messages([{"role": "user", "content": f"Tell me about {title.lower()}."},
                            {"role": "assistant", "content": answer}], "chat")


def documents(docs: list[tuple[str, str]], with_chat: bool) -> list[str]:
    plain = [SPECIAL_TOKENS[0] + text.strip() + SPECIAL_TOKENS[1] for _, text in docs]
    return plain + ([chat_sample(text) for _, text in docs] if with_chat else [])


def token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    return np.concatenate([np.array(tokenizer.encode(t).ids, np.int64) for t in texts])


# --- the model under training ----------------------------------------------------------------

class Trainee(nn.Module):
    """The model plus its Engram tables as trainable float rows [rows, 256] by layer."""

    def __init__(self, args: ModelArgs, tokenizer, seed: int):
        super().__init__()
        mx.random.seed(seed)
        self.model = Model(args)
        self.model.set_dtype(mx.float32)
        d = args.hidden_size
        for block in self.model.layers:
            for site in ("attn", "ffn"):
                fn = getattr(block, f"hc_{site}_fn")
                setattr(block, f"hc_{site}_fn", mx.random.normal(fn.shape) * (fn.shape[1] ** -0.5))
            block.ffn.gate.weight = mx.random.normal(block.ffn.gate.weight.shape) * d ** -0.5
            if "engram" in block:
                block.engram.q_weight = mx.ones((args.hc_mult, d))
                block.engram.k_weight = mx.ones((args.hc_mult, d))
        self.tables = {str(layer): mx.random.normal((int(p.sum()), args.engram_head_dim))
                       for layer, p in layer_primes(args).items()}
        hasher = NgramHasher(args, build_token_map(tokenizer))
        self.model.set_engram(hasher, {layer: _TrainedTable(self, layer) for layer in args.engram_layer_ids})

    def __call__(self, ids: np.ndarray) -> mx.array:
        return self.model(ids)


class _TrainedTable:
    """What Model.set_engram expects of a table, gathering from the Trainee's current
    rows, so the gradient reaches them."""

    def __init__(self, owner: Trainee, layer: int):
        self.owner, self.layer = owner, layer
        self.rows = owner.tables[str(layer)].shape[0]
        self.name = f"layers.{layer}.engram (training)"

    def start(self, ids: np.ndarray):
        table, index = self.owner.tables[str(self.layer)], mx.array(ids.astype(np.int32))
        return _Ready(table[index])


class _Ready:
    def __init__(self, rows: mx.array):
        self.rows = rows

    def wait(self) -> mx.array:
        return self.rows


def next_token_loss(model, ids: np.ndarray) -> mx.array:
    """Mean cross-entropy of ids[:, 1:] given ids[:, :-1], in nats."""
    logits = model(ids[:, :-1])
    return nn.losses.cross_entropy(logits, mx.array(ids[:, 1:]), reduction="mean")


def adamw(lr: float, steps: int) -> optim.AdamW:
    """AdamW with a linear warm-up over the first 5% of `steps`, then a cosine decay to lr / 10."""
    warmup = max(1, steps // 20)
    schedule = optim.join_schedules(
        [optim.linear_schedule(lr / warmup, lr, warmup),
         optim.cosine_decay(lr, steps - warmup, lr * 0.1)], [warmup])
    return optim.AdamW(learning_rate=schedule, weight_decay=0.01)


def train(trainee: Trainee, stream: np.ndarray, steps: int, batch: int, seq: int, lr: float,
          seed: int) -> list[tuple[int, float]]:
    rng = np.random.default_rng(seed)
    opt = adamw(lr, steps)
    step_fn = nn.value_and_grad(trainee, lambda ids: next_token_loss(trainee, ids))
    history, recent, start = [], [], time.time()
    with flags.override(kv_qdq=False, act_quant=False):
        for step in range(1, steps + 1):
            starts = rng.integers(0, len(stream) - seq - 1, batch)
            ids = np.stack([stream[s:s + seq + 1] for s in starts])
            loss, grads = step_fn(ids)
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            opt.update(trainee, grads)
            mx.eval(trainee.parameters(), opt.state, loss)
            recent.append(loss.item())
            if step % 10 == 0 or step == steps:
                mean = float(np.mean(recent))
                history.append((step, mean))
                recent = []
                rate = step / (time.time() - start)
                print(f"step {step}/{steps}  loss {mean:.3f}  {rate:.2f} steps/s  "
                      f"eta {(steps - step) / rate / 60:.1f} min", flush=True)
    return history


# --- export to the official storage formats --------------------------------------------------

class _GivenValues:
    """Stands in for the numpy Generator of dsv4.testing's encoders (fp8_block_weight,
    fp4_weight draw their input with one `normal` call), so they encode trained values."""

    def __init__(self, values: np.ndarray):
        self.values = values

    def normal(self, mean, std, shape) -> np.ndarray:
        if tuple(shape) != self.values.shape:
            raise ValueError(f"encoder asked for shape {tuple(shape)}, the values are {self.values.shape}")
        return self.values


def engram_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float rows [n, 256] -> e4m3 codes + e8m0 power-of-two scales per 32 (mxfp8)."""
    groups = values.reshape(values.shape[0], -1, 32)
    exp = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 448.0)).astype(np.int32)
    codes = encode_e4m3(np.clip(groups / (2.0 ** exp)[..., None], -448, 448))
    return codes.reshape(values.shape), (exp + 127).astype(np.uint8)


_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


def official_storage(trainee: Trainee, args: ModelArgs) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of the official layout, {name: (dtype, storage array)}, from the float weights."""
    out = encoded(trainee.model, layout.expected_tensors(args))
    for layer in args.engram_layer_ids:
        codes, scales = engram_rows(np.array(trainee.tables[str(layer)], np.float32))
        out[f"layers.{layer}.engram.embed.weight"] = ("F8_E4M3", codes)
        out[f"layers.{layer}.engram.embed.scale"] = ("F8_E8M0", scales)
    for i in range(args.num_hidden_layers):
        # The official checkpoint's image-routing bias; the text model does not read it.
        out[f"layers.{i}.ffn.gate.bias_vl"] = ("F32", np.zeros(args.n_routed_experts, np.float32))
    return out


def encoded(module: nn.Module, expected: dict) -> dict[str, tuple[str, np.ndarray]]:
    """The `expected` official tensors ({name: (dtype, shape)}, dsv4.layout) of a float module
    whose parameters carry the official names, in their storage formats."""
    params = {n: np.array(v, np.float32) for n, v in tree_flatten(module.parameters())}
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, (dtype, shape) in expected.items():
        expert = _EXPERT.match(name)
        if name.endswith(".scale"):
            continue  # written with its weight
        if expert:
            base, e, w = expert.groups()
            values = params[f"{base}.{w}.weight"][int(e)]
            codes, scale = fp4_weight(_GivenValues(values), values.shape, 0.0)
            out[name], out[f"{base}.{e}.{w}.scale"] = ("I8", codes), ("F8_E8M0", scale)
        elif dtype == "F8_E4M3":
            values = params[name]
            codes, scale = fp8_block_weight(_GivenValues(values), *values.shape, 0.0)
            module = name.removesuffix(".weight")
            out[name], out[f"{module}.scale"] = ("F8_E4M3", codes), ("F8_E8M0", scale)
        elif dtype == "BF16":
            out[name] = ("BF16", to_bf16_bits(params[name]))
        else:
            out[name] = ("F32", params[name])
        if name in out and out[name][1].shape != shape and dtype != "I8":
            raise ValueError(f"{name}: exported {out[name][1].shape}, the layout expects {shape}")
    return out


def write_checkpoint(path: Path, tensors: dict, config: dict, tokenizer) -> None:
    """Write into a temporary sibling, then move into place: never a half-written model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    write_sharded(tmp, tensors, SHARDS)
    write_side_files(tmp, config, tokenizer)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def write_side_files(path: Path, config: dict, tokenizer) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True, "model_max_length": 4096}, indent=1))


def demo_config(tokenizer) -> dict:
    config = tiny_config(vocab_size=tokenizer.get_vocab_size(), **CONFIG_OVERRIDES)
    text = config["text_config"]
    text["engram_compressed_vocab_size"] = int(build_token_map(tokenizer).max() + 1)
    text["engram_num_embeddings"] = [int(p.sum()) for p in layer_primes(ModelArgs.from_dict(config)).values()]
    return config


# --- the DSpark draft stages (dsv4/draft.py) --------------------------------------------------

def with_draft(config: dict) -> dict:
    """The config with DSpark draft stages (dsv4.testing.draft_config) after its layers."""
    config = json.loads(json.dumps(config))
    text = config["text_config"]
    n = text["num_hidden_layers"]
    fields = draft_config(n)
    text.update(fields)
    text["compress_ratios"] = list(text["compress_ratios"][:n]) + [0] * fields["num_nextn_predict_layers"]
    return config


def new_draft(args: ModelArgs, seed: int) -> Draft:
    """Draft stages in float32, their mHC and router weights drawn as the Trainee's blocks'."""
    mx.random.seed(seed)
    draft = Draft(args)
    draft.set_dtype(mx.float32)
    for stage in draft.mtp:
        for site in ("attn", "ffn"):
            fn = getattr(stage, f"hc_{site}_fn")
            setattr(stage, f"hc_{site}_fn", mx.random.normal(fn.shape) * (fn.shape[1] ** -0.5))
        stage.ffn.gate.weight = mx.random.normal(stage.ffn.gate.weight.shape) * args.hidden_size ** -0.5
    return draft


def draft_loss(model, draft: Draft, ids: np.ndarray) -> tuple[mx.array, mx.array]:
    """Self-distillation on one window ids [1, S] through the frozen backbone `model`: every
    draft block that fits (after position p >= window - 1, rows p+1..p+block) against the
    backbone's own distribution at each row's position, teacher forced (row i's Markov token
    is the text's token before that position); the confidence head learns whether the row's
    argmax is the backbone's. Returns (loss, argmax agreement per block row).

    Each block sees its window rotated to positions 0..window-1 and sits at window.. instead
    of at its own positions: RoPE makes attention depend on position differences only, and
    all blocks then share one rotation (dsv4's rope takes one offset per call)."""
    w, k, s = draft.args.sliding_window, draft.block_size, ids.shape[1]
    hidden = []
    teacher = mx.stop_gradient(mx.softmax(model(ids, model.make_cache(), hidden=hidden)[0], axis=-1))
    h = mx.stop_gradient(mx.concatenate(hidden, axis=-1))[None]                    # [1, S, 3D]
    anchors = np.arange(w - 1, s - k)
    rows = anchors[:, None] + 1 + np.arange(k)[None]                               # [A, block]
    first = draft.mtp[0]
    main_x = first.main_norm(fp8_linear(first.main_proj, h))[0]
    window = draft.make_cache()
    at_zero = draft._state(window, 0)
    positions = mx.array(anchors[:, None] - w + 1 + np.arange(w)[None])            # [A, window]
    for i, stage in enumerate(draft.mtp):
        window.rows[i] = stage.attn.window_rows(fp8_linear(stage.attn.wkv, main_x)[positions], at_zero)
    window.end = w
    x = draft.hidden(model, window, mx.array(ids[0, anchors + 1]))                # [A, block, D]
    bias, embed = draft.markov(mx.array(ids[0, rows]))
    logits = draft.logits(model, x) + bias
    target = teacher[mx.array(rows)]
    distill = -mx.mean(mx.sum(target * nn.log_softmax(logits, axis=-1), axis=-1))
    hit = mx.stop_gradient((mx.argmax(logits, -1) == mx.argmax(target, -1)).astype(mx.float32))
    confident = mx.mean(nn.losses.binary_cross_entropy(draft.confidence(x, embed), hit))
    return distill + 0.1 * confident, mx.mean(hit, axis=0)


def train_draft(model, draft: Draft, stream: np.ndarray, steps: int, seq: int, lr: float,
                seed: int) -> list[tuple[int, float, list[float]]]:
    """AdamW on the draft stages only (the backbone frozen), one window of `seq` tokens a step."""
    rng = np.random.default_rng(seed)
    opt = adamw(lr, steps)
    model.freeze()
    step_fn = nn.value_and_grad(draft, lambda ids: draft_loss(model, draft, ids)[0])
    history, recent, start = [], [], time.time()
    with flags.override(kv_qdq=False, act_quant=False):
        for step in range(1, steps + 1):
            at = rng.integers(0, len(stream) - seq)
            ids = stream[None, at:at + seq]
            loss, grads = step_fn(ids)
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            opt.update(draft, grads)
            mx.eval(draft.parameters(), opt.state, loss)
            recent.append(loss.item())
            if step % 20 == 0 or step == steps:
                hit = [round(float(v), 3) for v in np.array(draft_loss(model, draft, ids)[1])]
                history.append((step, float(np.mean(recent)), hit))
                recent = []
                rate = step / (time.time() - start)
                print(f"draft step {step}/{steps}  loss {history[-1][1]:.3f}  argmax agreement by row {hit}  "
                      f"{rate:.2f} steps/s  eta {(steps - step) / rate / 60:.1f} min", flush=True)
    return history


def draft_storage(draft: Draft, args: ModelArgs) -> dict[str, tuple[str, np.ndarray]]:
    """The draft stages' official tensors (mtp.*), from the float weights."""
    out = encoded(draft, layout.draft_tensors(args))
    for s in range(args.num_nextn_predict_layers):
        out[f"mtp.{s}.ffn.gate.bias_vl"] = ("F32", np.zeros(draft.mtp[s].ffn.gate.weight.shape[0], np.float32))
    return out


def stored_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of a checkpoint's shards as stored (storage arrays)."""
    ckpt = Checkpoint(path, "model*.safetensors")
    return {n: (info.dtype, np.array(view(info))) for n, info in ckpt.tensors.items()}


def draft_acceptance(path: Path, held: np.ndarray, prompts: int = 4, prompt_len: int = 64,
                     tokens: int = 128) -> dict:
    """Greedy speculative decoding of held-out text with the checkpoint as dsv4.load reads it
    (every rounding on), k = the block: acceptance, tokens per verify, drafts accepted by row."""
    from dsv4.generation import stream_generate
    from dsv4.speculative import Stats

    with flags.override(draft="on"):
        model, tokenizer = dsv4.load(path)
    total = Stats()
    for i in range(prompts):
        at = i * len(held) // prompts
        last = list(stream_generate(model, tokenizer, held[at:at + prompt_len].tolist(),
                                    max_tokens=tokens, ignore_eos=True, draft="on"))[-1].speculative
        total.verifies += last.verifies
        total.drafted += last.drafted
        total.accepted += last.accepted
        total.accepted_at = [a + b for a, b in zip(total.accepted_at + [0] * 9, last.accepted_at + [0] * 9)]
    return {"acceptance": total.acceptance, "tokens_per_verify": total.tokens_per_verify,
            "verifies": total.verifies, "accepted_by_row": [a for a in total.accepted_at if a]}


# --- evaluation -------------------------------------------------------------------------------

def held_out_loss(model, stream: np.ndarray, seq: int, batch: int = 1) -> float:
    """Mean next-token loss over the non-overlapping windows of seq+1 tokens."""
    n = (len(stream) - 1) // seq
    windows = np.stack([stream[i * seq: i * seq + seq + 1] for i in range(n)])
    total = 0.0
    for lo in range(0, n, batch):
        part = windows[lo:lo + batch]
        total += next_token_loss(model, part).item() * len(part)
    return total / n


def unigram_loss(train_stream: np.ndarray, held_stream: np.ndarray, vocab: int) -> float:
    """Cross-entropy of the held-out tokens under add-one smoothed training frequencies."""
    counts = np.bincount(train_stream, minlength=vocab) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held_stream[1:]].mean())


def random_model(path: Path, config: dict, tokenizer, seed: int) -> Path:
    """dsv4.testing's random official-layout weights for the same config and tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    write_sharded(path, official_tensors(ModelArgs.from_dict(config), seed), SHARDS)
    write_side_files(path, config, tokenizer)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "dsv4" / "demo")
    p.add_argument("--seed", type=int, default=0)
    # One long window per step: 512 tokens reach the compressed rows (256 at ratio 2) and
    # the indexers' top-k, which 64-token windows barely do.
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens scored")
    p.add_argument("--draft-steps", type=int, default=600, help="steps of the DSpark draft stages")
    p.add_argument("--draft-seq", type=int, default=256, help="tokens of a draft step's window")
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--draft-only", type=Path, metavar="DIR",
                   help="keep DIR's backbone as stored and train only the draft stages on it")
    p.add_argument("--metrics", type=Path, help="write the numbers as JSON here")
    a = p.parse_args(argv)

    docs = topics()
    corpus_sha = hashlib.sha256("".join(t for _, t in docs).encode()).hexdigest()
    train_docs, held_docs = split_topics(docs)
    train_texts = documents(train_docs, with_chat=True)
    if a.draft_only:
        from dsv4.config import read_json
        from dsv4.tokenizer import Tokenizer

        tokenizer = Tokenizer(a.draft_only).backend
    else:
        tokenizer = train_tokenizer(VOCAB_SIZE, "\n".join(train_texts))
    train_stream = token_stream(tokenizer, train_texts)
    held_stream = token_stream(tokenizer, documents(held_docs, with_chat=False))[:a.eval_tokens + 1]
    print(f"corpus: {len(docs)} topics (sha256 {corpus_sha[:16]}), {len(train_stream)} training "
          f"tokens, {len(held_stream)} held-out tokens from {[n for n, _ in held_docs]}", flush=True)
    metrics = {"seed": a.seed, "python": sys.version.split()[0], "corpus_sha256": corpus_sha,
               "train_tokens": int(len(train_stream)), "held_out_tokens": int(len(held_stream) - 1),
               "held_out_topics": [n for n, _ in held_docs]}

    if a.draft_only:
        config = with_draft(read_json(a.draft_only / "config.json"))
        args = ModelArgs.from_dict(config)
        backbone, _ = dsv4.load(a.draft_only, dtype=mx.float32)
        backbone.args = args   # the forward hands out the draft stages' inputs by its config
        tensors = stored_tensors(a.draft_only)
        metrics["backbone"] = f"{a.draft_only} as stored"
    else:
        config = with_draft(demo_config(tokenizer))
        args = ModelArgs.from_dict(config)
        trainee = Trainee(args, tokenizer, a.seed)
        with flags.override(kv_qdq=False, act_quant=False):
            untrained_float = held_out_loss(trainee, held_stream, a.seq)
        history = train(trainee, train_stream, a.steps, a.batch, a.seq, a.lr, a.seed)
        with flags.override(kv_qdq=False, act_quant=False):
            trained_float = held_out_loss(trainee, held_stream, a.seq)
        backbone, tensors = trainee.model, official_storage(trainee, args)
        metrics.update({"steps": a.steps, "batch": a.batch, "seq": a.seq, "lr": a.lr, "train_curve": history})

    draft = new_draft(args, a.seed)
    untrained_draft = draft_storage(draft, args)
    draft_history = train_draft(backbone, draft, train_stream, a.draft_steps, a.draft_seq, a.draft_lr, a.seed)
    write_checkpoint(a.out, {**tensors, **draft_storage(draft, args)}, config, tokenizer)
    print(f"wrote {a.out}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        untrained_dir = Path(tmp) / "untrained-draft"
        write_checkpoint(untrained_dir, {**tensors, **untrained_draft}, config, tokenizer)
        metrics["draft"] = {"steps": a.draft_steps, "seq": a.draft_seq, "lr": a.draft_lr, "train_curve": draft_history,
                            "greedy_speculative": {"trained": draft_acceptance(a.out, held_stream),
                                                   "untrained": draft_acceptance(untrained_dir, held_stream)}}
        if not a.draft_only:
            demo, _ = dsv4.load(a.out)
            rand, _ = dsv4.load(random_model(Path(tmp) / "random", config, tokenizer, a.seed))
            metrics["loss"] = {"unigram": unigram_loss(train_stream, held_stream, args.vocab_size),
                               "random_checkpoint": held_out_loss(rand, held_stream, a.seq),
                               "untrained_float": untrained_float,
                               "trained_float_no_qdq": trained_float,
                               "demo_checkpoint": held_out_loss(demo, held_stream, a.seq)}
            metrics["perplexity"] = {k: math.exp(v) for k, v in metrics["loss"].items()}
    print(json.dumps({k: metrics[k] for k in ("loss", "perplexity") if k in metrics}, indent=1))
    print(json.dumps(metrics["draft"]["greedy_speculative"], indent=1))
    if a.metrics:
        a.metrics.write_text(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
