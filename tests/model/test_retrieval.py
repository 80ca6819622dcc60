"""Retrieval, init and bookkeeping of the memory layers: continuity, init scales, SVD gradients, counts."""

import pytest
import torch
from model_support import small_config

from ultramem import UltraMemForCausalLM, memory_ops


def _memory_output_std(config, seeds: int = 32) -> float:
    """Std of the first memory layer's output at init for unit-variance inputs, averaged over seeds.

    Each head's summed core is rescaled to ||C||_F = 1, its expected norm at init, so that the chi-square
    spread of a 2x2 core's norm does not swamp the comparison (the split between the h cores stays random).
    """
    stds = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        layer = UltraMemForCausalLM(config).model.memory_layers[0]
        cores = layer.retrieval.cores  # (H, h, r, r)
        with torch.no_grad():
            cores /= cores.sum(1, keepdim=True).norm(dim=(-2, -1), keepdim=True)
        hidden = torch.randn(2, 32, config.hidden_size, generator=torch.Generator().manual_seed(100 + seed))
        with torch.no_grad():
            stds.append(layer(hidden).std().item())
    return sum(stds) / len(stds)


@pytest.mark.parametrize("improved_init", [True, False])
def test_memory_output_scale_at_init_does_not_depend_on_mcs_cores(improved_init):
    """Each value chunk is weighted by one core's score (about S/h): the init compensates (`MemoryInitScales`)."""
    kwargs = dict(improved_init=improved_init, memory_num_keys=32, memory_value_dim=16, memory_layers=[[0, 1]])
    one, two = (_memory_output_std(small_config(mcs_cores=h, **kwargs)) for h in (1, 2))
    assert two / one == pytest.approx(1.0, abs=0.1), two / one


def _rotation(angle: float) -> torch.Tensor:
    cos, sin = torch.tensor(angle).cos(), torch.tensor(angle).sin()
    return torch.stack([torch.stack([cos, -sin]), torch.stack([sin, cos])])


@pytest.mark.parametrize(
    "name, matrix",
    [
        ("rotation", 1.7 * _rotation(0.3)),
        ("reflection", 1.3 * _rotation(0.4) @ torch.diag(torch.tensor([1.0, -1.0]))),
        ("zero", torch.zeros(2, 2)),
        ("rank one", torch.outer(torch.tensor([0.6, -0.8]), torch.tensor([1.0, 2.0]))),
        ("generic", torch.tensor([[0.3, -1.2], [0.7, 0.5]])),
    ],
)
def test_svd_2x2_gradients_are_finite_and_match_linalg(name, matrix):
    """The closed form used on accelerators: finite gradients everywhere, torch.linalg.svd's where defined."""
    from ultramem.memory_ops import svd_2x2

    closed = matrix.double().requires_grad_()
    singular, u, t = svd_2x2(closed)
    (singular.sum() + 0.7 * singular[0] + u.sum() + t.sum()).backward()
    assert torch.isfinite(closed.grad).all()
    torch.testing.assert_close(singular, torch.linalg.svdvals(matrix.double()))

    # The nuclear norm is differentiable wherever the matrix is invertible (rotation, reflection, generic);
    # the leading singular value where the two singular values differ (rank one, generic).
    checks = {"nuclear norm": ("rotation", "reflection", "generic"), "leading value": ("rank one", "generic")}
    for check, weights in zip(checks, ((1.0, 1.0), (1.0, 0.0))):
        if name not in checks[check]:
            continue
        grads = []
        for svd in (lambda x: svd_2x2(x)[0], torch.linalg.svdvals):
            x = matrix.double().requires_grad_()
            (svd(x) * torch.tensor(weights, dtype=torch.float64)).sum().backward()
            grads.append(x.grad)
        torch.testing.assert_close(grads[0], grads[1], msg=check)


