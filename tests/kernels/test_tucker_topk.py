"""TDQKR's one-kernel selection at inference (`kernels.tucker_topk`, `ultramem::tucker_topk`) against the reference
composition (`memory_ops.tucker_topk`), in Triton's interpreter on CPU; where it hands over to the reference; and its
switch (opt-in: off unless `fused_selection()` or `ULTRAMEM_FUSED_SELECTION=1`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from selection_inputs import random_inputs, tie_free_inputs

from ultramem import kernels, memory_ops
from ultramem.kernels.tucker_topk import fused_selection, fuses

# The Triton cases run on CPU tensors in Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1 before
# anything imports triton on a machine without CUDA.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton cases run on CPU tensors in Triton's interpreter"
)


@pytest.fixture(autouse=True)
def switched_on():
    """Every case here runs with the one-kernel selection switched on; those about the switch turn it off inside."""
    with fused_selection():
        yield


@pytest.mark.numerics  # run again under a second CPU dispatch level (.ci/run)
@interpreted
@pytest.mark.parametrize(
    "batch, heads, rank, num_keys, num_cores, topk",
    [(3, 2, 2, 12, 2, 4), (2, 1, 3, 37, 3, 7), (2, 2, 1, 20, 1, 1), (1, 2, 2, 9, 2, 9), (2, 2, 2, 70, 2, 33)],
    ids=["paper-like", "rank3-h3", "rank1", "topk=n", "topk33"],
)
@pytest.mark.usefixtures("poison")
def test_matches_the_reference(batch, heads, rank, num_keys, num_cores, topk):
    """float32: the reference's addresses in its order, and its per-core scores."""
    inputs = random_inputs(batch, heads, rank, num_keys, num_cores)
    with torch.no_grad():
        index, scores = kernels.tucker_topk(*inputs, topk)
        expected_index, expected_scores = memory_ops.tucker_topk(*inputs, topk)
    assert index.dtype == torch.int64 and index.shape == (batch, heads, topk)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.usefixtures("poison")
def test_half_precision_matches_the_unfused_kernels(dtype):
    """16-bit scores: the projections are rounded as the reference rounds them, so (without ties) the same axis
    candidates; the grid is scored in float32 as the candidate kernel scores it, so the same winners in the same order.
    The winners' scores are rounded once from float32 (the reference's einsum rounds in between)."""
    inputs = tie_free_inputs(2, 2, 2, 50, 2, dtype)
    with torch.no_grad():
        index, scores = kernels.tucker_topk(*inputs, 8)
        expected_index, expected_scores = memory_ops.tucker_topk(*inputs, 8, False, kernels.tucker_candidate_topk)
    assert scores.dtype == dtype
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores.float(), expected_scores.float(), rtol=2e-2, atol=5e-2)


@interpreted
@pytest.mark.usefixtures("poison")
def test_batch_dims_and_a_negative_quadrant():
    """Any leading dims (B, T) pass through; a token whose best rank-1 score is in the (bottom, bottom) quadrant takes
    its candidates there, as the reference does."""
    axis_scores, cores, vectors = random_inputs(6, 2, 2, 30, 2, seed=3)
    for axis in range(2):  # a and b drop far below zero for token 0
        axis_scores[0, axis, 0, 0] -= 10 * vectors[axis, 0, 0, 0].sign()
    axis_scores = axis_scores.view(2, 3, 2, 2, 2, 30)
    with torch.no_grad():
        index, scores = kernels.tucker_topk(axis_scores, cores, vectors, 5)
        expected_index, expected_scores = memory_ops.tucker_topk(axis_scores, cores, vectors, 5)
    assert index.shape == (2, 3, 2, 5) and scores.shape == (2, 3, 2, 5, 2)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.usefixtures("poison")
def test_more_keys_than_one_chunk_merge_into_the_same_selection(monkeypatch):
    """Axes longer than a chunk (MAX_CHUNK keys, 4,096 on the GPU) are taken a chunk at a time, each chunk's best
    merged into the best so far: the same addresses as the reference, with n not a multiple of the chunk."""
    from ultramem.kernels import _triton_tucker_topk

    monkeypatch.setattr(_triton_tucker_topk, "MAX_CHUNK", 16)
    inputs = random_inputs(3, 2, 2, 57, 2, seed=7)
    with torch.no_grad():
        index, scores = kernels.tucker_topk(*inputs, 6)
        expected_index, expected_scores = memory_ops.tucker_topk(*inputs, 6)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)


@interpreted
def test_training_takes_the_kernels_addresses_and_the_references_gradients():
    """A gradient wanted (training): the kernel picks the addresses, and the winners' per-core scores, recomputed from
    their gathered axis scores, carry the reference's gradients to the axis scores and the cores."""
    axis_scores, cores, vectors = random_inputs(2, 2, 2, 16, 2)
    leaves = [tensor.requires_grad_() for tensor in (axis_scores, cores)]
    with torch.profiler.profile() as profile:
        index, scores = kernels.tucker_topk(axis_scores, cores, vectors, 4)
    assert "ultramem::tucker_topk" in {event.key for event in profile.key_averages()}
    expected_index, expected_scores = memory_ops.tucker_topk(axis_scores, cores, vectors, 4)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(scores.sum(), leaves)
    expected_grads = torch.autograd.grad(expected_scores.sum(), leaves)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected)


