"""convert/writer.py: shards, index, atomic rename, resume, verification.

The oracle for what was written is the `safetensors` library's own reader (and `mx.load`),
never our reader alone.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from dsv4_convert.writer import (ConversionError, ModelDirWriter, Unit, assign_shards,
                                 shard_name)


def _tensors(seed: int, n: int = 7) -> dict[str, dict[str, tuple[str, np.ndarray]]]:
    """n modules of random tensors with mixed dtypes and sizes, {module: {name: (dtype, array)}}."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        m = f"layers.{i}.proj"
        rows = int(rng.integers(1, 40))
        out[m] = {f"{m}.weight": ("U32", rng.integers(0, 2**32, (rows, 8), dtype=np.uint32)),
                  f"{m}.scales": ("U8", rng.integers(0, 256, (rows, 1), dtype=np.uint8))}
        if i % 3 == 0:
            out[m][f"{m}.norm"] = ("F16", rng.normal(size=(rows,)).astype(np.float16))
        if i % 3 == 1:
            out[m][f"{m}.bias"] = ("F32", rng.normal(size=(2, rows, 3)).astype(np.float32))
    return out


def _units(modules, calls=None, fail_on=None, error=KeyboardInterrupt):
    def make(key, tensors):
        def produce():
            if calls is not None:
                calls.append(key)
            if key == fail_on:
                raise error(f"stopped at {key}")
            return dict(tensors)
        return Unit(key, sum(a.nbytes for _, a in tensors.values()), produce)
    return [make(k, t) for k, t in modules.items()]


def _all(modules):
    return {n: a for t in modules.values() for n, (_, a) in t.items()}


def _read_dir(path):
    """Every file of a directory as bytes (for identical-directory checks)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_shards_index_and_side_group_read_back_with_safetensors(tmp_path):
    modules, side = _tensors(0), _tensors(1, 3)
    limit = 700
    dst = tmp_path / "out"
    with ModelDirWriter(dst, {"v": 1}, max_shard_bytes=limit, progress=False) as out:
        shards = out.write_weights({"model": _units(modules), "mtp": _units(side)})
        out.write_json("config.json", {"a": 1})
    assert not (tmp_path / ".out.partial").exists()
    files = sorted(p.name for p in dst.iterdir())
    model_files = [s.file for s in shards if s.group == "model"]
    assert len(model_files) > 2
    n = len(model_files)
    assert model_files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    mtp_files = [s.file for s in shards if s.group == "mtp"]
    assert files == sorted(model_files + mtp_files + ["config.json", "model.safetensors.index.json"]
                           + (["mtp.safetensors.index.json"] if len(mtp_files) > 1 else []))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    expected = _all(modules)
    read = {}
    for file in model_files:
        loaded = load_file(dst / file)
        data_bytes = sum(a.nbytes for a in loaded.values())
        # a shard passes the limit only when it holds a single module
        assert data_bytes <= limit or len({k.rsplit(".", 1)[0] for k in loaded}) == 1
        assert all(index["weight_map"][k] == file for k in loaded)
        read.update(loaded)
    assert set(read) == set(expected) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in expected.values())
    for name, array in expected.items():
        assert read[name].dtype == array.dtype and read[name].shape == array.shape
        assert read[name].tobytes() == array.tobytes(), name
    side_read = {}
    for file in mtp_files:
        side_read.update(mx.load(str(dst / file)))
    assert set(side_read) == set(_all(side))
    w = "layers.0.proj.weight"
    assert np.array_equal(np.array(side_read[w]), _all(side)[w])


def test_assignment_is_greedy_in_order_and_deterministic():
    units = [Unit(f"u{i}", size, lambda: {}) for i, size in enumerate([5, 5, 1, 9, 20, 3])]
    shards = assign_shards({"model": units, "vision": units[:2]}, 10)
    assert [s.keys for s in shards] == [("u0", "u1"), ("u2", "u3"), ("u4",), ("u5",),
                                        ("u0", "u1")]
    assert [s.file for s in shards][-1] == "vision.safetensors"
    assert shard_name("model", 0, 1) == "model-00001-of-00001.safetensors"
    assert shards == assign_shards({"model": units, "vision": units[:2]}, 10)
    with pytest.raises(ConversionError, match="must not start with 'model'"):
        assign_shards({"model_mtp": units}, 10)
    with pytest.raises(ConversionError, match="u0 is given twice"):
        assign_shards({"model": units + units[:1]}, 10)


def test_header_larger_than_reserved_is_rewritten_exactly(tmp_path):
    rng = np.random.default_rng(3)
    many = {f"m.{'x' * 200}.{i}": ("F32", rng.normal(size=(i + 1,)).astype(np.float32))
            for i in range(40)}
    unit = Unit("m", sum(a.nbytes for _, a in many.values()), lambda: dict(many))
    with ModelDirWriter(tmp_path / "out", {}, progress=False) as out:
        out.write_weights({"model": [unit]})
    loaded = load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")
    assert {k: v.tobytes() for k, v in loaded.items()} == {k: a.tobytes() for k, (_, a) in many.items()}


def test_bad_input_leaves_nothing_behind(tmp_path):
    modules = _tensors(0)
    key = list(modules)[-1]
    with pytest.raises(ValueError, match=f"stopped at {key}"):
        with ModelDirWriter(tmp_path / "out", {}, max_shard_bytes=500, progress=False) as out:
            out.write_weights({"model": _units(modules, fail_on=key, error=ValueError)})
    assert list(tmp_path.iterdir()) == []


def test_declared_size_must_match(tmp_path):
    unit = Unit("a", 5, lambda: {"a": ("U8", np.zeros(4, np.uint8))})
    with pytest.raises(ConversionError, match="unit a declared 5 bytes but produced 4"):
        with ModelDirWriter(tmp_path / "out", {}, progress=False) as out:
            out.write_weights({"model": [unit]})
    assert list(tmp_path.iterdir()) == []


def _tree(path):
    """Every file under `path` (relative name -> bytes)."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _model_dir(dst, seed=0, **options):
    """A directory as the converters write it: weights and a config.json with a dsv4 block."""
    with ModelDirWriter(dst, {}, progress=False, **options) as out:
        out.write_weights({"model": _units(_tensors(seed, 2))})
        out.write_json("config.json", {"dsv4": {"format_version": 1}, "seed": seed})


