"""Streamed routed experts (--expert-cache-gb) against the fully resident model.

Oracle: the same checkpoint loaded resident. The streamed model computes from the cache's slots
with the resident code path, so its logits must be bit-identical (np.array_equal, not a
tolerance) for a chunked prefill and 64 teacher-forced decode steps, at every cache size from the
least (one token's top-k in every layer) to all experts, with and without prefetch, under every
eviction policy, for each expert format: official fp4 experts (per-expert tensors read as
mxfp4), a converted dsv4 directory (stacked mxfp4 in shards; affine requantized), and ds4 GGUF
blocks referenced in place (including a file whose layers mix block types: several pools).

The tiny checkpoints have 32 experts, top-2, over 8 layers: the least cache (16 slots) is half
a layer's experts, so prefill chunks split into token parts and the policies evict all the time.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import expert_store, flags, profiler, step
from dsv4.safetensors_file import Checkpoint, CheckpointError
from dsv4.testing import write_tiny_checkpoint

EXPERTS, TOP_K, LAYERS = 32, 2, 8
STEPS = 64
CHUNKS = (48, 6)   # a prefill of two chunks


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("stream") / "official", seed=3,
                                 config_overrides={"n_routed_experts": EXPERTS,
                                                   "num_experts_per_tok": TOP_K})


@functools.lru_cache(maxsize=None)
def sizes(path, dtype=None) -> tuple[int, int]:
    """(bytes of one expert of the first pool, bytes of the least cache)."""
    store = dsv4.load(path, dtype=dtype, expert_cache_gb="1000")[0].expert_store
    return store.pools[0].expert_bytes, store.least_bytes


def expert_bytes(path) -> int:
    return sizes(path)[0]


def prompt() -> np.ndarray:
    return np.random.default_rng(11).integers(7, 500, (1, sum(CHUNKS)))


def run(model, tokens=None) -> tuple[list[np.ndarray], list[int]]:
    """Logits of each prefill chunk and of STEPS decode steps fed `tokens` (default: the
    model's own greedy choices), and the tokens fed."""
    ids, cache, out, fed = prompt(), model.make_cache(), [], []
    lo = 0
    for n in CHUNKS:
        out.append(np.array(model(ids[:, lo:lo + n], cache)))
        lo += n
    for i in range(STEPS):
        t = tokens[i] if tokens is not None else int(np.argmax(out[-1][0, -1]))
        fed.append(t)
        out.append(np.array(model(np.array([[t]]), cache)))
    return out, fed


@pytest.fixture(scope="module")
def resident(official):
    model, _ = dsv4.load(official)
    return run(model)


def identical(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def least_gb(path, dtype=None) -> str:
    """The least cache, as the option is written."""
    return f"{sizes(path, dtype)[1] / 1e9:.9f}"


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("size", ["least", "half", "all"])
def test_logits_equal_resident_at_every_cache_size(official, resident, size, prefetch):
    per_expert = expert_bytes(official)
    slots = {"least": TOP_K * LAYERS, "half": EXPERTS * LAYERS // 2, "all": EXPERTS * LAYERS}[size]
    with flags.override(expert_prefetch=prefetch):
        model, _ = dsv4.load(official, expert_cache_gb=f"{slots * per_expert / 1e9:.9f}")
        store = model.expert_store
        assert sum(p.slots for p in store.pools) == slots
        got, _ = run(model, resident[1])
    assert identical(got, resident[0])
    total = store.totals()
    assert total.misses > 0 and total.bytes_read == total.misses * per_expert
    if size == "least":
        assert total.lookups > LAYERS * (len(CHUNKS) + STEPS)   # prefill went in token parts
    if size == "all":                                           # each expert read once at most
        assert total.misses + total.prefetched <= EXPERTS * LAYERS
    if not prefetch or size != "all":
        assert (total.prefetched > 0) == prefetch
    store.close()


@pytest.mark.parametrize("policy", ["lru", "frequency", "layer"])
def test_every_policy_is_exact_at_the_least_cache(official, resident, policy):
    with flags.override(expert_cache_policy=policy):
        model, _ = dsv4.load(official, expert_cache_gb=least_gb(official))
        got, _ = run(model, resident[1])
    assert identical(got, resident[0])
    assert model.expert_store.pools[0].policy.kind == policy


def test_direct_reads_are_exact(official, resident):
    """O_DIRECT reads (expert_io_direct, Linux) through the workers' aligned buffers."""
    with flags.override(expert_io_direct=True):
        model, _ = dsv4.load(official, expert_cache_gb=least_gb(official))
        got, _ = run(model, resident[1])
    store = model.expert_store
    assert all(fd is not None for pool in store.pools for p in pool.layers[0].params.values()
               for fd in p.files[0].direct)
    assert identical(got, resident[0]) and store.totals().misses > 0


def fixed_run(model, tokens) -> list[np.ndarray]:
    """Logits of the prefill chunks (reference forward), then of the fixed-shape decode step
    (dsv4/step.py, the GPU's decode loop, here forced on the CPU) fed `tokens` one by one."""
    ids, cache, out, lo = prompt(), model.make_cache(), [], 0
    for n in CHUNKS:
        out.append(np.array(model(ids[:, lo:lo + n], cache)))
        lo += n
    dec = step.FixedDecoder(model, cache)
    out += [np.array(dec(mx.array([t]))) for t in tokens]
    dec.close(dec.pos)
    return out


@pytest.fixture(scope="module")
def resident_fixed(official, resident):
    """The resident model's logits through its one compiled fixed-shape step."""
    with flags.override(compile=True):
        return fixed_run(dsv4.load(official)[0], resident[1])


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("size", ["least", "half", "all"])
def test_compiled_segments_equal_resident_at_every_cache_size(official, resident, resident_fixed, size, prefetch):
    """The fixed-shape step over streamed experts as compiled segments (dsv4/step_segments.py):
    64 teacher-forced steps bit-identical to the resident model's single compiled step."""
    slots = {"least": TOP_K * LAYERS, "half": EXPERTS * LAYERS // 2, "all": EXPERTS * LAYERS}[size]
    with flags.override(expert_prefetch=prefetch, compile=True, expert_step_segments=True):
        model, _ = dsv4.load(official, expert_cache_gb=f"{slots * expert_bytes(official) / 1e9:.9f}")
        got = fixed_run(model, resident[1])
    assert {type(f).__name__ for f in model._fixed_steps.values()} == {"SegmentedStep"}
    assert identical(got, resident_fixed)
    total = model.expert_store.totals()
    assert total.misses > 0
    if not prefetch or size != "all":
        assert (total.prefetched > 0) == prefetch
    model.expert_store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_segments_equal_resident(official, resident, resident_fixed, prefetch):
    """On a GPU (pytest -m gpu): the segments over the pool's slots (kernels on, the pool in
    managed memory on CUDA), 64 steps bit-identical to the resident model's compiled step, at
    the least cache."""
    from dsv4.kernels.dialect import backend

    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    with flags.override(expert_prefetch=prefetch, compile=True, expert_step_segments=True):
        model, _ = dsv4.load(official, expert_cache_gb=least_gb(official))
        got = fixed_run(model, resident[1])
    assert {type(f).__name__ for f in model._fixed_steps.values()} == {"SegmentedStep"}
    assert identical(got, resident_fixed) and model.expert_store.totals().misses > 0
    model.expert_store.close()


def test_op_by_op_fixed_step_is_exact(official, resident, resident_fixed):
    """The same step with the segments off (the rollback): run op by op, also exact."""
    with flags.override(compile=True, expert_step_segments=False):
        model, _ = dsv4.load(official, expert_cache_gb=least_gb(official))
        got = fixed_run(model, resident[1][:16])
    assert {type(f).__name__ for f in model._fixed_steps.values()} == {"function"}
    assert identical(got, resident_fixed[:len(got)])


def test_segments_are_traced_once_per_variant(official, monkeypatch):
    """A step replays its segments' traced graphs: once a step's variant and buffer shapes have
    been seen, it traces nothing (the Python of a streamed router runs only while tracing);
    op by op it runs at every step, so the count can tell."""
    from dsv4.moe import MoE

    calls = []
    real = MoE.streamed_routing
    monkeypatch.setattr(MoE, "streamed_routing", lambda self, x: calls.append(1) or real(self, x))
    for segments in (True, False):
        with flags.override(compile=True, expert_step_segments=segments):
            model, _ = dsv4.load(official, expert_cache_gb=least_gb(official))
            cache = model.make_cache()
            model(prompt(), cache)
            dec = step.FixedDecoder(model, cache)
            seen, repeats = set(), 0
            for t in range(40):
                key = (dec.variant(), tuple(sorted((n, b.shape) for n, b in dec.buffers.items())))
                calls.clear()
                dec(mx.array([7 + t]))
                # Every segment but the last ends at a streamed router: a new key traces them all.
                assert len(calls) == (0 if segments and key in seen else LAYERS), (segments, t, key)
                repeats += key in seen
                seen.add(key)
        assert repeats > 20
        model.expert_store.close()


# --- the server's batch ---------------------------------------------------------------------
# Sessions at different positions decoded together at fixed shapes (dsv4/batch_step.py, the
# server's batch on GPUs, here forced on the CPU).

BATCH = (6, 23, 54)   # the sessions' prompt lengths: before, at and past their first compressed rows


def sessions(model) -> list:
    """Caches of BATCH sessions, each prefilled with its own prompt."""
    rng, caches = np.random.default_rng(5), []
    for n in BATCH:
        caches.append(model.make_cache())
        model(rng.integers(7, 500, (1, n)), caches[-1])
    return caches


def batch_run(model, caches, fed=None, steps=32) -> tuple[list[np.ndarray], list]:
    """The batched fixed-shape step over `caches` for `steps` steps, fed `fed` [steps][B]
    (default: the sessions' greedy tokens), its buffers starting small so that they grow (a new
    trace); the caches handed back. -> (each step's logits, the tokens fed)."""
    from dsv4.batch_step import SessionsDecoder

    out, tokens = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step, "MIN_CAPACITY", 4)
        dec = SessionsDecoder(model, caches)
        for i in range(steps):
            t = fed[i] if fed is not None else (np.argmax(out[-1], -1).tolist() if out else [7, 8, 9])
            tokens.append(t)
            out.append(np.array(dec(mx.array(t))))
        assert dec.sessions[-1].buffers["2.compressed"].shape[1] > 4   # the buffers grew
        dec.close(dec.positions)
    return out, tokens


def same_caches(a: list, b: list) -> bool:
    """Whether each cache holds the same tokens and arrays, bit for bit."""
    for x, y in zip(a, b):
        mine, theirs = x.state(), y.state()
        if x.meta() != y.meta() or mine.keys() != theirs.keys() or not all(
                mine[n].dtype == theirs[n].dtype and mx.array_equal(mine[n], theirs[n]).item() for n in mine):
            return False
    return len(a) == len(b)


@pytest.fixture(scope="module")
def resident_batch(official):
    """The resident model's batched steps (its one compiled graph per variant): their logits
    and greedy tokens, and the caches handed back."""
    with flags.override(compile=True):
        model = dsv4.load(official)[0]
        caches = sessions(model)
        logits, fed = batch_run(model, caches)
    return logits, fed, caches


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("size", ["least", "all"])
def test_batch_segments_equal_the_resident_batch(official, resident_batch, monkeypatch, size, prefetch):
    """The batched step over streamed experts as compiled segments: every step's logits, and
    each session's cache handed back, bit-identical to the resident model's compiled batched
    step. Each streamed layer looks the batch's experts up once a step: the distinct experts any
    session's token selects (each miss read once for the batch, as a prefill chunk reads)."""
    from dsv4.moe import MoE

    slots = {"least": TOP_K * LAYERS, "all": EXPERTS * LAYERS}[size]
    with flags.override(expert_prefetch=prefetch, compile=True, expert_step_segments=True):
        model, _ = dsv4.load(official, expert_cache_gb=f"{slots * expert_bytes(official) / 1e9:.9f}")
        store = model.expert_store
        caches = sessions(model)
        chosen, lookups = [], []
        real_chosen, real_lookup = MoE.streamed_chosen, store.lookup
        monkeypatch.setattr(MoE, "streamed_chosen", lambda self, routing: chosen.append(
            real_chosen(self, routing)) or chosen[-1])
        monkeypatch.setattr(store, "lookup", lambda layer, experts, tokens: lookups.append(
            (experts, tokens)) or real_lookup(layer, experts, tokens))
        steps = len(resident_batch[0])
        got, _ = batch_run(model, caches, resident_batch[1])
    assert sum(p.slots for p in store.pools) == slots
    assert {type(f).__name__ for f in model._fixed_batch_steps.values()} == {"SegmentedStep"}
    assert identical(got, resident_batch[0])
    assert same_caches(caches, resident_batch[2])
    assert len(lookups) == len(chosen) == steps * LAYERS
    for (experts, tokens), ids in zip(lookups, chosen):
        assert ids.shape == (len(BATCH), TOP_K) and tokens == len(BATCH)
        assert np.array_equal(experts, np.unique(ids))
    assert store.totals().misses > 0
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_batch_segments_equal_the_resident_batch(official, resident_batch, prefetch):
    """On a GPU (pytest -m gpu): the batch's segments over the pool's slots (kernels on, the
    pool in managed memory on CUDA) at the least cache: every step's logits and the caches
    handed back bit-identical to the resident model's compiled batched step."""
    from dsv4.kernels.dialect import backend

    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    with flags.override(expert_prefetch=prefetch, compile=True, expert_step_segments=True):
        model, _ = dsv4.load(official, expert_cache_gb=least_gb(official))
        caches = sessions(model)
        got, _ = batch_run(model, caches, resident_batch[1])
    assert {type(f).__name__ for f in model._fixed_batch_steps.values()} == {"SegmentedStep"}
    assert identical(got, resident_batch[0]) and same_caches(caches, resident_batch[2])
    assert model.expert_store.totals().misses > 0
    model.expert_store.close()


def test_the_engine_batches_streamed_sessions_as_the_resident_model(official):
    """The server's engine (dsv4/serve/engine.py) over streamed experts at the least cache, its
    batches as segments: 2-4 sessions join and leave (the engine settles a batch and makes a new
    decoder whenever it changes), and every step's logits, and the caches settled at the end,
    are bit-identical to the same engine's over the resident model."""
    from dsv4.serve.engine import ModelEngine

    rng = np.random.default_rng(6)
    prompts = [rng.integers(7, 500, n).tolist() for n in (6, 23, 54, 11)]
    schedule = [[0, 1]] * 3 + [[0, 1, 2]] * 3 + [[0, 1, 2, 3]] * 4 + [[1, 2, 3]] * 3 + [[1, 3]] * 3
    runs = []
    for gb in (None, least_gb(official)):
        with flags.override(batch_fixed_decode=True, compile=True, expert_step_segments=True):
            model, _ = dsv4.load(official, expert_cache_gb=gb)
            engine = ModelEngine(model, None)
            caches = [engine.new_cache() for _ in prompts]
            fed = [[int(mx.argmax(engine.prefill(c, p)))] for c, p in zip(caches, prompts)]
            logits = []
            for members in schedule:
                logits.append(np.array(engine.decode([caches[i] for i in members], [fed[i][-1] for i in members])))
                for i, pick in zip(members, np.argmax(logits[-1], -1).tolist()):
                    fed[i].append(pick)
            engine.settle()
        runs.append((logits, caches))
    assert {type(f).__name__ for f in model._fixed_batch_steps.values()} == {"SegmentedStep"}
    assert identical(runs[1][0], runs[0][0])
    assert same_caches(runs[1][1], runs[0][1])
    assert model.expert_store.totals().misses > 0
    model.expert_store.close()


def test_batch_segments_are_traced_once_per_variant(official, monkeypatch):
    """The batch's segments replay their traced graphs from the second step of a variant on,
    also for a new decoder over the same sessions (the server makes one whenever its batch
    changes: the graphs live on the model)."""
    from dsv4.batch_step import SessionsDecoder, batch_regimes
    from dsv4.moe import MoE

    calls = []
    real = MoE.streamed_routing
    monkeypatch.setattr(MoE, "streamed_routing", lambda self, x: calls.append(1) or real(self, x))
    with flags.override(compile=True, expert_step_segments=True):
        model, _ = dsv4.load(official, expert_cache_gb=least_gb(official))
        caches = sessions(model)
        seen, repeats, dec = set(), 0, None
        for t in range(30):
            if t % 10 == 0:   # a new decoder every 10 steps
                if dec is not None:
                    dec.close(dec.positions)
                dec = SessionsDecoder(model, caches)
            shapes = tuple(tuple(sorted((n, b.shape) for n, b in d.buffers.items())) for d in dec.sessions)
            key = (batch_regimes([d.variant()[1] for d in dec.sessions]), shapes)
            calls.clear()
            dec(mx.array([7 + t, 8 + t, 9 + t]))
            # Every segment but the last ends at a streamed router: a new key traces them all.
            assert len(calls) == (0 if key in seen else LAYERS), (t, key)
            repeats += key in seen
            seen.add(key)
        dec.close(dec.positions)
    assert {type(f).__name__ for f in model._fixed_batch_steps.values()} == {"SegmentedStep"}
    assert repeats > 20
    model.expert_store.close()


# --- formats --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(official, tmp_path_factory):
    from convert import official as conv

    root = tmp_path_factory.mktemp("stream-converted")
    conv.convert(official, root / "mxfp4", progress=False, log=lambda *a: None)
    conv.convert(official, root / "affine", experts=conv.Requant(4, 32), progress=False,
                 log=lambda *a: None)
    return root


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    from gguf import GGMLQuantizationType as T

    from convert import gguf as conv
    from tests.gguf_fixtures import fixture_config, source_tokenizer, write_ds4_gguf

    root = tmp_path_factory.mktemp("stream-gguf")
    tokenizer = source_tokenizer()
    config = fixture_config(tokenizer)
    config["text_config"].update(n_routed_experts=16, num_experts_per_tok=2)
    mixed = {layer: (T.Q4_K, T.Q4_K, T.Q4_K) for layer in (2, 5)}
    out = {}
    for name, types in (("q2", None), ("q2-mixed", mixed)):
        write_ds4_gguf(root / f"{name}.gguf", "q2", seed=5, tokenizer=tokenizer, config=config,
                       expert_types=types)
        dst = root / name
        conv.convert(root / f"{name}.gguf", dst, conv.Options(), workers=1, progress=False)
        out[name] = dst
    # A byte-split GGUF cut inside an expert: that tensor's experts are read across both parts.
    data = (root / "q2.gguf").read_bytes()
    down = conv.GGUFSource(root / "q2.gguf").tensors["blk.3.ffn_down_exps.weight"]
    cut = down.offset + down.nbytes // 2 + 7
    (root / "q2s.gguf.part1").write_bytes(data[:cut])
    (root / "q2s.gguf.part2").write_bytes(data[cut:])
    conv.convert(root / "q2s.gguf.part1", root / "q2-split", conv.Options(), workers=1, progress=False)
    out["q2-split"] = root / "q2-split"
    conv.convert(root / "q2.gguf", root / "q2-copied", conv.Options(copy_weights=True), workers=1,
                 progress=False)
    out["q2-copied"] = root / "q2-copied"
    conv.convert(root / "q2.gguf", root / "q2-affine", conv.Options(affine=True), workers=1,
                 progress=False)
    out["q2-affine"] = root / "q2-affine"
    return out


def _format_check(path, dtype=None, pools=1):
    want, fed = run(dsv4.load(path, dtype=dtype)[0])
    model, _ = dsv4.load(path, dtype=dtype, expert_cache_gb=least_gb(path, dtype))
    assert len(model.expert_store.pools) == pools
    got, _ = run(model, fed)
    assert identical(got, want)
    assert model.expert_store.totals().misses > 0


@pytest.mark.parametrize("kind", ["mxfp4", "affine"])
def test_converted_directories_stream_exactly(converted, kind):
    _format_check(converted / kind)


@pytest.mark.parametrize("kind", ["q2", "q2-split", "q2-copied", "q2-affine"])
def test_gguf_blocks_stream_exactly(gguf_models, kind):
    _format_check(gguf_models[kind])
    if kind == "q2-split":
        refs = json.loads((gguf_models[kind] / "config.json").read_text())["dsv4"]["tensors"]
        assert len(refs["layers.3.ffn.experts.w2.weight"]["parts"]) == 2


def test_layers_of_other_block_types_get_their_own_pool(gguf_models):
    _format_check(gguf_models["q2-mixed"], pools=2)


def test_float_scales_are_cast_as_the_resident_model_casts_them(converted):
    """load(dtype=float32) casts the affine experts' bf16 scales and biases: the store converts
    them after each read, as set_dtype did the resident stack."""
    model, _ = dsv4.load(converted / "affine", dtype=mx.float32, expert_cache_gb="1")
    params = model.expert_store.pools[0].layers[0].params
    assert params["w1.scales"].stored == "BF16" and params["w1.scales"].dtype == mx.float32
    _format_check(converted / "affine", dtype=mx.float32)


# --- what is read ---------------------------------------------------------------------------

class PreadLog:
    """Wraps os.preadv: records (path, offset, bytes) of each read; fails where told to."""

    def __init__(self, monkeypatch, fail=None):
        self.real = os.preadv
        self.reads: list[tuple[Path, int, int]] = []   # (file, offset, bytes)
        self.fail = fail
        self.lock = threading.Lock()
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, fd, buffers, offset):
        if self.fail is not None and self.fail(fd, offset):
            raise OSError(errno.EIO, "Input/output error")
        n = self.real(fd, buffers, offset)
        with self.lock:
            self.reads.append((Path(os.readlink(f"/proc/self/fd/{fd}")), offset, n))
        return n


def test_prefill_reads_each_selected_expert_once(official, monkeypatch):
    """Oracle: the experts the resident model's routers select for the chunk (recorded from its
    Router.select). With a cache that holds them, each is read exactly once, and nothing else."""
    from dsv4.moe import Router

    selected: list[np.ndarray] = []
    real_select = Router.select

    def recording(self, logits):
        ids, weights = real_select(self, logits)
        selected.append(np.array(ids))
        return ids, weights

    resident, _ = dsv4.load(official)
    monkeypatch.setattr(Router, "select", recording)
    ids = prompt()[:, :CHUNKS[0]]
    resident(ids, resident.make_cache())
    monkeypatch.undo()
    want = {(layer, int(e)) for layer, chosen in enumerate(selected) for e in np.unique(chosen)}
    assert len(want) < EXPERTS * LAYERS                          # not every expert is selected

    with flags.override(expert_prefetch=False, expert_read_chunk_kb=1 << 20, expert_native_reads=False):
        model, _ = dsv4.load(official, expert_cache_gb="1")
        store = model.expert_store
        log = PreadLog(monkeypatch)
        model(ids, model.make_cache())
    offsets = {}
    for layer, placement in store.pools[0].layers.items():
        p = placement.params["w1.weight"]
        offsets.update({(p.files[e].path, int(p.offsets[e])): (layer, e) for e in range(EXPERTS)})
    read = [offsets[path, offset] for path, offset, _ in log.reads if (path, offset) in offsets]
    assert sorted(read) == sorted(want)                          # each once, exactly these
    assert store.totals().misses == len(want)


# --- faults ---------------------------------------------------------------------------------

def test_truncated_before_loading_names_the_experts_tensor(official, tmp_path):
    copy = tmp_path / "cut"
    shutil.copytree(official, copy)
    info = Checkpoint(copy, "model*.safetensors")["layers.6.ffn.experts.9.w2.scale"]
    os.truncate(info.file, info.offset + 3)
    with pytest.raises(CheckpointError, match=r"truncated: tensor layers\.6\.ffn\.experts\.9\.w2\.scale "):
        dsv4.load(copy, expert_cache_gb="1")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("layout, decode", [("official", "reference"), ("stacked", "reference"),
                                            ("official", "segments"), ("official", "batch")])
def test_truncated_mid_generation_raises_and_joins(official, converted, tmp_path, layout, decode, native):
    """A shard cut short after loading: the lookup that needs a lost expert raises an
    ExpertReadError naming the tensor and the expert; every read has joined (no prefetch left
    in flight), no slot holds a lost expert it did not hold before the cut, and closing the store
    returns. Decoding through the reference forward, or the fixed-shape step's compiled
    segments (the lookup between two of them raises), alone or for a batch of sessions (the
    one lookup of the batch's experts raises, once for the batch). With the native reader's
    threads and with Python's."""
    from dsv4.batch_step import SessionsDecoder

    copy = tmp_path / "cut"
    shutil.copytree(official if layout == "official" else converted / "mxfp4", copy)
    model, _ = dsv4.load(copy, expert_cache_gb=least_gb(copy))
    store = model.expert_store
    ckpt = Checkpoint(copy, "model*.safetensors")
    first = "layers.7.ffn.experts.0.w1.weight" if layout == "official" else "layers.7.ffn.experts.w1.weight"
    lost = ckpt[first]
    cut = lost.offset + lost.nbytes // 2
    caches = [model.make_cache() for _ in range(3 if decode == "batch" else 1)]
    for i, cache in enumerate(caches):             # the batch's sessions at different positions
        model(prompt()[:, :8 + 5 * i], cache)
    os.truncate(lost.file, cut)
    read_before_the_cut = filled_slots(store)
    with flags.override(compile=True, expert_step_segments=True, expert_native_reads=native), \
            pytest.raises(expert_store.ExpertReadError) as info:
        dec = {"reference": None, "segments": step.FixedDecoder,
               "batch": lambda model, cache: SessionsDecoder(model, caches)}[decode]
        dec = dec and dec(model, caches[0])
        for t in range(400):                       # until a lost expert is needed
            if dec is None:
                model(np.array([[7 + t]]), caches[0])
            else:
                dec(mx.array([7 + t, 200 + t, 400 + t][:len(caches)]))
    if dec is not None:
        steps = model._fixed_batch_steps if decode == "batch" else model._fixed_steps
        assert {type(f).__name__ for f in steps.values()} == {"SegmentedStep"}
    found = re.match(r"(layers\.(\d+)\.ffn\.experts\.\S+?)(?:, | \()expert (\d+)\)?: short read at "
                     r"byte \d+ of (\S+): got \d+ of \d+ bytes \(file truncated\?\)", str(info.value))
    assert found, str(info.value)
    tensor, layer, expert, file = found[1], int(found[2]), int(found[3]), Path(found[4])
    w, kind = tensor.split(".")[-2:]
    param = f"{w}.{'scales' if kind == 'scale' else kind}"
    p = store.pools[0].layers[layer].params[param]
    assert p.tensors[expert] == tensor and file == lost.file
    assert p.files[expert].parts[0][0] == lost.file and p.offsets[expert] + p.nbytes > cut
    store.close()
    for pool in store.pools:
        assert not pool.loading
        for slot in np.flatnonzero(pool.owner_layer >= 0):
            layer, e = pool.owner_layer[slot], pool.owner_expert[slot]
            assert pool.slot_of[layer][e] == slot
            param = next(iter(pool.layers[layer].params.values()))
            lies_past_the_cut = param.files[e].parts[0][0] == lost.file and param.offsets[e] >= cut
            assert not lies_past_the_cut or (pool, slot, layer, e) in read_before_the_cut


def filled_slots(store) -> set:
    """(pool, slot, layer, expert) of every filled slot."""
    return {(pool, slot, pool.owner_layer[slot], pool.owner_expert[slot])
            for pool in store.pools for slot in np.flatnonzero(pool.owner_layer >= 0)}


def test_io_error_names_tensor_and_expert(official, monkeypatch):
    model, _ = dsv4.load(official, expert_cache_gb=least_gb(official))
    store = model.expert_store
    p = store.pools[0].layers[4].params["w3.scales"]
    bad = int(p.offsets[5])
    with flags.override(expert_prefetch=False, expert_native_reads=False):   # os.preadv: Python's reads
        PreadLog(monkeypatch, fail=lambda fd, offset: offset == bad)
        with pytest.raises(expert_store.ExpertReadError,
                           match=r"layers\.4\.ffn\.experts\.5\.w3\.scale \(expert 5\): reading \d+ "
                                 r"bytes at byte \d+ of .* failed: Input/output error"):
            cache = model.make_cache()
            for t in range(200):
                model(np.array([[7 + t]]), cache)
        monkeypatch.undo()
    assert store.pools[0].slot_of[4][5] == -1           # not left half-written in use


def test_cache_smaller_than_one_token_is_refused(official):
    least = float(least_gb(official))
    with pytest.raises(expert_store.ExpertStoreError, match="too small.*the least --expert-cache-gb"):
        dsv4.load(official, expert_cache_gb=f"{least * 0.9:.9f}")
    with pytest.raises(expert_store.ExpertStoreError, match="expected a number of GB"):
        dsv4.load(official, expert_cache_gb="lots")


def test_stage_profile_counts_hits_misses_and_bytes_per_layer(official):
    model, tokenizer = dsv4.load(official, expert_cache_gb=least_gb(official))
    per_expert = model.expert_store.pools[0].expert_bytes
    with flags.override(stage_profile=True, async_decode=False):
        profiler.reset()
        out = list(dsv4.generation.stream_generate(model, tokenizer, prompt()[0].tolist()[:12],
                                                   max_tokens=9, ignore_eos=True))
        counts = profiler.per_step_counts()
        report = profiler.report()
    profiler.reset()
    assert len(out) == 9
    for layer in range(LAYERS):   # a decode step looks up one token's top-k in every layer
        hits, misses = counts[f"experts L{layer} hits"], counts[f"experts L{layer} misses"]
        assert hits + misses == pytest.approx(TOP_K)
        assert counts[f"experts L{layer} MB read"] == pytest.approx(misses * per_expert / 1e6)
    assert "experts L7 misses" in report


# --- the command lines ------------------------------------------------------------------------

def test_generate_option_streams_and_gives_the_resident_tokens(official, capsys):
    from dsv4 import generation

    outputs = []
    for extra in ([], ["--expert-cache-gb", least_gb(official)]):
        with pytest.raises(SystemExit) as done:
            generation.main(["--model", str(official), "--raw", "-p", "The quick brown fox", "-m", "16",
                             "--bench-json", *extra])
        assert not done.value.code
        outputs.append(capsys.readouterr().out)
    result = [json.loads(o.split("DSV4_RESULT ")[1].splitlines()[0]) for o in outputs]
    assert result[1]["tokens"] == result[0]["tokens"]
    assert "Experts: a 0.000" in outputs[1] and "% hits" in outputs[1] and "Experts:" not in outputs[0]


@pytest.mark.parametrize("value, expected", [("0", "expected a number of GB > 0"),
                                             ("-3", "expected a number of GB > 0"),
                                             ("1e-9", "too small")])
def test_generate_refuses_bad_cache_sizes_in_one_line(official, capsys, value, expected):
    from dsv4 import generation

    with pytest.raises(SystemExit) as done:
        generation.main(["--model", str(official), "-m", "2", "--expert-cache-gb", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0]


@pytest.mark.parametrize("command", ["dsv4.chat", "dsv4.server"])
def test_chat_and_server_take_the_option(command):
    import subprocess
    import sys

    help_text = subprocess.run([sys.executable, "-m", command, "--help"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "200"}).stdout
    assert "--expert-cache-gb" in help_text


def test_metal_pool_buffers_and_wired_limit(official, monkeypatch):
    """What attach asks of Metal, with Metal's answers stood in for (no Mac here): a pool buffer
    larger than max_buffer_length is refused with the size that fits, and a pool that fits
    gets the wired limit set to the recommended working set (MLX then keeps its buffers in
    residency sets)."""
    per_expert, _ = sizes(official)
    w1 = 64 * 64 // 2            # w1.weight of one expert: 64 x 64 fp4 codes, in bytes
    wired = []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_buffer_length": 20 * w1,
                                                     "max_recommended_working_set_size": 10 ** 9})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: wired.append(n) or 0)
    with pytest.raises(expert_store.ExpertStoreError, match=r"more than Metal's largest .*at most 20 slots"):
        dsv4.load(official, expert_cache_gb=f"{64 * per_expert / 1e9:.9f}")
    model, _ = dsv4.load(official, expert_cache_gb=f"{16 * per_expert / 1e9:.9f}")
    assert sum(p.slots for p in model.expert_store.pools) == 16 and wired == [10 ** 9]


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """A tiny checkpoint with DSpark draft stages."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("stream_draft") / "ckpt", seed=4, draft=True,
                                 config_overrides={"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K})


@pytest.mark.parametrize("verify", ["reference", "fixed", "segments"])
def test_speculation_streams_and_gives_plain_decodes_tokens(drafted, verify):
    """DSpark over streamed experts at the least cache gives plain decode's greedy tokens on the
    resident model, the verify over the Cache or at fixed shapes, op by op or as compiled
    segments (its k + 1 positions are one chunk, routed together:
    test_prefill_reads_each_selected_expert_once)."""
    from dsv4.generation import decode_tokens, prefill
    from dsv4.sampling import Sampling
    from dsv4.speculative import Policy, Stats, speculative_tokens

    path = drafted
    ids = prompt()
    with flags.override(draft="on"):
        resident, _ = dsv4.load(path)
        cache = resident.make_cache()
        sampler = lambda logits: mx.argmax(logits, axis=-1)
        want = list(decode_tokens(resident, cache, sampler(prefill(resident, ids, cache)), sampler, 48))
        streamed, _ = dsv4.load(path, expert_cache_gb=least_gb(path))
    cache, window = streamed.make_cache(), streamed.draft.make_cache()
    logits = prefill(streamed, ids, cache, draft_cache=window)
    stats = Stats()
    with flags.override(fixed_verify=verify != "reference", expert_step_segments=verify == "segments"):
        got = list(speculative_tokens(streamed, cache, window, logits, Sampling(), 48, Policy(3), stats))
    assert got == want
    assert stats.verifies > 0 and streamed.expert_store.totals().misses > 0
    streamed.expert_store.close()


def test_fixed_verify_through_segments_equals_resident(drafted):
    """FixedDecoder.feed (a speculative verify: 1-6 positions in one step, with the draft
    stages' inputs) and rewind over streamed experts at the least cache, as compiled segments:
    every position's logits and inputs bit-identical to the resident model's compiled verify."""
    rng = np.random.default_rng(3)
    schedule = [(int(n), int(rng.integers(0, n)), rng.integers(7, 500, (1, n))) for n in rng.integers(1, 7, 16)]
    runs = []
    for gb in (None, least_gb(drafted)):
        with flags.override(draft="on", compile=True, expert_step_segments=True):
            model, _ = dsv4.load(drafted, expert_cache_gb=gb)
            cache = model.make_cache()
            model(prompt()[:, :8], cache)
            dec = step.FixedDecoder(model, cache)
            out = []
            for n, back, chunk in schedule:
                logits, hidden = dec.feed(mx.array(chunk), hidden=True)
                assert len(hidden) == len(model.args.dspark_target_layer_ids)
                out += [np.array(logits)] + [np.array(h.astype(mx.float32)) for h in hidden]   # exact: bf16 in fp32
                dec.rewind(back)
        runs.append(out)
    assert {type(f).__name__ for f in model._fixed_steps.values()} == {"SegmentedStep"}
    assert model.expert_store.totals().misses > 0
    assert identical(runs[1], runs[0])
    model.expert_store.close()
