"""The A/B harness on a cheap child command: order, fresh processes, statistics, exactness, files;
the standard workloads' timing and greedy generation.

The child is a few lines of Python that logs its variant and pid, and reports a value chosen from
a list by how many times its variant ran before; so the test knows every number it will see and
checks the harness against numpy's median and plain arithmetic.
"""

import csv
import hashlib
import os
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import ab, hardware, workloads
from dsv4 import flags, profiler

CHILD = r"""
import json, os, sys, time
name, log = os.environ["AB_NAME"], os.environ["AB_LOG"]
with open(log, "a") as f:
    f.write(f"{name} {os.getpid()}\n")
with open(log) as f:
    k = [line.split()[0] for line in f].count(name) - 1
tokens = [int(t) for t in os.environ.get("AB_TOKENS", "1,2,3").split(",")]
if os.environ.get("AB_TOKENS_VARY"):
    tokens.append(k)
if os.environ.get("AB_BUSY_S"):       # burn CPU time, measured by the child itself
    stop = time.process_time() + float(os.environ["AB_BUSY_S"])
    while time.process_time() < stop:
        pass
if os.environ.get("AB_SLEEP_S"):
    time.sleep(float(os.environ["AB_SLEEP_S"]))
if os.environ.get("AB_FAIL"):
    sys.exit("child failed on purpose")
print("some other output")
value = float(os.environ["AB_VALUES"].split(",")[k])
print("DSV4_RESULT " + json.dumps({"generation_tps": value, "tokens": tokens, "argv": sys.argv[1:]}))
"""
BASE = [sys.executable, "-c", CHILD]


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "runs.log"
    monkeypatch.setenv("AB_LOG", str(path))
    return path


def _logged(path):
    return [line.split() for line in path.read_text().splitlines()]


def _spec(name, values, extra=""):
    return f"{name}: AB_NAME={name} AB_VALUES={','.join(map(str, values))} {extra}"


def test_schedule_alternates_direction_every_round():
    assert [n for _, n in ab.schedule(["A", "B"], 4)] == list("ABBAABBA")
    assert [n for _, n in ab.schedule(["A", "B", "C"], 3)] == list("ABCCBAABC")
    assert [r for r, _ in ab.schedule(["A", "B"], 2)] == [0, 0, 1, 1]


def test_parse_variant_splits_environment_from_arguments():
    v = ab.parse_variant("qdq-off: DSV4_KV_QDQ=0 X=a=b --max-tokens 8 'two words' Y=not-env")
    assert v.name == "qdq-off"
    assert v.env == {"DSV4_KV_QDQ": "0", "X": "a=b"}
    assert v.args == ["--max-tokens", "8", "two words", "Y=not-env"]
    with pytest.raises(ValueError, match="NAME"):
        ab.parse_variant("no colon here")


def test_each_run_is_a_fresh_process_in_interleaved_order(log):
    variants = [ab.parse_variant(_spec("A", [0] * 4, "--flag-a")), ab.parse_variant(_spec("B", [0] * 4))]
    runs = ab.run_variants(BASE, variants, runs=3, warmup=1, log=lambda _: None)
    logged = _logged(log)
    assert [name for name, _ in logged] == list("ABBAABBA")
    assert len({pid for _, pid in logged}) == 8
    assert [r.variant for r in runs] == list("ABBAABBA")
    assert [r.warmup for r in runs] == [True, True] + [False] * 6
    assert all(r.result["argv"] == (["--flag-a"] if r.variant == "A" else []) for r in runs)


def test_medians_extremes_and_ratios_leave_out_warmups(log):
    a_values, b_values = [1000, 10, 40, 20, 30], [0.001, 5, 7, 100, 9]   # first: warm-up
    variants = [ab.parse_variant(_spec("A", a_values)), ab.parse_variant(_spec("B", b_values))]
    runs = ab.run_variants(BASE, variants, runs=4, warmup=1, log=lambda _: None)
    summary = ab.summarize(runs, ["A", "B"])
    for name, values in (("A", a_values[1:]), ("B", b_values[1:])):
        stats = summary[name]["generation_tps"]
        assert stats.median == pytest.approx(np.median(values))
        assert (stats.min, stats.max, stats.n) == (min(values), max(values), 4)
    ratio = ab.ratios(summary, ["A", "B"])["generation_tps"]["B/A"]
    assert ratio == pytest.approx(np.median(b_values[1:]) / np.median(a_values[1:]))
    walls = [r.wall_s for r in runs if r.variant == "A" and not r.warmup]
    assert summary["A"]["wall_s"].median == pytest.approx(np.median(walls))