def test_signed_candidates_need_two_m_keys_per_axis():
    """With fewer than 2m keys per axis the top-m and bottom-m candidates would share keys: duplicate slots."""
    from ultramem import UltraMemConfigError

    with pytest.raises(UltraMemConfigError, match=r"memory_topk=4 .*<= memory_num_keys / 2 = 3"):
        small_config(tdqkr_signed_candidates=True, memory_num_keys=6, memory_num_values=9)
    model = UltraMemForCausalLM(small_config(tdqkr_signed_candidates=True, memory_num_keys=8)).eval()
    with torch.no_grad():
        virtual_index, _ = model.model.memory_layers[0].retrieve(torch.randn(2, 5, 32))  # (B, T, H, m)
    assert (virtual_index.sort(-1).values.diff(dim=-1) > 0).all()  # no slot selected twice


def test_aux_loss_with_memory_layers_on_different_devices():
    """`device_map` may put memory layers on different devices: the aux loss must not stack their cores.

    CPU-only stand-in for two accelerators: one layer on the meta device, the others on CPU.
    """
    model = UltraMemForCausalLM(small_config())
    model.model.memory_layers[0].to("meta")
    loss = model.model.aux_loss()  # the formula itself: test_modeling.py::test_aux_loss_formula_and_loss_sum
    assert loss.device.type == "meta" and loss.shape == ()


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_non_embedding_parameters_match_the_presets(tie_word_embeddings):
    """Value tables are parameters, not embeddings; the token embedding and the LM head are (tiny: 20.52M)."""
    from ultramem.presets import count_parameters, get_config

    config = get_config("tiny-ultramem", tie_word_embeddings=tie_word_embeddings)
    with torch.device("meta"):
        model = UltraMemForCausalLM(config)
    expected = count_parameters(config)["total"]
    assert model.num_parameters(exclude_embeddings=True) == expected
    assert model.model.num_parameters(exclude_embeddings=True) == expected
    embeddings = config.vocab_size * config.hidden_size * (1 if tie_word_embeddings else 2)
    assert model.num_parameters() == expected + embeddings


@pytest.mark.parametrize("compiled", [False, True])
def test_static_cache_generation_equals_dynamic(compiled):
    """`cache_implementation="static"` (mask dict per layer type, static conv states) and compiled decoding
    (`compile_config`; Dynamo with the eager backend, so CPU stays fast) equal dynamic-cache generation."""
    from model_support import left_padded_batch, perturbed_model
    from transformers import CompileConfig

    config = small_config(vocab_size=211)
    model = perturbed_model(config, seed=7)
    input_ids, attention_mask = left_padded_batch(config.vocab_size, [9, 6, 3], seed=4)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    dynamic = model.generate(input_ids, **kwargs)
    if compiled:
        torch._dynamo.reset()
        model.generation_config.compile_config = CompileConfig(backend="eager", fullgraph=True, mode=None)
        model.generation_config.compile_config._compile_all_devices = True
    static = model.generate(input_ids, cache_implementation="static", **kwargs)
    again = model.generate(input_ids, cache_implementation="static", **kwargs)  # the static cache is reset and reused
    assert torch.equal(static, dynamic) and torch.equal(again, dynamic)
    assert hasattr(model, "_compiled_call") == compiled  # the decode steps did go through torch.compile


def _core_across_sign_tie(angle: float) -> torch.Tensor:
    """A rank-2 core whose leading left singular vector is at 135 degrees + `angle`: |u_0| = |u_1| at angle 0."""
    left = _rotation(3 * torch.pi / 4 + angle)
    return left @ torch.diag(torch.tensor([1.0, 0.3])) @ _rotation(0.5).T


@pytest.mark.parametrize("signed", [False, True])
def test_selection_is_continuous_in_the_core(signed):
    """A 2e-4 rad rotation of a core across |u_0| = |u_1| (entries of opposite sign) changes few selected slots."""
    config = small_config(
        memory_num_keys=64, memory_topk=8, mcs_cores=1, memory_layers=[[0, 1]], tdqkr_signed_candidates=signed
    )
    torch.manual_seed(0)
    layer = UltraMemForCausalLM(config).eval().model.memory_layers[0]
    hidden = torch.randn(4, 64, config.hidden_size, generator=torch.Generator().manual_seed(1))
    selections = []
    for angle in (-1e-4, 1e-4):
        with torch.no_grad():
            layer.retrieval.cores.copy_(_core_across_sign_tie(angle).expand_as(layer.retrieval.cores))
            virtual_index, _ = layer.retrieve(hidden)  # (B, T, H, m)
        selections.append(virtual_index.sort(-1).values)
    changed = (selections[0] != selections[1]).float().mean().item()
    assert changed < 0.01


