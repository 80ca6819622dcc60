"""The Triton memory kernels against the PyTorch reference (`ultramem.memory_ops`), on CPU.

Kernels run in Triton's interpreter (TRITON_INTERPRET=1). Triton reads that variable when a
function is decorated, including its own standard library, so it must be set before anything in
the process imports triton. This module sets it at collection when it can; if triton was imported
earlier (importing Transformers' model classes does, and conftest imports them), the cases cannot
run in this process: one test re-runs this file in a fresh process with the variable set, and the
in-process copies are skipped with that reason. Setting TRITON_INTERPRET=1 before pytest starts
runs them in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_INTERPRETER_WAS_SET = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON_IMPORTED_FIRST = "triton" in sys.modules and not _INTERPRETER_WAS_SET
if not _TRITON_IMPORTED_FIRST:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see the module docstring)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from ultramem import kernels, memory_ops  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
in_process = pytest.mark.skipif(
    _TRITON_IMPORTED_FIRST, reason="triton was imported before TRITON_INTERPRET=1; run by test_in_fresh_process"
)

# Tolerances per dtype: the kernels round once from float32, the reference is run in float32.
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def _lookup_inputs(num_tokens, num_slots, value_dim, num_rows, num_groups, num_cores, dtype, seed, row_range=None):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(num_rows, value_dim, generator=generator).to(dtype)
    rows = torch.randint(0, row_range or num_rows, (num_tokens, num_slots), generator=generator)
    groups = torch.randint(0, num_groups, (num_tokens, num_slots), generator=generator)
    scores = torch.randn(num_tokens, num_slots, num_cores, generator=generator).to(dtype)
    grad_out = torch.randn(num_tokens, num_groups, value_dim, generator=generator).to(dtype)
    return values, rows, groups, scores, grad_out


def _reference_grads(values, rows, groups, scores, num_groups, grad_out):
    """Reference output and gradients, computed in float32 from the same (rounded) inputs."""
    values32 = values.float().requires_grad_()
    scores32 = scores.float().requires_grad_()
    out = memory_ops.lookup_reduce(values32, rows, groups, scores32, num_groups)
    grad_values, grad_scores = torch.autograd.grad(out, (values32, scores32), grad_out.float())
    return out.detach(), grad_values, grad_scores


def _kernel_grads(values, rows, groups, scores, num_groups, grad_out, deterministic):
    values = values.clone().requires_grad_()
    scores = scores.clone().requires_grad_()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out = kernels.lookup_reduce(values, rows, groups, scores, num_groups)
        grad_values, grad_scores = torch.autograd.grad(out, (values, scores), grad_out)
    finally:
        torch.use_deterministic_algorithms(previous)
    return out.detach(), grad_values, grad_scores


# (T, K, Dv, N, E, h): E in {1, 4, 9}, h in {1, 2, 4}, value dims that are not powers of two.
SHAPES = [
    (5, 7, 12, 11, 1, 1),
    (6, 12, 20, 9, 4, 2),
    (4, 18, 36, 13, 9, 4),
    (3, 9, 24, 10, 9, 1),
    (7, 5, 40, 6, 4, 4),
]


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-K{}-Dv{}-N{}-E{}-h{}".format(*s))
def test_lookup_reduce_matches_reference(shape, dtype, poison):
    num_tokens, num_slots, value_dim, num_rows, num_groups, num_cores = shape
    inputs = _lookup_inputs(*shape, dtype=dtype, seed=sum(shape))
    values, rows, groups, scores, grad_out = inputs
    ref_out, ref_grad_values, ref_grad_scores = _reference_grads(values, rows, groups, scores, num_groups, grad_out)
    for deterministic in (True, False):
        out, grad_values, grad_scores = _kernel_grads(*inputs[:4], num_groups, grad_out, deterministic)
        assert out.dtype == grad_values.dtype == grad_scores.dtype == dtype
        assert out.shape == (num_tokens, num_groups, value_dim)
        torch.testing.assert_close(out.float(), ref_out, **TOLERANCE[dtype])
        torch.testing.assert_close(grad_scores.float(), ref_grad_scores, **TOLERANCE[dtype])
        torch.testing.assert_close(grad_values.float(), ref_grad_values, **TOLERANCE[dtype])


@in_process
def test_sorted_value_gradient_runs_where_it_is_faster():
    """16-bit tables with fewer (token, slot) entries than rows take the sort/segment value gradient even without
    deterministic mode (measured faster on an H200 there), and still match the reference."""
    from ultramem.kernels._triton_lookup_reduce import sorted_value_grad_is_faster

    shape = (2, 3, 16, 64, 4, 2)  # 6 entries, 64 rows
    values, rows, groups, scores, grad_out = _lookup_inputs(*shape, dtype=torch.bfloat16, seed=5)
    assert sorted_value_grad_is_faster(values, rows)
    assert not sorted_value_grad_is_faster(values.float(), rows)
    assert not sorted_value_grad_is_faster(values[:6], rows.clamp_max(5))
    reference = _reference_grads(values, rows, groups, scores, 4, grad_out)
    for got, want in zip(_kernel_grads(values, rows, groups, scores, 4, grad_out, False), reference, strict=True):
        torch.testing.assert_close(got.float(), want, **TOLERANCE[torch.bfloat16])


@in_process
@pytest.mark.parametrize("draw", range(6))
def test_lookup_reduce_random_shapes(draw):
    """Seeded random (T, K, Dv, N, E, h): Dv = h x (1..7), so mostly not a power of two."""
    rng = torch.Generator().manual_seed(100 + draw)

    def pick(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=rng))

    num_groups, num_cores = (1, 4, 9)[pick(0, 2)], (1, 2, 4)[pick(0, 2)]
    shape = (pick(1, 9), pick(1, 20), num_cores * pick(1, 7), pick(1, 30), num_groups, num_cores)
    values, rows, groups, scores, grad_out = _lookup_inputs(*shape, dtype=torch.float32, seed=draw)
    reference = _reference_grads(values, rows, groups, scores, num_groups, grad_out)
    for deterministic in (True, False):
        got = _kernel_grads(values, rows, groups, scores, num_groups, grad_out, deterministic)
        for tensor, expected in zip(got, reference):
            torch.testing.assert_close(tensor, expected, **TOLERANCE[torch.float32], msg=lambda m: f"{shape}: {m}")


@in_process
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_value_gradient_with_heavy_duplicates(deterministic):
    """24 tokens x 16 slots all reading 3 rows (many tokens and heads on one row; segments span several
    tiles of the deterministic kernel), 4 groups, 2 cores."""
    inputs = _lookup_inputs(24, 16, 12, 50, 4, 2, torch.float32, seed=3, row_range=3)
    values, rows, groups, scores, grad_out = inputs
    _, ref_grad_values, ref_grad_scores = _reference_grads(values, rows, groups, scores, 4, grad_out)
    _, grad_values, grad_scores = _kernel_grads(values, rows, groups, scores, 4, grad_out, deterministic)
    assert ref_grad_values[:3].abs().min() > 0 and ref_grad_values[3:].abs().max() == 0
    torch.testing.assert_close(grad_values, ref_grad_values, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_scores, ref_grad_scores, rtol=1e-5, atol=1e-5)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_mode_gives_identical_bits(dtype):
    inputs = _lookup_inputs(24, 12, 8, 5, 4, 2, dtype, seed=11)
    first = _kernel_grads(*inputs[:4], 4, inputs[4], deterministic=True)
    second = _kernel_grads(*inputs[:4], 4, inputs[4], deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(
            a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        )


@in_process
def test_mixed_dtypes_and_int32_indices():
    """bf16 table with float32 scores (as under autocast) and int32 indices: each output keeps its dtype."""
    values, rows, groups, scores, grad_out = _lookup_inputs(6, 10, 20, 9, 4, 2, torch.float32, seed=4)
    values, grad_out = values.to(torch.bfloat16), grad_out.to(torch.bfloat16)
    _, ref_grad_values, ref_grad_scores = _reference_grads(values, rows, groups, scores, 4, grad_out)
    out, grad_values, grad_scores = _kernel_grads(
        values, rows.int(), groups.int(), scores, 4, grad_out, deterministic=True
    )
    assert (out.dtype, grad_values.dtype, grad_scores.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    torch.testing.assert_close(out, memory_ops.lookup_reduce(values, rows, groups, scores, 4), rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(grad_values.float(), ref_grad_values, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(grad_scores, ref_grad_scores, **TOLERANCE[torch.bfloat16])


@in_process
def test_empty_and_slotless_inputs():
    values = torch.randn(4, 6, requires_grad=True)
    for num_tokens, num_slots in ((0, 3), (2, 0)):
        rows = torch.zeros(num_tokens, num_slots, dtype=torch.int64)
        scores = torch.zeros(num_tokens, num_slots, 2, requires_grad=True)
        out = kernels.lookup_reduce(values, rows, rows, scores, 4)
        assert torch.equal(out, torch.zeros(num_tokens, 4, 6))
        out.sum().backward()
        assert torch.equal(values.grad, torch.zeros_like(values))


@in_process
@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(values=torch.zeros(5, 12, dtype=torch.int32)), TypeError, "values has dtype torch.int32"),
        (dict(rows=torch.zeros(3, 4)), TypeError, "rows has dtype torch.float32"),
        (dict(groups=torch.zeros(3, 5, dtype=torch.int64)), ValueError, "groups must have the shape of rows"),
        (dict(scores=torch.zeros(3, 4, 5)), ValueError, "h = 5"),
        (dict(rows=torch.full((3, 4), 5)), IndexError, "rows contains 5; allowed range is [0, 4]"),
        (dict(rows=torch.full((3, 4), -1)), IndexError, "rows contains -1; allowed range is [0, 4]"),
        (dict(groups=torch.full((3, 4), 4)), IndexError, "groups contains 4; allowed range is [0, 3]"),
        (dict(num_groups=0), ValueError, "num_groups must be an int >= 1"),
    ],
)
def test_lookup_reduce_rejects_bad_input(change, error, message):
    arguments = dict(
        values=torch.zeros(5, 12),
        rows=torch.zeros(3, 4, dtype=torch.int64),
        groups=torch.zeros(3, 4, dtype=torch.int64),
        scores=torch.zeros(3, 4, 2),
        num_groups=4,
    )
    arguments.update(change)
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        kernels.lookup_reduce(**arguments)


def _candidate_inputs(lead, num_heads, num_cores, rank, num_candidates, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    row = torch.randn(*lead, num_heads, rank, num_candidates, generator=generator).to(dtype)
    col = torch.randn(*lead, num_heads, rank, num_candidates, generator=generator).to(dtype)
    cores = torch.randn(num_heads, num_cores, rank, rank, generator=generator).to(dtype)
    return row, col, cores


@in_process
@pytest.mark.parametrize("num_cores, rank, num_candidates", [(1, 2, 5), (2, 2, 7), (4, 3, 6), (2, 2, 16)])
def test_tucker_candidate_topk_matches_reference(num_cores, rank, num_candidates, poison):
    row, col, cores = _candidate_inputs((2, 3), 2, num_cores, rank, num_candidates, torch.float32, seed=num_candidates)
    inputs = [t.clone().requires_grad_() for t in (row, col, cores)]
    ref_inputs = [t.clone().requires_grad_() for t in (row, col, cores)]
    flat_index, core_scores = kernels.tucker_candidate_topk(*inputs, num_candidates)
    ref_index, ref_scores = memory_ops.tucker_candidate_topk(*ref_inputs, num_candidates)
    assert flat_index.dtype == torch.int64
    assert torch.equal(flat_index, ref_index)
    torch.testing.assert_close(core_scores, ref_scores, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(core_scores)
    grads = torch.autograd.grad((core_scores * weights).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_scores * weights).sum(), ref_inputs)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


@in_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tucker_candidate_topk_half_precision(dtype):
    """Indices may differ from the reference only where two summed scores tie at this precision."""
    row, col, cores = _candidate_inputs((3,), 2, 2, 2, 6, dtype, seed=5)
    flat_index, core_scores = kernels.tucker_candidate_topk(row, col, cores, 6)
    exact = torch.einsum("...ax,...iab,...by->...xy", row.float(), cores.float(), col.float()).flatten(-2)
    chosen = exact.gather(-1, flat_index)
    best = exact.topk(6, dim=-1).values
    torch.testing.assert_close(chosen, best, **TOLERANCE[dtype])
    assert core_scores.dtype == dtype
    torch.testing.assert_close(core_scores.float().sum(-1), chosen, **TOLERANCE[dtype])


@in_process
def test_tucker_candidate_topk_falls_back_above_128_candidates():
    row, col, cores = _candidate_inputs((1,), 1, 2, 2, 130, torch.float32, seed=1)
    for got, ref in zip(
        kernels.tucker_candidate_topk(row, col, cores, 3), memory_ops.tucker_candidate_topk(row, col, cores, 3)
    ):
        assert torch.equal(got, ref)


@in_process
@pytest.mark.parametrize(
    "shapes, topk, message",
    [
        (((2, 2, 5), (2, 2, 4), (1, 2, 2)), 3, "row_scores and col_scores must both be"),
        (((2, 2, 5), (2, 2, 5), (1, 3, 3)), 3, r"cores must be \(..., h, r, r\) with r = 2"),
        (((2, 2, 5), (2, 2, 5), (1, 2, 2)), 26, r"topk must be an int in \[1, 25\]"),
        (((3, 2, 5), (3, 2, 5), (2, 1, 2, 2)), 4, r"leading dims of row_scores \(3,\).* must broadcast"),
    ],
)
def test_tucker_candidate_topk_rejects_bad_input(shapes, topk, message):
    with pytest.raises(ValueError, match=message):
        kernels.tucker_candidate_topk(*(torch.zeros(s) for s in shapes), topk)


@in_process
def test_torch_compile_traces_the_kernels_without_graph_breaks():
    """fullgraph=True fails on any graph break; aot_eager runs the custom ops' fake and real kernels."""
    values, rows, groups, scores, _ = _lookup_inputs(4, 6, 12, 7, 4, 2, torch.float32, seed=2)
    row, col, cores = _candidate_inputs((4,), 1, 2, 2, 5, torch.float32, seed=2)

    def memory_step(values, scores, row, col, cores):
        flat_index, core_scores = kernels.tucker_candidate_topk(row, col, cores, 5)
        pooled = kernels.lookup_reduce(values, rows, groups, scores * core_scores.mean(), 4)
        return pooled.square().sum() + flat_index.sum()

    leaves = [t.clone().requires_grad_() for t in (values, scores, row, col, cores)]
    compiled = torch.compile(memory_step, backend="aot_eager", fullgraph=True)
    compiled_grads = torch.autograd.grad(compiled(*leaves), leaves)
    eager_grads = torch.autograd.grad(memory_step(*leaves), leaves)
    for got, ref in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no GPU is present")