def test_cpu_time_counts_work_and_not_waiting(log):
    variants = [ab.parse_variant(_spec("busy", [1, 1], "AB_BUSY_S=0.3")),
                ab.parse_variant(_spec("sleepy", [1, 1], "AB_SLEEP_S=0.3"))]
    runs = ab.run_variants(BASE, variants, runs=1, warmup=0, log=lambda _: None)
    busy, sleepy = sorted(runs, key=lambda r: r.variant)
    assert busy.cpu_s >= 0.3
    assert sleepy.wall_s >= 0.3 and sleepy.cpu_s < 0.2


def test_result_protocol_takes_the_last_line_and_digests_tokens():
    out = "DSV4_RESULT {\"x\": 1}\nlog\nDSV4_RESULT {\"tokens\": [5, 17, 3], \"prompt_tps\": 2.5}\n"
    result = ab.parse_result(out)
    assert result["tokens_md5"] == hashlib.md5(b"5,17,3").hexdigest()
    assert "x" not in result
    with pytest.raises(ab.BenchmarkError, match="no line starting with"):
        ab.parse_result("prompt_tps 3\n")
    with pytest.raises(ab.BenchmarkError, match="not JSON"):
        ab.parse_result("DSV4_RESULT {oops\n")


def test_exactness_holds_for_identical_tokens_and_fires_for_different_ones(log):
    same = [ab.parse_variant(_spec(n, [1] * 3, )) for n in ("A", "B")]
    for v in same:
        v.exact = True
    runs = ab.run_variants(BASE, same, runs=2, warmup=1, log=lambda _: None)
    assert ab.check_exactness(runs, same) == []

    log.unlink()
    differ = [ab.parse_variant(_spec("A", [1] * 3)),
              ab.parse_variant(_spec("B", [1] * 3, "AB_TOKENS=1,2,4"))]
    for v in differ:
        v.exact = True
    runs = ab.run_variants(BASE, differ, runs=2, warmup=1, log=lambda _: None)
    problems = ab.check_exactness(runs, differ)
    assert len(problems) == 1 and "2 different outputs" in problems[0]
    differ[1].exact = False   # B is allowed to differ; A alone is consistent
    assert ab.check_exactness(runs, differ) == []


def test_exactness_fires_when_one_variant_is_not_deterministic(log):
    variants = [ab.parse_variant(_spec("A", [1] * 3, "AB_TOKENS_VARY=1")),
                ab.parse_variant(_spec("B", [1] * 3))]
    variants[0].exact = True
    runs = ab.run_variants(BASE, variants, runs=2, warmup=1, log=lambda _: None)
    problems = ab.check_exactness(runs, variants)
    assert len(problems) == 1 and "3 different outputs" in problems[0]


def test_main_writes_csv_and_report_and_flags_inexact_variants(log, tmp_path):
    out = tmp_path / "results"
    code = ab.main(["--runs", "2", "--warmup", "1", "--exact", "A,B", "--out-dir", str(out),
                    "--note", "cheap child", "--variant", _spec("A", [3, 4, 6]),
                    "--variant", _spec("B", [3, 8, 9], "AB_TOKENS=9"), "--", *BASE])
    assert code == 1
    md, = out.glob("*-ab-A-vs-B.md")
    table, = out.glob("*-ab-A-vs-B.csv")
    text = md.read_text()
    assert text.index("EXACTNESS CHECK FAILED") < text.index("## Machine")
    assert f"| mlx_version | {mx.__version__} |" in text
    assert "| generation_tps | 5 [4 - 6] | 8.5 [8 - 9] |" in text
    assert "| generation_tps | 1.7 |" in text          # 8.5 / 5
    assert "cheap child" in text and table.name in text
    rows = list(csv.DictReader(table.open()))
    assert [r["variant"] for r in rows] == list("ABBAAB")
    assert [float(r["generation_tps"]) for r in rows] == [3, 3, 8, 4, 6, 9]
    assert [r["warmup"] for r in rows] == ["1", "1", "0", "0", "0", "0"]
    assert {r["tokens_md5"] for r in rows if r["variant"] == "B"} == {hashlib.md5(b"9").hexdigest()}
    assert not list(out.glob("*.tmp"))