def _brute_force_top_m(row_factors, col_factors, top_m, rows_per_chunk=512):
    """The exact top-m cells of each grid, scoring every cell (row chunks keep memory small)."""
    best_scores, best_cells = [], []
    for start in range(0, row_factors.shape[-1], rows_per_chunk):
        scores = torch.einsum("pkx,pky->pxy", row_factors[..., start : start + rows_per_chunk], col_factors)
        values, cells = scores.flatten(1).topk(top_m, dim=-1)
        best_scores.append(values)
        best_cells.append(cells + start * col_factors.shape[-1])
    values, position = torch.cat(best_scores, -1).topk(top_m, dim=-1)
    return torch.cat(best_cells, -1).gather(-1, position), values


@pytest.mark.parametrize("num_keys, rank, decay", [(64, 2, 1.0), (64, 3, 0.3), (3000, 2, 0.3), (3000, 2, 1.0)])
def test_exact_top_m_without_the_grid(num_keys, rank, decay):
    """The bounded search returns the exact top-m (scores compared, so ties cannot fail it) in blocks of rows."""
    from ultramem.diagnostics import exact_top_m

    generator = torch.Generator().manual_seed(num_keys + rank)
    weights = decay ** torch.arange(rank, dtype=torch.float64)  # singular values of the core
    row_factors = torch.randn(6, rank, num_keys, generator=generator, dtype=torch.float64) * weights[:, None]
    col_factors = torch.randn(6, rank, num_keys, generator=generator, dtype=torch.float64)
    cells = exact_top_m(row_factors, col_factors, top_m=16, rows_per_step=32)
    _, expected = _brute_force_top_m(row_factors, col_factors, 16)
    rows, cols = cells // num_keys, cells % num_keys
    found = torch.einsum(
        "pkm,pkm->pm",
        row_factors.gather(-1, rows.unsqueeze(1).expand(-1, rank, -1)),
        col_factors.gather(-1, cols.unsqueeze(1).expand(-1, rank, -1)),
    )
    torch.testing.assert_close(found.sort(-1, descending=True).values, expected)
    assert cells.unique(dim=-1).shape == cells.shape


def test_diagnostics_recall_matches_the_full_grid(monkeypatch):
    """Recall from the bounded search equals the recall against every cell of the n x n grid."""
    from model_support import left_padded_batch, perturbed_model

    import ultramem.diagnostics as diagnostics

    model = perturbed_model(small_config(memory_num_keys=24), seed=2)
    input_ids, attention_mask = left_padded_batch(97, [10, 7, 4], seed=3)
    bounded = diagnostics.retrieval_diagnostics(model, input_ids, attention_mask, chunk=5, rows_per_step=4)
    monkeypatch.setattr(diagnostics, "exact_top_m", lambda rows, cols, m, _: _brute_force_top_m(rows, cols, m)[0])
    full = diagnostics.retrieval_diagnostics(model, input_ids, attention_mask)
    assert bounded == full
    assert 0.3 < bounded["tdqkr_recall"] < 1.0


def test_diagnostics_under_zero3_gather_only_keys_and_cores(monkeypatch):
    """ZeRO-3 stand-in: the keys are empty except inside the retrieval's forward (as ZeRO-3's hooks do) or a
    `deepspeed.zero.GatheredParameters` block (the cores stay whole: below ZeRO-3's persistence threshold, which the
    aux loss relies on); the diagnostics are those of the unpartitioned model."""
    import contextlib
    import sys
    import types

    from model_support import left_padded_batch, perturbed_model

    from ultramem.diagnostics import retrieval_diagnostics

    model = perturbed_model(small_config(), seed=4)
    input_ids, attention_mask = left_padded_batch(97, [9, 5], seed=5)
    expected = retrieval_diagnostics(model, input_ids, attention_mask)

    full: dict[torch.nn.Parameter, torch.Tensor] = {}

    def gather(params):
        for param in params:
            param.data = full[param]

    def release(params):
        for param in params:
            param.data = torch.empty(0)

    for layer in model.model.memory_layers:
        params = [layer.retrieval.row_keys, layer.retrieval.col_keys]
        for param in params:
            full[param], param.ds_id = param.data, len(full)
        release(params)
        layer.retrieval.register_forward_pre_hook(lambda module, args, params=params: gather(params))
        layer.retrieval.register_forward_hook(lambda module, args, output, params=params: release(params))

    requests = []

    @contextlib.contextmanager
    def gathered_parameters(params):
        requests.append(list(params))
        gather(requests[-1])
        yield
        release(requests[-1])

    zero = types.SimpleNamespace(GatheredParameters=gathered_parameters)
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(zero=zero))
    assert retrieval_diagnostics(model, input_ids, attention_mask) == expected
    assert len(requests) == len(model.model.memory_layers)
    assert all(param.numel() == 0 for param in full)  # released again


