"""Decoding with value tables larger than memory (issue 11): `memory_offload="disk"` / `"cpu"` at the paper's sizes.

Each run loads a random-weight checkpoint (written once by `ultramem.offload.random_checkpoint`, streamed, never
held in memory) in its own process, evicts the checkpoint file from the page cache first (a cold start: every
selected row comes from disk), prefills a 16-token prompt, and times 32 greedy decoding steps (DynamicCache).
It reports the time per step (one token for each of the batch's sequences), tokens/s, the peak resident memory
of the process (VmHWM: anonymous memory plus the mapped file pages it touched), the value rows read and the
bytes a step had read from storage (rows not in the page cache).

CPU, this machine (24 GB RAM; ultramem-1.6b-x12 is 43.9 GB in bf16; checkpoints built when missing, and those
built by the run deleted after it with --cleanup):

    OMP_NUM_THREADS=1 python benchmarks/bench_offload.py --device cpu --checkpoints /tmp/offload_bench --build --cleanup

Runs (`--runs`): `dense` = dense-1.6b in memory; `disk` / `disk-sync` = ultramem-1.6b-x12 with its tables
memory-mapped, lookups in the skip-layer window on a background thread / blocking (the overlap, measured);
`disk-x1/16`, `disk-x1/4` = the same model with 16x / 4x fewer value rows (the time as the table grows 16x);
`disk-t151m`, `disk-t151m-x4`, `disk-t151m-x16` = the same model with tables of ultramem-151m-x12's size (3.7 GB)
and 4x / 16x that (up to 59.3 GB: a 64 GB checkpoint, one at a time on disk with --cleanup).

Quantized tables (docs/quantized.md; the checkpoints written with them by the random-checkpoint builder):
`cpu-int4` = ultramem-1.6b-x12 with int4 tables read into host memory (`memory_offload="cpu"`, 10.0 GB of tables),
`disk-int8` / `disk-int4` = int8 / int4 tables memory-mapped (19.9 / 10.0 GB); the summary gives each against
`dense` and against `disk` (bf16 tables memory-mapped):

    OMP_NUM_THREADS=1 python benchmarks/bench_offload.py --device cpu --checkpoints /tmp/offload_bench --build \\
        --runs dense,disk,cpu-int4,disk-int8 --name offload_cpu_quantized

GPU (not run: no GPU in the session that wrote this): the tables in pinned host memory with a model larger than
an 80 GB GPU (`cpu-offload-gpu`: 2.25x the rows of ultramem-1.6b-x12, 89 GB of tables, pinned as 6 power-of-two
blocks of 17.2 GB: needs ~120 GB host RAM),
against ultramem-1.6b-x12 in pinned host memory and fully on the GPU, where it fits:

    python benchmarks/bench_offload.py --device cuda --checkpoints /data/offload --build \\
        --runs gpu-resident,cpu-offload,cpu-offload-gpu --name offload_h100
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lib import cli, report, timing

DEFAULT_NAME = "offload"


@dataclass(frozen=True)
class Run:
    preset: str
    offload: str | None
    asynchronous: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)
    quantization: str | None = None  # the checkpoint's value tables: bf16 (None), "int8" or "int4"

    @property
    def checkpoint(self) -> str:
        """Folder name of the checkpoint: the preset, the overridden fields and the tables' format."""
        name = self.preset + "".join(f"-{k}{v}" for k, v in sorted(self.overrides.items()))
        return name + (f"-{self.quantization}" if self.quantization else "")


