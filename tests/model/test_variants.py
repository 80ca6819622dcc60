"""UltraMemV2, Memory+ and PEER as switches of the one model, each against its paper's equations.

The float64 reference is `test_modeling.reference_memory_layer`, written from the equations; the variants are
`model_support.VARIANTS`.
"""

import statistics

import pytest
import torch
from model_support import (
    VARIANTS,
    assert_loads_alike_with_and_without_the_package,
    left_padded_batch,
    perturbed_model,
    reference_memory_layer,
    small_config,
)

from ultramem import UltraMemConfig, UltraMemConfigError, UltraMemForCausalLM
from ultramem.ablation import V2_LADDER_ROWS, ultramemv2_ladder
from ultramem.memory_ops import key_balance_loss, with_loss_gradient
from ultramem.memory_query import MemoryInputs
from ultramem.presets import get_config
from ultramem.sizing import count_parameters


def _stores(model):
    pool = model.model.value_pool
    return (pool, model.model.pre_value_pool) if pool is not None else None


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("memory_implementation", ["torch", "embedding_bag", "cpp"])
def test_memory_layer_matches_float64_reference(variant, memory_implementation):
    """Output and every gradient (layer parameters and the pool's tables) of a memory layer reading the second
    window of a shared pool, against the float64 loop."""
    config = small_config(memory_implementation=memory_implementation, **VARIANTS[variant])
    model = perturbed_model(config, seed=3)
    with torch.no_grad():  # the pre-values' init makes every gate ~N(0, 1): spread the tables further
        for name, table in model.named_parameters():
            if "pre_value" in name and name.endswith("weight") and table.dim() == 2 and "gate" not in name:
                table.normal_()
    layer = model.model.memory_layers[1]
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 5, config.hidden_size, generator=generator)
    upstream = torch.randn(2, 5, config.hidden_size, generator=generator)
    stores = _stores(model)

    output = layer(hidden, MemoryInputs(stores=stores))
    output.backward(upstream)

    params = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    pool = {}
    if stores is not None:
        pool = {f"{kind}.weight": table.weight for kind, table in zip(("values", "pre_values"), stores) if table}
    tables = {name: p.detach().double().requires_grad_() for name, p in pool.items()}
    expected = reference_memory_layer(layer, hidden.double(), params, {**params, **tables})
    expected.backward(upstream.double())

    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-6)
    named = [*layer.named_parameters(), *pool.items()]
    reference = {**params, **tables}
    for name, param in named:
        expected_grad = reference[name].grad
        scale = max(1.0, expected_grad.abs().max().item())
        torch.testing.assert_close(param.grad.double(), expected_grad, rtol=1e-4, atol=1e-6 * scale, msg=name)
    gated = [name for name in reference if "gate" in name]
    assert all(reference[name].grad.abs().sum() > 0 for name in gated)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_generation_equals_recomputation(variant):
    model = perturbed_model(small_config(**VARIANTS[variant]), seed=4)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, [7, 3])
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(input_ids, use_cache=True, **kwargs)
    recomputed = model.generate(input_ids, use_cache=False, **kwargs)
    assert torch.equal(cached, recomputed)


def test_memory_beside_the_mlp_reads_after_attention_and_adds_to_the_mlp_output():
    """UltraMemV2's block: h' = h + Attn(LN h); out = h' + MLP(LN h') + Mem(h'), the memory in parallel with the MLP."""
    config = small_config(**VARIANTS["ultramemv2"])
    model = perturbed_model(config)
    block, memory = model.model.layers[0], model.model.memory_layers[0]
    input_ids = torch.randint(1, config.vocab_size, (1, 6))
    with torch.no_grad():
        outputs = model(input_ids, output_hidden_states=True)
        hidden = outputs.hidden_states[0]
        positions = model.model.rotary_emb(hidden, torch.arange(6).unsqueeze(0))
        mask = torch.full((6, 6), float("-inf")).triu(1)[None, None]
        attn, _ = block.self_attn(block.input_layernorm(hidden), position_embeddings=positions, attention_mask=mask)
        middle = hidden + attn
        expected = (
            middle
            + block.mlp(block.post_attention_layernorm(middle))
            + memory(middle, MemoryInputs(stores=_stores(model)))
        )
    torch.testing.assert_close(outputs.hidden_states[1], expected, rtol=1e-5, atol=1e-5)


def test_memory_in_place_of_the_mlp_leaves_the_block_without_one():
    model = UltraMemForCausalLM(small_config(**VARIANTS["memoryplus"]))
    names = {name for name, _ in model.named_parameters()}
    assert not any(name.startswith(("model.layers.1.mlp", "model.layers.3.mlp")) for name in names)
    assert any(name.startswith("model.layers.0.mlp") for name in names)
    assert not any(".post_attention_layernorm" in name for name in names if name.startswith("model.layers.1."))