def test_main_exact_variants_that_agree_exit_zero(log, tmp_path):
    code = ab.main(["--runs", "1", "--warmup", "0", "--exact", "A", "--exact", "B",
                    "--out-dir", str(tmp_path), "--label", "agree",
                    "--variant", _spec("A", [1]), "--variant", _spec("B", [2]), "--", *BASE])
    assert code == 0
    text, = [p.read_text() for p in tmp_path.glob("*-ab-agree.md")]
    assert "EXACTNESS CHECK FAILED" not in text
    assert f"produced the same tokens ({hashlib.md5(b'1,2,3').hexdigest()})" in text


def test_a_failing_run_stops_the_benchmark_and_writes_nothing(log, tmp_path, capsys):
    code = ab.main(["--runs", "2", "--warmup", "0", "--out-dir", str(tmp_path),
                    "--variant", _spec("A", [1, 1]), "--variant", _spec("B", [1, 1], "AB_FAIL=1"),
                    "--", *BASE])
    assert code == 2
    assert "variant B" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [log]


def test_hardware_describes_this_machine():
    info = hardware.describe()
    assert info["mlx_version"] == mx.__version__
    assert info["cpu_cores"] == os.cpu_count()
    assert info["mlx_backend"] in ("cpu", "metal", "cuda")
    lines = hardware.to_markdown(info).splitlines()
    assert len(lines) == 2 + len(info)
    assert f"| cpu_cores | {os.cpu_count()} |" in lines


# --- the standard workloads -------------------------------------------------------------------

def test_measure_times_a_stream_of_tokens():
    def stream():
        time.sleep(0.05)            # the prompt
        yield 7
        for token in (8, 9, 10):
            time.sleep(0.02)
            yield token

    result = workloads.measure(stream(), prompt_tokens=100)
    assert result["tokens"] == [7, 8, 9, 10] and result["generation_tokens"] == 4
    assert result["tokens_md5"] == hashlib.md5(b"7,8,9,10").hexdigest()
    assert result["ttft_s"] >= 0.05
    assert result["prompt_tps"] == pytest.approx(100 / result["ttft_s"])
    assert 0 < result["generation_tps"] <= 3 / 0.06
    assert result["generation_cpu_ms_per_token"] < 10   # sleeping is not CPU time
    assert workloads.measure(iter([5]), 3)["generation_tokens"] == 1


def test_synthetic_prompt_depends_only_on_the_seed():
    a = workloads.synthetic_prompt(1000, 50, seed=3)
    assert a == workloads.synthetic_prompt(1000, 50, seed=3)
    assert a != workloads.synthetic_prompt(1000, 50, seed=4)
    assert len(a) == 1000 and min(a) >= 0 and max(a) < 50 and len(set(a)) == 50


def test_synthetic_workload_prints_a_result_line_with_the_stage_profile(capsys):
    with flags.override(stage_profile=True):
        assert workloads.main(["--model", "synthetic", "--prompt-tokens", "4",
                               "--generation-tokens", "3"]) == 0
    profiler.reset()
    out, err = capsys.readouterr()
    result = ab.parse_result(out)
    assert result["generation_tokens"] == 3 and result["workload"] == "custom"
    assert list(result["stage_profile_ms"]) == ["embed", "attention", "moe", "head", "sampling",
                                                profiler.UNMARKED]
    assert "stage profile: 2 decode steps" in err


def test_model_workload_is_greedy_and_ignores_end_of_sequence(tmp_path):
    from dsv4 import load
    from dsv4.generation import stream_generate
    from dsv4.testing import write_tiny_checkpoint

    model, tokenizer = load(write_tiny_checkpoint(tmp_path / "tiny", seed=0))
    tokenizer.eos_token_ids = set(range(model.args.vocab_size))   # every token ends a sequence
    prompt = workloads.synthetic_prompt(6, model.args.vocab_size, seed=0)
    assert len(list(stream_generate(model, tokenizer, prompt, max_tokens=4))) == 1
    ids = list(workloads.model_tokens(model, tokenizer, prompt, max_tokens=4))
    cache, expected, inputs = model.make_cache(), [], prompt
    for _ in range(4):           # greedy by hand: the argmax of the last position, fed back
        logits = model(mx.array(inputs)[None], cache=cache)
        expected.append(int(mx.argmax(logits[0, -1]).item()))
        inputs = expected[-1:]
    assert ids == expected
