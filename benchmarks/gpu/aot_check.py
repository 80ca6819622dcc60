"""Compile every Triton kernel for Ampere (sm_80) and Hopper (sm_90) without a GPU, and report
registers and spills per kernel, at the launch parameters of the paper's UltraMem-x12 configurations.

    python benchmarks/gpu/aot_check.py [--arch 80 90] [--dtype bfloat16] [--configs 1.6b]

Triton ships ptxas and cuobjdump, so this runs on a CPU-only machine: CI checks that the kernels
build for the GPUs they target, which the CPU interpreter cannot. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ultramem.kernels import _triton_candidate_topk as candidates
from ultramem.kernels import _triton_lookup_reduce as lookup
from ultramem.kernels import _triton_quantized_lookup as quantized
from ultramem.kernels import _triton_tucker_topk as selection
from ultramem.presets import get_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for `lib`

from lib.models import PEERS  # noqa: E402

SIZES = ["151m", "680m", "1.6b"]
TRITON_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def resource_usage(fn, arguments: dict[str, str], constants: dict[str, int], arch: int, num_warps: int) -> dict:
    """Compile `fn` for sm_<arch> and read its registers, stack and local memory from the cubin."""
    signature = {name: "constexpr" if name in constants else arguments[name] for name in fn.arg_names}  # in order
    kernel = triton.compile(
        ASTSource(fn, signature, constants), target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}
    )
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        listing = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", listing)}


def forward_tiles(slots: int, chunk: int) -> dict[str, tuple[int, int, int]]:
    """The forward's heuristic tile (the interpreter's, labelled '') and each tile `triton.autotune` may choose on a
    GPU (labelled '[BLOCK_K x BLOCK_D, warps]'): all of them must build without spills."""
    tiles = {"": lookup.forward_tile(slots, chunk)}
    for config in lookup.tuned_forward_configs():
        block_k, block_d = config.kwargs["BLOCK_K"], config.kwargs["BLOCK_D"]
        tiles[f"[{block_k}x{block_d}, {config.num_warps} warps]"] = (block_k, block_d, config.num_warps)
    return tiles


def kernel_launches(config_name: str, dtype: str) -> dict[str, tuple]:
    """(kernel, argument types, constexprs, warps) of every launch at one configuration, by name."""
    config = get_config(PEERS[config_name]["ultramem"])
    slots = config.memory_heads * config.memory_topk
    chunk = config.memory_value_dim // config.mcs_cores
    groups = config.ive_expansion
    t = TRITON_DTYPES[dtype]
    sizes = dict(num_slots="i32", value_dim="i32", chunk="i32", num_cores="i32")
    forward_arguments = dict(values_ptr=f"*{t}", rows_ptr="*i64", groups_ptr="*i64", scores_ptr=f"*{t}",
                             out_ptr=f"*{t}", **sizes, size_class="i32")  # fmt: skip
    launches = {
        f"lookup_reduce.forward{label}": (
            lookup._forward_kernel.fn,
            forward_arguments,
            dict(NUM_GROUPS=groups, GROUPS_PAD=triton.next_power_of_2(groups), BLOCK_K=block_k, BLOCK_D=block_d),
            warps,
        )
        for label, (block_k, block_d, warps) in forward_tiles(slots, chunk).items()
    }
    block_k, block_d, warps = lookup.backward_tile(slots, chunk)
    backward_arguments = dict(
        grad_out_ptr=f"*{t}",
        values_ptr=f"*{t}",
        rows_ptr="*i64",
        groups_ptr="*i64",
        scores_ptr=f"*{t}",
        grad_scores_ptr=f"*{t}",
        grad_values_ptr="*fp32",
        **sizes,
    )
    for mode, atomic in (("atomic", True), ("scores", False)):
        launches[f"lookup_reduce.backward_{mode}"] = (
            lookup._backward_kernel,
            backward_arguments,
            dict(
                NUM_GROUPS=groups, ACCUMULATE_VALUES=atomic, BLOCK_K=block_k, BLOCK_D=block_d, COMPUTE_SCORE_GRAD=True
            ),
            warps,
        )
    launches["lookup_reduce.value_grad_segments"] = segment_launch(
        t, chunk, {"groups_ptr": "*i64"}, {"NUM_GROUPS": groups}
    )
    launches.update(lookup_dot_launches(slots, config.memory_value_dim, t))
    quantized_sizes = dict(num_slots="i32", width="i32", group_size="i32", group_bytes="i32", groups_per_core="i32",
                           num_cores="i32", value_dim="i32")  # fmt: skip
    for format, group_size in (("int8", chunk), ("int4", 64 if chunk % 64 == 0 else chunk)):  # the formats' defaults
        for label, (block_k, block_d, warps) in forward_tiles(slots, group_size).items():
            launches[f"quantized_lookup_reduce.forward_{format}{label}"] = (
                quantized._forward_kernel.fn,
                dict(
                    weight_ptr="*u8",
                    rows_ptr="*i64",
                    groups_ptr="*i64",
                    scores_ptr=f"*{t}",
                    out_ptr="*fp32",
                    **quantized_sizes,
                    size_class="i32",
                ),  # fmt: skip
                dict(
                    INT4=format == "int4",
                    NUM_GROUPS=groups,
                    GROUPS_PAD=triton.next_power_of_2(groups),
                    BLOCK_K=block_k,
                    BLOCK_D=block_d,
                ),  # fmt: skip
                warps,
            )
        block_k, block_d, _ = quantized.backward_tile(slots, group_size)
        launches[f"quantized_lookup_reduce.score_grad_{format}"] = (
            quantized._score_grad_kernel,
            dict(
                grad_out_ptr="*fp32",
                weight_ptr="*u8",
                rows_ptr="*i64",
                groups_ptr="*i64",
                grad_scores_ptr=f"*{t}",
                **quantized_sizes,
            ),
            dict(INT4=format == "int4", NUM_GROUPS=groups, BLOCK_K=block_k, BLOCK_D=block_d),
            quantized.SCORE_GRAD_WARPS,
        )
    padded, topk_padded, warps = candidates.candidate_tile(config.memory_topk, config.memory_topk)
    launches["tucker_candidate_topk"] = (
        candidates._candidate_index_kernel,
        dict(row_ptr=f"*{t}", col_ptr=f"*{t}", core_ptr=f"*{t}", out_ptr="*i64", num_candidates="i32", topk="i32"),
        dict(RANK=config.tucker_rank, M_PAD=padded, K_PAD=topk_padded),
        warps,
    )
    chunk, topk_padded, warps = selection.selection_tile(config.memory_num_keys, config.memory_topk)
    launches["tucker_topk"] = (
        selection._tucker_topk_kernel,
        dict(row_ptr=f"*{t}", col_ptr=f"*{t}", u_ptr=f"*{t}", t_ptr=f"*{t}", cores_ptr=f"*{t}", index_ptr="*i64",
             scores_out_ptr=f"*{t}", stride_item="i32", stride_rank="i32", num_heads="i32", num_keys="i32",
             topk="i32"),
        dict(RANK=config.tucker_rank, NUM_CORES=config.mcs_cores, CHUNK=chunk, M_PAD=topk_padded,
             DTYPE=selection.TRITON_DTYPES[getattr(torch, dtype)]),
        warps,
    )  # fmt: skip
    return launches


def segment_launch(t: str, width: int, group_arguments: dict[str, str], group_constants: dict) -> tuple:
    """The sorted value gradient's launch (`_value_grad_segment_kernel`) at row width `width`, with the group
    pointer's type in `group_arguments` or, for lookup_dot's single group, as a constexpr None in `group_constants`."""
    block_p, block_d, warps = lookup.segment_tile(2**20, width)
    arguments = dict(grad_out_ptr=f"*{t}", sorted_rows_ptr="*i32", order_ptr="*i64", segment_end_ptr="*i64",
                     scores_ptr=f"*{t}", grad_values_ptr=f"*{t}", num_entries="i32", num_slots="i32", value_dim="i32",
                     chunk="i32", num_cores="i32", **group_arguments)  # fmt: skip
    return (
        lookup._value_grad_segment_kernel,
        arguments,
        dict(**group_constants, BLOCK_P=block_p, BLOCK_D=block_d),
        warps,
    )


def lookup_dot_launches(slots: int, dim: int, t: str) -> dict[str, tuple]:
    """`lookup_dot`'s launches of the lookup-reduce kernels (`_triton_lookup_dot`): E = h = 1, with the pointers it
    passes as None (constexpr); `dim` stands for the pre-value width Dp (the tiles are the same for every Dp >= 128)."""
    sizes = dict(num_slots="i32", value_dim="i32", chunk="i32", num_cores="i32")
    one_group = dict(groups_ptr=None, NUM_GROUPS=1)
    block_k, block_d, warps = lookup.backward_tile(slots, dim)
    tile = dict(BLOCK_K=block_k, BLOCK_D=block_d)
    pointers = dict(grad_out_ptr=f"*{t}", rows_ptr="*i64")
    launches = {
        "lookup_dot.forward": (
            lookup._backward_kernel,
            dict(**pointers, values_ptr=f"*{t}", grad_scores_ptr=f"*{t}", **sizes),
            dict(
                **one_group,
                scores_ptr=None,
                grad_values_ptr=None,
                ACCUMULATE_VALUES=False,
                COMPUTE_SCORE_GRAD=True,
                **tile,
            ),
            warps,
        ),
        "lookup_dot.table_grad_atomic": (
            lookup._backward_kernel,
            dict(**pointers, scores_ptr=f"*{t}", grad_values_ptr="*fp32", **sizes),
            dict(
                **one_group,
                values_ptr=None,
                grad_scores_ptr=None,
                ACCUMULATE_VALUES=True,
                COMPUTE_SCORE_GRAD=False,
                **tile,
            ),
            warps,
        ),
    }
    for label, (block_k, block_d, warps) in forward_tiles(slots, dim).items():
        launches[f"lookup_dot.query_grad{label}"] = (
            lookup._forward_kernel.fn,
            dict(values_ptr=f"*{t}", rows_ptr="*i64", scores_ptr=f"*{t}", out_ptr=f"*{t}", **sizes, size_class="i32"),
            dict(**one_group, GROUPS_PAD=1, BLOCK_K=block_k, BLOCK_D=block_d),
            warps,
        )
    launches["lookup_dot.table_grad_segments"] = segment_launch(t, dim, {}, one_group)
    return launches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", type=int, default=[80, 90])
    parser.add_argument("--dtype", default="bfloat16", choices=list(TRITON_DTYPES))
    parser.add_argument("--configs", nargs="+", default=["1.6b"], choices=SIZES)
    args = parser.parse_args(argv)
    report = []
    for config_name in args.configs:
        for name, (fn, arguments, constants, warps) in kernel_launches(config_name, args.dtype).items():
            for arch in args.arch:
                usage = resource_usage(fn, arguments, constants, arch, warps)
                report.append(
                    dict(
                        kernel=name,
                        config=config_name,
                        arch=f"sm_{arch}",
                        dtype=args.dtype,
                        constants=constants,
                        num_warps=warps,
                        **usage,
                    )
                )
                print(f"{name:36s} {config_name:5s} sm_{arch} warps={warps} {usage}", flush=True)
    print(json.dumps(report, default=str))  # constexpr dtypes as their names


if __name__ == "__main__":
    main()
