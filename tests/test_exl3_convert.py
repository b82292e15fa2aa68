"""EXL3 pack -> dsv4 directory, on tiny synthetic packs made from a tiny official checkpoint.

The pack keeps every official tensor except the routed experts, which become random EXL3
trellises (any bit pattern is a valid trellis) padded to 128 as exllamav3 pads them. The
oracle for the experts is the numpy reference decoder; for everything else, the official
packing (`dsv4.layout`) of the checkpoint the pack was made from.
"""

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from convert import exl3, exl3_pack
from convert import exl3_reference as ref
from convert.writer import ConversionError
from dsv4 import layout
from dsv4.config import ModelArgs
from dsv4.safetensors_file import Checkpoint, CheckpointError, view
from dsv4.testing import write_sharded, write_tiny_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "exl3"
EXPERT = re.compile(r"^(layers\.(\d+)\.ffn\.experts\.\d+\.w[123])\.(weight|scale)$")
KS = [1, 2, 3, 4, 5, 6, 7, 8]  # layer i uses K = KS[i], codebook CODEBOOKS[i % 3]


def pad128(x):
    return -(-x // 128) * 128


def make_pack(official, pack, seed=0, skip=(), marker_value=None, config_edit=None, singles=(),
              inject=None):
    """Turn the official checkpoint into an EXL3 pack (routed experts, and the Linears named in
    `singles`, EXL3-coded); returns {module: (K, codebook)}."""
    rng = np.random.default_rng(seed)
    ckpt = Checkpoint(official)
    tensors, coded = {}, {}
    for name, info in sorted(ckpt.tensors.items()):
        if name in skip:
            continue
        m = EXPERT.match(name)
        single = name.removesuffix(".weight") in singles
        if not m and not single:
            tensors[name] = (info.dtype, np.array(view(info)))
            continue
        if single:
            module, layer, (out, inp) = name.removesuffix(".weight"), 4, info.shape
        elif m.group(3) == "scale":
            continue
        else:
            module, layer = m.group(1), int(m.group(2))
            out, inp = info.shape[0], 2 * info.shape[1]
        k_bits, codebook = KS[layer], ref.CODEBOOKS[layer % 3]
        kp, np_ = pad128(inp), pad128(out)
        tensors[f"{module}.trellis"] = ("I16", rng.integers(-32768, 32768, (kp // 16, np_ // 16,
                                                                           16 * k_bits), np.int16))
        sign = rng.choice([-1.0, 1.0], kp + np_)
        tensors[f"{module}.suh"] = ("F16", (sign[:kp] * rng.uniform(0.05, 0.1, kp)).astype(np.float16))
        tensors[f"{module}.svh"] = ("F16", (sign[kp:] * rng.uniform(0.5, 1.0, np_)).astype(np.float16))
        if inject and module in inject:  # given trellis, suh, svh
            for part, array in zip(("trellis", "suh", "svh"), inject[module]):
                tensors[f"{module}.{part}"] = (tensors[f"{module}.{part}"][0], array)
        if codebook != "3inst":
            value = marker_value if marker_value is not None else \
                exl3_pack.LOCKED_MULTIPLIERS[codebook]
            tensors[f"{module}.{codebook}"] = ("I32", np.array([value], np.uint32).view(np.int32))
        coded[module] = (k_bits, codebook)
    pack.mkdir()
    write_sharded(pack, tensors, shards=2)
    config = json.loads((official / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "exl3", "bits": 4.5, "codebook": "mcg",
                                     "original_quantization_config": config["quantization_config"]}
    if config_edit:
        config_edit(config)
    (pack / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(official / name, pack / name)
    return coded


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("official") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def converted(official, tmp_path_factory):
    root = tmp_path_factory.mktemp("exl3")
    coded = make_pack(official, root / "pack")
    result = exl3.convert(root / "pack", root / "out", workers=1, progress=False)
    return root, coded, result.errors


def oracle_weight(pack_ckpt, module, codebook, out, inp):
    """[out, in] float32 from the numpy reference, trimmed of the 128-padding."""
    w = ref.weight(np.array(view(pack_ckpt[f"{module}.trellis"])),
                   np.array(view(pack_ckpt[f"{module}.suh"])),
                   np.array(view(pack_ckpt[f"{module}.svh"])), codebook)
    return w[:inp, :out].T


def test_experts_decode_to_the_reference_within_the_reported_error(converted):
    root, coded, errors = converted
    pack, out = Checkpoint(root / "pack"), Checkpoint(root / "out")
    config = json.loads((root / "out" / "config.json").read_text())
    args = ModelArgs.from_dict(config)
    assert config["dsv4"]["source"]["kind"] == "exl3"
    assert config["dsv4"]["requantization"]["exl3"]["relative_error_by_module"] == errors
    for layer in range(args.num_hidden_layers):
        for proj in ("w1", "w2", "w3"):
            name = f"layers.{layer}.ffn.experts.{proj}"
            q = config["quantization"][name]
            assert q["mode"] == "affine" and q["bits"] == exl3.BITS_FOR_K[KS[layer]]
            scales, biases = (mx.array(np.array(view(out[f"{name}.{part}"])))
                              .view(mx.bfloat16).astype(mx.float32) for part in ("scales", "biases"))
            w = mx.dequantize(mx.array(np.array(view(out[f"{name}.weight"]))), scales, biases,
                              group_size=q["group_size"], bits=q["bits"])
            w = np.array(w.astype(mx.float32))
            e2 = r2 = 0.0
            for e in range(args.n_routed_experts):
                module = f"layers.{layer}.ffn.experts.{e}.{proj}"
                assert coded[module] == (KS[layer], ref.CODEBOOKS[layer % 3])
                expect = oracle_weight(pack, module, coded[module][1], *w.shape[1:])
                e2 += np.sum((w[e] - expect) ** 2)
                r2 += np.sum(expect**2)
            measured = np.sqrt(e2 / r2)
            # the converter's own measure of what requantisation added is this one
            assert abs(measured - errors[name]) < 0.02 * errors[name] + 1e-4
            assert measured < {3: 0.25, 4: 0.12, 5: 0.06, 6: 0.03, 8: 0.01}[q["bits"]]


def test_official_tensors_are_packed_exactly_as_the_official_layout(converted, official):
    root, _, _ = converted
    out = Checkpoint(root / "out")
    src = Checkpoint(official)
    args = ModelArgs.from_dict(json.loads((official / "config.json").read_text()))
    checked = 0
    for item in layout.plan(src, args):
        if ".ffn.experts." in item.name:
            continue
        for name, (dtype, array) in item.produce().items():
            assert out[name].dtype == dtype
            assert np.array_equal(np.array(view(out[name])), array), name
            checked += 1
    assert checked > 100
    experts = [n for n in out.names() if ".experts." in n]
    assert len(experts) == 3 * 3 * args.num_hidden_layers  # weight, scales, biases per stack


def test_converted_directory_loads_and_runs(converted):
    from dsv4 import load

    model, tokenizer = load(converted[0] / "out")
    ids = mx.array([tokenizer.encode("The quick brown fox")])
    logits = model(ids)
    assert logits.shape[:2] == ids.shape and np.all(np.isfinite(np.array(logits)))


@pytest.mark.slow
def test_bits_override_and_parallel_workers_give_the_same_bytes(converted, tmp_path):
    root, _, _ = converted
    exl3.convert(root / "pack", tmp_path / "w2", bits=8, workers=2, progress=False)
    exl3.convert(root / "pack", tmp_path / "w1", bits=8, workers=1, progress=False)
    a, b = Checkpoint(tmp_path / "w2"), Checkpoint(tmp_path / "w1")
    name = "layers.3.ffn.experts.w2.weight"
    assert a[name].shape[-1] == 64 * 8 // 32
    assert np.array_equal(np.array(view(a[name])), np.array(view(b[name])))


def test_missing_tensors_are_listed(official, tmp_path):
    make_pack(official, tmp_path / "pack", skip={"layers.2.attn.wq_a.weight", "head.weight"})
    with pytest.raises(ConversionError, match=r"head\.weight is missing.*layers\.2\.attn\.wq_a"
                                              r"\.weight is missing"):
        exl3.convert(tmp_path / "pack", tmp_path / "out", workers=1, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_unlocked_codebook_multiplier_is_refused(official, tmp_path):
    make_pack(official, tmp_path / "pack", marker_value=0x12345678)
    with pytest.raises(CheckpointError, match=r"\.mcg is \[305419896\], expected the locked "
                                              r"multiplier 0xcbac1fed"):
        exl3.convert(tmp_path / "pack", tmp_path / "out", workers=1, progress=False)


def test_trellis_that_does_not_fit_the_linear_is_refused(official, tmp_path):
    make_pack(official, tmp_path / "pack")
    ckpt = Checkpoint(tmp_path / "pack")
    lin = exl3_pack.scan(ckpt)["layers.0.ffn.experts.0.w1"]
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.experts\.0\.w1\.trellis is "
                                              r"\[8, 8, 16\].*expected in 256 and out 64"):
        exl3_pack.check_fits(lin, 64, 256)


def test_virtual_heads_are_restored(tmp_path):
    config = {"text_config": {"num_attention_heads": 72, "o_groups": 9,
                              "virtual_heads_from": {"num_attention_heads": 64, "o_groups": 8}},
              "virtual_heads_from": {"num_attention_heads": 64, "o_groups": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    restored = exl3.read_config(tmp_path)
    assert restored["text_config"]["num_attention_heads"] == 64
    assert restored["text_config"]["o_groups"] == 8
    assert "virtual_heads_from" not in restored["text_config"]


def test_official_checkpoint_is_not_taken_for_a_pack(official, tmp_path):
    with pytest.raises(ConversionError, match="not an EXL3 pack"):
        exl3.convert(official, tmp_path / "out", workers=1, progress=False)


def test_legacy_packed_signs():
    bits = np.array([0b1000000000000101], dtype=np.uint16).view(np.int16)
    signs = exl3_pack.unpack_signs(bits)
    assert signs.tolist() == [-1, 1, -1] + [1] * 12 + [-1]


def test_resumed_conversion_reports_every_module(converted, tmp_path, monkeypatch):
    root, _, errors = converted
    real, calls = exl3.decode_requantize, []

    def stop_midway(*args):
        calls.append(1)
        if len(calls) == 60:  # inside the third stack of experts
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(exl3, "decode_requantize", stop_midway)
    with pytest.raises(KeyboardInterrupt):
        exl3.convert(root / "pack", tmp_path / "out", workers=1, progress=False,
                     max_shard_bytes=20_000)
    assert (tmp_path / ".out.partial").is_dir() and not (tmp_path / "out").exists()
    again = []
    monkeypatch.setattr(exl3, "decode_requantize", lambda *args: again.append(1) or real(*args))
    result = exl3.convert(root / "pack", tmp_path / "out", workers=1, progress=False,
                          max_shard_bytes=20_000, resume=True)
    assert result.errors == pytest.approx(errors, rel=1e-6)
    assert 0 < len(again) < len(errors) * 8  # finished shards were not decoded again


@pytest.mark.slow
def test_cli_subcommand(converted, tmp_path):
    import subprocess
    import sys

    root = converted[0]
    run = subprocess.run([sys.executable, "-m", "dsv4_convert", "exl3", str(root / "pack"),
                          str(tmp_path / "out"), "--workers", "1", "--bits", "4", "--quiet"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "K=3 -> affine 4-bit/64" in run.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["layers.0.ffn.experts.w1"]["bits"] == 4


@pytest.mark.parametrize("dst", ["pack", "."])
def test_overwrite_never_deletes_the_pack(converted, tmp_path, dst):
    pack = shutil.copytree(converted[0] / "pack", tmp_path / "pack")
    (pack / "NOTES.md").write_text("mine")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(ConversionError, match=f"{pack}(, a path| is a path) the conversion reads"):
        exl3.convert(pack, tmp_path / dst, workers=1, overwrite=True, progress=False)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


def test_a_single_exl3_linear_becomes_bf16(official, tmp_path):
    from dsv4 import load

    coded = make_pack(official, tmp_path / "pack", singles=("head",))
    assert coded["head"] == (5, "mcg")
    result = exl3.convert(tmp_path / "pack", tmp_path / "out", workers=1, progress=False)
    out, pack = Checkpoint(tmp_path / "out"), Checkpoint(tmp_path / "pack")
    assert "head" not in json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert out["head.weight"].dtype == "BF16" and "head.scales" not in out
    w = (np.array(view(out["head.weight"])).astype(np.uint32) << 16).view(np.float32)
    expect = oracle_weight(pack, "head", "mcg", *w.shape)
    measured = np.sqrt(np.sum((w - expect) ** 2) / np.sum(expect**2))
    assert abs(measured - result.errors["head"]) < 0.02 * measured and measured < 0.003
    model, tokenizer = load(tmp_path / "out")
    logits = model(mx.array([tokenizer.encode("Sparse is better than dense.")]))
    assert np.all(np.isfinite(np.array(logits)))


def test_padded_heads_without_their_real_counts_are_refused(official, tmp_path):
    def pad_heads(config):  # a TP3-style config that lost its virtual_heads_from
        config["text_config"].update(num_attention_heads=6, o_groups=3)

    make_pack(official, tmp_path / "pack", config_edit=pad_heads)
    with pytest.raises(ConversionError, match=r"attn_sink is F32\[4\], expected F32\[6\]"):
        exl3.convert(tmp_path / "pack", tmp_path / "out", workers=1, progress=False)


def test_group_major_reindexed_pack_is_refused(converted, tmp_path):
    pack = tmp_path / "pack"
    shutil.copytree(converted[0] / "pack", pack)
    (pack / "permute_g8_manifest.json").write_text("{}")
    with pytest.raises(ConversionError, match="PF-G8 pack"):
        exl3.convert(pack, tmp_path / "out", workers=1, progress=False)


def test_expert_matches_exllamav3_itself(official, tmp_path):
    # exllamav3's own full weight (get_weight_tensor on an H200) of a 128x128 K=1 3INST tensor,
    # placed as expert 0 of layer 0 (K=1, 3INST in this pack); 8-bit so requantising adds ~0.7%
    with np.load(FIXTURES / "exl3_3inst.npz") as z:
        trellis, suh, svh, w_exl = (z[f"K1_{k}"] for k in ("trellis", "suh", "svh", "w_torch"))
    module = "layers.0.ffn.experts.0.w1"
    make_pack(official, tmp_path / "pack", inject={module: (trellis, suh, svh)})
    exl3.convert(tmp_path / "pack", tmp_path / "out", bits=8, workers=1, progress=False)
    out = Checkpoint(tmp_path / "out")
    name = "layers.0.ffn.experts.w1"
    scales, biases = (mx.array(np.array(view(out[f"{name}.{part}"]))[0]).view(mx.bfloat16)
                      .astype(mx.float32) for part in ("scales", "biases"))
    w = np.array(mx.dequantize(mx.array(np.array(view(out[f"{name}.weight"]))[0]), scales, biases,
                               group_size=64, bits=8))
    expect = w_exl[: w.shape[1], : w.shape[0]].T.astype(np.float64)  # exllamav3 is [in, out]
    assert np.sqrt(np.sum((w - expect) ** 2) / np.sum(expect**2)) < 0.01