def test_cpu_tensors_without_interpreter_raise_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    values, rows, groups, scores, _ = _lookup_inputs(2, 3, 4, 5, 1, 1, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="need triton and CUDA tensors .*set_memory_implementation"):
        kernels.lookup_reduce(values, rows, groups, scores, 1)
    with pytest.raises(RuntimeError, match="need triton and CUDA tensors"):
        kernels.tucker_candidate_topk(*_candidate_inputs((2,), 1, 1, 2, 3, torch.float32, seed=0), 3)


@in_process
def test_triton_available_under_interpreter():
    assert kernels.triton_available()


@pytest.mark.skipif(not _TRITON_IMPORTED_FIRST, reason="the cases ran in this process (triton was not imported first)")
def test_in_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        __file__,
        "-k",
        "not benchmark_script and not compile_for_ampere",
    ]  # those two run in subprocesses anyway
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_kernels_compile_for_ampere_and_hopper():
    """The interpreter cannot catch what only the GPU compiler rejects: compile every kernel for sm_80
    and sm_90 ahead of time (Triton ships ptxas; no GPU needed) and check that none spills registers."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu/aot_check.py", "--configs", "151m"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # a kernel `triton.autotune` tunes appears once per candidate tile, as "name[tile]"
    assert {(row["kernel"].split("[")[0], row["arch"]) for row in report} == {
        (kernel, arch)
        for kernel in (
            "lookup_reduce.forward",
            "lookup_reduce.backward_atomic",
            "lookup_reduce.backward_scores",
            "lookup_reduce.value_grad_segments",
            "lookup_dot.forward",
            "lookup_dot.table_grad_atomic",
            "lookup_dot.query_grad",
            "lookup_dot.table_grad_segments",
            "tucker_candidate_topk",
            "tucker_topk",
            *(
                f"quantized_lookup_reduce.{kernel}_{format}"
                for kernel in ("forward", "score_grad")
                for format in ("int8", "int4")
            ),
        )
        for arch in ("sm_80", "sm_90")
    }
    for row in report:
        assert row["LOCAL"] == row["STACK"] == 0 and row["REG"] <= 128, row


@in_process
@pytest.mark.parametrize("fused_selection", [False, True], ids=["candidate-kernel", "fused-selection"])
def test_model_trains_through_the_kernels(fused_selection):
    """UltraMemForCausalLM with memory_implementation='triton' gives the loss and every gradient of 'torch', with the
    default selection and with the opt-in one-kernel selection."""
    from model_support import assert_trains_like_the_reference

    torch.manual_seed(0)
    with kernels.fused_selection(fused_selection), torch.profiler.profile() as profile:
        assert_trains_like_the_reference("triton", torch.randint(0, 97, (2, 9)))
    assert ("ultramem::tucker_topk" in {event.key for event in profile.key_averages()}) == fused_selection


@in_process
def test_model_compiles_without_graph_breaks_through_the_kernels():
    """torch.compile(fullgraph=True) of the whole model on the Triton path: custom ops, no graph break."""
    from model_support import small_config

    from ultramem import UltraMemForCausalLM

    torch.manual_seed(0)
    model = UltraMemForCausalLM(
        small_config(memory_implementation="triton", num_hidden_layers=2, memory_layers=[[0, 1]])
    )
    input_ids = torch.randint(0, 97, (2, 9))
    eager = model(input_ids=input_ids, labels=input_ids).loss
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=input_ids, labels=input_ids).loss
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    assert model.model.embed_tokens.weight.grad is not None