@interpreted
def test_signed_candidates_take_the_reference_composition():
    """Signed candidates (2m per axis, 4 m^2 candidates) are the reference composition's with the candidate kernel."""
    inputs = random_inputs(2, 2, 2, 16, 2)
    assert fuses(4, signed=False) and not fuses(4, signed=True)
    with torch.no_grad():
        signed_index, _ = kernels.tucker_topk(*inputs, 4, signed=True)
    torch.testing.assert_close(signed_index, memory_ops.tucker_topk(*inputs, 4, True)[0])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(axis_scores=(2, 3, 2, 2, 16)), "axis_scores must be (..., 2, H, r, n)"),
        (dict(cores=(2, 2, 3, 3)), "cores must be (H, h, r, r)"),
        (dict(leading_vectors=(2, 2, 3, 1)), "leading_vectors must be (2, H, r, 1)"),
        (dict(topk=17), "topk must be an int in [1, 16]"),
    ],
)
def test_rejects_bad_input_with_one_named_error(change, message):
    shapes = dict(axis_scores=(2, 2, 2, 2, 16), cores=(2, 2, 2, 2), leading_vectors=(2, 2, 2, 1), topk=4) | change
    axis_scores, cores, leading = (torch.zeros(shapes[name]) for name in ("axis_scores", "cores", "leading_vectors"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        kernels.tucker_topk(axis_scores, cores, leading, shapes["topk"])


@interpreted
def test_custom_op_passes_opcheck():
    """Schema, fake (meta) implementation and dispatch of `ultramem::tucker_topk`."""
    axis_scores, cores, leading = random_inputs(3, 2, 2, 12, 2)
    row, col, u, t = (*axis_scores.unbind(1), *leading.squeeze(-1))
    torch.library.opcheck(torch.ops.ultramem.tucker_topk, (row, col, u, t, cores, 4))


@interpreted
def test_model_decodes_through_the_fused_selection():
    """A model on the Triton path generates, token for token, what the reference path generates, and its decode
    step runs the fused selection once per memory layer and no `topk`."""
    from model_support import small_config

    from ultramem import UltraMemForCausalLM

    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(memory_implementation="torch")).eval()
    prompt = torch.randint(1, 97, (2, 5))
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    model.set_memory_implementation("triton")
    with torch.profiler.profile() as profile:
        generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(generated, expected, rtol=0, atol=0)
    calls = {event.key: event.count for event in profile.key_averages()}
    steps, memory_layers = 4, len(model.config.memory_layers)  # the prefill and 3 decode steps
    assert calls.get("ultramem::tucker_topk") == steps * memory_layers
    assert "aten::topk" not in calls


@pytest.mark.parametrize("environment, expected", [({}, "False"), ({"ULTRAMEM_FUSED_SELECTION": "1"}, "True")])
def test_the_switch_is_off_unless_the_environment_turns_it_on(environment, expected):
    """Opt-in until a GPU has timed it: a fresh process starts with the switch off; the variable turns it on."""
    env = {key: value for key, value in os.environ.items() if key != "ULTRAMEM_FUSED_SELECTION"} | environment
    code = "import importlib; print(importlib.import_module('ultramem.kernels.tucker_topk')._fused_selection)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == expected


@interpreted
def test_switched_off_the_model_decodes_through_the_candidate_kernel():
    """With the switch off (the default) the Triton path's decode step runs the reference composition with the
    candidate kernel, and the switch restores its previous state when the block ends."""
    from model_support import small_config

    from ultramem import UltraMemForCausalLM

    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(memory_implementation="triton")).eval()
    prompt = torch.randint(1, 97, (2, 5))
    with fused_selection(False), torch.profiler.profile() as profile:
        model.generate(prompt, max_new_tokens=2, do_sample=False)
    calls = {event.key: event.count for event in profile.key_averages()}
    assert "ultramem::tucker_topk" not in calls and calls.get("ultramem::tucker_candidate_index", 0) > 0
    assert fuses(4, signed=False)  # the fixture's state is back


@interpreted
def test_a_compiled_caller_follows_the_switch():
    """torch.compile guards on the switch: the same compiled function runs the one-kernel selection while it is on
    and the candidate kernel once it is off again."""
    inputs = random_inputs(2, 2, 2, 16, 2)
    compiled = torch.compile(lambda *args: kernels.tucker_topk(*args, 4), backend="aot_eager", fullgraph=True)

    def custom_ops() -> set[str]:
        with torch.profiler.profile() as profile, torch.no_grad():
            compiled(*inputs)
        return {event.key for event in profile.key_averages() if event.key.startswith("ultramem::")}

    assert custom_ops() == {"ultramem::tucker_topk"}  # the fixture's switch is on
    with fused_selection(False):
        assert custom_ops() == {"ultramem::tucker_candidate_index"}
