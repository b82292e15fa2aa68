"""Compare variants of one command: fresh processes, interleaved order, medians, ratios, exactness.

    python -m benchmarks.ab --runs 5 --warmup 1 --exact qdq,qdq-again \\
        --variant "qdq: DSV4_KV_QDQ=1" --variant "noqdq: DSV4_KV_QDQ=0" \\
        -- python -m benchmarks.workloads --model /tmp/tiny --workload decode-512

A variant is `NAME: [ENV=VALUE ...] [ARG ...]`: the environment it sets and the arguments it
appends to the command after `--` (with no command after `--`, its arguments are the whole
command, which is how two implementations are compared). Every run is a fresh process that must
print one result line, `DSV4_RESULT {json}` (protocol in benchmarks/README.md). Runs go in rounds
A B | B A | A B ... so slow drift of a shared machine hits every variant alike; warm-up rounds come
first and are left out of the statistics. Variants declared exact (`--exact`) must produce the same
`tokens_md5` in every run, warm-ups included, or the report says so at its top and the exit status
is 1. Writes `<date>-ab-<label>.csv` (every run) and `.md` (the report) into --out-dir.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks import hardware  # noqa: E402

RESULT_PREFIX = "DSV4_RESULT "
STAGE_KEY = "stage_profile_ms"
HEADLINE = ("generation_tps", "generation_cpu_ms_per_token", "prompt_tps", "prompt_cpu_s", "ttft_s",
            "peak_memory_gb", "wall_s", "cpu_s")   # the first rows of a report, in this order
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"

_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


class BenchmarkError(RuntimeError):
    """A run failed or broke the result protocol; nothing is written."""


@dataclass
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    exact: bool = False

    def command(self, base: list[str]) -> list[str]:
        return [*base, *self.args]


def parse_variant(spec: str) -> Variant:
    """`NAME: ENV=VALUE ... ARG ...` -> Variant; leading KEY=VALUE words are the environment."""
    name, colon, rest = spec.partition(":")
    name = name.strip()
    if not colon or not _NAME.fullmatch(name):
        raise ValueError(f"variant {spec!r}: expected 'NAME: [ENV=VALUE ...] [ARG ...]' "
                         "with NAME made of letters, digits and _.+-")
    words = shlex.split(rest)
    env = {}
    while words and _ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return Variant(name, env, words)


def schedule(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) in run order: forward on even rounds, backward on odd ones (A B B A A B ...)."""
    return [(r, name) for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def tokens_md5(ids) -> str:
    """md5 of the token ids written in decimal and joined by commas: "1,2,3" (the protocol's digest)."""
    return hashlib.md5(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def parse_result(stdout: str) -> dict:
    """The JSON of the last line starting with `DSV4_RESULT ` (tokens_md5 derived from `tokens`)."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise BenchmarkError(f"no line starting with {RESULT_PREFIX!r} in its stdout "
                             "(the result protocol is in benchmarks/README.md)")
    try:
        result = json.loads(lines[-1][len(RESULT_PREFIX):])
    except json.JSONDecodeError as error:
        raise BenchmarkError(f"its result line is not JSON ({error}): {lines[-1][:200]!r}") from None
    if not isinstance(result, dict):
        raise BenchmarkError(f"its result line must hold a JSON object, got: {lines[-1][:200]!r}")
    if "tokens" in result and "tokens_md5" not in result:
        result["tokens_md5"] = tokens_md5(result["tokens"])
    return result


@dataclass
class Run:
    order: int
    round: int
    variant: str
    warmup: bool
    wall_s: float
    cpu_s: float
    result: dict

    def metrics(self) -> dict[str, float]:
        """wall_s (process start to exit), cpu_s, every numeric key of the result, each stage."""
        numbers = {"wall_s": self.wall_s, "cpu_s": self.cpu_s}
        for key, value in self.result.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numbers[key] = float(value)
        for stage, ms in self.result.get(STAGE_KEY, {}).items():
            numbers[f"{STAGE_KEY}.{stage}"] = float(ms)
        return numbers


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(base: list[str], variant: Variant, timeout_s: float) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of all its threads, result) of one fresh process."""
    command = variant.command(base)
    cpu_start = _children_cpu_s()
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env={**os.environ, **variant.env}, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"variant {variant.name}: `{shlex.join(command)}` ran longer than "
                             f"{timeout_s} s") from None
    wall_s = time.perf_counter() - start
    cpu_s = _children_cpu_s() - cpu_start
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise BenchmarkError(f"variant {variant.name}: `{shlex.join(command)}` exited with status "
                             f"{proc.returncode}; end of its stderr:\n{tail}")
    try:
        return wall_s, cpu_s, parse_result(proc.stdout)
    except BenchmarkError as error:
        raise BenchmarkError(f"variant {variant.name}: `{shlex.join(command)}`: {error}") from None


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_variants(base: list[str], variants: list[Variant], runs: int, warmup: int,
                 timeout_s: float = 600.0, log=_progress) -> list[Run]:
    """Run every variant `warmup + runs` times, one fresh process each, in interleaved order."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must differ, got {names}")
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs} warmup={warmup}")
    by_name = {v.name: v for v in variants}
    plan = schedule(names, warmup + runs)
    done = []
    for order, (round_, name) in enumerate(plan):
        wall_s, cpu_s, result = run_once(base, by_name[name], timeout_s)
        run = Run(order, round_, name, round_ < warmup, wall_s, cpu_s, result)
        done.append(run)
        shown = {k: v for k, v in run.metrics().items() if not k.startswith(STAGE_KEY)}
        log(f"[{order + 1}/{len(plan)}] {'warm-up ' if run.warmup else ''}{name}: "
            + " ".join(f"{k}={v:.4g}" for k, v in shown.items()))
    return done


@dataclass(frozen=True)
class Stats:
    median: float
    min: float
    max: float
    n: int


def summarize(runs: list[Run], names: list[str]) -> dict[str, dict[str, Stats]]:
    """variant -> metric -> Stats over the measured (non-warm-up) runs that report the metric."""
    summary = {}
    for name in names:
        values: dict[str, list[float]] = {}
        for run in runs:
            if run.variant == name and not run.warmup:
                for key, value in run.metrics().items():
                    values.setdefault(key, []).append(value)
        summary[name] = {key: Stats(statistics.median(v), min(v), max(v), len(v))
                         for key, v in values.items()}
    return summary


def ratios(summary: dict[str, dict[str, Stats]], names: list[str]) -> dict[str, dict[str, float]]:
    """metric -> {"B/A": median(B) / median(A)} for every pair A before B in `names`."""
    table: dict[str, dict[str, float]] = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for metric, stats_a in summary[a].items():
                stats_b = summary[b].get(metric)
                if stats_b is not None and stats_a.median != 0:
                    table.setdefault(metric, {})[f"{b}/{a}"] = stats_b.median / stats_a.median
    return table


def distinct_outputs(runs: list[Run]) -> dict[str, list[str]]:
    """variant -> the distinct tokens_md5 its runs produced (warm-ups included), in first-seen order."""
    seen: dict[str, list[str]] = {}
    for run in runs:
        md5s = seen.setdefault(run.variant, [])
        md5 = run.result.get("tokens_md5")
        if md5 is not None and md5 not in md5s:
            md5s.append(md5)
    return seen


def check_exactness(runs: list[Run], variants: list[Variant]) -> list[str]:
    """What breaks the exactness claim: every run of every exact variant must print one same md5."""
    exact = [v.name for v in variants if v.exact]
    problems = []
    sources: dict[str, list[str]] = {}
    for run in runs:
        if run.variant not in exact:
            continue
        label = f"{run.variant} run {run.order + 1}{' (warm-up)' if run.warmup else ''}"
        md5 = run.result.get("tokens_md5")
        if md5 is None:
            problems.append(f"{label}: its result has no tokens_md5, so exactness cannot be checked")
        else:
            sources.setdefault(md5, []).append(label)
    if len(sources) > 1:
        problems.append(f"variants declared exact ({', '.join(exact)}) produced {len(sources)} "
                        "different outputs: " + "; ".join(
                            f"{md5} from {', '.join(labels)}" for md5, labels in sources.items()))
    return problems


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render_report(title: str, when: datetime, machine: dict, base: list[str],
                  variants: list[Variant], runs: list[Run], warmup: int, problems: list[str],
                  csv_name: str, invocation: str, load: tuple[str, str], revision: str,
                  note: str = "") -> str:
    names = [v.name for v in variants]
    summary = summarize(runs, names)
    measured = max((s.n for s in summary[names[0]].values()), default=0)
    lines = [f"# A/B: {title}", "", f"Date: {when:%Y-%m-%d %H:%M} UTC", ""]
    if problems:
        lines += ["**EXACTNESS CHECK FAILED**: variants declared exact did not produce identical "
                  "tokens.", ""] + [f"- {p}" for p in problems] + [""]
    if note:
        lines += [note, ""]
    lines += ["## Machine", "", hardware.to_markdown(machine), "",
              f"Load average (1 min) at start / end: {load[0]} / {load[1]}.", "",
              f"Code: {revision} (run from {os.getcwd()}).", "",
              "## Variants", "", f"Command: `{shlex.join(base) if base else '(per variant)'}`", ""]
    lines += _table(["variant", "environment", "extra arguments", "declared exact"],
                    [[v.name, " ".join(f"{k}={val}" for k, val in v.env.items()) or "-",
                      f"`{shlex.join(v.args)}`" if v.args else "-", "yes" if v.exact else "no"]
                     for v in variants])
    first_rounds = " | ".join(" ".join(n for r, n in schedule(names, 2) if r == k) for k in (0, 1))
    lines += ["", f"Each variant: {warmup} warm-up run(s), then {measured} measured run(s); every run "
              f"a fresh process; order interleaved by rounds ({first_rounds} | ...).", "",
              f"Reproduce: `{invocation}`", "",
              "## Results", "", f"Median [min - max] over the {measured} measured runs of each "
              "variant. wall_s is the whole process (start-up and loading included); cpu_s its CPU time (all "
              "threads), less sensitive than wall time to other jobs on a shared machine.", ""]
    found = list(dict.fromkeys(m for n in names for m in summary[n]))
    metrics = [m for m in HEADLINE if m in found] + [
        m for m in found if m not in HEADLINE and not m.startswith(STAGE_KEY)]
    lines += _table(["metric", *names], [
        [m, *(f"{_fmt(s.median)} [{_fmt(s.min)} - {_fmt(s.max)}]" if (s := summary[n].get(m))
              else "-" for n in names)] for m in metrics])
    pair_ratios = ratios(summary, names)
    pairs = [f"{b}/{a}" for i, a in enumerate(names) for b in names[i + 1:]]
    lines += ["", "## Ratios", "", "Median of the first variant named over median of the second "
              "(above 1: larger; for tokens/s larger is faster, for seconds smaller is faster).", ""]
    lines += _table(["metric", *pairs], [[m, *(_fmt(pair_ratios[m][p]) if p in pair_ratios.get(m, {})
                                               else "-" for p in pairs)] for m in metrics])
    outputs = distinct_outputs(runs)
    lines += ["", "## Outputs", ""]
    lines += _table(["variant", "declared exact", "distinct tokens_md5 (all runs)"],
                    [[v.name, "yes" if v.exact else "no",
                      ", ".join(outputs.get(v.name, [])) or "none reported"] for v in variants])
    exact = [v.name for v in variants if v.exact]
    if exact and not problems:
        lines += ["", f"Exactness: every run of {', '.join(exact)} produced the same tokens "
                  f"({outputs[exact[0]][0]})."]
    elif not exact:
        lines += ["", "Exactness: no variant was declared exact; outputs are listed, not checked."]
    stages = [m for m in found if m.startswith(STAGE_KEY)]
    if stages:
        lines += ["", "## Stage profile", "", "Milliseconds per decode step (median over runs) "
                  "from DSV4_STAGE_PROFILE=1; each stage boundary forces a sync (see "
                  "dsv4/profiler.py), so these totals are perturbed.", ""]
        lines += _table(["stage", *names], [
            [s[len(STAGE_KEY) + 1:], *(_fmt(summary[n][s].median) if s in summary[n] else "-"
                                       for n in names)] for s in stages])
    lines += ["", "## Every run", "", f"[{csv_name}]({csv_name}): one row per run, warm-ups "
              "included, in run order.", ""]
    return "\n".join(lines)


def runs_csv(runs: list[Run]) -> str:
    columns: list[str] = []
    for run in runs:
        columns += [key for key in run.metrics() if key not in columns]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["order", "round", "variant", "warmup", *columns, "tokens_md5"])
    for run in runs:
        numbers = run.metrics()
        writer.writerow([run.order + 1, run.round + 1, run.variant, int(run.warmup),
                         *(repr(numbers[c]) if c in numbers else "" for c in columns),
                         run.result.get("tokens_md5", "")])
    return out.getvalue()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def code_revision() -> str:
    """The git commit the code ran from, and whether tracked files differed from it."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return commit + (" with uncommitted changes" if dirty else "")


def _load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    base = argv[argv.index("--") + 1:] if "--" in argv else []
    options = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True,
                        help="'NAME: [ENV=VALUE ...] [ARG ...]'; give two or more")
    parser.add_argument("--runs", type=int, default=5, help="measured runs per variant")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up runs per variant")
    parser.add_argument("--exact", action="append", default=[],
                        help="comma-separated names of variants that must produce identical tokens")
    parser.add_argument("--label", help="file-name label (default: the variant names)")
    parser.add_argument("--note", default="", help="a sentence for the report (e.g. the model used)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    args = parser.parse_args(options)

    variants = [parse_variant(spec) for spec in args.variant]
    names = [v.name for v in variants]
    if len(variants) < 2:
        parser.error("give at least two --variant")
    for name in (n for group in args.exact for n in group.split(",") if n):
        if name not in names:
            parser.error(f"--exact names {name!r}, which is not a variant ({', '.join(names)})")
        next(v for v in variants if v.name == name).exact = True
    for v in variants:
        if not v.command(base):
            parser.error(f"variant {v.name} has no command: give one after `--` or in the variant")

    when = datetime.now(timezone.utc)
    load_start, revision = _load_average(), code_revision()
    try:
        runs = run_variants(base, variants, args.runs, args.warmup, args.timeout)
    except BenchmarkError as error:
        print(f"error: {error}\nno report written.", file=sys.stderr)
        return 2
    problems = check_exactness(runs, variants)
    label = re.sub(r"[^A-Za-z0-9_.+-]+", "-", args.label or "-vs-".join(names))
    stem = f"{when:%Y-%m-%d-%H%M%S}-ab-{label}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = args.out_dir / f"{stem}.csv", args.out_dir / f"{stem}.md"
    invocation = shlex.join(["python", "-m", "benchmarks.ab", *argv])
    report = render_report(" vs ".join(names), when, hardware.describe(), base, variants, runs,
                           args.warmup, problems, csv_path.name, invocation,
                           (load_start, _load_average()), revision, args.note)
    _write_atomic(csv_path, runs_csv(runs))
    _write_atomic(md_path, report)
    print(report)
    print(f"\nwrote {md_path}\nwrote {csv_path}", file=sys.stderr)
    if problems:
        print("\nEXACTNESS CHECK FAILED:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
