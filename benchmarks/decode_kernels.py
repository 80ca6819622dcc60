"""Kernels a compiled decode step launches, from the code Inductor generates: dense against UltraMem, per memory layer.

In a CUDA graph every kernel costs a launch gap on top of its work, and at decode sizes the gap is most of it, so the
count is what issue 34 bounds (at most 6 kernels per memory layer). It needs no GPU: on CPU Inductor generates C++
kernels with its fusion decisions, the GEMMs and custom ops stay calls of their own (the Triton memory kernels run in
Triton's interpreter here), so the count shows which operators remain; on CUDA the same script counts the Triton
kernels Inductor generates. One decode step (sequence length 1) after a 2-token prefill in a static cache, the
inference cache refreshed first as `generate` does. `triton+fused-selection` is the Triton path with the opt-in
one-kernel selection (`ultramem.kernels.fused_selection`).

    python benchmarks/decode_kernels.py --size tiny        # CPU, about 2 minutes
    python benchmarks/decode_kernels.py --size 680m --device cuda

Prints the table and writes `decode_kernels_<device>.json` (every kernel and call by name); no timing, no plot.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import torch

if __name__ == "__main__" and not torch.cuda.is_available():  # before anything imports triton: the memory kernels'
    os.environ.setdefault("TRITON_INTERPRET", "1")  # custom ops then run in Triton's interpreter

from lib import cli, models, report  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from ultramem.kernels import fused_selection  # noqa: E402

IMPLEMENTATIONS = ["triton", "triton+fused-selection", "torch", "embedding_bag"]

LAUNCH_PATTERNS = {
    "generated": re.compile(r"^\s+(cpp_fused_\w+)\(|^\s+(triton_\w+)\.run\(", re.M),  # Inductor's own kernels
    "extern": re.compile(r"extern_kernels\.(\w+)\("),  # GEMMs and other library calls
    "op": re.compile(r"torch\.ops\.(\w+\.\w+)\.default\("),  # custom ops (ultramem::*) and ATen fallbacks
}


def launches(code: str) -> Counter:
    """Kernel launches in the `call` function of Inductor's generated code, by "kind:name"."""
    body = code[code.index("def call(") :] if "def call(" in code else code
    found = Counter()
    for kind, pattern in LAUNCH_PATTERNS.items():
        for match in pattern.finditer(body):
            name = next(group for group in match.groups() if group)
            if kind == "generated":  # cpp_fused_add_mul_3 -> cpp_fused_add_mul: what it fuses, not its number
                name = re.sub(r"_\d+$", "", name)
            found[f"{kind}:{name}"] += 1
    return found


@torch.no_grad()
def decode_step_launches(model, batch: int, implementation: str | None = None) -> Counter:
    """The launches of one compiled decode step of `model` (eval, a static cache holding a 2-token prompt), its memory
    computed by `implementation`. The prompt is read through the PyTorch path: only its cache is needed, and Triton's
    interpreter (CPU) took most of this script's time running the prefill's kernels."""
    model.eval()
    if implementation is not None:
        models.use_memory_implementation(model, "torch")
    cache = models.filled_static_cache(model, batch, context=2, max_len=8)
    if implementation is not None:
        models.use_memory_implementation(model, implementation)
    tokens = torch.randint(1, model.config.vocab_size, (batch, 1), device=model.device)
    position = torch.tensor([2], device=model.device)
    if hasattr(model, "refresh_inference_cache"):
        model.refresh_inference_cache()
    torch._dynamo.reset()
    forward = torch.compile(model.forward, dynamic=False)
    _, codes = run_and_get_code(lambda: forward(input_ids=tokens, cache=cache, use_cache=True, cache_position=position))
    return sum((launches(code) for code in codes), Counter())


def count(size: str, device: torch.device, batch: int, implementations: list[str]) -> dict:
    """Launches of dense and of UltraMem with each memory implementation; UltraMem's extra per memory layer."""
    presets = models.PEERS[size]
    rows = {}
    dense = models.build(presets["dense"], device, torch.float32, max_position_embeddings=8)
    rows["dense"] = decode_step_launches(dense, batch)
    del dense
    for implementation in implementations:
        model = models.build(presets["ultramem"], device, torch.float32, max_position_embeddings=8)
        name, _, option = implementation.partition("+")
        with fused_selection(option == "fused-selection"):
            rows[f"ultramem/{implementation}"] = decode_step_launches(model, batch, name)
        memory_layers = len(model.config.memory_layers)
        del model
    base = sum(rows["dense"].values())
    table = []
    for name, found in rows.items():
        total = sum(found.values())
        extra = None if name == "dense" else (total - base) / memory_layers
        table.append({"model": name, "launches": total, "per_memory_layer_over_dense": extra, "by_name": dict(found)})
    return {"size": size, "batch": batch, "memory_layers": memory_layers, "rows": table}


def main(argv: list[str] | None = None) -> None:
    parser = cli.make_parser(__doc__, "decode_kernels", timed=False, plot=False)
    parser.add_argument("--size", default="tiny", choices=list(models.PEERS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--implementations", type=lambda text: cli.names(text, IMPLEMENTATIONS, "--implementations"),
                        default="triton,triton+fused-selection,torch", help=f"comma-separated, of {IMPLEMENTATIONS}")  # fmt: skip
    args = cli.resolve(parser.parse_args(argv), "decode_kernels")
    cli.at_least(args, batch=1)
    result = count(args.size, args.device, args.batch, args.implementations)
    report.finish(
        args, result, report.format_table(result["rows"], ["model", "launches", "per_memory_layer_over_dense"])
    )


if __name__ == "__main__":
    main()