RUNS: dict[str, Run] = {
    "dense": Run("dense-1.6b", None),
    "disk": Run("ultramem-1.6b-x12", "disk"),
    "disk-sync": Run("ultramem-1.6b-x12", "disk", asynchronous=False),
    "disk-x1/16": Run("ultramem-1.6b-x12", "disk", overrides={"memory_num_keys": 896}),
    "disk-x1/4": Run("ultramem-1.6b-x12", "disk", overrides={"memory_num_keys": 1792}),
    # the same model with tables of ultramem-151m-x12's size (3.7 GB), 4x and 16x that (14.8, 59.3 GB)
    "disk-t151m": Run("ultramem-1.6b-x12", "disk", overrides={"memory_num_keys": 1098}),
    "disk-t151m-x4": Run("ultramem-1.6b-x12", "disk", overrides={"memory_num_keys": 2196}),
    "disk-t151m-x16": Run("ultramem-1.6b-x12", "disk", overrides={"memory_num_keys": 4392}),
    "gpu-resident": Run("ultramem-1.6b-x12", None),
    "cpu-offload": Run("ultramem-1.6b-x12", "cpu"),
    "cpu-offload-gpu": Run("ultramem-1.6b-x12", "cpu", overrides={"memory_num_keys": 5376}),
    # quantized tables (docs/quantized.md): int4 in host memory (14.5 GB checkpoint), int8 memory-mapped (24.4 GB)
    "cpu-int4": Run("ultramem-1.6b-x12", "cpu", quantization="int4"),
    "disk-int8": Run("ultramem-1.6b-x12", "disk", quantization="int8"),
    "disk-int4": Run("ultramem-1.6b-x12", "disk", quantization="int4"),
    "tiny-dense": Run("tiny-dense", None),  # smoke runs (CI)
    "tiny-disk": Run("tiny-ultramem", "disk"),
    "tiny-cpu-int4": Run("tiny-ultramem", "cpu", quantization="int4"),
    "tiny-disk-int8": Run("tiny-ultramem", "disk", quantization="int8"),
}
CPU_RUNS = ["dense", "disk", "disk-sync", "disk-x1/16", "disk-x1/4"]


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, DEFAULT_NAME)
    parser.add_argument("--checkpoints", type=Path, required=True, help="folder of the random checkpoints")
    parser.add_argument("--build", action="store_true", help="write missing checkpoints (streamed, random weights)")
    parser.add_argument("--cleanup", action="store_true", help="delete the checkpoints this run built after use")
    parser.add_argument("--runs", default=",".join(CPU_RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--batch-sizes", type=cli.int_list, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over --runs, interleaved (a shared machine's load drifts); medians reported")  # fmt: skip
    args = parser.parse_args(argv)
    args.dtype = args.dtype or "bfloat16"
    args.statistic = args.statistic or "median"  # wall clock: waiting for the disk is the cost measured here
    cli.resolve(args, DEFAULT_NAME)
    args.runs = cli.names(args.runs, RUNS, "--runs")
    return args


def ensure_checkpoint(run: Run, args) -> tuple[Path, bool]:
    """The run's checkpoint folder, written when missing and --build; returns (folder, built now)."""
    from ultramem.offload.random_checkpoint import write_random_checkpoint
    from ultramem.presets import get_config

    folder = args.checkpoints / run.checkpoint
    if (folder / "model.safetensors.index.json").is_file():
        return folder, False
    if not args.build:
        raise SystemExit(f"{folder}: no checkpoint; pass --build to write it")
    start = time.perf_counter()
    write_random_checkpoint(
        get_config(run.preset, **run.overrides), folder, args.dtype, memory_quantization=run.quantization
    )
    seconds = time.perf_counter() - start
    size = sum(file.stat().st_size for file in folder.glob("*.safetensors"))
    print(f"built {folder}: {size / 1e9:.1f} GB in {seconds:.0f} s ({size / 1e6 / seconds:.0f} MB/s)")
    return folder, True


def process_memory_gb() -> dict[str, float]:
    """Peak and current resident memory of this process, from /proc (kB)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 2**20
    return {"peak_rss_gb": fields["VmHWM"], "rss_anon_gb": fields["RssAnon"], "rss_file_gb": fields["RssFile"]}


def io_counters() -> tuple[int, int]:
    """Bytes this process has had fetched from storage (`/proc/self/io` read_bytes, readahead it asked for
    included) and its major page faults so far, all threads."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def decode(label: str, folder: Path, batch: int, args) -> dict[str, Any]:
    """One run in this (fresh) process: cold load, prefill, `new_tokens` timed greedy steps."""
    import ultramem  # noqa: F401 - registers the stores
    from ultramem import UltraMemForCausalLM

    run = RUNS[label]
    torch.manual_seed(0)
    for file in folder.glob("*.safetensors"):  # cold: no page of the checkpoint cached
        with open(file, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    model = UltraMemForCausalLM.from_pretrained(
        folder, dtype=args.dtype, device_map=str(args.device), memory_offload=run.offload
    ).eval()
    load_s = time.perf_counter() - start
    stores = [layer.values for layer in model.model.memory_layers]
    for store in stores:
        store.asynchronous = run.asynchronous
    tokens = torch.randint(1, model.config.vocab_size, (batch, args.prompt_tokens), device=args.device)
    io, disk_mb, major = [], [], []  # /proc and getrusage read outside the timed span
    with torch.no_grad():
        output = model(input_ids=tokens, use_cache=True, logits_to_keep=1)
        cache = output.cache

        def step() -> None:  # one greedy token for every sequence
            nonlocal output
            output = model(input_ids=output.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)

        def after() -> None:
            io.append(io_counters())
            disk_mb.append((io[-1][0] - io[-2][0]) / 1e6)
            major.append(io[-1][1] - io[-2][1])

        wall, cpu = timing.time_calls(step, args.device, 0, args.new_tokens, before_each=lambda: io.append(io_counters()),
                                      after_each=after)  # fmt: skip
    times = timing.summarize(wall, cpu, args.statistic)
    tables = [s for s in stores if hasattr(s, "table")]
    return {
        "run": label,
        "preset": run.checkpoint,
        "offload": run.offload or "none",
        "tables": run.quantization or (str(args.dtype).removeprefix("torch.") if stores else "none"),
        "asynchronous": run.asynchronous,
        "batch": batch,
        "table_gb": sum(s.table.numel() * s.table.element_size() for s in tables) / 1e9,
        "load_s": load_s,
        **times,
        "tokens_per_s": batch * 1e3 / times["median_ms"],
        "rows_read_per_step": sum(s.rows_read for s in tables) / (args.new_tokens + 1),
        "disk_mb_per_step": statistics.median(disk_mb),  # rows not in the page cache, read from storage
        "major_faults_per_step": statistics.median(major),
        **process_memory_gb(),
        "load_avg_1min": os.getloadavg()[0],  # a shared machine: other jobs' load stretches the wall clock
        "step_ms": wall,
        "step_cpu_ms": cpu,
        "step_disk_mb": disk_mb,
        "device_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device.type == "cuda" else None,
    }


def run_isolated(label: str, folder: Path, batch: int, args) -> dict[str, Any]:
    """`decode` in a fresh process, so each peak-memory figure is its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(decode, (label, folder, batch, args))


# Quantized tables against dense-1.6b and against the bf16 tables memory-mapped ("disk"), in the summary.
QUANTIZED = ("cpu-int4", "disk-int8", "disk-int4")

# The tables growing 16x: from 1/16 of ultramem-1.6b-x12's to its own, and from ultramem-151m-x12's size up.
SCALING_SERIES = {
    "16x from 2.5 GB": ("disk-x1/16", "disk-x1/4", "disk"),
    "16x from 3.7 GB": ("disk-t151m", "disk-t151m-x4", "disk-t151m-x16"),
}


def medians(rows: list[dict[str, Any]], key: str) -> dict[tuple[str, int], float]:
    """(run, batch) -> the median of `key` over the repeats."""
    values: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        values.setdefault((r["run"], r["batch"]), []).append(r[key])
    return {point: statistics.median(v) for point, v in values.items()}


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch: UltraMem (disk) / dense, the async overlap, and the spread of times as the table grows."""
    by = medians(rows, "ms")
    table = []
    for batch in sorted({r["batch"] for r in rows}):
        ratio = lambda a, b: by[(a, batch)] / by[(b, batch)] if (a, batch) in by and (b, batch) in by else None  # noqa: E731
        row = {
            "batch": batch,
            "ultramem/dense": ratio("disk", "dense"),
            "sync/async": ratio("disk-sync", "disk"),
            "offload/resident (gpu)": ratio("cpu-offload", "gpu-resident"),
            **{f"{run}/{peer}": ratio(run, peer) for run in QUANTIZED for peer in ("dense", "disk")},
        }
        for series, runs in SCALING_SERIES.items():
            scaled = [by[(run, batch)] for run in runs if (run, batch) in by]
            row[f"spread, {series}"] = max(scaled) / min(scaled) - 1 if len(scaled) > 1 else None
        table.append(row)
    return table


COLUMNS = {"run": "run", "batch": "batch", "tables": "format", "table_gb": "tables GB", "ms": "ms/step",
           "median_ms": "wall ms", "tokens_per_s": "tok/s", "peak_rss_gb": "peak RSS GB", "rss_file_gb": "file RSS GB",
           "rows_read_per_step": "rows/step", "disk_mb_per_step": "disk MB/step", "load_s": "load s", "cpu_ms": "CPU ms",
           "load_avg_1min": "loadavg"}  # fmt: skip
SUMMARY_COLUMNS = ["batch", "ultramem/dense", "sync/async", *(f"spread, {series}" for series in SCALING_SERIES),
                   "offload/resident (gpu)",
                   *(f"{run}/{peer}" for run in QUANTIZED for peer in ("dense", "disk"))]  # fmt: skip


def plot(args, rows: list[dict[str, Any]]) -> None:
    """Step time against batch size (wall clock and process CPU time) and against the size of the tables; peak
    resident memory."""
    runs = list(dict.fromkeys(r["run"] for r in rows))
    panels = []
    for key, what in (("median_ms", "wall clock"), ("cpu_ms", "process CPU time")):
        by = medians(rows, key)
        series = {run: ([b for r, b in by if r == run], [ms for (r, _), ms in by.items() if r == run]) for run in runs}
        panels.append(report.Panel(f"decode step, {what}", "ms / step", series, xlabel="batch size"))
    scaling = {}
    for series, series_runs in SCALING_SERIES.items():
        for batch in args.batch_sizes:
            for key, what in (("median_ms", "wall"), ("cpu_ms", "CPU")):
                points = sorted(
                    (r["table_gb"], r[key]) for r in rows if r["run"] in series_runs and r["batch"] == batch
                )
                if points:
                    scaling[f"{series}, batch {batch}, {what}"] = ([p[0] for p in points], [p[1] for p in points])
    if scaling:
        panels.append(report.Panel("tables on disk growing 16x", "ms / step", scaling, xlabel="value-table GB"))
    by = medians(rows, "peak_rss_gb")
    memory = {run: ([b for r, b in by if r == run], [gb for (r, _), gb in by.items() if r == run]) for run in runs}
    panels.append(report.Panel("peak resident memory", "GB", memory, xlabel="batch size"))
    report.plot(args.results_dir / f"{args.name}.png", panels, f"memory_offload, {str(args.dtype)[6:]}, {args.device}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rows, built = [], set()
    passes = [(repeat, label) for repeat in range(args.repeats) for label in args.runs]
    for index, (repeat, label) in enumerate(passes):
        folder, new = ensure_checkpoint(RUNS[label], args)
        if new:
            built.add(folder)
        for batch in args.batch_sizes:
            row = {**run_isolated(label, folder, batch, args), "repeat": repeat}
            print(report.format_table([row], COLUMNS))
            rows.append(row)
        if (
            folder in built
            and args.cleanup
            and not any(RUNS[r].checkpoint == RUNS[label].checkpoint for _, r in passes[index + 1 :])
        ):
            shutil.rmtree(folder)
    payload = {
        "settings": {
            "runs": {label: vars(RUNS[label]) for label in args.runs},
            "batch_sizes": args.batch_sizes,
            "repeats": args.repeats,
            "new_tokens": args.new_tokens,
            "prompt_tokens": args.prompt_tokens,
            "cache": "DynamicCache",
            "page_cache": "checkpoint evicted (POSIX_FADV_DONTNEED) before each run: cold reads",
            "memory": "peak_rss_gb = VmHWM of the run's own process (anonymous + touched file pages)",
        },
        "rows": rows,
        "summary": summary_rows(rows),
    }
    if not args.no_plot:
        plot(args, rows)
    tables = report.format_table(rows, COLUMNS) + "\n\n" + report.format_table(payload["summary"], SUMMARY_COLUMNS)
    report.finish(args, payload, tables)
    return payload


if __name__ == "__main__":
    main()
