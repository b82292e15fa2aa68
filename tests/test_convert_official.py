"""Official checkpoint -> dsv4 model directory (convert/official.py, convert/__main__.py).

Oracles: the `safetensors` library's reader for what was written, `dsv4.layout.plan` for what
must be written, a numpy transcription of e4m3/e2m1 * 2**(e8m0 - 127) for the values, and the
source files' own bytes for everything copied.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors import deserialize
from typer.testing import CliRunner

from dsv4 import safetensors_file as sf
from dsv4.config import ModelArgs
from dsv4.layout import plan
from dsv4.testing import to_bf16_bits, write_sharded, write_tiny_checkpoint
from dsv4_convert import official
from dsv4_convert.__main__ import app
from dsv4_convert.official import Requant, convert
from dsv4_convert.writer import ConversionError
from tests.formats import e2m1_packed_value, e4m3_value, e8m0_scale


def load_file(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a file, parsed by the safetensors library, in numpy storage dtypes."""
    return {name: np.frombuffer(t["data"], sf.STORAGE[t["dtype"]]).reshape(t["shape"])
            for name, t in deserialize(Path(path).read_bytes())}


def fp8_source_value(codes, block_scales):
    """Official fp8 weight [out, in] with 32x32 e8m0 block scales -> float64."""
    s = np.repeat(np.repeat(2.0 ** (block_scales.astype(np.int64) - 127), 32, 0), 32, 1)
    return e4m3_value(codes) * s[:codes.shape[0], :codes.shape[1]]


def fp4_source_value(packed, scales):
    """Official fp4 expert [out, in/2] (low nibble first) with e8m0 per 32 -> float64."""
    return e2m1_packed_value(packed) * np.repeat(e8m0_scale(scales), 32, 1)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("official") / "src", seed=3)


