"""`python -m dsv4.generate` on bad input: one `error:` line, exit status 2, no traceback, and
no minutes of loading before it (options and switches are checked first). And the numbers
its stats line reports are the true ones."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4 import generation
from dsv4.safetensors_file import read_header, view, write


def run_cli(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        generation.main(argv)
    out, err = capsys.readouterr()
    return exit_.value.code or 0, out, err


def assert_one_line_error(code, err, pattern):
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(pattern, lines[0]), lines[0]


@pytest.fixture(scope="module")
def converted(tiny_dir, tmp_path_factory):
    from dsv4_convert.official import convert

    dst = tmp_path_factory.mktemp("cli") / "model"
    convert(tiny_dir, dst, progress=False, log=lambda line: None)
    return dst


def broken_copy(converted, tmp_path, change) -> Path:
    model = tmp_path / "model"
    shutil.copytree(converted, model)
    change(model)
    return model


def shard(model: Path) -> Path:
    return sorted(model.glob("model-*.safetensors"))[0]


def rewrite_shard(model: Path, edit) -> None:
    tensors, meta = read_header(shard(model))
    arrays = {n: (i.dtype, np.array(view(i))) for n, i in tensors.items()}
    edit(arrays)
    write(shard(model), arrays, meta)


def drop_tensor(model: Path, name: str = "layers.0.attn.wkv.weight") -> None:
    rewrite_shard(model, lambda arrays: arrays.pop(name))
    index = model / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].pop(name)
    index.write_text(json.dumps(data))


def integer_weight(model: Path) -> None:   # a float tensor stored as packed integers
    def edit(arrays):
        dtype, a = arrays["layers.0.attn.kv_norm.weight"]
        arrays["layers.0.attn.kv_norm.weight"] = ("U32", np.zeros(a.shape, np.uint32))
    rewrite_shard(model, edit)


BROKEN_MODELS = {
    "empty config": (lambda m: (m / "config.json").write_text(""), r"config\.json: not valid JSON"),
    "corrupt config": (lambda m: (m / "config.json").write_text('{"vocab_size": '), r"config\.json: not valid JSON"),
    "config not an object": (lambda m: (m / "config.json").write_text("[1, 2]"), r"config\.json: expected a JSON object"),
    "config missing fields": (lambda m: (m / "config.json").write_text("{}"), r"config\.json: missing field"),
    "truncated shard": (lambda m: os.truncate(shard(m), shard(m).stat().st_size - 64), r"truncated: tensor"),
    "shard cut to its header": (lambda m: os.truncate(shard(m), 1000), r"does not fit"),
    "missing tensor": (drop_tensor, r"missing tensor\(s\) \['layers\.0\.attn\.wkv\.weight'\]"),
    "wrong dtype": (integer_weight, r"layers\.0\.attn\.kv_norm\.weight is uint32, expected floats"),
    "no tokenizer": (lambda m: (m / "tokenizer.json").unlink(), r"tokenizer\.json: not found"),
    "bad tokenizer": (lambda m: (m / "tokenizer.json").write_text("{}"), r"tokenizer\.json: not a tokenizer file"),
    "missing shard": (lambda m: shard(m).unlink(), r"lists shards that are missing"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_MODELS))
def test_a_broken_model_directory_is_one_line(case, converted, tmp_path, capsys):
    change, pattern = BROKEN_MODELS[case]
    model = broken_copy(converted, tmp_path, change)
    code, _, err = run_cli(["--model", str(model), "-m", "2"], capsys)
    assert_one_line_error(code, err, pattern)


@pytest.mark.parametrize("argv,pattern", [
    (["-m", "0"], r"--max-tokens=0: expected an integer >= 1"),
    (["-m", "-4"], r"--max-tokens=-4"),
    (["--temp", "-1"], r"--temp=-1\.0"),
    (["--temp", "nan"], r"--temp=nan: expected a finite number"),
    (["--top-p", "0"], r"--top-p=0\.0: expected a number > 0 and <= 1"),
    (["--top-p", "1.01"], r"--top-p"),
    (["--seed", "-2"], r"--seed=-2"),
    (["--raw", "--prompt", ""], r"the prompt is empty"),
    (["--model", "./nothere"], r"\./nothere: no such directory"),
    (["--model", "~/surely-not-a-dsv4-model-dir"], r"surely-not-a-dsv4-model-dir: no such directory"),
])
def test_bad_options_are_one_line(argv, pattern, capsys, monkeypatch):
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("sent to the hub"))
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, pattern)


@pytest.mark.parametrize("env,pattern", [
    ({"DSV4_KV_QDQ": "maybe"}, r"DSV4_KV_QDQ='maybe': expected one of 0/1"),
    ({"DSV4_ENGRAM_DECODE_WORKERS": "abc"}, r"DSV4_ENGRAM_DECODE_WORKERS='abc': expected an integer"),
    ({"DSV4_ENGRAM_DECODE_WORKERS": "0"}, r"expected an integer >= 1"),
    ({"DSV4_HEAD_QUANT": "foo"}, r"DSV4_HEAD_QUANT='foo': expected one of off, mxfp8, affine8"),
    ({"DSV4_FIXED_DECODE": "sometimes"}, r"DSV4_FIXED_DECODE='sometimes': expected one of auto"),
])
def test_bad_switch_values_are_one_line_before_loading(env, pattern, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("dsv4.loader.load", lambda *a, **k: pytest.fail("loaded before checking the switches"))
    code, _, err = run_cli(["-m", "2"], capsys)
    assert_one_line_error(code, err, pattern)


def test_an_unknown_switch_is_warned_about(capsys, monkeypatch):
    monkeypatch.setenv("DSV4_KERNEL_MOEE", "0")
    code, out, err = run_cli(["-m", "2"], capsys)
    assert code == 0
    assert "warning: DSV4_KERNEL_MOEE is not a dsv4 switch (did you mean DSV4_KERNEL_MOE?)" in err


def test_local_looking_paths_never_reach_the_hub(tmp_path, monkeypatch):
    from dsv4.errors import InputError
    from dsv4.loader import resolve

    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("sent to the hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "afile").write_text("x")
    for text in ("./q2", "/no/such/model", "~/no-such-model", "models/q2-typo", "a/b/c", "afile", "x/"):
        with pytest.raises(InputError):
            resolve(text)
    calls = []
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo, **k: calls.append(repo) or str(tmp_path))
    resolve("deepseek-ai/DeepSeek-V4.1-Flash")
    assert calls == ["deepseek-ai/DeepSeek-V4.1-Flash"]


def test_hub_failure_is_one_line(capsys, monkeypatch):
    def offline(repo, **kwargs):
        from huggingface_hub.errors import LocalEntryNotFoundError
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub.\nmore")
    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    code, _, err = run_cli(["--model", "someone/not-here"], capsys)
    assert_one_line_error(code, err, r"someone/not-here: no such directory here, and not found on the Hugging Face hub")


def test_stats_line_is_honest(tiny_dir, capsys):
    code, out, err = run_cli(["--model", str(tiny_dir), "-m", "1"], capsys)
    assert code == 0, err
    assert "0.000 tokens-per-sec" not in out and "Generation: 1 token (" in out
    assert re.search(r"^Load: [0-9.]+ s", out, re.M)
    peak = re.search(r"Peak memory: ([0-9.]+) GB \(process peak RSS\)", out)
    assert peak and float(peak.group(1)) * 1e9 >= resident_bytes() * 0.5   # the process's, not MLX's 0.007


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_loading_makes_the_dense_copies_first_use_would(tiny_dir):
    """The CPU's dense copies of quantized weights (what made a cold prefill 3x slower than a
    warm one) are made by load, also for layers a short prompt does not reach."""
    import dsv4
    from dsv4.linear import QuantizedLinear

    model, tok = dsv4.load(tiny_dir)

    def copies():
        return {(name, key) for name, m in model.named_modules() if isinstance(m, QuantizedLinear)
                for key in m.__dict__.get("_derived", {})}

    made = copies()
    assert made
    generation.warm_up(model)
    list(generation.stream_generate(model, tok, list(range(3, 200)), max_tokens=3))
    assert copies() == made


def test_long_prompts_show_prefill_progress(tiny_dir):
    prompt = " ".join(f"w{i % 50}" for i in range(300))
    out = subprocess.run([sys.executable, "-m", "dsv4.generate", "--model", str(tiny_dir), "--raw",
                          "--prompt", prompt, "-m", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"prefill: \d+ of \d+ tokens \(100%\)", out.stderr), out.stderr
    assert "Traceback" not in out.stderr