def test_shared_pool_counts_once_and_windows_wrap_around():
    config = small_config(**VARIANTS["ultramemv2"])
    model = UltraMemForCausalLM(config)
    assert model.get_value_table_names() == ["model.value_pool.weight", "model.pre_value_pool.weight"]
    assert all(layer.values is None for layer in model.model.memory_layers)
    counts = count_parameters(config)
    tables = config.value_pool_size * (config.memory_value_dim + config.pre_value_dim)
    assert counts["total"] - tables == count_parameters(
        small_config(**{**VARIANTS["ultramemv2"], "value_pool_size": None})
    )["total"] - config.num_memory_layers * config.memory_num_values * (config.memory_value_dim + config.pre_value_dim)
    assert counts["physical_values"] == config.value_pool_size
    last = model.model.memory_layers[-1].value_expansion  # window [54, 54 + 36) wraps to rows 0..17
    rows, _ = last.physical_slots(torch.arange(config.memory_num_keys**2))
    assert set(rows.tolist()) == {*range(54, 72), *range(0, 18)}


@pytest.mark.parametrize("value_gate", ["peer", "peer_gelu"])
def test_v2_init_gives_the_target_output_variance(value_gate):
    """UltraMemV2's rule (appendix A, with the sampled score spread and the gate's second moment): the memory output's
    variance at init is the target 1/(2L), within 10%, averaged over sampled models."""
    config = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        memory_heads=8,
        memory_topk=8,
        memory_key_dim=32,
        memory_num_keys=64,
        memory_value_dim=32,
        ive_expansion=4,
        use_query_conv=False,
        memory_layers=[[0, 0], [1, 1]],
        memory_site="mlp",
        value_gate=value_gate,
        pre_value_dim=16,
        ive_single_projector=True,
        value_pool_size=2048,
        share_query=False,
    )
    hidden = torch.randn(2, 512, 64, generator=torch.Generator().manual_seed(0))
    ratios = []
    for seed in range(16):
        torch.manual_seed(seed)
        model = UltraMemForCausalLM(UltraMemConfig(**config)).eval()
        with torch.no_grad():
            ratios += [
                layer(hidden, MemoryInputs(stores=_stores(model))).var().item() * 4
                for layer in model.model.memory_layers
            ]
    assert statistics.mean(ratios) == pytest.approx(1.0, abs=0.1)


def test_key_balance_loss_is_the_papers_formula():
    """Eq. 18-20: n * sum_x f_x p_x per head, f the share of tokens choosing x in their top-m, p the mean softmax."""
    scores = torch.randn(5, 3, 2, 10, dtype=torch.float64)  # (B, T, H, n)
    loss = key_balance_loss(scores, topk=4)
    flat = scores.reshape(15, 2, 10)
    expected = 0.0
    for h in range(2):
        chosen = torch.zeros(10, dtype=torch.float64)
        for t in range(15):
            chosen[flat[t, h].argsort(descending=True)[:4]] += 1
        expected += 10 * (chosen / 15 * flat[:, h].softmax(-1).mean(0)).sum() / 2
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    uniform = torch.zeros(4, 1, 10)  # every key equally likely: p = 1/n, f sums to m
    assert key_balance_loss(uniform, topk=3).item() == pytest.approx(3.0)


def test_balance_loss_travels_with_the_backward_and_is_logged():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    (with_loss_gradient(x, (w**2).sum()) * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(w.grad, 2 * w.detach())

    input_ids = torch.randint(1, 97, (2, 8))
    runs = {}
    for coef in (0.0, 0.5):
        model = perturbed_model(
            small_config(**{**VARIANTS["ultramemv2"], "key_balance_loss_coef": coef}), seed=6
        ).train()
        output = model(input_ids, labels=input_ids)
        output.loss.backward()
        runs[coef] = model, output
    (plain, plain_out), (balanced, balanced_out) = runs[0.0], runs[0.5]
    logged = sum(layer.retrieval.last_balance_loss for layer in balanced.model.memory_layers)
    torch.testing.assert_close(balanced_out.aux_loss, plain_out.aux_loss + logged)
    torch.testing.assert_close(balanced_out.lm_loss, plain_out.lm_loss)
    key_grads = [
        (a.retrieval.row_keys.grad - b.retrieval.row_keys.grad).abs().max()
        for a, b in zip(balanced.model.memory_layers, plain.model.memory_layers)
    ]
    assert min(key_grads) > 0  # the balance loss reaches the keys
    torch.testing.assert_close(balanced.lm_head.weight.grad, plain.lm_head.weight.grad)  # downstream: unchanged
    balanced.eval()
    with_labels = dict(input_ids=input_ids, labels=input_ids)
    assert balanced(**with_labels).aux_loss == plain.eval()(**with_labels).aux_loss  # not at inference


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        (dict(value_gate="peer"), "pre_value_dim", "> 0"),
        (dict(pre_value_dim=8), "pre_value_dim", "must be 0 unless value_gate"),
        (
            dict(value_gate="swilu", value_projection=False, ive_expansion=1, memory_value_dim=32),
            "value_projection",
            "True",
        ),
        (dict(memory_site="mlp"), "memory_layers[0]", "[a, a]"),
        (dict(value_pool_size=50), "value_pool_size", "divisible"),
        (dict(value_pool_size=30), "value_pool_size", ">= memory_num_values"),
        (dict(value_pool_size=3 * 36 + 3), "value_pool_size", "<= 3 x memory_num_values"),
        (dict(value_gate="gated"), "value_gate", "one of"),
        (dict(memory_site="ffn"), "memory_site", "one of"),
        (dict(key_balance_loss_coef=-1.0), "key_balance_loss_coef", ">= 0"),
        (dict(value_gate="peer", pre_value_dim=4, memory_quantization="int8"), "value_gate", "memory_quantization"),
    ],
)
def test_successor_switches_are_checked_in_one_line(overrides, field, allowed):
    with pytest.raises(UltraMemConfigError) as error:
        small_config(**overrides)
    message = str(error.value)
    assert f"UltraMemConfig.{field}=" in message and allowed in message and "\n" not in message


