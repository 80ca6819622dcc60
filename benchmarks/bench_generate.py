"""Per-token time of `model.generate` as users call it, for dense, UltraMem and MoE models of equal compute
(issue 34, item 5: the user's path, where bench_decode times one isolated step).

Greedy decoding of exactly `--new-tokens` tokens (min_new_tokens = max_new_tokens) after a random prompt of
`--prompt` tokens, for the models of `lib.models.PEERS` (as in bench_decode), with one of two caches:

- `eager`: generate's default, a DynamicCache and the eager forward;
- `static`: `cache_implementation="static"`. On CUDA Transformers then compiles the decoding forward by itself
  (`torch.compile(mode="reduce-overhead")`, CUDA graphs; the prefill stays eager), as users get it; elsewhere it
  runs eagerly. `--no-auto-compile` (generate's `disable_compile=True`) keeps it eager on CUDA too. Each row says
  whether Transformers compiled (`compiled`).

A stopping criterion that never stops records `time.perf_counter()` (and the process CPU time) after a device
synchronize each time generate has appended a token: one timestamp per new token. The time to the first one is
the prefill (with generate's setup), reported apart and excluded; the per-token times are the differences between
consecutive timestamps, `--iters` generate calls (5) after `--warmup` untimed ones (1), summarized as in every speed
script (`--statistic`). generate synchronizes at every token anyway (its stopping check), so the criterion's
synchronize adds no wait of its own.

H100 / H200 (bf16; the issue's target: static-cache UltraMem/dense <= 1.10 at batch 1 and 16):

    python benchmarks/bench_generate.py --device cuda --sizes 680m --batch-sizes 1,16

CPU (tiny presets, float32, a few seconds):

    OMP_NUM_THREADS=1 python benchmarks/bench_generate.py --device cpu --sizes tiny

On a machine whose speed drifts, `--interleave` holds the models at once and alternates their generate calls;
`--kinds` adds Engram's n-gram memory (`engram`, lib.models.ENGRAM_PEERS), UltraMem with the C++ CPU kernels
(`ultramem-cpp`, memory implementation "cpp") or leaves models out. The eager CPU ratios of issues 45 and 48
(UltraMem / dense and Engram / dense <= 1.10 and 1.05, batch 1 and 8):

    OMP_NUM_THREADS=1 python benchmarks/bench_generate.py --device cpu --sizes tiny \
        --kinds dense,ultramem,ultramem-cpp,engram --caches eager --batch-sizes 1,8 --prompt 64 --new-tokens 32 \
        --iters 20 --interleave --name generate_cpu_eager

and the same at `--sizes small` (8 blocks of 512; `--kinds dense,ultramem,ultramem-cpp --iters 10 --name
generate_cpu_eager_small`).

A kind with `-disk` (`engram-disk`, `ultramem-disk`) is the same model with its value tables written to files once
and memory-mapped (`set_value_store("disk")`; the page cache warm, as for a table that fits in memory), timed against
the in-memory one (issue 45: n-gram tables from disk <= 1.05x in memory):

    OMP_NUM_THREADS=1 python benchmarks/bench_generate.py --device cpu --sizes tiny --kinds dense,engram,engram-disk \
        --caches eager --batch-sizes 1,8 --prompt 64 --new-tokens 32 --iters 20 --interleave --name generate_cpu_disk

Where a decode step's time goes: `--by-part` adds, after the timed calls, `--iters` generate calls with forward
hooks on the memory layers (product-key and n-gram), the decoder blocks and the LM head, each timed in place (the
hooks synchronize the device: read it on CPU), and a table of each part's ms per token for every model, the rest of
the step last (embedding, generate's own work, the hooks), then `memory warm ms`: the memory layers' last decode steps
run again back to back after each call, what they take with warm caches (in place the LM head between two steps has
evicted them):

    OMP_NUM_THREADS=1 python benchmarks/bench_generate.py --device cpu --sizes tiny --kinds dense,ultramem,engram \
        --caches eager --batch-sizes 1 --prompt 64 --new-tokens 32 --iters 20 --interleave --by-part \
        --name generate_cpu_by_part

Writes benchmarks/results/generate_<device>.json and .png; the table (per-token ms and the ratios UltraMem/dense,
MoE/UltraMem, Engram/dense and disk/in memory for every size, batch and cache) is printed last.
"""

from __future__ import annotations

import math
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lib import cli, models, report, timing
from transformers import StoppingCriteria, StoppingCriteriaList