def test_destination_exists_and_overwrite_replaces_an_earlier_output(tmp_path):
    dst = tmp_path / "out"
    _model_dir(dst, seed=0)
    before = _tree(dst)
    with pytest.raises(ConversionError, match="already exists.*--overwrite"):
        ModelDirWriter(dst, {}).__enter__()
    assert _tree(dst) == before and not (tmp_path / ".out.partial").exists()
    _model_dir(dst, seed=1, overwrite=True)
    assert json.loads((dst / "config.json").read_text())["seed"] == 1
    assert _tree(dst) != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # an empty directory holds nothing to lose
    (tmp_path / "empty").mkdir()
    _model_dir(tmp_path / "empty", overwrite=True)
    assert (tmp_path / "empty" / "config.json").is_file()


def _not_a_model(dst):
    (dst / "notes.txt").write_text("my notes")


def _foreign_config(dst):
    (dst / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (dst / "model-00001-of-00001.safetensors").write_bytes(b"their weights")


def _model_with_a_folder(dst):
    (dst / "config.json").write_text(json.dumps({"dsv4": {"format_version": 1}}))
    (dst / "other-model").mkdir()
    (dst / "other-model" / "weights.bin").write_bytes(b"precious")


@pytest.mark.parametrize("fill, reason", [
    (_not_a_model, "no config.json with a dsv4 block"),
    (_foreign_config, "no config.json with a dsv4 block"),
    (_model_with_a_folder, "it holds the folder other-model"),
])
def test_overwrite_refuses_a_directory_dsv4_did_not_write(tmp_path, fill, reason):
    dst = tmp_path / "out"
    dst.mkdir()
    fill(dst)
    before = _tree(dst)
    with pytest.raises(ConversionError, match=f"out is not a dsv4 model directory \\({reason}"):
        _model_dir(dst, overwrite=True)
    assert _tree(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_destination_that_is_a_file_is_refused(tmp_path, overwrite):
    dst = tmp_path / "afile"
    dst.write_text("keep me")
    with pytest.raises(ConversionError, match="afile is a file, not a model directory"):
        _model_dir(dst, overwrite=overwrite)
    assert dst.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_only_the_writers_own_unfinished_directory_is_removed(tmp_path):
    dst = tmp_path / "out"
    stranger = tmp_path / ".out.partial"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("not a conversion")
    for options in ({"overwrite": True}, {"resume": True}):
        with pytest.raises(ConversionError, match=r"\.out\.partial is in the way and is not an "
                                                  r"unfinished dsv4 conversion"):
            _model_dir(dst, **options)
    assert (stranger / "notes.txt").read_text() == "not a conversion" and not dst.exists()
    # nor the directory the replaced output is moved to while swapping
    stranger.rename(tmp_path / ".out.old")
    _model_dir(dst)
    with pytest.raises(ConversionError, match=r"\.out\.old is in the way"):
        _model_dir(dst, overwrite=True)
    assert (tmp_path / ".out.old" / "notes.txt").read_text() == "not a conversion"


@pytest.mark.parametrize("where, relation", [
    ("src", "{src} is a path"), (".", "{tmp} contains {src}, a path"),
    ("src/inside", "{src}/inside lies inside {src}, a path"), ("link", "{src} is a path")])
def test_destination_overlapping_a_source_is_refused(tmp_path, where, relation):
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"source")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(src)
    before = _tree(tmp_path)
    dst = (tmp_path / where)
    with pytest.raises(ConversionError, match=f"^{relation.format(src=src, tmp=tmp_path)} the "
                                              f"conversion reads or its result references"):
        _model_dir(dst, overwrite=True, sources=[src, src / "weights.bin"])
    assert _tree(tmp_path) == before
    # a source file elsewhere: its folder may not be the destination either
    with pytest.raises(ConversionError, match=f"contains {src / 'weights.bin'}, a path the"):
        _model_dir(src, overwrite=True, sources=[tmp_path / "link" / "weights.bin"])
    assert _tree(tmp_path) == before


def test_unwritable_parent_is_one_clear_error(tmp_path, monkeypatch):
    from pathlib import Path

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConversionError, match=f"^{tmp_path}: cannot create the destination there "
                                              f"\\(Permission denied\\)$"):
        _model_dir(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_destination_in_a_symlink_loop_is_one_clear_error(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ConversionError, match="a symlink loop|parent directory does not exist"):
        _model_dir(tmp_path / "a" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_destination_that_appears_during_the_conversion_is_kept(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(ConversionError, match="already exists.*finished conversion is kept in"):
        with ModelDirWriter(dst, {}, progress=False) as out:
            out.write_weights({"model": _units(_tensors(0, 2))})
            dst.mkdir()
            (dst / "notes.txt").write_text("arrived meanwhile")
    assert (dst / "notes.txt").read_text() == "arrived meanwhile"
    (dst / "notes.txt").rename(tmp_path / "notes.txt")
    dst.rmdir()
    calls = []
    with ModelDirWriter(dst, {}, resume=True, progress=False) as out:
        out.write_weights({"model": _units(_tensors(0, 2), calls=calls)})
    assert calls == [] and (dst / "model-00001-of-00001.safetensors").is_file()


def test_resume_redoes_only_unfinished_shards_and_gives_the_same_directory(tmp_path):
    modules = _tensors(5, 9)
    with ModelDirWriter(tmp_path / "ref", {"v": 1}, max_shard_bytes=600, progress=False) as out:
        shards = out.write_weights({"model": _units(modules)})
        out.write_json("config.json", {"a": 1})
    assert len(shards) >= 3
    stop = shards[2].keys[0]
    dst = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with ModelDirWriter(dst, {"v": 1}, max_shard_bytes=600, progress=False) as out:
            out.write_weights({"model": _units(modules, fail_on=stop)})
    tmp = tmp_path / ".out.partial"
    assert sorted(p.name for p in tmp.iterdir()) == sorted([s.file for s in shards[:2]] + ["plan.json"])
    assert not dst.exists()
    # without --resume an unfinished conversion is not touched
    with pytest.raises(ConversionError, match="--resume"):
        ModelDirWriter(dst, {"v": 1}, max_shard_bytes=600).__enter__()
    # other options: refused, and the partial work stays
    with pytest.raises(ConversionError, match="v: was 1, now 2"):
        with ModelDirWriter(dst, {"v": 2}, max_shard_bytes=600, resume=True) as out:
            pass
    assert (tmp / shards[0].file).exists()
    calls = []
    with ModelDirWriter(dst, {"v": 1}, max_shard_bytes=600, resume=True, progress=False) as out:
        out.write_weights({"model": _units(modules, calls=calls)})
        out.write_json("config.json", {"a": 1})
    done_before = {k for s in shards[:2] for k in s.keys}
    assert calls == [k for s in shards[2:] for k in s.keys] and not done_before & set(calls)
    assert _read_dir(dst) == _read_dir(tmp_path / "ref")
    assert not tmp.exists()


def test_resume_with_other_shard_plan_is_refused(tmp_path):
    modules = _tensors(5, 9)
    dst = tmp_path / "out"
    units = _units(modules, fail_on=list(modules)[-1])
    with pytest.raises(KeyboardInterrupt):
        with ModelDirWriter(dst, {}, max_shard_bytes=600, progress=False) as out:
            out.write_weights({"model": units})
    with pytest.raises(ConversionError, match="shards of the partial conversion differ"):
        with ModelDirWriter(dst, {}, max_shard_bytes=600, resume=True, progress=False) as out:
            out.write_weights({"model": _units(modules)[:-1]})
    assert (tmp_path / ".out.partial" / "plan.json").exists()


def test_verify_finds_a_changed_row(tmp_path):
    modules = _tensors(2, 4)
    units = _units(modules)
    with ModelDirWriter(tmp_path / "ok", {}, progress=False) as out:
        out.write_weights({"model": units})
        assert out.verify({"model": units}, rows=4) == len(_all(modules))
    name = "layers.3.proj.weight"
    info_rows = modules["layers.3.proj"][name][1].shape[0]
    with pytest.raises(ConversionError, match=rf"tensor {name} row \d+ differs"):
        with ModelDirWriter(tmp_path / "bad", {}, progress=False) as out:
            out.write_weights({"model": units})
            from dsv4.safetensors_file import read_header
            shard = out.path("model-00001-of-00001.safetensors")
            info = read_header(shard)[0][name]
            with open(shard, "r+b") as f:  # flip a byte of the last row (always sampled)
                f.seek(info.offset + info.nbytes - 1)
                byte = f.read(1)[0]
                f.seek(info.offset + info.nbytes - 1)
                f.write(bytes([byte ^ 1]))
            out.verify({"model": units}, rows=info_rows)
    assert not (tmp_path / "bad").exists() and not (tmp_path / ".bad.partial").exists()


def test_progress_shows_bytes_rate_and_time_left(tmp_path, capsys):
    modules = _tensors(4, 3)
    total = sum(a.nbytes for a in _all(modules).values())
    with ModelDirWriter(tmp_path / "out", {}, progress=True) as out:
        out.write_weights({"model": _units(modules)})
    last = capsys.readouterr().err.strip().split("\r")[-1]
    assert last.startswith(f"writing weights: {total / 1e6:.1f} MB of {total / 1e6:.1f} MB (100%), ")
    assert "MB/s" in last and last.endswith("left")


def test_verify_uses_a_units_row_sampler_instead_of_producing_again(tmp_path):
    rng = np.random.default_rng(7)
    full = rng.integers(0, 2**32, (3, 10, 4), dtype=np.uint32)
    produced = []

    def produce():
        produced.append(1)
        return {"m.weight": ("U32", full)}

    def sample(rows, gen, bad=False):
        from dsv4_convert.writer import pick_rows
        picks = pick_rows(30, rows, gen)
        data = full.reshape(30, 4)[picks].copy()
        if bad:
            data[-1, 0] ^= 1
        return {"m.weight": ("U32", full.shape, picks, data)}

    unit = Unit("m", full.nbytes, produce, sample=sample)
    with ModelDirWriter(tmp_path / "out", {}, progress=False) as out:
        out.write_weights({"model": [unit]})
        assert out.verify({"model": [unit]}, rows=5) == 1
        assert produced == [1]  # only the write produced the unit
        bad = Unit("m", full.nbytes, produce, sample=lambda r, g: sample(r, g, bad=True))
        with pytest.raises(ConversionError, match="tensor m.weight row 29 differs"):
            out.verify({"model": [bad]}, rows=5)
        wrong_shape = Unit("m", full.nbytes, produce, sample=lambda r, g: {
            "m.weight": ("U32", (30, 4), np.array([0]), full.reshape(30, 4)[:1])})
        with pytest.raises(ConversionError, match=r"m.weight is U32\[3, 10, 4\], expected U32\[30, 4\]"):
            out.verify({"model": [wrong_shape]})


def test_not_enough_disk_space_is_refused_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    modules = _tensors(0, 3)
    need = sum(a.nbytes for a in _all(modules).values())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, need + 99))
    with pytest.raises(ConversionError, match=r"needs 0\.0 MB more, the disk has 0\.0 MB free"):
        with ModelDirWriter(tmp_path / "out", {}, progress=False) as out:
            out.write_weights({"model": _units(modules)}, other_bytes=100)
    assert list(tmp_path.iterdir()) == []
    with ModelDirWriter(tmp_path / "out", {}, progress=False) as out:
        out.write_weights({"model": _units(modules)}, other_bytes=99)
    assert (tmp_path / "out" / "model-00001-of-00001.safetensors").is_file()
