"""generate / stream_generate and the CLI on a tiny checkpoint."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np

import dsv4
from dsv4.generation import stream_generate


def test_greedy_stream_equals_manual_argmax(tiny_dir):
    model, tok = dsv4.load(tiny_dir)
    prompt = tok.encode("Simple is better than complex.")
    got = [r.token for r in stream_generate(model, tok, prompt, max_tokens=12)]
    cache = model.make_cache()
    logits = model(np.array([prompt]), cache)[0, -1]
    want = []
    for _ in range(12):
        want.append(int(mx.argmax(logits).item()))
        if want[-1] in tok.eos_token_ids:
            break
        logits = model(np.array([[want[-1]]]), cache)[0, -1]
    assert got == want


def test_stream_text_joins_to_decoded_tokens(tiny_dir):
    model, tok = dsv4.load(tiny_dir)
    responses = list(stream_generate(model, tok, "Errors should never", max_tokens=15, temp=0.9, seed=3))
    assert responses[-1].finish_reason in ("length", "stop")
    tokens = [r.token for r in responses if r.token not in tok.eos_token_ids]
    assert "".join(r.text for r in responses) == tok.decode(tokens)
    again = [r.token for r in stream_generate(model, tok, "Errors should never", max_tokens=15, temp=0.9, seed=3)]
    assert again == [r.token for r in responses]


def test_cli_streams_and_reports(tiny_dir):
    out = subprocess.run([sys.executable, "-m", "dsv4.generate", "--model", str(tiny_dir),
                          "--prompt", "Hello", "--max-tokens", "6", "--bench-json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Generation:" in out.stdout and "Peak memory:" in out.stdout
    line = [l for l in out.stdout.splitlines() if l.startswith("DSV4_RESULT ")][-1]
    result = json.loads(line.removeprefix("DSV4_RESULT "))
    assert result["generation_tokens"] == len(result["tokens"]) <= 6


def test_package_exports_the_functions_and_examples_run():
    import dsv4 as package

    assert callable(package.generate) and callable(package.stream_generate) and callable(package.load)
    from pathlib import Path

    root = Path(__file__).parent.parent
    for script in ("generate.py", "stream.py", "greedy_vs_sampled.py"):
        out = subprocess.run([sys.executable, str(root / "examples" / script)], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, f"{script}: {out.stderr[-2000:]}"
        assert out.stdout.strip(), script


def test_help_lists_every_switch():
    from dsv4 import flags

    out = subprocess.run([sys.executable, "-m", "dsv4.generate", "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0
    missing = [f.env for f in flags.FLAGS.values() if f.env not in out.stdout]
    assert not missing, missing


def test_prefill_takes_chunks_of_the_switch(tiny_dir):
    """DSV4_PREFILL_CHUNK sets the prefill's chunks; the last position's logits do not depend on them."""
    from dsv4 import flags
    from dsv4.generation import PREFILL_CHUNK, prefill, prefill_chunk

    model, tok = dsv4.load(tiny_dir)
    ids = np.array([tok.encode("Simple is better than complex. Flat is better than nested.")])
    seen = []
    forward = type(model).__call__
    model_calls = lambda self, chunk, *a, **k: seen.append(chunk.shape[1]) or forward(self, chunk, *a, **k)
    assert prefill_chunk() == PREFILL_CHUNK
    whole = prefill(model, ids, model.make_cache())
    with flags.override(prefill_chunk=5):
        type(model).__call__ = model_calls
        try:
            chunked = prefill(model, ids, model.make_cache())
        finally:
            type(model).__call__ = forward
    n = ids.shape[1]
    assert seen == [5] * (n // 5) + ([n % 5] if n % 5 else [])
    np.testing.assert_allclose(np.array(chunked), np.array(whole), rtol=1e-5, atol=1e-5)


def test_prefill_evaluated_layer_by_layer_gives_the_same_logits(tiny_dir, monkeypatch):
    """DSV4_PREFILL_EVAL_LAYERS evaluates each layer's streams and pre on their own: the same values."""
    from dsv4 import flags
    from dsv4.generation import prefill

    model, tok = dsv4.load(tiny_dir)
    ids = np.array([tok.encode("Simple is better than complex. Flat is better than nested.")])
    chunks = -(-ids.shape[1] // 7)
    whole = np.array(prefill(model, ids, model.make_cache(), chunk=7))
    for how, name in (("async", "async_eval"), ("sync", "eval")):
        evaluated, real = [], getattr(mx, name)
        monkeypatch.setattr(mx, name, lambda *a: evaluated.append(len(a)) or real(*a))
        with flags.override(prefill_eval_layers=how):
            got = np.array(prefill(model, ids, model.make_cache(), chunk=7))
        monkeypatch.setattr(mx, name, real)
        assert evaluated.count(2) == model.args.num_hidden_layers * chunks   # (streams, pre) per layer
        np.testing.assert_array_equal(got, whole)


def test_prefill_defaults_follow_the_backend():
    """auto: CUDA prefills in chunks of CUDA_PREFILL_CHUNK evaluated layer by layer (async), the
    others in chunks of PREFILL_CHUNK as one graph; the switches still override."""
    from dsv4 import flags
    from dsv4.attention import ForwardState
    from dsv4.generation import CUDA_PREFILL_CHUNK, PREFILL_CHUNK, prefill_chunk
    from dsv4.kernels import dialect
    from dsv4.model import layer_evaluation

    state = ForwardState.__new__(ForwardState)   # only its type matters here
    assert prefill_chunk() == PREFILL_CHUNK and layer_evaluation(state, (1, 64)) is None
    with dialect.pretend_gpu("cuda", None):
        assert prefill_chunk() == CUDA_PREFILL_CHUNK
        assert layer_evaluation(state, (1, 64)) is mx.async_eval
        assert layer_evaluation(state, (1, 1)) is None                 # a decode step: one graph
        assert layer_evaluation(state, (4, 1)) is None                 # a batch of them
        assert layer_evaluation(state, (1, 6)) is None                 # a draft's verification
        with flags.override(prefill_chunk=300, prefill_eval_layers="off"):
            assert prefill_chunk() == 300 and layer_evaluation(state, (1, 64)) is None
    with dialect.pretend_gpu("metal", None):
        assert prefill_chunk() == PREFILL_CHUNK and layer_evaluation(state, (1, 64)) is None