@pytest.mark.parametrize("signed", [False, True])
def test_tdqkr_prepared_on_its_cores_equals_the_selection(signed):
    """`tucker_topk_on` (a decode step's, the cores' layout taken once) selects what `tucker_topk` does, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    axis_scores = torch.randn(3, 1, 2, 2, 2, 40, generator=generator)  # (B, T, 2, H, r, n)
    cores = torch.randn(2, 3, 2, 2, generator=generator)  # (H, h, r, r)
    _, u, t = memory_ops.core_svd(cores.sum(1))
    leading = torch.stack((u, t)).unsqueeze(-1)  # (2, H, r, 1)
    index, scores = memory_ops.tucker_topk_on(cores, leading, 6, signed)(axis_scores)
    expected_index, expected_scores = memory_ops.tucker_topk(axis_scores, cores, leading, 6, signed)
    assert index.shape == (3, 1, 2, 6) and scores.shape == (3, 1, 2, 6, 3)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=0)


@pytest.mark.parametrize("rows_max", [0, 1 << 30], ids=["amin-amax", "aminmax"])
def test_rank_one_candidates_either_way_take_the_same_quadrant(monkeypatch, rows_max):
    """Few rows take their extremes with one `aminmax`, many (on CPU) with `amin` and `amax`: the same candidates,
    those of the quadrant whose best rank-1 score is higher."""
    monkeypatch.setattr(memory_ops, "AMINMAX_CPU_ROWS_MAX", rows_max)
    generator = torch.Generator().manual_seed(0)
    projected = torch.randn(64, 2, 3, 1, 30, generator=generator)  # (B, 2, H, 1, n): a and b
    candidates = memory_ops.rank_one_candidates(projected, 4, signed=False)  # (B, 2, H, 1, m)
    a, b = projected.unbind(1)
    bottom = a.amax(-1) * b.amax(-1) < a.amin(-1) * b.amin(-1)  # (B, H, 1)
    chosen = torch.where(bottom[:, None, :, :, None], -projected, projected)
    torch.testing.assert_close(candidates, chosen.topk(4, dim=-1).indices, rtol=0, atol=0)
    assert 0 < int(bottom.sum()) < bottom.numel()  # both quadrants chosen somewhere


@pytest.mark.parametrize("grid_max", [0, 1 << 30], ids=["divided", "grid"])
def test_winner_addresses_either_way_are_the_rows_and_columns_they_name(monkeypatch, grid_max):
    """Many tokens read the winners' row and column, few their grid of candidate pairs: both give x * n + y."""
    monkeypatch.setattr(memory_ops, "ADDRESS_GRID_MAX", grid_max)
    generator = torch.Generator().manual_seed(0)
    num_keys, candidates, topk = 50, 7, 5
    index = torch.randint(0, num_keys, (3, 2, 2, 1, candidates), generator=generator)  # (B, 2, H, 1, m')
    flat_index = torch.randint(0, candidates**2, (3, 2, topk), generator=generator)  # (B, H, m)
    expected = torch.tensor(
        [
            [
                [
                    int(index[b, 0, h, 0, f // candidates]) * num_keys + int(index[b, 1, h, 0, f % candidates])
                    for f in row
                ]
                for h, row in enumerate(heads.tolist())
            ]
            for b, heads in enumerate(flat_index)
        ]
    )
    torch.testing.assert_close(memory_ops.winner_addresses(index, flat_index, num_keys), expected, rtol=0, atol=0)
