"""ds4 GGUF -> dsv4 model directory, on tiny ds4-dialect files written with gguf's writer.

Oracles: gguf's own dequantisation (`gguf.quants.dequantize`) for every weight, MLX's
`mx.dequantize` for our packing, the source tokenizer for the rebuilt one, the official
tensors the fixture was made from for the Engram rows, dsv4.layout for the names.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize

from convert import gguf as conv
from convert import gguf_quants as gq
from convert.writer import ConversionError
from dsv4 import gguf_blocks
from dsv4.config import ModelArgs
from dsv4.engram_store import open_table
from dsv4.layout import expected_tensors
from dsv4.safetensors_file import read_header, view
from tests.gguf_fixtures import NON_SPECIAL_ADDED, write_ds4_gguf

# layers 6 and 7 Q4_K, the rest IQ2_XXS gate/up + Q2_K down: ds4's spliced "mixed" files
MIXED = {6: (T.Q4_K, T.Q4_K, T.Q4_K), 7: (T.Q4_K, T.Q4_K, T.Q4_K)}
CORPUS = [
    "def main(argv):\n    return sum(int(x) ** 2 for x in argv if x.isdigit())  # 1234567",
    "深度求索 数字 こんにちは カタカナ 한국어 文字列。",
    "emoji 🙂🚀 👩\u200d👩\u200d👧 flags 🇫🇷 done",
    "   leading\t\ttabs,  runs    of   spaces \n\n\n\r\n trailing   ",
    "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>ok</think>"
    + NON_SPECIAL_ADDED + "{}",
    "Café naïve résumé — ÉCOLE école, 3.14159e-10, 1,234,567.89, x86_64",
    "",
]
AFFINE = conv.Options(affine=True)  # the fixture's output: the tests of the affine mappings


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    made = write_ds4_gguf(root / "tiny-q2.gguf", "q2", seed=3, expert_types=MIXED)
    report = conv.convert(root / "tiny-q2.gguf", root / "out", AFFINE, workers=2, progress=False)
    return {"root": root, "gguf": root / "tiny-q2.gguf", "out": root / "out", "report": report,
            **made}


def _tensors(out):
    index = json.loads((out / "model.safetensors.index.json").read_text())
    infos = {}
    for file in sorted(set(index["weight_map"].values())):
        infos.update(read_header(out / file)[0])
    return infos


def _affine(infos, module, bits):
    s = view(infos[f"{module}.scales"]).astype(np.float32)  # f32 compute: exact products
    b = view(infos[f"{module}.biases"]).astype(np.float32)
    return np.array(mx.dequantize(mx.array(view(infos[f"{module}.weight"])), mx.array(s), mx.array(b),
                                  group_size=32, bits=bits, dtype=mx.float32))


def test_exact_types_bit_exact_against_gguf(mixed):
    src = conv.GGUFSource(mixed["gguf"])
    infos = _tensors(mixed["out"])
    config = json.loads((mixed["out"] / "config.json").read_text())
    seen = set()
    for t in src.tensors.values():
        if t.qtype not in (T.Q8_0, T.Q4_K):
            continue
        module = conv.dsv4_name(t.name).removesuffix(".weight")
        bits = config["quantization"].get(module, config["quantization"])["bits"]
        ref = dequantize(np.asarray(src.raw(t)).reshape(t.byte_shape), t.qtype)
        got = _affine(infos, module, bits)
        assert np.array_equal(got, ref), t.name
        seen.add(t.qtype)
    assert seen == {T.Q8_0, T.Q4_K}


def test_float_tensors_copied(mixed):
    src = conv.GGUFSource(mixed["gguf"])
    infos = _tensors(mixed["out"])
    checked = 0
    for t in src.tensors.values():
        if t.qtype in (T.F16, T.F32) and t.qtype != T.I8 and conv.dsv4_name(t.name):
            got = view(infos[conv.dsv4_name(t.name)])
            ref = np.asarray(src.raw(t)).view(np.float16 if t.qtype == T.F16 else np.float32)
            assert got.dtype == ref.dtype and np.array_equal(got.reshape(-1), ref), t.name
            checked += 1
    assert checked > 50


def test_lossy_types_within_reported_error(mixed):
    src = conv.GGUFSource(mixed["gguf"])
    infos = _tensors(mixed["out"])
    err, ref_sq = {}, {}
    for t in src.tensors.values():
        if t.qtype not in (T.IQ2_XXS, T.Q2_K):
            continue
        module = conv.dsv4_name(t.name).removesuffix(".weight")
        ref = dequantize(np.asarray(src.raw(t)).reshape(t.byte_shape), t.qtype)
        got = _affine(infos, module, {T.IQ2_XXS: 3, T.Q2_K: 4}[t.qtype])
        kind = f"{conv._kind(module)} ({t.qtype.name})"
        err[kind] = err.get(kind, 0.0) + float(np.sum((got.astype(np.float64) - ref) ** 2))
        ref_sq[kind] = ref_sq.get(kind, 0.0) + float(np.sum(ref.astype(np.float64) ** 2))
    assert set(err) == {"layers.*.ffn.experts.w1 (IQ2_XXS)", "layers.*.ffn.experts.w3 (IQ2_XXS)",
                        "layers.*.ffn.experts.w2 (Q2_K)"}
    for kind in err:
        measured = np.sqrt(err[kind] / ref_sq[kind])
        reported = mixed["report"][kind]["added_relative_rms_error"]
        assert abs(measured - reported) <= 1e-4 * reported, kind
        # what the mappings are for: IQ2_XXS levels sit ~2% off the 3-bit line; Q2_K at 4 bits
        assert measured < (0.03 if "IQ2_XXS" in kind else 0.06), (kind, measured)


def test_iq2_xxs_8bit_is_exact(mixed):
    src = conv.GGUFSource(mixed["gguf"])
    t = src.tensors["blk.0.ffn_gate_exps.weight"]
    raw = np.asarray(src.raw(t)).reshape(t.byte_shape)
    a = gq.to_affine(raw, T.IQ2_XXS, 8)
    got = mx.dequantize(mx.array(a.weight), mx.array(a.scales), mx.array(a.biases), group_size=32,
                        bits=8, dtype=mx.float32)
    assert np.array_equal(np.array(got), dequantize(raw, T.IQ2_XXS))


def test_lloyd_steps_never_worse_than_min_max():
    rng = np.random.default_rng(0)
    values = rng.normal(0, 1, (4096, 32)).astype(np.float32) * rng.uniform(0.1, 3, (4096, 1))
    errors = []
    for steps in (0, 1, 3):
        s, b, c = gq.fit_affine(values, 4, steps)
        got = s.astype(np.float32)[:, None] * c + b.astype(np.float32)[:, None]
        errors.append(np.sum((got - values) ** 2, axis=1))
    assert np.all(errors[1] <= errors[0] * (1 + 1e-3)) and np.all(errors[2] <= errors[1] * (1 + 1e-3))
    assert errors[2].sum() < 0.95 * errors[0].sum()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_codes_is_mlx_packing(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 64), dtype=np.uint8)
    ones = mx.ones((3, 2), mx.float32)
    got = mx.dequantize(mx.array(gq.pack_codes(codes, bits)), ones, mx.zeros((3, 2)), group_size=32,
                        bits=bits, dtype=mx.float32)
    assert np.array_equal(np.array(got), codes.astype(np.float32))


def test_names_shapes_and_config(mixed):
    config = json.loads((mixed["out"] / "config.json").read_text())
    args = ModelArgs.from_dict(config)
    infos = _tensors(mixed["out"])
    wanted = set()
    for name, (dtype, shape) in expected_tensors(args).items():
        if name.endswith(".scale"):
            continue
        name = conv.re.sub(r"\.experts\.\d+\.", ".experts.", name)
        module = name.removesuffix(".weight")
        if f"{module}.scales" in infos:
            wanted |= {f"{module}.weight", f"{module}.scales", f"{module}.biases"}
        else:
            wanted.add(name)
    assert set(infos) == wanted
    src = conv.GGUFSource(mixed["gguf"])
    quantized = sum(t.qtype in gq.MAPPERS for t in src.tensors.values())
    assert sum(n.endswith(".scales") for n in infos) == quantized
    e, inter, d = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
    assert infos["layers.0.ffn.experts.w1.weight"].shape == (e, inter, d * 3 // 32)
    assert infos["layers.7.ffn.experts.w2.scales"].shape == (e, d, inter // 32)
    assert infos["layers.7.ffn.experts.w2.scales"].dtype == "F32"   # Q4_K: exact with f32
    assert infos["head.scales"].dtype == "F16"                       # Q8_0: exact in f16
    assert config["quantization"]["layers.0.ffn.experts.w1"] == {"group_size": 32, "bits": 3,
                                                                  "mode": "affine"}
    assert config["quantization"]["layers.7.ffn.experts.w1"]["bits"] == 4
    assert config["text_config"] == mixed["config"]["text_config"]
    assert "quantization_config" not in config
    assert config["dsv4"]["format_version"] == 1 and config["dsv4"]["source"]["kind"] == "gguf"


# --- GGUF blocks kept as they are (the default) ------------------------------------------------

@pytest.fixture(scope="module")
def kept(mixed):
    """The mixed file converted natively: blocks referenced in place, and with --copy-weights."""
    out = {}
    for mode, options in (("referenced", conv.Options()), ("copied", conv.Options(copy_weights=True))):
        dst = mixed["root"] / mode
        out[mode] = (dst, conv.convert(mixed["gguf"], dst, options, workers=1, progress=False))
    return out


def _gguf_py_tensors(path) -> dict:
    """dsv4 name -> the tensor's data as gguf's own reader gives it (quantized: uint8 blocks
    [..., out, row bytes])."""
    from gguf import GGUFReader

    return {conv.dsv4_name(t.name): (t.tensor_type, np.asarray(t.data))
            for t in GGUFReader(str(path)).tensors if conv.dsv4_name(t.name)}


def _module_quantization(config: dict, module: str) -> dict:
    q = config["quantization"]
    return q.get(module, {k: v for k, v in q.items() if not isinstance(v, dict)})


def test_kept_blocks_are_referenced_in_the_gguf(mixed, kept):
    dst, report = kept["referenced"]
    config = json.loads((dst / "config.json").read_text())
    refs = config["dsv4"]["tensors"]
    quantized = {n: (qtype.name, d) for n, (qtype, d) in _gguf_py_tensors(mixed["gguf"]).items()
                 if qtype in gq.MAPPERS}
    types = {n: qtype for n, (qtype, _) in quantized.items()}
    assert set(refs) == set(quantized) and len(refs) > 60
    data = np.fromfile(mixed["gguf"], np.uint8)
    for name, (_, blocks) in quantized.items():
        ref = refs[name]
        assert ref == {"file": str(mixed["gguf"].resolve()), "offset": ref["offset"], "dtype": "U8",
                       "shape": list(blocks.shape)}, name
        n = int(np.prod(ref["shape"]))
        assert np.array_equal(data[ref["offset"]: ref["offset"] + n].reshape(blocks.shape), blocks)
        assert _module_quantization(config, name.removesuffix(".weight")) == {
            "mode": "gguf", "type": types[name]}
    assert {types[n] for n in refs} == {"Q8_0", "Q4_K", "Q2_K", "IQ2_XXS"}
    assert refs["layers.0.ffn.experts.w1.weight"]["shape"] == [8, 256, 256 // 256 * 66]
    # the shards hold the float tensors only; no module is quantized any other way
    infos = _tensors(dst)
    assert not set(infos) & set(refs) and all(i.dtype in ("F16", "F32") for i in infos.values())
    assert all(q.get("mode") == "gguf" for q in config["quantization"].values()
               if isinstance(q, dict))
    for kind, r in report.items():
        if r["from"] in gguf_blocks.TYPES:
            assert r["to"] == conv.IN_PLACE and r["bytes_out"] == r["bytes_in"], kind
            assert "added_relative_rms_error" not in r


def test_copied_blocks_are_the_gguf_bytes(mixed, kept):
    dst, report = kept["copied"]
    config = json.loads((dst / "config.json").read_text())
    referenced = json.loads((kept["referenced"][0] / "config.json").read_text())
    assert "tensors" not in config["dsv4"]
    assert config["quantization"] == referenced["quantization"]
    infos = _tensors(dst)
    for name, (qtype, data) in _gguf_py_tensors(mixed["gguf"]).items():
        if qtype in gq.MAPPERS:
            assert infos[name].dtype == "U8" and np.array_equal(view(infos[name]), data), name
        else:
            assert np.array_equal(view(infos[name]).reshape(-1), data.reshape(-1)), name
    assert all(r["bytes_out"] == r["bytes_in"] for r in report.values())


@pytest.mark.parametrize("dtype, workers", [("f32", 2), ("bf16", 1)])
def test_dequantized_weights_are_the_gguf_values(mixed, tmp_path, dtype, workers):
    """--dequantize decodes with dsv4.gguf_blocks (in spawned workers with 2): gguf-py's
    decoder is the oracle, bit for bit (bf16: its values rounded by MLX)."""
    conv.convert(mixed["gguf"], tmp_path / "out", conv.Options(dequantize=dtype), workers=workers,
                 progress=False)
    infos = _tensors(tmp_path / "out")
    checked = set()
    for name, (qtype, data) in _gguf_py_tensors(mixed["gguf"]).items():
        if qtype not in gq.MAPPERS:
            continue
        want = dequantize(data, qtype)
        if dtype == "bf16":
            want = np.array(mx.array(want).astype(mx.bfloat16).view(mx.uint16))
        assert infos[name].dtype == dtype.upper() and np.array_equal(view(infos[name]), want), name
        checked.add(qtype)
    assert checked == {T.Q8_0, T.Q4_K, T.Q2_K, T.IQ2_XXS}


def test_split_file_references_each_part(mixed, tmp_path):
    """A byte-split file: a tensor in one part is referenced in that part (offset in it), one
    that straddles the cut by all the parts (offset into their concatenation)."""
    data = mixed["gguf"].read_bytes()
    src = conv.GGUFSource(mixed["gguf"])
    cut_in = src.tensors["blk.6.ffn_down_exps.weight"]
    cut = cut_in.offset + cut_in.nbytes // 2 + 1
    (tmp_path / "m.gguf.part1").write_bytes(data[:cut])
    (tmp_path / "m.gguf.part2").write_bytes(data[cut:])
    conv.convert(tmp_path / "m.gguf.part1", tmp_path / "out", workers=1, verify=True, progress=False)
    refs = json.loads((tmp_path / "out" / "config.json").read_text())["dsv4"]["tensors"]
    parts = [str(tmp_path / "m.gguf.part1"), str(tmp_path / "m.gguf.part2")]
    assert refs["layers.6.ffn.experts.w2.weight"]["parts"] == parts
    assert refs["layers.6.ffn.experts.w2.weight"]["offset"] == cut_in.offset
    assert refs["layers.7.ffn.experts.w2.weight"]["file"] == parts[1]
    assert refs["layers.0.attn.wq_a.weight"]["file"] == parts[0]
    files = {p: np.fromfile(p, np.uint8) for p in parts}
    for name, (qtype, blocks) in _gguf_py_tensors(mixed["gguf"]).items():
        if qtype not in gq.MAPPERS:
            continue
        ref = refs[name]
        whole = np.concatenate([files[p] for p in ref["parts"]]) if "parts" in ref else files[ref["file"]]
        got = whole[ref["offset"]: ref["offset"] + blocks.size]
        assert np.array_equal(got.reshape(blocks.shape), blocks), name


def test_verify_checks_the_references(mixed, tmp_path, monkeypatch):
    """--verify reads referenced rows as recorded: a reference one block off is caught."""
    real = conv.tensor_reference

    def off_by_a_block(src, t):
        ref = real(src, t)
        if t.name == "blk.3.ffn_up_exps.weight":
            ref["offset"] += gq.BLOCK_BYTES[t.qtype]
        return ref

    monkeypatch.setattr(conv, "tensor_reference", off_by_a_block)
    with pytest.raises(ConversionError, match=r"reference of layers\.3\.ffn\.experts\.w3\.weight "
                                              r"reads row 0 wrong"):
        conv.convert(mixed["gguf"], tmp_path / "out", workers=1, verify=True, progress=False)
    assert not (tmp_path / "out").exists()


def test_options_are_part_of_the_resume_fingerprint(mixed, kept, tmp_path, monkeypatch):
    """An interrupted --copy-weights conversion resumes with --copy-weights only."""
    real, calls = conv.run_job, []

    def interrupted(job):
        calls.append(job.name)
        if len(calls) == 60:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(conv, "run_job", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conv.convert(mixed["gguf"], tmp_path / "out", conv.Options(copy_weights=True), workers=1,
                     progress=False, max_shard_bytes=200_000)
    monkeypatch.setattr(conv, "run_job", real)
    with pytest.raises(ConversionError, match="cannot resume a conversion made with other inputs "
                                              "or options .*copy_weights"):
        conv.convert(mixed["gguf"], tmp_path / "out", workers=1, resume=True, progress=False,
                     max_shard_bytes=200_000)
    conv.convert(mixed["gguf"], tmp_path / "out", conv.Options(copy_weights=True), workers=1,
                 resume=True, progress=False, max_shard_bytes=200_000)
    a, b = _tensors(mixed["root"] / "copied"), _tensors(tmp_path / "out")
    assert set(a) == set(b) and all(np.array_equal(view(a[n]), view(b[n])) for n in a)


@pytest.mark.parametrize("options, match", [
    ({"affine": True, "copy_weights": True}, "--copy-weights applies to GGUF blocks"),
    ({"dequantize": "f32", "copy_weights": True}, "--copy-weights applies to GGUF blocks"),
    ({"dequantize": "f32", "affine": True}, "--affine and --dequantize exclude each other"),
    ({"dequantize": "f16"}, r"dequantize to 'f16': expected one of \['bf16', 'f32'\]"),
])
def test_contradicting_options_refused(options, match):
    with pytest.raises(ConversionError, match=match):
        conv.Options(**options)


def test_engram_rows_through_the_store(mixed):
    config = json.loads((mixed["out"] / "config.json").read_text())
    refs = config["dsv4"]["engram"]
    assert sorted(refs) == ["1", "3"]
    assert all(ref["offset"] % 16384 == 0 for ref in refs.values())  # as ds4 aligns them
    for layer, ref in refs.items():
        with open_table(ref, mixed["out"], head_dim=256) as table:
            rows = table.read_range(0, table.rows)
            ids = np.array([0, table.rows - 1, table.rows // 2])
            got = np.array(table.read(ids).astype(mx.float32))
        g = f"layers.{layer}.engram.embed"
        expected = np.concatenate([mixed["official"][f"{g}.weight"][1],
                                   mixed["official"][f"{g}.scale"][1]], axis=1)
        assert np.array_equal(rows, expected)
        codes, scales = expected[ids, :256], expected[ids, 256:]
        want = np.array(mx.from_fp8(mx.array(codes), mx.float32)) * \
            np.repeat(2.0 ** (scales.astype(np.float32) - 127), 32, axis=1)
        assert np.array_equal(got, want.astype(np.float32))


def test_tokenizer_round_trips(mixed):
    from tokenizers import Tokenizer, pre_tokenizers

    source = mixed["tokenizer"]
    rebuilt = Tokenizer.from_file(str(mixed["out"] / "tokenizer.json"))
    for text in CORPUS:
        ids = source.encode(text, add_special_tokens=False).ids
        assert rebuilt.encode(text, add_special_tokens=False).ids == ids, text
        decoded = source.decode(ids, skip_special_tokens=False)
        assert rebuilt.decode(ids, skip_special_tokens=False) == decoded
        assert rebuilt.decode(ids, skip_special_tokens=False) == text
    assert rebuilt.encode("hi").ids[0] == 0   # add_bos_token: BOS first
    assert rebuilt.token_to_id(NON_SPECIAL_ADDED) == source.token_to_id(NON_SPECIAL_ADDED)
    # the corpus tells DeepSeek's pre-tokenisation from plain byte-level splitting
    plain = Tokenizer.from_str(source.to_str())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert any(plain.encode(t, add_special_tokens=False).ids !=
               source.encode(t, add_special_tokens=False).ids for t in CORPUS)
    tok_config = json.loads((mixed["out"] / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<｜begin▁of▁sentence｜>" and tok_config["add_bos_token"]


def test_split_file_reads_as_one(mixed, tmp_path):
    data = mixed["gguf"].read_bytes()
    src = conv.GGUFSource(mixed["gguf"])
    first_table = min(t.offset for n, t in src.tensors.items() if "engram_embd" in n)
    cut = first_table - 5000                      # inside the resident weights
    (tmp_path / "m.gguf.part1").write_bytes(data[:cut])
    (tmp_path / "m.gguf.part2").write_bytes(data[cut:])
    conv.convert(tmp_path / "m.gguf.part1", tmp_path / "out", AFFINE, workers=1, progress=False)
    a, b = _tensors(mixed["out"]), _tensors(tmp_path / "out")
    assert set(a) == set(b) and all(np.array_equal(view(a[n]), view(b[n])) for n in a)
    refs = json.loads((tmp_path / "out" / "config.json").read_text())["dsv4"]["engram"]
    assert refs["1"]["file"] == str(tmp_path / "m.gguf.part2")
    assert refs["1"]["offset"] == first_table - cut
    with open_table(refs["1"], tmp_path / "out", head_dim=256) as table:
        in_file = np.frombuffer(data, np.uint8, table.rows * 264, first_table).reshape(-1, 264)
        assert np.array_equal(table.read_range(0, table.rows), in_file)
    # a missing last part: the tensor that ends past the data is named
    with pytest.raises(ConversionError, match=r"tensor blk\.\d+\.\w+\.weight ends at byte \d+, "
                                              r"but the file has \d+ bytes .*a missing part"):
        (tmp_path / "m.gguf.part2").rename(tmp_path / "m.gguf.partX")
        conv.GGUFSource(tmp_path / "m.gguf.part1")
    # a cut inside a table (not at a row boundary): referenced in place across both parts ...
    (tmp_path / "n.gguf.part1").write_bytes(data[:first_table + 1000])
    (tmp_path / "n.gguf.part2").write_bytes(data[first_table + 1000:])
    conv.convert(tmp_path / "n.gguf.part1", tmp_path / "out2", workers=1, progress=False)
    refs = json.loads((tmp_path / "out2" / "config.json").read_text())["dsv4"]["engram"]
    assert any("parts" in ref for ref in refs.values())
    for layer, ref in refs.items():
        with open_table(ref, tmp_path / "out2", head_dim=256) as table:
            assert np.array_equal(table.read_range(0, table.rows),
                                  mixed["tables"][f"blk.{layer}.engram_embd.weight"])
    # ... and --copy-engram copies it out of both parts
    conv.convert(tmp_path / "n.gguf.part1", tmp_path / "out3", workers=1, copy_engram=True,
                 progress=False)
    refs = json.loads((tmp_path / "out3" / "config.json").read_text())["dsv4"]["engram"]
    for layer, ref in refs.items():
        assert "parts" not in ref
        with open_table(ref, tmp_path / "out3", head_dim=256) as table:
            assert np.array_equal(table.read_range(0, table.rows),
                                  mixed["tables"][f"blk.{layer}.engram_embd.weight"])


def test_gguf_split_shards_read_as_one(mixed, tmp_path):
    """gguf-py's own gguf-split shards of the same model (metadata in the first, each shard its
    own tensors): the conversion is the single file's, every reference points into the shard
    that holds the tensor; a missing or renumbered shard is named."""
    made = write_ds4_gguf(tmp_path / "m.gguf", "q2", tokenizer=mixed["tokenizer"], config=mixed["config"],
                          split_max_size=1 << 20, alignment=None)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) > 2
    write_ds4_gguf(tmp_path / "one.gguf", "q2", tokenizer=mixed["tokenizer"], config=mixed["config"])
    conv.convert(shards[1], tmp_path / "out", workers=1, progress=False)     # any shard names the set
    conv.convert(tmp_path / "one.gguf", tmp_path / "want", workers=1, progress=False)
    a, b = _tensors(tmp_path / "want"), _tensors(tmp_path / "out")
    assert set(a) == set(b) and all(np.array_equal(view(a[n]), view(b[n])) for n in a)
    refs = json.loads((tmp_path / "out" / "config.json").read_text())["dsv4"]
    src = GGUFReader(shards[-1])
    last = {t.name: int(t.data_offset) for t in src.tensors}
    for name, ref in {**refs["tensors"], **refs["engram"]}.items():
        assert "parts" not in ref and Path(ref["file"]).name.startswith("m-")
    table = next(n for n in last if "engram_embd" in n)
    layer = table.split(".")[1]
    assert refs["engram"][layer] == {**refs["engram"][layer], "file": str(shards[-1]), "offset": last[table]}
    with open_table(refs["engram"][layer], tmp_path / "out", head_dim=256) as t:
        assert np.array_equal(t.read_range(0, t.rows), made["tables"][table])
    shards[1].rename(tmp_path / "m-moved.gguf")
    with pytest.raises(ConversionError, match=f"shard {shards[1].name} of the {len(shards)} is missing"):
        conv.GGUFSource(shards[0])
    (tmp_path / "m-moved.gguf").rename(shards[1])
    shards[1].rename(tmp_path / "x")
    shards[2].rename(shards[1])
    (tmp_path / "x").rename(shards[2])
    with pytest.raises(ConversionError, match=r"split.no 2 of split.count \d+, expected shard 1 "):
        conv.GGUFSource(shards[0])


@pytest.mark.parametrize("overrides, match", [
    ({"typed_overrides": {"num_attention_heads": 8}}, "deepseek41.num_attention_heads = 8"),
    ({"typed_overrides": {"routed_scaling_factor": 2.0}}, "routed_scaling_factor"),
    ({"engram_overrides": {"multipliers": [3] * 8}}, "multipliers disagrees"),
    ({"engram_overrides": {"pad_id": 7}}, "pad_id disagrees"),
    ({"skip": ("blk.5.attn_kv.weight",)}, "layers.5.attn.wkv.weight is missing"),
])
def test_bad_files_refused(tmp_path, mixed, overrides, match):
    path = tmp_path / "bad.gguf"
    write_ds4_gguf(path, "q2", tokenizer=mixed["tokenizer"], config=mixed["config"], **overrides)
    with pytest.raises(ConversionError, match=match):
        conv.convert(path, tmp_path / "out", workers=1, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize("arch, tensor, key, match", [
    ("deepseek4", "blk.0.ffn_gate_exps.weight", None, "DeepSeek V4 Flash GGUF"),
    ("deepseek41", "blk.1.engram_wkv.weight", "deepseek41.engram.head_count", "llama.cpp-dialect"),
    ("llama", "blk.0.attn_q.weight", None, "not a DeepSeek V4.1 Flash GGUF"),
])
def test_other_dialects_refused(tmp_path, arch, tensor, key, match):
    path = tmp_path / f"{arch}.gguf"
    w = GGUFWriter(str(path), arch)
    if key:
        w.add_uint32(key, 8)
    w.add_tensor(tensor, np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(conv.UnsupportedGGUF, match=match):
        conv.convert(path, tmp_path / "out", progress=False)


def test_resume_after_interruption(mixed, tmp_path, monkeypatch):
    """A conversion stopped after some shards resumes and gives the same tensors."""
    real, calls = conv.run_job, []

    def interrupted(job):
        calls.append(job.name)
        if len(calls) == 60:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(conv, "run_job", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conv.convert(mixed["gguf"], tmp_path / "out", AFFINE, workers=1, progress=False,
                     max_shard_bytes=2_000_000)
    finished = [p.name for p in (tmp_path / ".out.partial").glob("model-*.safetensors")]
    assert finished and not (tmp_path / "out").exists()
    monkeypatch.setattr(conv, "run_job", real)
    conv.convert(mixed["gguf"], tmp_path / "out", AFFINE, workers=1, resume=True, progress=False,
                 max_shard_bytes=2_000_000)
    a, b = _tensors(mixed["out"]), _tensors(tmp_path / "out")
    assert set(a) == set(b) and all(np.array_equal(view(a[n]), view(b[n])) for n in a)


def test_small_tasks_copied_tables_and_verify(mixed, tmp_path, monkeypatch):
    """Modules cut into many worker tasks give the same bytes; --copy-engram writes the
    tables into the directory (the store reads the same rows); --verify re-reads rows."""
    monkeypatch.setattr(conv, "CHUNK_WEIGHTS", 5000)  # several tasks per expert tensor
    conv.convert(mixed["gguf"], tmp_path / "out", AFFINE, workers=2, copy_engram=True,
                 verify=True, progress=False)
    a, b = _tensors(mixed["out"]), _tensors(tmp_path / "out")
    assert set(a) == set(b) and all(np.array_equal(view(a[n]), view(b[n])) for n in a)
    refs = json.loads((tmp_path / "out" / "config.json").read_text())["dsv4"]["engram"]
    assert refs["1"] == {"layout": "interleaved264", "file": "engram-01.bin", "offset": 0,
                         "rows": mixed["tables"]["blk.1.engram_embd.weight"].shape[0]}
    for layer, ref in refs.items():
        with open_table(ref, tmp_path / "out", head_dim=256) as table:
            assert np.array_equal(table.read_range(0, table.rows),
                                  mixed["tables"][f"blk.{layer}.engram_embd.weight"])


def test_command_line(mixed, tmp_path):
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command("gguf")(conv.gguf_command)
    app.command("other")(lambda: None)
    runner = CliRunner()
    bad = runner.invoke(app, ["gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "x")])
    assert bad.exit_code == 2 and bad.output == f"error: {tmp_path / 'missing.gguf'}: file not found\n"
    ok = runner.invoke(app, ["gguf", str(mixed["gguf"]), str(tmp_path / "out"),
                             "--affine", "--iq2-xxs-bits", "8", "--workers", "1"])
    assert ok.exit_code == 0, ok.output
    assert "layers.*.ffn.experts.w1 (IQ2_XXS)" in ok.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    q = config["quantization"]
    assert q.get("layers.0.ffn.experts.w1", q)["bits"] == 8   # as asked; 3 by default
    assert "added_relative_rms_error" not in config["dsv4"]["conversion"][
        "layers.*.ffn.experts.w1 (IQ2_XXS)"]
    lone = runner.invoke(app, ["gguf", str(mixed["gguf"]), str(tmp_path / "y"), "--q2-k-bits", "8"])
    assert lone.exit_code == 2 and lone.output == "error: --q2-k-bits applies to --affine\n"
    both = runner.invoke(app, ["gguf", str(mixed["gguf"]), str(tmp_path / "y"), "--affine",
                               "--copy-weights"])
    assert both.exit_code == 2 and both.output.startswith("error: --copy-weights applies to GGUF")
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("dst", ["q2", "."])
def test_overwrite_never_deletes_the_gguf(mixed, tmp_path, dst):
    """The result references the GGUF's Engram tables in place: a destination holding the
    .gguf is refused, with the folder and its other files as they were."""
    import shutil

    folder = tmp_path / "q2"
    folder.mkdir()
    gguf = shutil.copy(mixed["gguf"], folder / "model.gguf")
    (folder / "README.md").write_text("where I got it")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(ConversionError, match=f"contains {gguf}, a path the conversion reads"):
        conv.convert(gguf, tmp_path / dst, workers=1, overwrite=True, progress=False)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


@pytest.mark.parametrize("change, match", [
    ({"pre": "llama-bpe"}, "tokenizer.ggml.pre is 'llama-bpe'"),
    ({"merges": ["a b c"]}, r"merges\[0\] = 'a b c' is not two symbols"),
    ({"merges": ["a zz"]}, "merge 'a' 'zz' uses 'zz'"),
    ({"token_types": [1]}, "token_type has 1 entries for 5 tokens"),
    ({"bos_id": 9}, "bos_token_id 9 is outside the 5 tokens"),
])
def test_tokenizer_metadata_errors(change, match):
    from convert.gguf_tokenizer import TokenizerMetadataError, build

    meta = {"tokens": ["<s>", "a", "b", "ab", "x"], "token_types": [3, 1, 1, 1, 1],
            "merges": ["a b"], "pre": "joyai-llm", "bos_id": 0, "eos_id": 0, "add_bos": True,
            "add_eos": False}
    meta.update(change)
    with pytest.raises(TokenizerMetadataError, match=match):
        build(**meta, source="t.gguf")