DEFAULT_NAME = "generate"
# engram on request: Engram's n-gram memory (lib.models.ENGRAM_PEERS); a kind + "-disk": its tables memory-mapped
# ultramem-cpp: UltraMem with the C++ CPU kernels (memory implementation "cpp")
KINDS = ("dense", "ultramem", "moe", "engram", "ultramem" + models.ON_DISK, "engram" + models.ON_DISK,
         "ultramem" + models.CPP_KERNELS)  # fmt: skip
CACHES = ("eager", "static")


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, DEFAULT_NAME)
    # one call is many steps: a single warm-up call compiles, records the CUDA graphs and replays them
    parser.set_defaults(warmup=1, iters=5)
    add = parser.add_argument
    add("--sizes", type=cli.sizes, default=None, help="680m on CUDA; tiny on CPU")
    add("--batch-sizes", type=cli.int_list, default=None, help="1,16 on CUDA; 1,4 on CPU")
    add("--prompt", type=int, default=None, help="prompt tokens (2048 on CUDA, 32 on CPU)")
    add("--new-tokens", type=int, default=None, help="tokens generated per call (64 on CUDA, 8 on CPU)")
    add("--kinds", default="dense,ultramem,moe", help=f"comma-separated, of {KINDS}")
    add("--caches", default=",".join(CACHES), help="eager (DynamicCache) and/or static (cache_implementation)")
    add(
        "--interleave",
        action="store_true",
        help="hold the models of a size at once and time their generate calls in "
        "turn (one call of each per round), so machine drift does not enter their ratios",
    )
    add("--no-auto-compile", action="store_true", help="generate(disable_compile=True): a static cache stays eager")
    add("--by-part", action="store_true", help="also time the memory layers, blocks and LM head in place (hooks)")
    cli.add_moe_argument(parser, "at the middle batch size, with the first cache")
    args = cli.resolve(parser.parse_args(argv), DEFAULT_NAME)
    cuda = args.device.type == "cuda"
    args.sizes = args.sizes or (["680m"] if cuda else ["tiny"])
    args.batch_sizes = args.batch_sizes or ([1, 16] if cuda else [1, 4])
    args.prompt = args.prompt if args.prompt is not None else (2048 if cuda else 32)
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (64 if cuda else 8)
    args.caches = cli.names(args.caches, CACHES, "--caches")
    args.kinds = cli.names(args.kinds, KINDS, "--kinds")
    if "dense" not in args.kinds:
        raise SystemExit("--kinds: the ratios are against dense: include it")
    engram = any(kind.startswith("engram") for kind in args.kinds)
    if engram and (missing := [s for s in args.sizes if s not in models.ENGRAM_PEERS]):
        raise SystemExit(
            f"--kinds engram: no Engram preset at size {missing[0]}; sizes: {', '.join(models.ENGRAM_PEERS)}"
        )
    cli.at_least(args, prompt=1, new_tokens=2)  # two timestamps make one per-token time
    return args


class TokenClock(StoppingCriteria):
    """Never stops; records wall-clock and process CPU time after a device synchronize at every new token."""

    def __init__(self, device: torch.device):
        self.device = device
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        timing.synchronize(self.device)
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_once(model, prompt: torch.Tensor, cache: str, args) -> tuple[float, list[float], list[float], bool]:
    """One greedy generate call: prefill ms (to the first token), the per-token wall and CPU ms after it, and
    whether Transformers compiled the forward."""
    clock = TokenClock(args.device)
    options = {"cache_implementation": "static"} if cache == "static" else {}
    timing.synchronize(args.device)
    start = time.perf_counter()
    output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                            stopping_criteria=StoppingCriteriaList([clock]), disable_compile=args.no_auto_compile,
                            pad_token_id=model.config.pad_token_id or 0, **options)  # fmt: skip
    if output.shape[1] != prompt.shape[1] + args.new_tokens or len(clock.wall) != args.new_tokens:
        raise RuntimeError(f"expected {args.new_tokens} new tokens, got {output.shape[1] - prompt.shape[1]}")
    wall = [(b - a) * 1e3 for a, b in zip(clock.wall, clock.wall[1:])]
    cpu = [(b - a) * 1e3 for a, b in zip(clock.cpu, clock.cpu[1:])]
    return (clock.wall[0] - start) * 1e3, wall, cpu, hasattr(model, "_compiled_call")