@pytest.mark.parametrize("variant", ["ultramemv2", "memoryplus"])
def test_save_and_load_in_a_fresh_process_with_and_without_the_package(variant, tmp_path):
    model = perturbed_model(small_config(**VARIANTS[variant]), seed=8)
    assert_loads_alike_with_and_without_the_package(model, torch.randint(1, 97, (2, 7)), tmp_path)


@pytest.mark.parametrize(
    "v1, successor",
    [
        ("tiny-ultramem", "tiny-ultramemv2"),
        ("small-ultramem", "small-ultramemv2"),
        ("ultramem-151m-x12", "ultramemv2-151m"),
        ("tiny-ultramem", "tiny-memoryplus"),
        ("small-ultramem", "small-memoryplus"),
    ],
)
def test_successor_presets_match_their_ultramem_preset_in_parameters(v1, successor):
    ours, theirs = count_parameters(get_config(successor)), count_parameters(get_config(v1))
    assert ours["total"] == pytest.approx(theirs["total"], rel=0.005)
    if "v2" in successor:  # the MLP width balances the activated parameters; Memory+ replaces MLPs, it has fewer
        assert ours["activated"] == pytest.approx(theirs["activated"], rel=0.001)


@pytest.mark.parametrize("scale", ["tiny", "small"])
def test_v2_ladder_changes_one_thing_a_row_from_v1_to_v2(scale):
    ladder = ultramemv2_ladder(scale)
    assert [row for row, _ in ladder] == list(V2_LADDER_ROWS)
    assert ladder[0][1].to_dict() == get_config(f"{scale}-ultramem").to_dict()
    assert ladder[-1][1].to_dict() == get_config(f"{scale}-ultramemv2").to_dict()
    derived = {"layer_types", "number_of_conv_states", "memory_num_values"}
    expected_changes = {
        "+single projector": {"ive_single_projector"},
        "+per-rank queries": {"share_query"},
        "-query conv": {"use_query_conv"},
        "-Tucker penalty": {"aux_loss_alpha"},
        "+every block, shared pool": {"memory_layers", "memory_site", "memory_heads", "memory_topk", "value_pool_size"},
        "+PEER (Dp:Dv = 1:3)": {"value_gate", "pre_value_dim", "memory_value_dim"},
        "+MLP rebalanced": {"intermediate_size"},
    }
    for (_, before), (row, after) in zip(ladder, ladder[1:]):
        first, second = before.to_dict(), after.to_dict()
        changed = {key for key in {*first, *second} if first.get(key) != second.get(key)} - derived
        assert changed and changed <= expected_changes[row], row  # (m stays where blocks = 2 x V1's layers)
        slots = [c.memory_heads * c.memory_topk * c.num_memory_layers for c in (before, after)]
        assert slots[0] == slots[1], row  # every row reads as many value rows per token


@pytest.mark.parametrize("variant", ["ultramemv2", "peer_gelu"])
def test_pre_value_tables_and_pools_train_in_the_value_group(variant, tmp_path):
    """The optimizer's value group (its own LR schedule) holds the value and pre-value tables, a shared pool's
    included, and nothing else."""
    from transformers import TrainingArguments

    from ultramem.training.schedule import VALUE_GROUP
    from ultramem.training.trainer import UltraMemTrainer

    model = UltraMemForCausalLM(small_config(**VARIANTS[variant]))
    trainer = UltraMemTrainer(model=model, args=TrainingArguments(tmp_path, report_to=[], use_cpu=True))
    group = next(g for g in trainer.create_optimizer().param_groups if g["ultramem_group"] == VALUE_GROUP)
    tables = dict(model.named_parameters())
    expected = {id(tables[name]) for name in model.get_value_table_names()}
    assert {id(param) for param in group["params"]} == expected
    assert any("pre_value" in name for name in model.get_value_table_names())
