"""ds4's DSpark support GGUF converted beside its text GGUF (`dsv4_convert gguf --draft`,
convert/gguf_draft.py): the draft stages it holds are the official checkpoint's where its
precision is lossless (native: MXFP4 experts, F16 dense; bf16), give the logits of the same file
decoded at full precision where it is not (q2), and speculate exactly; bad support files are
refused with one line.

Forward checks run in f32 with the fp8/fp4 roundings off, as test_convert_gguf_model.py's do.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from mlx.utils import tree_flatten

import dsv4
from convert import gguf as conv
from convert import gguf_quants
from dsv4 import flags, loader
from dsv4.config import ModelArgs
from dsv4.speculative import Policy, Stats
from dsv4.testing import official_tensors, write_sharded
from tests.gguf_fixtures import (draft_fixture_config, fixture_config, source_tokenizer,
                                 write_dspark_gguf, write_ds4_gguf)
from tests.test_draft import block_logits
from tests.test_draft_step import FP32, SAMPLINGS, check_cycles
from tests.test_expert_streaming import least_gb
from tests.test_speculative import plain, speculate

SEED = 3
PROMPT = np.array([[0, 5, 17, 3, 99, 100, 101, 7, 250, 251, 252, 64, 65, 66, 67, 300, 12, 13]])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The text GGUF (q2 recipe), support files in three precisions with the metadata spelled as
    three ds4 revisions did, their conversions, and the official checkpoint of the same tensors."""
    root = tmp_path_factory.mktemp("gguf-draft")
    tokenizer = source_tokenizer()
    config = draft_fixture_config(tokenizer)
    write_ds4_gguf(root / "text.gguf", "q2", seed=SEED, tokenizer=tokenizer, config=config)
    spellings = {"native": "dspark.", "bf16": "deepseek4.dspark.", "q2": "deepseek4.dspark_"}
    out = {"root": root, "config": config, "tokenizer": tokenizer}
    for recipe, prefix in spellings.items():
        write_dspark_gguf(root / f"{recipe}.gguf", config, recipe, seed=SEED, prefix=prefix,
                          hc_head=recipe == "native")
    for name, recipe, options in (("native", "native", conv.Options()), ("bf16", "bf16", conv.Options()),
                                  ("q2", "q2", conv.Options()), ("q2-f32", "q2", conv.Options(dequantize="f32"))):
        out[name] = root / f"out-{name}"
        out[name, "report"] = conv.convert(root / "text.gguf", out[name], options, workers=1,
                                           progress=False, draft=root / f"{recipe}.gguf", verify=True)
    official = root / "official"
    official.mkdir()
    write_sharded(official, official_tensors(ModelArgs.from_dict(config), SEED), 1)
    (official / "config.json").write_text(json.dumps(config))
    out["official"] = official
    return out


def _model(path):
    with flags.override(draft="on"):
        model, _ = dsv4.load(path, dtype=mx.float32)
    return model


def _official_draft(made):
    with flags.override(draft="on"):
        draft = loader.load_draft(made["official"], made["config"], ModelArgs.from_dict(made["config"]))
    draft.set_dtype(mx.float32)
    return draft


def _outputs(model) -> np.ndarray:
    """The draft block's logits after PROMPT, the Markov bias and embedding of PROMPT's tokens,
    and the confidence of rows x = their embeddings' first D values: every head of the stages."""
    draft = model.draft
    with flags.override(kv_qdq=False, act_quant=False):
        logits = block_logits(model, PROMPT, [7, 11])
        bias, embed = draft.markov(mx.array(PROMPT[0, :draft.block_size]))
        x = model.embed(mx.array(PROMPT[:, :draft.block_size])).astype(mx.float32)
        confidence = draft.confidence(x, embed[None])
    return np.concatenate([a.reshape(-1) for a in (logits, np.array(bias), np.array(embed),
                                                   np.array(confidence))])