# A decode step's parts, by module name: the same in UltraMem, Llama and Mixtral models
PARTS = {"memory": r"model\.(memory_layers|ngram_memories)\.\d+", "blocks": r"model\.layers\.\d+", "head": r"lm_head"}


class PartClock:
    """Wall time of each call of a model's memory layers, decoder blocks and LM head, from forward hooks that
    synchronize the device at each edge (on an accelerator they serialise what they time); and the memory layers'
    last calls, to time them again with warm caches (`memory_warm_ms`)."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.calls: dict[tuple[str, str], list[float]] = {}  # (part, module) -> each call's seconds
        self.last_memory_calls: dict[str, tuple] = {}  # module name -> (module, args, kwargs) of its last call
        self.hooks = []
        for name, module in model.named_modules():
            part = next((part for part, pattern in PARTS.items() if re.fullmatch(pattern, name)), None)
            if part is not None:
                times, start = self.calls.setdefault((part, name), []), []
                self.hooks.append(module.register_forward_pre_hook(lambda *_, start=start: start.append(self.now())))
                self.hooks.append(
                    module.register_forward_hook(lambda *_, t=times, s=start: t.append(self.now() - s.pop()))
                )
            if part == "memory":
                remember = lambda m, a, k, name=name: self.last_memory_calls.__setitem__(name, (m, a, k))  # noqa: E731
                self.hooks.append(module.register_forward_pre_hook(remember, with_kwargs=True))

    def now(self) -> float:
        timing.synchronize(self.device)
        return time.perf_counter()

    def per_token_ms(self) -> dict[str, float]:
        """Each part's ms per decode step: its modules' calls after the first (the prefill), averaged, summed."""
        parts = dict.fromkeys(PARTS, 0.0)
        for (part, _), times in self.calls.items():
            parts[part] += statistics.fmean(times[1:]) * 1e3
        return parts

    def memory_warm_ms(self, calls: int) -> float:
        """The memory layers' last decode step again, `calls` times back to back (after one untimed) inside one
        `fixed_weights` scope, as generate runs it: their ms per token with warm caches, where in place the LM head
        between two steps has evicted them. Called after the hooks are removed and the generate call is over (the
        calls update the conv states again)."""
        if not self.last_memory_calls:
            return 0.0
        total = 0.0
        with models.as_generate_runs(self.model):
            for module, args, kwargs in self.last_memory_calls.values():
                call = lambda m=module, a=args, k=kwargs: m(*a, **k)  # noqa: E731
                wall, _ = timing.time_calls(call, self.device, warmup=1, iters=calls)
                total += statistics.median(wall)
        return total

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def time_parts(peers: dict[str, Any], prompts: dict[str, torch.Tensor], cache: str, args) -> dict[str, dict]:
    """`--by-part`: each part's ms per token (`PartClock`) and the rest of the step, of every model, median over
    `args.iters` generate calls, their calls in turn as the timed ones."""
    runs = {name: [] for name in peers}
    for _ in range(args.iters):
        for name, model in peers.items():
            clock = PartClock(model, args.device)
            try:
                _, wall, _, _ = generate_once(model, prompts[name], cache, args)
            finally:
                clock.remove()
            parts = clock.per_token_ms()
            rest = statistics.fmean(wall) - sum(parts.values())
            runs[name].append({**parts, "rest": rest, "memory_warm": clock.memory_warm_ms(args.new_tokens)})
    return {name: {part: statistics.median(run[part] for run in of) for part in of[0]} for name, of in runs.items()}


def time_generate(model, batch: int, cache: str, args) -> dict[str, Any]:
    """Per-token time of `args.iters` generate calls after `args.warmup` (`timing.summarize` of every token's)."""
    return time_generate_interleaved({"model": model}, batch, cache, args)["model"]


def time_generate_interleaved(peers: dict[str, Any], batch: int, cache: str, args) -> dict[str, dict[str, Any]]:
    """`time_generate` of several models, their generate calls in turn (one call of each per round), so that a
    machine whose speed drifts (shared cores) does not enter their ratios."""
    prompts = {
        name: torch.randint(1, model.config.vocab_size, (batch, args.prompt), device=args.device)
        for name, model in peers.items()
    }
    for _ in range(args.warmup):
        for name, model in peers.items():
            generate_once(model, prompts[name], cache, args)
    calls = {name: [] for name in peers}
    for _ in range(args.iters):
        for name, model in peers.items():
            calls[name].append(generate_once(model, prompts[name], cache, args))
    timed = {}
    for name, runs in calls.items():
        prefill, wall, cpu, compiled = zip(*runs, strict=True)
        flat = timing.summarize([t for run in wall for t in run], [t for run in cpu for t in run], args.statistic)
        timed[name] = {
            **flat,
            "prefill_ms": statistics.median(prefill),
            "compiled": compiled[-1],
            "token_ms": list(wall),
        }
    if args.by_part:
        for name, parts in time_parts(peers, prompts, cache, args).items():
            timed[name]["by_part_ms"] = parts
    return timed


def build(size: str, kind: str, args) -> tuple[Any, dict[str, Any]]:
    """The model of `kind` at `size` (positions for prompt and new tokens), MoE's expert path probed at the middle
    batch size with the first cache."""
    batch = args.batch_sizes[len(args.batch_sizes) // 2]
    probe = lambda m: time_generate(m, batch, args.caches[0], args)
    positions = args.prompt + args.new_tokens
    return models.build_peer(size, kind, args, probe, positions=positions, tables_dir=args.tables_dir)


def bench_models(size: str, kinds: list[str], args) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every cache and batch size of the models of `kinds` held at once, their calls interleaved."""
    built = {}
    for kind in kinds:
        base = kind.removesuffix(models.CPP_KERNELS)
        if kind == base:
            built[kind] = build(size, kind, args)
            continue
        # the base's model with the C++ kernels: one copy of the weights (the base's, where it is timed too), the
        # implementation set at each call
        model, info = built[base] if base in built else build(size, base, args)
        if base in built:
            built[base] = (models.WithMemoryImplementation(model, None), info)
        cpp = models.WithMemoryImplementation(model, "cpp")
        built[kind] = (cpp, {**info, "kind": kind, "memory_implementation": "cpp"})
    rows = []
    with torch.no_grad():
        for cache in args.caches:
            for batch in args.batch_sizes:
                timed = time_generate_interleaved(
                    {kind: model for kind, (model, _) in built.items()}, batch, cache, args
                )
                for kind, (_, info) in built.items():
                    rows.append({"size": size, "kind": kind, "batch": batch, "cache": cache, **timed[kind]})
                    print(f"{info['preset']:<20} {cache:>6} batch {batch:>4}: {timed[kind]['ms']:8.3f} ms/token "
                          f"(prefill {timed[kind]['prefill_ms']:.1f} ms, compiled {timed[kind]['compiled']})")  # fmt: skip
                # as in a fresh process: a compiled forward (and the cache its CUDA graphs hold) is dropped, so the
                # next batch size is compiled for its own static shapes, not recompiled with a dynamic batch
                timing.release(args.device)
    infos = [info for _, info in built.values()]
    del built
    timing.release(args.device)
    return rows, infos


RATIOS = {"ultramem/dense": ("ultramem", "dense"), "ultramem-cpp/dense": ("ultramem-cpp", "dense"),
          "moe/ultramem": ("moe", "ultramem"),
          "engram/dense": ("engram", "dense"), "ultramem-disk/ultramem": ("ultramem-disk", "ultramem"),
          "engram-disk/engram": ("engram-disk", "engram")}  # fmt: skip


def ratio_rows(rows: list[dict[str, Any]], kinds: list[str]) -> list[dict[str, Any]]:
    """One row per (size, cache, batch): each kind's per-token time and the ratios between the kinds timed."""
    by_key = {(r["size"], r["cache"], r["batch"], r["kind"]): r["ms"] for r in rows}
    table = []
    for size, cache, batch in dict.fromkeys((r["size"], r["cache"], r["batch"]) for r in rows):
        ms = {kind: by_key.get((size, cache, batch, kind)) for kind in kinds}
        ratios = {name: models.ratio(ms[a], ms[b]) for name, (a, b) in RATIOS.items() if {a, b} <= set(kinds)}
        table.append({"size": size, "cache": cache, "batch": batch, **{f"{k}_ms": v for k, v in ms.items()}, **ratios})
    return table


def table_columns(kinds: list[str]) -> dict[str, str]:
    ratios = {name: name for name, pair in RATIOS.items() if set(pair) <= set(kinds)}
    return {"size": "size", "cache": "cache", "batch": "batch", **{f"{k}_ms": f"{k} ms/token" for k in kinds}, **ratios}


def draw_parts(axis, rows: list[dict[str, Any]]) -> None:
    """`--by-part`: each model's step stacked by part, in place, and its memory layers' warm time as a tick."""
    kinds, bottom = [row["kind"] for row in rows], [0.0] * len(rows)
    for part in (*PARTS, "rest"):
        heights = [row["by_part_ms"][part] for row in rows]
        axis.bar(kinds, heights, bottom=bottom, label=part if part != "memory" else "memory, in place")
        bottom = [low + height for low, height in zip(bottom, heights, strict=True)]
    warm = [row["by_part_ms"]["memory_warm"] or math.nan for row in rows]  # none without memory layers
    axis.scatter(kinds, warm, marker="_", s=500, color="black", zorder=3, label="memory, warm (back to back)")
    axis.tick_params(axis="x", labelsize=7)


def plot(args, rows: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> None:
    panels = []
    for size in args.sizes:
        series = {
            f"{kind} {cache}": (
                [r["batch"] for r in rows if (r["size"], r["kind"], r["cache"]) == (size, kind, cache)],
                [r["ms"] for r in rows if (r["size"], r["kind"], r["cache"]) == (size, kind, cache)],
            )
            for kind in args.kinds
            for cache in args.caches
        }
        panels.append(report.Panel(f"{size}: generate, per token", "ms / token", series, xlabel="batch size"))
        of_size = [r for r in ratios if r["size"] == size]
        series = {
            f"{name} {cache}": (
                [r["batch"] for r in of_size if r["cache"] == cache],
                [r[name] for r in of_size if r["cache"] == cache],
            )  # fmt: skip
            for name in RATIOS
            if name in of_size[0]
            for cache in args.caches
        }
        panels.append(report.Panel(f"{size}: ratios (target U/D <= 1.10)", "ratio", series, xlabel="batch size",
                                   draw=lambda axis: axis.axhline(1.10, color="grey", ls=":")))  # fmt: skip
        for cache, batch in dict.fromkeys((r["cache"], r["batch"]) for r in rows if "by_part_ms" in r):
            timed = [r for r in rows if (r["size"], r["cache"], r["batch"]) == (size, cache, batch)]
            panels.append(report.Panel(f"{size}: the step by part, {cache}, batch {batch}", "ms / token", xlog=False,
                                       draw=lambda axis, timed=timed: draw_parts(axis, timed)))  # fmt: skip
    title = f"generate, greedy, prompt {args.prompt} + {args.new_tokens} tokens, prefill excluded"
    report.plot(args.results_dir / f"{args.name}.png", panels, title)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows, infos = [], []
    # the "-disk" kinds' table files: beside the results (on disk, where /tmp may be RAM), removed after the run
    args.results_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tables-", dir=args.results_dir) as tables_dir:
        args.tables_dir = Path(tables_dir)
        for size in args.sizes:
            for kinds in [args.kinds] if args.interleave else [[kind] for kind in args.kinds]:
                model_rows, model_infos = bench_models(size, kinds, args)
                rows, infos = rows + model_rows, infos + model_infos
                report.save(args, {"complete": False, "rows": rows})  # kept should the run be cut short
    settings = {"sizes": args.sizes, "kinds": args.kinds, "interleaved": args.interleave, "batch_sizes": args.batch_sizes, "prompt": args.prompt,
                "new_tokens": args.new_tokens, "caches": args.caches, "auto_compile": not args.no_auto_compile,
                "by_part": args.by_part,
                "decoding": "greedy, min_new_tokens = max_new_tokens", "warmup": args.warmup, "iters": args.iters,
                "per_token": "differences of timestamps taken after a synchronize at every new token; the first "
                "(prefill, prefill_ms) excluded"}  # fmt: skip
    payload = {
        "settings": settings,
        "models": infos,
        "rows": rows,
        "ratios": ratio_rows(rows, args.kinds),
        "complete": True,
    }
    if not args.no_plot:
        plot(args, rows, payload["ratios"])
    if args.by_part:
        by_part = [{**row, **row["by_part_ms"]} for row in rows]
        columns = {"size": "size", "kind": "kind", "cache": "cache", "batch": "batch", "ms": "ms/token",
                   **{part: f"{part} ms" for part in (*PARTS, "rest")}, "memory_warm": "memory warm ms"}  # fmt: skip
        print("where a decode step's time goes (ms per token, in place):")
        print(report.format_table(by_part, columns))
    report.finish(args, payload, report.format_table(payload["ratios"], table_columns(args.kinds)))
    return payload


if __name__ == "__main__":
    main()
