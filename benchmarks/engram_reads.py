"""Engram row reads from a multi-GB table file: serial vs parallel decode, prefill batches, switches.

    python -m benchmarks.engram_reads                     # ~6 GB file in /tmp, dated report
    python -m benchmarks.engram_reads --rows 2000000 --runs 2 --no-report   # a quick look

Writes one synthetic file holding two tables at GGUF-like 16 KiB-aligned offsets (the second
crosses byte 2**32), 264-byte rows whose bytes are a hash of (table, row) so any row can be
checked without keeping the file's contents. Each pass is a fresh process (benchmarks.ab) that
first drops the file from the page cache (posix_fadvise DONTNEED) and checks every output bit:
- decode: 128 deterministic tokens, 24 rows from each of the two tables per token; both reads
  start, then both are waited for; ms per token (both tables), first pass of each variant excluded;
- decode while busy: the same, the caller running Python for 2 ms between starting and waiting
  (a decoder encoding its step): the native reader's threads against Python's, which need the GIL;
- prefill: the rows of a 4096-token prompt (4096 x 24 ids per table) in one batch read per table.
Variants alternate (A B | B A | ...). The file is deleted at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks import ab, hardware  # noqa: E402

ROW = 264
ALIGN = 16384
TOKENS = 128
ROWS_PER_TOKEN = 24
PROMPT_TOKENS = 4096


def row_bytes(table: int, rows: np.ndarray) -> np.ndarray:
    """The 264 bytes of each row of `table`: splitmix64 of (table, row, word), no NaN codes."""
    with np.errstate(over="ignore"):
        x = (rows.astype(np.uint64)[:, None] * np.uint64(33) + np.arange(33, dtype=np.uint64)
             + np.uint64(table << 48) + np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    raw = x.astype("<u8").view(np.uint8).reshape(len(rows), ROW)
    weight = raw[:, :256]
    weight[(weight & 0x7F) == 0x7F] ^= 1
    raw[:, 256:] = 112 + (raw[:, 256:] & 15)
    return raw


def layout(rows: int) -> list[int]:
    """Byte offsets of the two tables: after a 1-page 'header', each 16 KiB aligned."""
    first = ALIGN
    second = -(-(first + rows * ROW) // ALIGN) * ALIGN
    return [first, second]


def write_file(path: Path, rows: int, chunk: int = 1 << 20) -> list[int]:
    offsets = layout(rows)
    total = offsets[1] + rows * ROW
    start = time.monotonic()
    with open(path, "wb") as f:
        for table, offset in enumerate(offsets):
            f.seek(offset)
            for first in range(0, rows, chunk):
                f.write(row_bytes(table, np.arange(first, min(first + chunk, rows))).data)
                done = offset + min(first + chunk, rows) * ROW
                print(f"\rwriting {path}: {done / 2**30:.2f} / {total / 2**30:.2f} GiB "
                      f"({done / 2**20 / (time.monotonic() - start):.0f} MiB/s)",
                      end="", file=sys.stderr, flush=True)
        f.flush()
        os.fsync(f.fileno())
    print(file=sys.stderr)
    return offsets


def drop_cache(path: Path) -> bool:
    """Evict the file from the page cache where the OS allows; whether it could."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def id_sets(rows: int, shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    """Deterministic ids for each of the two tables."""
    return [np.random.default_rng([seed, table]).integers(0, rows, shape) for table in (0, 1)]


# --- one pass (a child process) --------------------------------------------------------------

def one_pass(args) -> dict:
    import mlx.core as mx
    from dsv4 import engram_store as es

    dropped = drop_cache(args.file)
    tables = [es.InterleavedTable(args.file, offset, args.rows, f"table{t}")
              for t, offset in enumerate(args.offsets)]
    digest = hashlib.md5()
    mismatches = 0

    def check(table: int, ids: np.ndarray, out) -> int:
        expected = es.dequantize_rows(row_bytes(table, ids.reshape(-1)), ids.shape)
        got = np.array(out.view(mx.uint16))
        digest.update(got.tobytes())
        return int(np.count_nonzero(got != np.array(expected.view(mx.uint16))))

    if args.mode == "decode":
        sets = id_sets(args.rows, (TOKENS, ROWS_PER_TOKEN), seed=7)
        times = []
        waits = []
        for token in range(TOKENS):
            for _ in range(args.repeat):
                start = time.perf_counter()
                requests = [t.start(ids[token]) for t, ids in zip(tables, sets)]
                busy(args.busy_ms)
                waited = time.perf_counter()
                outs = [r.wait() for r in requests]
                times.append(time.perf_counter() - start)
                waits.append(time.perf_counter() - waited)
            mx.eval(*outs)
            mismatches += sum(check(t, ids[token], out) for t, (ids, out) in enumerate(zip(sets, outs)))
        result = {"ms_per_token": 1000 * sum(times) / TOKENS,
                  "wait_ms_per_token": 1000 * sum(waits) / TOKENS,
                  "median_ms_per_read": 1000 * statistics.median(times),
                  "p90_ms_per_read": 1000 * float(np.percentile(times, 90))}
    else:
        sets = id_sets(args.rows, (PROMPT_TOKENS, ROWS_PER_TOKEN), seed=11)
        start = time.perf_counter()
        requests = [t.start(ids) for t, ids in zip(tables, sets)]
        outs = [r.wait() for r in requests]
        seconds = time.perf_counter() - start
        mx.eval(*outs)
        mismatches = sum(check(t, ids, out) for t, (ids, out) in enumerate(zip(sets, outs)))
        unique = sum(len(np.unique(ids)) for ids in sets)
        result = {"rows_per_s": 2 * PROMPT_TOKENS * ROWS_PER_TOKEN / seconds,
                  "distinct_rows_per_s": unique / seconds, "seconds": seconds}
    for t in tables:
        t.close()
    if mismatches:
        raise SystemExit(f"{mismatches} output values differ from the rows written")
    result.update(tokens_md5=digest.hexdigest(), cache_dropped=int(dropped))
    return result


def busy(ms: float) -> None:
    """Run Python (holding the GIL) for `ms`, as a decoder encoding its step does."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