def test_mxfp4_rows_are_gguf_pys_values():
    """Every e2m1 code in every nibble position, scales from 2^-127 to 2^127."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (3, 5, 4 * 17), dtype=np.uint8)
    raw[..., ::17] = rng.integers(0, 253, raw[..., ::17].shape, dtype=np.uint8)
    raw[0, 0, 0], raw[0, 0, 17], raw[0, 1, 0] = 0, 252, 127
    weight, scales = gguf_quants.mxfp4(raw)
    got = mx.dequantize(mx.array(weight), mx.array(scales), group_size=32, bits=4, mode="mxfp4",
                        dtype=mx.float32)
    np.testing.assert_array_equal(np.array(got), gguf_dequantize(raw, T.MXFP4))


@pytest.mark.parametrize("recipe", ["native", "bf16"])
def test_lossless_support_files_hold_the_official_stages(made, recipe):
    """native: the routed experts' mxfp4 arrays are the official ones bit for bit; with either
    precision the stages' outputs on one backbone are the official stages' (a float Linear
    against mxfp8's product: the fp32 summation order only)."""
    model = _model(made[recipe])
    official = _official_draft(made)
    ours = dict(tree_flatten(model.draft.parameters()))
    theirs = dict(tree_flatten(official.parameters()))
    assert {n.rsplit(".", 1)[0] for n in ours} >= {n.rsplit(".", 1)[0] for n in theirs if ".experts." not in n}
    if recipe == "native":
        for name, array in theirs.items():
            if ".experts." in name:
                np.testing.assert_array_equal(np.array(ours[name]), np.array(array), err_msg=name)
    got = _outputs(model)
    model.draft = official
    want = _outputs(model)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_quantized_support_file_gives_its_full_precision_logits(made):
    """q2 (Q8_0 dense, IQ2_XXS / Q2_K experts) kept as GGUF blocks, read in place in the support
    file: the outputs of the same file dequantized to f32."""
    config = json.loads((made["q2"] / "config.json").read_text())
    stored = config["dsv4"]["draft"]
    assert stored["quantization"]["mtp.0.ffn.experts.w1"] == {"mode": "gguf", "type": "IQ2_XXS"}
    assert stored["quantization"]["mtp.1.ffn.experts.w2"] == {"mode": "gguf", "type": "Q2_K"}
    assert stored["tensors"]["mtp.2.attn.wq_a.weight"]["file"].endswith("q2.gguf")
    got, want = _outputs(_model(made["q2"])), _outputs(_model(made["q2-f32"]))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_report_and_config(made):
    report = made["native", "report"]
    assert report["mtp.*.ffn.experts.w1 (MXFP4)"]["to"] == "MLX mxfp4"
    assert report["mtp.*.attn.wq_a (F16)"]["tensors"] == 3
    q2 = made["q2", "report"]
    assert q2["mtp.*.ffn.experts.w2 (Q2_K)"]["to"] == conv.IN_PLACE
    text = json.loads((made["native"] / "config.json").read_text())["text_config"]
    assert text["dspark_block_size"] == made["config"]["text_config"]["dspark_block_size"]


@pytest.mark.parametrize("k", [2, 5])
def test_speculation_from_the_support_file_is_exact(made, k):
    model = _model(made["q2"])
    want, _ = plain(model, PROMPT, 40)
    got, _ = speculate(model, PROMPT, 40, Policy(k))
    assert got == want


def test_text_config_without_draft_fields_takes_the_support_files(made, tmp_path):
    """A text file whose config has no DSpark fields gets them from the support file's metadata;
    without the top-k there as well, nothing says it: refused."""
    tokenizer, config = made["tokenizer"], made["config"]
    write_ds4_gguf(tmp_path / "text.gguf", "q2", seed=SEED, tokenizer=tokenizer,
                   config=fixture_config(tokenizer))
    conv.convert(tmp_path / "text.gguf", tmp_path / "out", workers=1, progress=False,
                 draft=made["root"] / "native.gguf")
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    for field in ("dspark_block_size", "dspark_target_layer_ids", "dspark_num_experts_per_tok",
                  "num_nextn_predict_layers"):
        assert text[field] == config["text_config"][field]
    assert _model(tmp_path / "out").draft is not None
    write_dspark_gguf(tmp_path / "no-topk.gguf", config, "native", seed=SEED,
                      metadata={"expert_used_count": None})
    with pytest.raises(conv.ConversionError, match="give dspark_num_experts_per_tok"):
        conv.convert(tmp_path / "text.gguf", tmp_path / "out2", workers=1, progress=False,
                     draft=tmp_path / "no-topk.gguf")


@pytest.mark.parametrize("kwargs, match", [
    (dict(revision="1" * 40), "converted from revision 1{40} of the checkpoint, but .*text.gguf from 0{40}"),
    (dict(metadata={"block_size": 4}), "DSpark metadata disagrees with the text file: dspark_block_size = 4"),
    (dict(skip=("mtp.1.attn_q_b.weight",)), r"tensor for mtp.1.attn.wq_b.weight is missing"),
    (dict(skip=("mtp.0.main_proj.weight",)), r"not V4.1's drafter \(it has no mtp.0.main_proj.weight"),
    (dict(architecture="deepseek41"), "not a DSpark support GGUF .general.architecture is 'deepseek41'"),
])
def test_bad_support_files_refused(made, tmp_path, kwargs, match):
    write_dspark_gguf(tmp_path / "bad.gguf", made["config"], "native", seed=SEED, **kwargs)
    with pytest.raises(conv.ConversionError, match=match):
        conv.convert(made["root"] / "text.gguf", tmp_path / "out", workers=1, progress=False,
                     draft=tmp_path / "bad.gguf")
    assert not (tmp_path / "out").exists()


def test_command_line(made, tmp_path):
    """--draft on the command line; a support file that is not one: one line, status 2."""
    def run(dst, draft):
        return subprocess.run([sys.executable, "-m", "dsv4_convert", "gguf", str(made["root"] / "text.gguf"),
                               str(dst), "--workers", "1", "--draft", str(draft)], capture_output=True, text=True)

    done = run(tmp_path / "out", made["root"] / "native.gguf")
    assert done.returncode == 0, done.stderr
    assert "mtp.*.ffn.experts.w1 (MXFP4)" in done.stderr and (tmp_path / "out" / "mtp.safetensors").is_file()
    bad = run(tmp_path / "out2", made["root"] / "text.gguf")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a DSpark support GGUF" in bad.stderr
    # without --draft, a support file next to the text file is pointed out
    (made["root"] / "native.gguf").rename(made["root"] / "V41-DSpark-support.gguf")
    try:
        plain = subprocess.run([sys.executable, "-m", "dsv4_convert", "gguf", str(made["root"] / "text.gguf"),
                                str(tmp_path / "out3"), "--workers", "1"], capture_output=True, text=True)
    finally:
        (made["root"] / "V41-DSpark-support.gguf").rename(made["root"] / "native.gguf")
    assert plain.returncode == 0 and f"--draft {made['root'] / 'V41-DSpark-support.gguf'}" in plain.stderr


def test_fixed_propose_over_gguf_blocks(made):
    """The fixed-shape propose (dsv4/draft_step.py, compiled) with the q2 stages' GGUF modules
    gives the reference propose's drafts and confidence, cycle after cycle."""
    with flags.override(compile=True, **FP32):
        check_cycles(_model(made["q2"]), SAMPLINGS["greedy"], 0)


@pytest.mark.gpu
def test_gpu_fixed_propose_over_gguf_blocks(made):
    """The same on a GPU with every kernel (the GGUF matvec and experts kernels among them)
    against the reference propose without them (summation order apart: 1e-4)."""
    kernels_off = {flag: False for flag in flags.FLAGS if flag.startswith("kernel_")}
    with flags.override(compile=True, **FP32):
        check_cycles(_model(made["q2"]), SAMPLINGS["sampled-penalized"], 0, kernels_off, tol=1e-4)


def test_speculation_over_streamed_gguf_experts(made):
    """ds4 cannot combine V4.1's DSpark with SSD streaming; dsv4 can, from ds4's own files: the
    q2 text file's routed experts streamed from the GGUF at the least cache, the q2 support
    file's stages drafting, the verify as compiled segments around the expert lookups: plain
    decode's tokens on the resident model."""
    with flags.override(draft="on"):
        want, _ = plain(dsv4.load(made["q2"])[0], PROMPT, 24)
        streamed, _ = dsv4.load(made["q2"], expert_cache_gb=least_gb(made["q2"]))
    stats = Stats()
    with flags.override(fixed_verify=True, expert_step_segments=True, compile=True):
        got, _ = speculate(streamed, PROMPT, 24, Policy(3), stats=stats)
    assert got == want
    assert stats.verifies > 0 and streamed.expert_store.totals().misses > 0
    streamed.expert_store.close()


def test_planned_sizes_at_real_shapes_are_ds4s_published_ones():
    """benchmarks/convert_gguf.py's planner run at V4.1's shapes against what ds4 publishes:
    the Q2 text file's tensors 151.77 GiB less its image-routing biases (landscape: 151.77 GiB
    main + 188.83 GiB Engram), the DSpark support file ~7.88 GiB in its first precision (Q8_0
    dense, Q4_K experts, the Markov head F32). Within 0.5%: the tensor tables are ds4's."""
    from benchmarks.convert_gguf import real_shapes

    real = real_shapes(drafts=("q4 first", "q2"))
    gib = lambda r: sum(s.bytes_in for s in r["kept"].values()) / 2 ** 30
    assert gib(real["q2"]) == pytest.approx(151.77, rel=5e-3)
    assert gib(real["dspark q4 first"]) == pytest.approx(7.88, rel=5e-3)
    assert real["dspark q2"]["written"] < 0.05 * gib(real["dspark q2"]) * 2 ** 30
