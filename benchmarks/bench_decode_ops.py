"""How many aten operators one decode step runs, and how many kernels it would launch on a GPU, per memory layer and
for the rest of the model (issue 48, item 1).

Eager, batch 1, CPU, float32: after a `--prompt`-token prefill into a DynamicCache and one decode step, the next new
token through the model's forward as `generate` runs it (`step`: the first decode step also builds the layers' decode
steps), and one new token of `model.generate` as users call it (`generate`: the difference between generating
`--new-tokens` + 2 and 2 tokens, over `--new-tokens`, so generate's own per-token work counts too, and what a call
does once, at its first decode step, does not). Operators are those that reach PyTorch's
dispatcher below autograd (a `TorchDispatchMode`: views and in-place ops included, a composite such as `linear` counted
as the kernels it runs), attributed to the innermost memory layer (product-key or n-gram) whose forward runs them.
Launches are the aten operators that run a kernel (views and `_unsafe_view` only relabel a tensor), the Triton
kernels the memory implementation launches, and its other custom operators (one each): an eager GPU step pays host
time for each. The count is deterministic for one PyTorch version; each operator costs host time on every device (a few
microseconds on CPU, a kernel launch on a GPU), which is why the step's count matters without graphs.

A variant is a preset, or `preset:store` for its value tables in that value store (`set_value_store`: int8 / int4
tables, offloaded to host memory or memory-mapped from disk). An offloaded store reads its rows in a worker thread,
whose operators this thread's counter does not see: its rows show what the step itself runs.

    python benchmarks/bench_decode_ops.py                        # every tiny variant, a few seconds
    python benchmarks/bench_decode_ops.py --presets tiny-ultramem --list   # with the memory layer's operators in order
    TRITON_INTERPRET=1 python benchmarks/bench_decode_ops.py --memory-implementation triton \
        --presets tiny-dense,tiny-ultramem,tiny-ultramem:int8 --name decode_ops_cpu_triton   # the GPU kernels' path

Writes benchmarks/results/decode_ops_cpu.json; the table is printed last: operators per token for the whole
model and per memory layer, the dense backbone's, and the memory layers' count as their difference from it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from collections.abc import Iterator

import torch
from lib import cli, models, report
from torch.utils._python_dispatch import TorchDispatchMode

from ultramem.memory_implementations import check_memory_implementation
from ultramem.modeling_ultramem import UltraMemMemoryLayer
from ultramem.ngram_memory import NGramMemory

VARIANTS = (
    "tiny-dense",
    "tiny-ultramem",
    "tiny-pkm",
    "tiny-ultramemv2",
    "tiny-memoryplus",
    "tiny-engram",
    "tiny-ultramem-engram",
    *(f"{preset}:{store}" for preset in ("tiny-ultramem", "tiny-engram") for store in ("int8", "int4", "cpu", "disk")),
)
REST = "rest"
# Operators that only relabel a tensor (no kernel on a GPU): views, and `_unsafe_view`, a view autograd does not track
METADATA_ONLY = (torch.ops.aten._unsafe_view,)
COLUMNS = {"preset": "preset", "memory_layers": "memory layers", "step_ops": "step ops", "step_rest_ops": "outside memory",
           "step_ops_per_memory_layer": "per memory layer", "memory_ops_vs_dense": "per memory layer vs dense",
           "memory_launches_vs_dense": "launches vs dense", "generate_ops_per_token": "generate ops / token"}  # fmt: skip


class OperatorCount(TorchDispatchMode):
    """Every aten operator dispatched inside it, and every Triton kernel launched (`kernel_launched`), by the memory
    layer running it (`REST` outside any); `launches` counts those that run a kernel."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.owners = [REST]
        self.ops: dict[str, list[str]] = {REST: []}
        self.launches: Counter[str] = Counter()
        self.kernels = 0  # Triton kernels launched
        self.hooks = []
        for name, module in model.named_modules():
            if isinstance(module, (UltraMemMemoryLayer, NGramMemory)):
                self.ops[name] = []
                self.hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: self.owners.append(name)))
                self.hooks.append(module.register_forward_hook(self._leave))
            if isinstance(module, UltraMemMemoryLayer):  # an offloaded store's layer runs in `start` and `_output`
                for method in ("start", "_output"):
                    setattr(module, method, self._owned(name, getattr(module, method)))
                    self.hooks.append(_Shadow(module, method))

    def _leave(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.owners.pop()  # returns None: the layer's output stays as it is

    def _owned(self, owner: str, method):
        def run(*args, **kwargs):
            self.owners.append(owner)
            try:
                return method(*args, **kwargs)
            finally:
                self.owners.pop()

        return run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        owner, kernels_before = self.owners[-1], self.kernels
        self.ops[owner].append(func.overloadpacket.__name__)
        result = func(*args, **(kwargs or {}))
        if func.namespace == "aten":
            self.launches[owner] += not (func.is_view or func.overloadpacket in METADATA_ONLY)
        else:  # a custom operator: its Triton kernels count themselves, any other implementation as one launch
            self.launches[owner] += self.kernels == kernels_before
        return result

    def kernel_launched(self, name: str) -> None:
        self.ops[self.owners[-1]].append(f"triton:{name}")
        self.launches[self.owners[-1]] += 1
        self.kernels += 1

    def counts(self) -> dict[str, int]:
        return {owner: len(ops) for owner, ops in self.ops.items()}

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class _Shadow:
    """An instance attribute shadowing its class's method, removed as a hook is."""

    def __init__(self, module: torch.nn.Module, method: str) -> None:
        self.module, self.method = module, method

    def remove(self) -> None:
        delattr(self.module, self.method)


@contextlib.contextmanager
def counting_triton_launches(counter: OperatorCount) -> Iterator[None]:
    """Every Triton kernel launch, compiled or interpreted (TRITON_INTERPRET=1), reported to `counter`; the launch
    itself runs outside the counter (the interpreter copies its arguments with torch operators a GPU would not run)."""
    try:
        from triton.runtime import interpreter, jit
    except ImportError:  # no Triton: no kernel to count
        yield
        return
    originals = {cls: cls.run for cls in (jit.JITFunction, interpreter.InterpretedFunction)}

    def counted(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                counter.kernel_launched(getattr(getattr(self, "fn", None), "__name__", "kernel"))
            with torch.utils._python_dispatch._disable_current_modes():
                return original(self, *args, **kwargs)

        return run

    for cls, original in originals.items():
        cls.run = counted(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def count(model: torch.nn.Module, run) -> OperatorCount:
    counter = OperatorCount(model)
    try:
        with counter, counting_triton_launches(counter):
            run()
    finally:
        counter.remove()
    return counter


@torch.no_grad()
def measure(variant: str, prompt: int, new_tokens: int, implementation: str | None = None) -> dict:
    """The counts of `variant` ("preset" or "preset:store"), computed by memory implementation `implementation` (None:
    the device's default)."""
    preset, _, store = variant.partition(":")
    torch.manual_seed(0)
    model = models.build(preset, "cpu", torch.float32).eval()
    if implementation is not None:
        models.use_memory_implementation(model, implementation)
    with tempfile.TemporaryDirectory(prefix="bench_decode_ops_") as tables:
        if store:
            model.set_value_store(store, **({"directory": tables} if store.startswith("disk") else {}))
        row = _measure(model, prompt, new_tokens)
    flags = {name: os.environ[name] for name in ("TRITON_INTERPRET", "ULTRAMEM_FUSED_SELECTION") if name in os.environ}
    return {"preset": variant, "memory_implementation": implementation, "environment_flags": flags, **row}


def _measure(model: torch.nn.Module, prompt: int, new_tokens: int) -> dict:
    input_ids = torch.randint(3, model.config.vocab_size, (1, prompt))
    out = model(input_ids, use_cache=True)
    cache, token = getattr(out, "cache", None) or out.past_key_values, out.logits[:, -1:].argmax(-1)
    with model.model.fixed_weights():  # as `generate` runs its steps: each layer's decode step
        model(token, cache=cache)  # the first step builds the decode steps (and fills the inference cache)
        step = count(model, lambda: model(token, cache=cache))  # a steady decode step

    def generate(tokens: int):
        return lambda: model.generate(input_ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    short, long = count(model, generate(2)), count(model, generate(new_tokens + 2))
    memory = [owner for owner in step.ops if owner != REST]
    total = sum(step.counts().values())
    return {
        "memory_layers": len(memory),
        "step_ops": total,
        "step_launches": sum(step.launches.values()),
        "step_rest_ops": step.counts()[REST],
        "step_ops_per_memory_layer": (total - step.counts()[REST]) / len(memory) if memory else 0,
        "generate_ops_per_token": (sum(long.counts().values()) - sum(short.counts().values())) / new_tokens,
        "memory_layer_ops": dict(Counter(step.ops[memory[0]]).most_common()) if memory else {},
        "memory_layer_sequence": step.ops[memory[0]] if memory else [],
    }


def main(argv: list[str] | None = None) -> None:
    parser = cli.make_parser(__doc__, "decode_ops_cpu", device=False, timed=False, plot=False)
    parser.add_argument("--presets", default=",".join(VARIANTS),
                        help="comma-separated presets or preset:store (tiny-dense first, the rows' reference)")  # fmt: skip
    parser.add_argument("--memory-implementation", default=None,
                        help="e.g. triton (on CPU with TRITON_INTERPRET=1); default: the device's")  # fmt: skip
    parser.add_argument("--prompt", type=int, default=64, help="prefill tokens")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens over which generate's count is averaged")
    parser.add_argument("--list", action="store_true", help="print the first memory layer's operators in order")
    args = cli.resolve(parser.parse_args(argv), "decode_ops_cpu")
    cli.at_least(args, prompt=1, new_tokens=1)
    try:
        check_memory_implementation(args.memory_implementation)
    except ValueError as error:
        parser.error(f"--memory-implementation: {error}")
    rows = [
        measure(variant, args.prompt, args.new_tokens, args.memory_implementation)
        for variant in args.presets.split(",")
    ]
    dense = next((row for row in rows if row["memory_layers"] == 0), None)
    for row in rows:
        if dense is not None and row["memory_layers"]:
            row["memory_ops_vs_dense"] = (row["step_ops"] - dense["step_ops"]) / row["memory_layers"]
            row["memory_launches_vs_dense"] = (row["step_launches"] - dense["step_launches"]) / row["memory_layers"]
        if args.list and row["memory_layers"]:
            print(
                f"{row['preset']}: one memory layer's operators in order:\n  " + " ".join(row["memory_layer_sequence"])
            )
    report.finish(args, {"rows": rows}, report.format_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