# --- the experiments -------------------------------------------------------------------------

def experiments(args) -> list[tuple[str, str, list[ab.Variant], list[str]]]:
    """(title, what it decides, variants, extra child arguments)."""
    env = "DSV4_ENGRAM_"
    decode = ["--mode", "decode"]
    python = {env + "NATIVE_READS": "0"}   # the experiments of the Python threads' switches
    threads = [("python-serial", {**python, env + "PARALLEL_DECODE": "0"}),
               ("python-parallel-4", {**python, env + "PARALLEL_DECODE": "1", env + "DECODE_WORKERS": "4"}),
               ("native-4", {env + "NATIVE_READS": "1", env + "PARALLEL_DECODE": "1", env + "DECODE_WORKERS": "4"})]
    return [
        ("Decode while the caller runs Python for 2 ms after starting the reads (a step's "
         "encoding): the native reader's threads vs Python's", "engram_native_reads",
         [ab.Variant(name, variant_env, exact=True) for name, variant_env in threads],
         decode + ["--busy-ms", "2"]),
        ("Decode: serial vs parallel, with and without kernel read-ahead",
         "engram_parallel_decode, engram_readahead",
         [ab.Variant(name, {**python, env + "PARALLEL_DECODE": parallel, env + "DECODE_WORKERS": "4",
                            env + "READAHEAD": readahead}, exact=True)
          for name, parallel, readahead in [("serial", "0", "0"), ("parallel-4", "1", "0"),
                                            ("serial+readahead", "0", "1"),
                                            ("parallel-4+readahead", "1", "1")]], decode),
        ("Decode: workers per table", "engram_decode_workers",
         [ab.Variant(f"workers-{n}", {**python, env + "PARALLEL_DECODE": "1", env + "DECODE_WORKERS": str(n)},
                     exact=True) for n in (2, 4, 8)], decode),
        ("Decode: page-cache hints", "engram_io_hints",
         [ab.Variant(f"hints-{v}", {env + "IO_HINTS": v}, exact=True) for v in ("0", "1")], decode),
        ("Decode, each token's rows read twice (repeats): hot-row cache", "engram_row_cache",
         [ab.Variant(f"cache-{n}", {env + "ROW_CACHE": str(n)}, exact=True) for n in (0, 100000)],
         decode + ["--repeat", "2"]),
        ("Prefill: 4096-token prompt, batch read workers", "engram_prefill_workers",
         [ab.Variant(f"workers-{n}", {env + "PREFILL_WORKERS": str(n)}, exact=True)
          for n in (1, 4, 16, 32)], ["--mode", "prefill"]),
    ]