def _copy(source: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(source, dst)
    return dst


def _read_weights(directory: Path, index: str = "model.safetensors.index.json") -> dict:
    weight_map = json.loads((directory / index).read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        loaded = load_file(directory / file)
        assert {n for n, f in weight_map.items() if f == file} == set(loaded), file
        out.update(loaded)
    return out


def _add_shard(src: Path, file: str, tensors: dict) -> None:
    """Add a shard to a checkpoint with an index (as MTP/vision shards lie in the real one)."""
    sf.write(src / file, tensors)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({n: file for n in tensors})
    index_path.write_text(json.dumps(index))


def _edit_tensor(src: Path, name: str, change) -> None:
    """Rewrite the shard holding `name` with `change(dtype, array)` -> (dtype, array) or None."""
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = index["weight_map"][name]
    infos, _ = sf.read_header(src / file)
    tensors = {n: (i.dtype, np.array(sf.view(i))) for n, i in infos.items()}
    new = change(*tensors.pop(name))
    if new is None:
        del index["weight_map"][name]
    else:
        tensors[name] = new
    sf.write(src / file, tensors)
    index_path.write_text(json.dumps(index))


def _only(tmp_path: Path, *names: str) -> None:
    """Nothing but `names` is left in tmp_path (no partial output)."""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


# --- lossless ------------------------------------------------------------------------------

def test_lossless_directory_holds_the_plan_and_exact_values(source, tmp_path):
    dst = tmp_path / "out"
    result = convert(source, dst, verify=True, progress=False)
    config = json.loads((dst / "config.json").read_text())
    src_config = json.loads((source / "config.json").read_text())
    args = ModelArgs.from_dict(src_config)
    ckpt = sf.Checkpoint(source)
    items = plan(ckpt, args)
    weights = _read_weights(dst)

    expected = {}
    for item in items:
        for name, (dtype, array) in item.produce().items():
            expected[name] = array
    assert set(weights) == set(expected)
    for name, array in expected.items():
        assert weights[name].shape == array.shape and weights[name].tobytes() == array.tobytes(), name
    vision = load_file(dst / "vision.safetensors")
    assert result.verified_tensors == len(expected) + len(vision)

    # quantization block: the mode each module has in the plan; plain tensors have no scales
    q = config["quantization"]
    for item in items:
        if item.quantization is None:
            assert f"{item.name.removesuffix('.weight')}.scales" not in weights
        else:
            got = q.get(item.name, {k: q[k] for k in ("group_size", "bits", "mode")})
            assert got == item.quantization, item.name
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v41"
    assert config["hidden_size"] == src_config["text_config"]["hidden_size"]
    assert config["dsv4"]["format_version"] == 1
    assert config["dsv4"]["source"] == {"kind": "official", "repo": None, "revision": None,
                                        "path": str(source.resolve())}

    # values: MLX's dequantization of the written packing equals the official formula
    m = "layers.2.attn.wq_b"
    got = mx.dequantize(mx.array(weights[f"{m}.weight"]), mx.array(weights[f"{m}.scales"]),
                        group_size=32, bits=8, mode="mxfp8", dtype=mx.float32)
    want = fp8_source_value(sf.view(ckpt[f"{m}.weight"]), sf.view(ckpt[f"{m}.scale"]))
    assert np.array_equal(np.array(got), want)
    m = "layers.5.ffn.experts.w2"
    got = mx.dequantize(mx.array(weights[f"{m}.weight"]), mx.array(weights[f"{m}.scales"]),
                        group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    e = 6
    want = fp4_source_value(sf.view(ckpt[f"layers.5.ffn.experts.{e}.w2.weight"]),
                            sf.view(ckpt[f"layers.5.ffn.experts.{e}.w2.scale"]))
    assert np.array_equal(np.array(got)[e], want)

    # tokenizer copied, vision routing bias in its own file, no mtp file (the source has none)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (source / name).read_bytes()
    assert set(vision) == {n for n in ckpt.names() if n.endswith("gate.bias_vl")}
    assert not list(dst.glob("mtp*"))
    _only(tmp_path, "out")


def test_engram_references_point_at_the_source_rows(source, tmp_path):
    from dsv4.engram_store import open_table

    dst = tmp_path / "out"
    convert(source, dst, progress=False)
    refs = json.loads((dst / "config.json").read_text())["dsv4"]["engram"]
    weights = _read_weights(source)
    assert sorted(refs) == ["1", "3"]
    for layer, ref in refs.items():
        assert Path(ref["weight"]["file"]).is_absolute()
        codes = weights[f"layers.{layer}.engram.embed.weight"].view(np.uint8)
        scales = weights[f"layers.{layer}.engram.embed.scale"].view(np.uint8)
        rows = np.array([0, 5, ref["rows"] - 1])
        with open_table(ref, dst, head_dim=256) as table:
            raw = table.read_raw(rows)
        assert ref["rows"] == codes.shape[0]
        assert np.array_equal(raw[:, :256], codes[rows]) and np.array_equal(raw[:, 256:], scales[rows])


def test_copy_engram_writes_self_contained_tables(source, tmp_path):
    from dsv4.engram_store import open_table

    dst = tmp_path / "out"
    convert(source, dst, copy_engram=True, progress=False)
    refs = json.loads((dst / "config.json").read_text())["dsv4"]["engram"]
    weights = _read_weights(source)
    for layer, ref in refs.items():
        assert ref == {"layout": "interleaved264", "file": f"engram-{int(layer):02d}.bin",
                       "offset": 0, "rows": weights[f"layers.{layer}.engram.embed.weight"].shape[0]}
        raw = np.fromfile(dst / ref["file"], np.uint8).reshape(ref["rows"], 264)
        assert np.array_equal(raw[:, :256], weights[f"layers.{layer}.engram.embed.weight"].view(np.uint8))
        assert np.array_equal(raw[:, 256:], weights[f"layers.{layer}.engram.embed.scale"].view(np.uint8))
        with open_table(ref, dst, head_dim=256) as table:
            assert table.rows == ref["rows"]


def test_mtp_and_vision_go_to_their_own_files_or_are_dropped(source, tmp_path):
    src = _copy(source, tmp_path)
    rng = np.random.default_rng(0)
    mtp = {"mtp.0.enorm.weight": ("BF16", rng.integers(0, 2**16, (64,), dtype=np.uint16)),
           "mtp.0.e_proj.weight": ("F8_E4M3", rng.integers(0, 0x7E, (64, 64), dtype=np.uint8)),
           "mtp.0.e_proj.scale": ("F8_E8M0", rng.integers(120, 130, (2, 2), dtype=np.uint8))}
    vision = {"vision.patch_embed.weight": ("F32", rng.normal(size=(8, 12)).astype(np.float32)),
              "aligner.proj.weight": ("F32", rng.normal(size=(4, 8)).astype(np.float32)),
              "image_newline": ("F32", rng.normal(size=(64,)).astype(np.float32))}
    _add_shard(src, "model-mtp.safetensors", mtp)
    _add_shard(src, "model-vision.safetensors", vision)
    out = tmp_path / "out"
    convert(src, out, progress=False)
    got = load_file(out / "mtp.safetensors")
    assert {n: a.tobytes() for n, a in got.items()} == {n: a.tobytes() for n, (_, a) in mtp.items()}
    got = load_file(out / "vision.safetensors")
    assert set(got) == set(vision) | {f"layers.{i}.ffn.gate.bias_vl" for i in range(8)}
    assert got["image_newline"].tobytes() == vision["image_newline"][1].tobytes()
    assert not set(_read_weights(out)) & (set(mtp) | set(got))  # mlx-lm never sees them
    assert [p.name for p in out.glob("model*.safetensors")] == ["model-00001-of-00001.safetensors"]

    dropped = tmp_path / "dropped"
    convert(src, dropped, drop_mtp=True, drop_vision=True, progress=False)
    assert not list(dropped.glob("mtp*")) and not list(dropped.glob("vision*"))
    assert _read_weights(dropped).keys() == _read_weights(out).keys()


def test_shards_respect_the_size_limit(source, tmp_path):
    dst = tmp_path / "out"
    result = convert(source, dst, max_shard_bytes=300_000, progress=False)
    files = sorted(dst.glob("model-*.safetensors"))
    assert result.shards == len(files) > 3
    for f in files:
        # a shard above the limit holds a single module (an item larger than the limit)
        names = {n.rsplit(".", 1)[0] for n in load_file(f)}
        assert sum(a.nbytes for a in load_file(f).values()) <= 300_000 or len(names) == 1
    convert(source, tmp_path / "one", progress=False)
    one = _read_weights(tmp_path / "one")
    assert {n: a.tobytes() for n, a in _read_weights(dst).items()} == {n: a.tobytes() for n, a in one.items()}


# --- requantization -------------------------------------------------------------------------

def test_requantized_experts_and_dense_report_their_true_error(source, tmp_path):
    dst = tmp_path / "out"
    result = convert(source, dst, experts=Requant(4, 64), dense=Requant(8, 32), verify=True,
                     progress=False)
    config = json.loads((dst / "config.json").read_text())
    weights = _read_weights(dst)
    ckpt = sf.Checkpoint(source)
    q = config["quantization"]

    def quant(module):
        return q.get(module, {k: q[k] for k in ("group_size", "bits", "mode")})

    sums = {}
    for layer in range(8):
        for kind in ("ffn.experts.w1", "ffn.experts.w2", "attn.wq_a", "attn.wo_b",
                     "ffn.shared_experts.w2"):
            m = f"layers.{layer}.{kind}"
            qm = quant(m)
            assert qm == ({"group_size": 64, "bits": 4, "mode": "affine"} if "experts.w" in kind
                          and "shared" not in kind else {"group_size": 32, "bits": 8, "mode": "affine"})
            bf16 = {k: mx.array(weights[f"{m}.{k}"]).view(mx.bfloat16).astype(mx.float32)
                    for k in ("scales", "biases")}
            got = np.array(mx.dequantize(
                mx.array(weights[f"{m}.weight"]), bf16["scales"], bf16["biases"],
                group_size=qm["group_size"], bits=qm["bits"], mode="affine",
                dtype=mx.float32)).astype(np.float64)
            if "experts.w" in kind and "shared" not in kind:
                want = np.stack([fp4_source_value(sf.view(ckpt[f"layers.{layer}.ffn.experts.{e}.{kind[-2:]}.weight"]),
                                                  sf.view(ckpt[f"layers.{layer}.ffn.experts.{e}.{kind[-2:]}.scale"]))
                                 for e in range(8)])
            else:
                want = fp8_source_value(sf.view(ckpt[f"{m}.weight"]), sf.view(ckpt[f"{m}.scale"]))
            s = sums.setdefault(kind, [0.0, 0.0])
            s[0] += np.sum((got - want) ** 2)
            s[1] += np.sum(want ** 2)
    for kind, (e2, r2) in sums.items():
        true = (e2 / r2) ** 0.5
        assert result.requant_errors[kind] == pytest.approx(true, rel=1e-4), kind
        assert 0 < true < (0.12 if "experts.w" in kind and "shared" not in kind else 0.01)
    recorded = config["dsv4"]["requantization"]
    assert recorded["experts"]["bits"] == 4 and recorded["dense"]["group_size"] == 32
    assert recorded["experts"]["relative_error"]["ffn.experts.w1"] == result.requant_errors["ffn.experts.w1"]
    assert "ffn.experts.w1" not in recorded["dense"]["relative_error"]
    # plain tensors untouched
    assert weights["layers.0.attn_norm.weight"].tobytes() == sf.view(ckpt["layers.0.attn_norm.weight"]).tobytes()


@pytest.mark.parametrize("bits,group", [(5, 64), (4, 48)])
def test_requant_options_are_checked(bits, group):
    with pytest.raises(ConversionError, match="must be one of"):
        Requant(bits, group)


# --- resume ---------------------------------------------------------------------------------

_KILLER = textwrap.dedent("""
    import os, signal, sys
    from dsv4_convert import official
    real_plan = official.plan
    def plan(ckpt, args):
        items = real_plan(ckpt, args)
        victim = items[int(sys.argv[3])]
        real = victim.produce
        def produce():
            os.kill(os.getpid(), signal.SIGKILL)   # killed: no handler, no cleanup runs
        victim.produce = produce
        return items
    official.plan = plan
    official.convert(sys.argv[1], sys.argv[2], max_shard_bytes=400_000, progress=False)
""")


def _tree(path: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_resume_after_a_kill_gives_the_same_directory(source, tmp_path):
    reference = tmp_path / "reference"
    convert(source, reference, max_shard_bytes=400_000, progress=False)
    shards = sorted(reference.glob("model-*.safetensors"))
    assert len(shards) >= 4
    dst = tmp_path / "out"
    victim = len(plan(sf.Checkpoint(source), ModelArgs.from_dict(
        json.loads((source / "config.json").read_text())))) * 3 // 4
    run = subprocess.run([sys.executable, "-c", _KILLER, str(source), str(dst), str(victim)],
                         capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    partial = tmp_path / ".out.partial"
    finished = sorted(p.name for p in partial.glob("model-*.safetensors"))
    assert 1 <= len(finished) < len(shards)
    assert not dst.exists()
    before = {f: (partial / f).stat().st_mtime_ns for f in finished}
    with pytest.raises(ConversionError, match="--resume"):
        convert(source, dst, max_shard_bytes=400_000, progress=False)
    convert(source, dst, max_shard_bytes=400_000, progress=False, resume=True)
    assert {f: (dst / f).stat().st_mtime_ns for f in finished} == before  # not written again
    assert _tree(dst) == _tree(reference)
    _only(tmp_path, "reference", "out")


def test_resume_refuses_other_options(source, tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        real = official.requantized_unit

        def interrupted(item, spec):
            unit = real(item, spec)
            if item.name == "layers.7.ffn.experts.w3":
                def stop():
                    raise KeyboardInterrupt
                unit.produce = stop
            return unit
        official.requantized_unit = interrupted
        try:
            convert(source, dst, experts=Requant(4, 64), max_shard_bytes=300_000, progress=False)
        finally:
            official.requantized_unit = real
    with pytest.raises(ConversionError, match="experts"):
        convert(source, dst, experts=Requant(2, 64), max_shard_bytes=300_000, resume=True,
                progress=False)
    result = convert(source, dst, experts=Requant(4, 64), max_shard_bytes=300_000, resume=True,
                     progress=False)
    # the errors of units written before the interruption come back from the shards' metadata
    full = convert(source, tmp_path / "full", experts=Requant(4, 64), progress=False)
    assert result.requant_errors == pytest.approx(full.requant_errors, rel=1e-12)
    assert _read_weights(dst).keys() == _read_weights(tmp_path / "full").keys()


# --- bad input --------------------------------------------------------------------------------

def _bad(tmp_path, source, edit, match):
    src = _copy(source, tmp_path)
    edit(src)
    with pytest.raises(ValueError, match=match):
        convert(src, tmp_path / "out", progress=False)
    _only(tmp_path, "src")


def test_missing_shard(source, tmp_path):
    _bad(tmp_path, source, lambda s: (s / "model-00002-of-00003.safetensors").unlink(),
         r"model-00002-of-00003.safetensors")


def test_missing_tensor(source, tmp_path):
    _bad(tmp_path, source, lambda s: _edit_tensor(s, "layers.4.attn.wkv.scale", lambda d, a: None),
         r"tensor layers\.4\.attn\.wkv\.scale is missing")


def test_extra_tensor(source, tmp_path):
    _bad(tmp_path, source,
         lambda s: _add_shard(s, "extra.safetensors", {"layers.2.attn.surprise": ("F32", np.zeros(3, np.float32))}),
         r"extra\.safetensors: unexpected tensor layers\.2\.attn\.surprise")


def test_shape_mismatch(source, tmp_path):
    _bad(tmp_path, source,
         lambda s: _edit_tensor(s, "layers.3.attn.q_norm.weight", lambda d, a: (d, a[:16])),
         r"tensor layers\.3\.attn\.q_norm\.weight is BF16\[16\], expected BF16\[32\]")


def test_dtype_mismatch(source, tmp_path):
    _bad(tmp_path, source,
         lambda s: _edit_tensor(s, "norm.weight", lambda d, a: ("F16", a.view(np.float16))),
         r"tensor norm\.weight is F16\[64\], expected BF16\[64\]")


def _as_float(src, module, shape):
    _edit_tensor(src, f"{module}.weight", lambda d, a: ("BF16", np.zeros(shape, np.uint16)))
    _edit_tensor(src, f"{module}.scale", lambda d, a: None)


def test_a_stack_of_fp4_and_float_experts(source, tmp_path):
    _bad(tmp_path, source, lambda s: _as_float(s, "layers.3.ffn.experts.5.w1", (64, 64)),
         r"layers\.3\.ffn\.experts\.w1: the experts of one stack must all be fp4 with their "
         r"\.scale or all BF16, or all F32; layers\.3\.ffn\.experts\.5\.w1\.weight is BF16, "
         r"layers\.3\.ffn\.experts\.0\.w1\.weight is I8")


def test_a_float_weight_of_the_wrong_shape(source, tmp_path):
    _bad(tmp_path, source, lambda s: _as_float(s, "layers.2.attn.wq_a", (32, 32)),
         r"tensor layers\.2\.attn\.wq_a\.weight is BF16\[32, 32\], expected F8_E4M3\[32, 64\] "
         r"with its \.scale, or BF16/F32\[32, 64\] without one")


def test_truncated_shard(source, tmp_path):
    def cut(src):
        path = src / "model-00003-of-00003.safetensors"
        os.truncate(path, path.stat().st_size - 100)
    _bad(tmp_path, source, cut, r"model-00003-of-00003\.safetensors: truncated: tensor \S+ ends at")


def test_missing_config(source, tmp_path):
    _bad(tmp_path, source, lambda s: (s / "config.json").unlink(), r"config\.json: not found")


def test_destination_exists(source, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    for overwrite in (False, True):  # not a dsv4 model directory: never replaced
        with pytest.raises(ConversionError, match=r"already exists \(use --overwrite|"
                                                  r"not a dsv4 model directory"):
            convert(source, dst, overwrite=overwrite, progress=False)
        assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]
        _only(tmp_path, "out")
    (dst / "keep.txt").unlink()
    convert(source, dst, drop_vision=True, overwrite=True, progress=False)  # empty: nothing lost
    assert not (dst / "vision.safetensors").exists()
    convert(source, dst, overwrite=True, progress=False)  # an earlier output: replaced
    assert (dst / "vision.safetensors").is_file()
    _only(tmp_path, "out")


def _tree_under(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("dst", ["models/src", "models", "models/src/out", "models/src-link"])
def test_overwrite_never_touches_the_source(source, tmp_path, dst):
    models = tmp_path / "models"
    src = _copy(source, models)
    (src / "NOTES.md").write_text("my notes on this checkpoint")
    (models / "other-model").mkdir()
    (models / "other-model" / "weights.bin").write_bytes(b"another model")
    (models / "src-link").symlink_to(src)
    before = _tree_under(tmp_path)
    run = CliRunner().invoke(app, ["official", str(src), str(tmp_path / dst), "--overwrite",
                                   "--quiet"])
    assert run.exit_code == 2, run.output
    assert run.output.startswith("error: ") and run.output.count("\n") == 1, run.output
    assert "the conversion reads or its result references" in run.output
    assert _tree_under(tmp_path) == before


def test_destination_that_is_a_file(source, tmp_path):
    dst = tmp_path / "afile"
    dst.write_text("not a model")
    run = CliRunner().invoke(app, ["official", str(source), str(dst), "--overwrite", "--quiet"])
    assert run.exit_code == 2 and run.output == f"error: {dst} is a file, not a model " \
                                                 f"directory: choose another destination\n"
    assert dst.read_text() == "not a model"
    _only(tmp_path, "afile")


# --- Hugging Face source ---------------------------------------------------------------------

def test_repo_id_downloads_only_the_needed_files(source, tmp_path, monkeypatch):
    import fnmatch

    import huggingface_hub

    origin = _copy(source, tmp_path / "origin")
    _add_shard(origin, "model-mtp.safetensors",
               {"mtp.0.enorm.weight": ("BF16", np.zeros(64, np.uint16))})
    (origin / "README.md").write_text("not needed")
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-V4.1-Flash" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, list(allow_patterns)))
        for f in origin.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    dst = tmp_path / "out"
    convert("deepseek-ai/DeepSeek-V4.1-Flash", dst, revision="main", drop_mtp=True, progress=False)
    assert [c[:2] for c in calls] == [("deepseek-ai/DeepSeek-V4.1-Flash", "main")]
    # weights, index, config and tokenizer files; not the README (nor code, docs, images)
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [
            "model-mtp.safetensors", "config.json", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json"])
    assert not list(dst.glob("mtp*"))
    config = json.loads((dst / "config.json").read_text())
    assert config["dsv4"]["source"] == {"kind": "official", "repo": "deepseek-ai/DeepSeek-V4.1-Flash",
                                        "revision": revision, "path": str(snapshot)}


def test_repo_that_cannot_be_fetched(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kw):
        raise OSError("Network is unreachable")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConversionError, match="org/missing: not a local directory, and fetching "
                                              "it .* failed: OSError: Network is unreachable"):
        convert("org/missing", tmp_path / "out", progress=False)
    _only(tmp_path)


def test_source_that_is_neither_directory_nor_repo(tmp_path):
    with pytest.raises(ConversionError, match="no such directory, and not a Hugging Face repo id"):
        convert(str(tmp_path / "nope" / "deeper" / "x"), tmp_path / "out", progress=False)


# --- command line -----------------------------------------------------------------------------

def test_cli_official_and_its_errors(source, tmp_path):
    runner = CliRunner()
    dst = tmp_path / "out"
    ok = runner.invoke(app, ["official", str(source), str(dst), "--quiet", "--verify",
                             "--experts-bits", "4", "--experts-group-size", "32", "--shard-gb", "0.001"])
    assert ok.exit_code == 0, ok.output
    assert "requantization error of ffn.experts.w1" in ok.output and "verified" in ok.output
    assert len(list(dst.glob("model-*.safetensors"))) > 1
    again = runner.invoke(app, ["official", str(source), str(dst), "--quiet"])
    assert again.exit_code == 2 and again.output == f"error: {dst} already exists (use " \
                                                    f"--overwrite to replace it)\n"
    bad = runner.invoke(app, ["official", str(source), str(tmp_path / "x"), "--dense-bits", "5"])
    assert bad.exit_code == 2 and bad.output == "error: requantization bits must be one of " \
                                                "(2, 3, 4, 8), got 5\n"


def test_cli_delegates_gguf_and_exl3(monkeypatch):
    import types

    runner = CliRunner()
    seen = []
    fake = types.ModuleType("dsv4_convert.gguf")

    def gguf_command(src: str, dst: str, bits: int = 4):
        seen.append((src, dst, bits))
    fake.gguf_command = gguf_command
    monkeypatch.setitem(sys.modules, "dsv4_convert.gguf", fake)
    run = runner.invoke(app, ["gguf", "a.gguf", "out", "--bits", "2"])
    assert run.exit_code == 0, run.output
    assert seen == [("a.gguf", "out", 2)]

    import importlib
    real_import = importlib.import_module

    def missing(name, *a):
        if name == "dsv4_convert.exl3":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *a)
    monkeypatch.setattr(importlib, "import_module", missing)
    run = runner.invoke(app, ["exl3", "x", "y"])
    assert run.exit_code == 2 and "exl3 converter is not available yet" in run.output


# --- a dequantised upload (BF16 / F32, no .scale) ------------------------------------------------

def dequantised(source: Path, dst: Path, dtype: str) -> Path:
    """The checkpoint as dequantised uploads store it: every fp8/fp4 weight and Engram table
    as `dtype` values (exact: bf16 holds every e4m3/e2m1 value times a power of two), no
    `.scale` tensors, no quantization_config; with F32 also every BF16 tensor as F32."""
    ckpt = sf.Checkpoint(source)
    tensors = {}
    for name, info in ckpt.tensors.items():
        scale = ckpt.tensors.get(f"{name.removesuffix('.weight')}.scale")
        if name.endswith(".scale"):
            continue
        stored = sf.view(info)
        if info.dtype == "I8":
            value = fp4_source_value(stored, sf.view(scale))
        elif info.dtype == "F8_E4M3" and ".engram.embed." in name:
            value = e4m3_value(stored) * np.repeat(e8m0_scale(sf.view(scale)), 32, 1)
        elif info.dtype == "F8_E4M3":
            value = fp8_source_value(stored, sf.view(scale))
        elif info.dtype == "BF16" and dtype == "F32":
            value = (stored.astype(np.uint32) << 16).view(np.float32)
        else:
            tensors[name] = (info.dtype, stored)
            continue
        value = value.astype(np.float32)
        tensors[name] = (dtype, value if dtype == "F32" else to_bf16_bits(value))
        if dtype == "BF16":
            assert np.array_equal(bf16_value(tensors[name][1]), value), name  # exact
    dst.mkdir()
    write_sharded(dst, tensors, shards=3)
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = dtype.lower()
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, dst / name)
    return dst


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="module")
def uploads(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("uploads")
    return {dtype: dequantised(source, root / dtype.lower(), dtype) for dtype in ("BF16", "F32")}


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_dequantised_upload_loads_as_the_original(source, uploads, dtype):
    """The same model: float Linears where the original has mxfp8/mxfp4, the same Engram rows,
    and the runtime's fp8/fp4 roundings (act_quant, KV QDQ at their defaults) on both."""
    import dsv4

    original, tokenizer = dsv4.load(source, dtype=mx.float32)
    upload, _ = dsv4.load(uploads[dtype], dtype=mx.float32)
    assert type(upload.layers[2].attn.wq_a).__name__ == "Linear"
    assert type(upload.layers[2].ffn.experts.w1).__name__ == "ExpertLinear"
    layer = original.args.engram_layer_ids[0]
    ids = np.arange(0, upload._engram_tables[layer].rows, 997)
    assert np.array_equal(np.array(upload._engram_tables[layer].read(ids).view(mx.uint16)),
                          np.array(original._engram_tables[layer].read(ids).view(mx.uint16)))
    ids = np.array([tokenizer.encode("Sparse is better than dense. Readability counts, 1234.")])
    want = _logits(original, ids, prefill=ids.shape[1] - 4)
    got = _logits(upload, ids, prefill=ids.shape[1] - 4)
    assert np.isfinite(want).all() and want.std() > 0
    assert _relative(got, want) < 1e-5


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_dequantised_upload_converts_keeping_its_float_weights(source, uploads, tmp_path, dtype):
    import dsv4

    upload = uploads[dtype]
    dst = tmp_path / "out"
    convert(upload, dst, copy_engram=True, verify=True, progress=False)
    config = json.loads((dst / "config.json").read_text())
    assert "quantization" not in config  # nothing is quantized
    weights = _read_weights(dst)
    ckpt = sf.Checkpoint(upload)
    assert weights["layers.2.attn.wq_a.weight"].tobytes() == \
        sf.view(ckpt["layers.2.attn.wq_a.weight"]).tobytes()
    assert weights["layers.3.ffn.experts.w2.weight"].tobytes() == np.stack(
        [sf.view(ckpt[f"layers.3.ffn.experts.{e}.w2.weight"]) for e in range(8)]).tobytes()
    for layer, ref in config["dsv4"]["engram"].items():
        assert ref == {"layout": dtype.lower(), "rows": ref["rows"],
                       "weight": {"file": f"engram-{int(layer):02d}.bin", "offset": 0}}
        assert (dst / ref["weight"]["file"]).read_bytes() == \
            sf.view(ckpt[f"layers.{layer}.engram.embed.weight"]).tobytes()
    direct, tokenizer = dsv4.load(upload, dtype=mx.float32)
    converted, _ = dsv4.load(dst, dtype=mx.float32)
    ids = np.array([tokenizer.encode("Errors should never pass silently.")])
    assert np.array_equal(np.array(converted(ids)), np.array(direct(ids)))


def test_requantizing_an_upload_equals_requantizing_the_original(source, uploads, tmp_path):
    """The upload's float weights are the original's values: quantized to affine they give
    the same tensors, and the same reported errors."""
    options = dict(experts=Requant(4, 32), dense=Requant(8, 32), progress=False)
    want = convert(source, tmp_path / "from-fp8", **options)
    expected = _read_weights(tmp_path / "from-fp8")
    affine = [n for n in expected if f"{n.rsplit('.', 1)[0]}.biases" in expected]
    for dtype, upload in uploads.items():
        got = convert(upload, tmp_path / dtype, **options)
        weights = _read_weights(tmp_path / dtype)
        assert weights.keys() == expected.keys(), dtype
        for name in affine:
            assert weights[name].tobytes() == expected[name].tobytes(), (dtype, name)
        assert got.requant_errors == want.requant_errors
    kinds = {official.tensor_kind(n.rsplit(".", 1)[0]) for n in affine}
    assert {"ffn.experts.w2", "ffn.shared_experts.w1", "attn.wo_a", "attn.indexer.wq_b",
            "engram.wkv"} <= kinds


# --- end to end: dsv4.load -------------------------------------------------------------------

def _logits(model, ids: np.ndarray, prefill: int) -> np.ndarray:
    """Prefill `prefill` tokens, then decode the rest one by one; every position's logits."""
    cache = model.make_cache()
    out = [np.array(model(ids[:, :prefill], cache))]
    for t in range(prefill, ids.shape[1]):
        out.append(np.array(model(ids[:, t:t + 1], cache)))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("copy_engram", [False, True])
def test_converted_directory_gives_bit_identical_logits(source, tmp_path, copy_engram):
    import dsv4

    dst = tmp_path / "out"
    convert(source, dst, copy_engram=copy_engram, max_shard_bytes=500_000, progress=False)
    official_model, tokenizer = dsv4.load(source)
    converted_model, _ = dsv4.load(dst)
    ids = np.array([tokenizer.encode("Sparse is better than dense. Readability counts, 1234.")])
    want = _logits(official_model, ids, prefill=ids.shape[1] - 4)
    got = _logits(converted_model, ids, prefill=ids.shape[1] - 4)
    assert np.isfinite(want).all() and want.std() > 0
    assert np.array_equal(got, want)


def test_engram_tables_of_another_width_are_copied_with_their_rows(tmp_path):
    import dsv4

    src = write_tiny_checkpoint(tmp_path / "src", seed=5, config_overrides={"engram_head_dim": 64})
    dst = tmp_path / "out"
    convert(src, dst, copy_engram=True, progress=False)
    ckpt = sf.Checkpoint(src)
    for layer, ref in json.loads((dst / "config.json").read_text())["dsv4"]["engram"].items():
        weight = sf.view(ckpt[f"layers.{layer}.engram.embed.weight"])
        scale = sf.view(ckpt[f"layers.{layer}.engram.embed.scale"])
        assert ref == {"layout": "interleaved66", "file": f"engram-{int(layer):02d}.bin",
                       "offset": 0, "rows": len(weight)}
        assert (dst / ref["file"]).read_bytes() == np.concatenate([weight, scale], 1).tobytes()
    official_model, tokenizer = dsv4.load(src)
    converted_model, _ = dsv4.load(dst)
    ids = np.array([tokenizer.encode("In the face of ambiguity, refuse the temptation to guess.")])
    assert np.array_equal(_logits(converted_model, ids, 6), _logits(official_model, ids, 6))


def test_requantized_modules_deviate_by_the_reported_error(source, tmp_path):
    """For Gaussian inputs x, E|dW x|^2 / E|W x|^2 = |dW|_F^2 / |W|_F^2: the loaded modules'
    outputs must deviate from the lossless ones by the relative error the converter reported."""
    import dsv4

    lossless, tokenizer = dsv4.load(source, dtype=mx.float32)
    dsts = {}
    for bits in (8, 4):
        dsts[bits] = tmp_path / f"q{bits}"
        result = convert(source, dsts[bits], experts=Requant(bits, 32), dense=Requant(8, 32),
                         progress=False)
    requant, _ = dsv4.load(dsts[4], dtype=mx.float32)
    modules = [dict(m.named_modules()) for m in (lossless, requant)]
    rng = np.random.default_rng(0)
    for kind in ("attn.wq_a", "attn.wo_b", "ffn.shared_experts.w2", "ffn.experts.w1",
                 "ffn.experts.w2"):
        err2 = ref2 = 0.0
        for layer in range(8):
            exact, approx = (m[f"layers.{layer}.{kind}"] for m in modules)
            in_dim = exact.scales.shape[-1] * 32
            x = mx.array(rng.normal(size=(512, in_dim)).astype(np.float32))
            if "experts.w" in kind and "shared" not in kind:
                ids = mx.array(rng.integers(0, 8, 512).astype(np.uint32))
                y, y2 = exact(x[:, None], ids), approx(x[:, None], ids)
            else:
                y, y2 = exact(x), approx(x)
            err2 += float(mx.sum(mx.square(y2 - y)))
            ref2 += float(mx.sum(mx.square(y)))
        assert (err2 / ref2) ** 0.5 == pytest.approx(result.requant_errors[kind], rel=0.1), kind

    # the whole model: finite logits, and fewer bits move them further (teacher forcing)
    ids = np.array([tokenizer.encode("Errors should never pass silently. Unless explicitly silenced.")])
    base = np.array(lossless(ids))
    moved = {}
    for bits, path in dsts.items():
        model, _ = dsv4.load(path, dtype=mx.float32)
        logits = np.array(model(ids))
        assert np.isfinite(logits).all()
        moved[bits] = np.linalg.norm(logits - base) / np.linalg.norm(base)
    assert 0 < moved[8] < moved[4]


def test_copy_engram_counts_the_tables_in_the_space_check(source, tmp_path, monkeypatch):
    from collections import namedtuple

    probe = tmp_path / "probe"
    convert(source, probe, progress=False)
    weights = sum(p.stat().st_size for p in probe.glob("*.safetensors"))
    tables = sum(r["rows"] for r in json.loads((probe / "config.json").read_text())
                 ["dsv4"]["engram"].values()) * 264
    shutil.rmtree(probe)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, weights + tables // 2))
    convert(source, tmp_path / "fits", progress=False)  # referenced tables need no room
    with pytest.raises(ConversionError, match="the disk has"):
        convert(source, tmp_path / "out", copy_engram=True, progress=False)
    _only(tmp_path, "fits")
