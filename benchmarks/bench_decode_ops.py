"""How many aten operators one decode step runs, per memory layer and for the rest of the model (issue 48, item 1).

Eager, batch 1, CPU, float32: after a `--prompt`-token prefill into a DynamicCache and one decode step, the next new
token through the model's forward (`step`: the first decode step also computes what the inference cache keeps), and one new token of `model.generate` as users call it (`generate`: the difference between
generating `--new-tokens` + 1 and 1 tokens, over `--new-tokens`, so generate's own per-token work counts too).
Operators are those that reach PyTorch's dispatcher below autograd (a `TorchDispatchMode`: views and in-place
ops included, a composite such as `linear` counted as the kernels it runs), attributed to the innermost memory layer
(product-key or n-gram) whose forward runs them. The count is deterministic for one PyTorch version; each one costs
host time on every device (a few microseconds on CPU, a kernel launch on a GPU), which is why the step's count matters
without graphs.

    python benchmarks/bench_decode_ops.py                        # every tiny variant, a few seconds
    python benchmarks/bench_decode_ops.py --presets tiny-ultramem --list   # with the memory layer's operators in order

Writes benchmarks/results/decode_ops_cpu.json; the table is printed last: operators per token for the whole
model and per memory layer, the dense backbone's, and the memory layers' count as their difference from it.
"""

from __future__ import annotations

from collections import Counter

import torch
from lib import cli, models, report
from torch.utils._python_dispatch import TorchDispatchMode

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
)
REST = "rest"
COLUMNS = {"preset": "preset", "memory_layers": "memory layers", "step_ops": "step ops", "step_rest_ops": "outside memory",
           "step_ops_per_memory_layer": "per memory layer", "memory_ops_vs_dense": "per memory layer vs dense",
           "generate_ops_per_token": "generate ops / token"}  # fmt: skip


class OperatorCount(TorchDispatchMode):
    """Every aten operator dispatched inside it, by the memory layer running it (`REST` outside any)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.owners = [REST]
        self.ops: dict[str, list[str]] = {REST: []}
        self.hooks = []
        for name, module in model.named_modules():
            if isinstance(module, (UltraMemMemoryLayer, NGramMemory)):
                self.ops[name] = []
                self.hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: self.owners.append(name)))
                self.hooks.append(module.register_forward_hook(self._leave))

    def _leave(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.owners.pop()  # returns None: the layer's output stays as it is

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.owners[-1]].append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict[str, int]:
        return {owner: len(ops) for owner, ops in self.ops.items()}

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def count(model: torch.nn.Module, run) -> OperatorCount:
    counter = OperatorCount(model)
    try:
        with counter:
            run()
    finally:
        counter.remove()
    return counter


@torch.no_grad()
def measure(preset: str, prompt: int, new_tokens: int) -> dict:
    torch.manual_seed(0)
    model = models.build(preset, "cpu", torch.float32).eval()
    input_ids = torch.randint(3, model.config.vocab_size, (1, prompt))
    out = model(input_ids, use_cache=True)
    cache, token = getattr(out, "cache", None) or out.past_key_values, out.logits[:, -1:].argmax(-1)
    model(token, cache=cache)  # the first step computes what the inference cache keeps for decode steps
    step = count(model, lambda: model(token, cache=cache))  # a steady decode step

    def generate(tokens: int):
        return lambda: model.generate(input_ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    short, long = count(model, generate(1)), count(model, generate(new_tokens + 1))
    memory = [owner for owner in step.ops if owner != REST]
    total = sum(step.counts().values())
    return {
        "preset": preset,
        "memory_layers": len(memory),
        "step_ops": total,
        "step_rest_ops": step.counts()[REST],
        "step_ops_per_memory_layer": (total - step.counts()[REST]) / len(memory) if memory else 0,
        "generate_ops_per_token": (sum(long.counts().values()) - sum(short.counts().values())) / new_tokens,
        "memory_layer_ops": dict(Counter(step.ops[memory[0]]).most_common()) if memory else {},
        "memory_layer_sequence": step.ops[memory[0]] if memory else [],
    }


def main(argv: list[str] | None = None) -> None:
    parser = cli.make_parser(__doc__, "decode_ops_cpu", device=False, timed=False, plot=False)
    parser.add_argument("--presets", default=",".join(VARIANTS), help="comma-separated presets (tiny-dense first)")
    parser.add_argument("--prompt", type=int, default=64, help="prefill tokens")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens over which generate's count is averaged")
    parser.add_argument("--list", action="store_true", help="print the first memory layer's operators in order")
    args = cli.resolve(parser.parse_args(argv), "decode_ops_cpu")
    cli.at_least(args, prompt=1, new_tokens=1)
    rows = [measure(preset, args.prompt, args.new_tokens) for preset in args.presets.split(",")]
    dense = next((row for row in rows if row["memory_layers"] == 0), None)
    for row in rows:
        if dense is not None and row["memory_layers"]:
            row["memory_ops_vs_dense"] = (row["step_ops"] - dense["step_ops"]) / row["memory_layers"]
        if args.list and row["memory_layers"]:
            print(
                f"{row['preset']}: one memory layer's operators in order:\n  " + " ".join(row["memory_layer_sequence"])
            )
    report.finish(args, {"rows": rows}, report.format_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