def render(when, machine, args, path_size, results, load) -> str:
    lines = ["# Engram row reads: serial vs parallel pread, prefill batches, switches", "",
             f"Date: {when:%Y-%m-%d %H:%M} UTC", "", "## Machine", "", hardware.to_markdown(machine),
             "", f"Disk: the file lives in {args.dir} ({_filesystem(args.dir)}). Load average "
             f"(1 min) at start / end: {load[0]} / {load[1]} (the machine is shared).", "",
             "## Setup", "",
             f"One file of {path_size / 2**30:.2f} GiB with two tables of {args.rows:,} rows of "
             f"{ROW} bytes ({args.rows * ROW / 2**30:.2f} GiB each) at offsets {args.offsets} "
             "(the second crosses byte 2**32). Every pass is a fresh process that drops the file "
             "from the page cache with posix_fadvise(DONTNEED) first, opens both tables and checks "
             "every output bit against the bytes written (bf16 of e4m3 * 2**(e8m0-127)); all "
             "variants of an experiment must give identical output (md5 over all outputs). "
             f"Decode: {TOKENS} tokens x {ROWS_PER_TOKEN} rows per table, both tables started "
             f"then waited; prefill: {PROMPT_TOKENS} tokens x {ROWS_PER_TOKEN} ids per table in "
             f"one batch read each. {args.warmup} warm-up pass(es) per variant excluded, then "
             f"{args.runs} measured; variants alternate A B | B A | ...; medians [min - max].", "",
             f"Reproduce: `python -m benchmarks.engram_reads --rows {args.rows} --runs {args.runs}`",
             ""]
    for title, flag, variants, runs in results:
        names = [v.name for v in variants]
        summary = ab.summarize(runs, names)
        problems = ab.check_exactness(runs, variants)
        metrics = [m for m in summary[names[0]] if m not in ("wall_s", "cache_dropped")]
        lines += [f"## {title}", "", f"Switch: `{flag}`.", ""]
        lines += ab._table(["metric", *names], [
            [m, *(f"{ab._fmt(summary[n][m].median)} [{ab._fmt(summary[n][m].min)} - "
                  f"{ab._fmt(summary[n][m].max)}]" for n in names)] for m in metrics])
        key = "ms_per_token" if "ms_per_token" in summary[names[0]] else "rows_per_s"
        base = summary[names[0]][key].median
        lines += ["", "Speed relative to " + names[0] + ": " + ", ".join(
            f"{n} {(base / summary[n][key].median if key == 'ms_per_token' else summary[n][key].median / base):.2f}x"
            for n in names[1:]) + ".", ""]
        dropped = all(r.result.get("cache_dropped") for r in runs)
        lines += [("Outputs identical across all passes." if not problems else
                   "**OUTPUTS DIFFER**: " + "; ".join(problems)) +
                  (" Page cache dropped before every pass." if dropped else
                   " The page cache could NOT be dropped on this OS."), ""]
    return "\n".join(lines)


def _filesystem(directory: Path) -> str:
    try:
        best = ("?", "?")
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, kind = line.split()[:3]
                if str(directory.resolve()).startswith(mount) and len(mount) >= len(best[1]):
                    best = (f"{kind} on {device}", mount)
        return best[0]
    except OSError:
        return "filesystem unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engram_reads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=12_000_000, help="rows per table")
    parser.add_argument("--runs", type=int, default=4, help="measured passes per variant")
    parser.add_argument("--warmup", type=int, default=1, help="passes per variant left out")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--only", help="run only experiments whose switch contains this text")
    parser.add_argument("--no-report", action="store_true", help="print, do not write a report")
    parser.add_argument("--out-dir", type=Path, default=ab.DEFAULT_OUT_DIR)
    # a single pass (the child process)
    parser.add_argument("--pass", dest="one_pass", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--offsets", type=lambda s: [int(x) for x in s.split(",")], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["decode", "prefill"], help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--busy-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one_pass:
        print(ab.RESULT_PREFIX + json.dumps(one_pass(args)), flush=True)
        return 0

    when = datetime.now(timezone.utc)
    load_start = ab._load_average()
    path = args.dir / f"dsv4-engram-bench-{os.getpid()}.bin"
    results = []
    try:
        args.offsets = write_file(path, args.rows)
        size = path.stat().st_size
        base = [sys.executable, "-m", "benchmarks.engram_reads", "--pass", "--file", str(path),
                "--rows", str(args.rows), "--offsets", ",".join(map(str, args.offsets))]
        for title, flag, variants, extra in experiments(args):
            if args.only and args.only not in flag:
                continue
            print(f"== {title}", file=sys.stderr)
            runs = ab.run_variants(base + extra, variants, args.runs, args.warmup)
            results.append((title, flag, variants, runs))
    finally:
        path.unlink(missing_ok=True)
    report = render(when, hardware.describe(), args, size, results,
                    (load_start, ab._load_average()))
    print(report)
    if not args.no_report:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        out = args.out_dir / f"{when:%Y-%m-%d-%H%M%S}-engram-reads.md"
        out.write_text(report)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
