"""Config validation errors, and the presets against the paper's parameter column."""

import pytest
from model_support import small_config
from transformers import MixtralConfig

from ultramem import UltraMemConfig, UltraMemConfigError
from ultramem.ablation import LADDER_ROWS, ablation_ladder, ladder_training_arguments
from ultramem.presets import PAPER_FIGURES, PRESETS, format_table, get_config, get_training_arguments, preset_table
from ultramem.sizing import count_parameters


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        (dict(ive_expansion=3, memory_num_values=48), "ive_expansion", "perfect square"),
        (dict(memory_key_dim=9), "memory_key_dim", "divisible by tucker_rank=2"),
        (dict(memory_value_dim=13), "memory_value_dim", "divisible by mcs_cores=2"),
        (dict(memory_topk=13), "memory_topk", "<= memory_num_keys=12"),
        (dict(memory_layers=[[0, 4]]), "memory_layers[0]", r"\[0, 4\)"),
        (dict(memory_layers=[[-1, 2]]), "memory_layers[0]", r"\[0, 4\)"),
        (dict(memory_layers=[[0, 1], [3, 2]]), "memory_layers[1]", "a <= b"),
        (dict(memory_layers=[[0]]), "memory_layers[0]", "a pair \\[a, b\\]"),
        (dict(hidden_size=0), "hidden_size", "positive"),
        (dict(hidden_size=30), "hidden_size", "divisible by num_attention_heads"),
        (dict(num_hidden_layers=0, memory_layers=[]), "num_hidden_layers", "positive"),
        (dict(vocab_size=-5), "vocab_size", "positive"),
        (dict(intermediate_size=0), "intermediate_size", "positive"),
        (dict(memory_heads=0), "memory_heads", "positive"),
        (dict(memory_topk=0), "memory_topk", "positive"),
        (dict(memory_num_keys=0, memory_num_values=1), "memory_num_keys", "positive"),
        (dict(tucker_rank=0), "tucker_rank", "positive"),
        (dict(mcs_cores=0), "mcs_cores", "positive"),
        (dict(memory_value_dim=0), "memory_value_dim", "positive"),
        (dict(memory_num_values=35), "memory_num_values", "memory_num_keys\\^2 / ive_expansion"),
        (dict(retrieval_mode="hashing"), "retrieval_mode", "product_key"),
        (dict(retrieval_mode="product_key"), "tucker_rank", "must be 1"),
        (dict(retrieval_mode="product_key", tucker_rank=1, memory_key_dim=8), "mcs_cores", "must be 1"),
        (dict(value_projection=False), "ive_expansion", "value_projection=False"),
        (dict(value_projection=False, ive_expansion=1, memory_num_values=144), "memory_value_dim", "hidden_size=32"),
        (dict(query_conv_kernel_size=0), "query_conv_kernel_size", ">= 1"),
        (dict(memory_offload="gpu"), "memory_offload", "disk"),
        (dict(memory_num_values=0), "memory_num_values", "positive"),
        (dict(ive_expansion=0), "ive_expansion", "perfect square"),
        (dict(tdqkr_signed_candidates=True, memory_topk=7), "memory_topk", "memory_num_keys / 2 = 6"),
        (dict(attention_dropout=1.0), "attention_dropout", r"\[0, 1\)"),
        (dict(hidden_dropout=-0.1), "hidden_dropout", r"\[0, 1\)"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps", "> 0"),
        (dict(aux_loss_alpha=-1.0), "aux_loss_alpha", ">= 0"),
        (dict(aux_loss_tau=-0.1), "aux_loss_tau", ">= 0"),
        (dict(value_lr_multiplier=0.0), "value_lr_multiplier", "> 0"),
        (dict(max_position_embeddings=0), "max_position_embeddings", "positive"),
    ],
)
def test_invalid_config_names_field_value_and_range(overrides, field, allowed):
    with pytest.raises(UltraMemConfigError) as error:
        small_config(**overrides)
    message = str(error.value)
    assert f"UltraMemConfig.{field}=" in message
    assert __import__("re").search(allowed, message), message


def test_ratios_and_multipliers_accept_integers_as_llama_dropout_does():
    """`attention_dropout=0` passes LlamaConfig's strict field check; it must pass ours, as must `aux_loss_tau=0`
    (a hand-written config.json or --config_file has them as JSON integers)."""
    integers = dict(attention_dropout=0, hidden_dropout=0, aux_loss_alpha=0, aux_loss_tau=0)
    config = small_config(**integers)
    again = UltraMemConfig.from_dict(config.to_dict())
    assert {field: getattr(again, field) for field in integers} == integers


def test_config_round_trips_through_dict():
    config = small_config()
    again = UltraMemConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    assert again.memory_layers == [[0, 2], [1, 3], [1, 1]]
    # two memory layers read block 1: the second keeps its conv state in a cache layer no memory layer reads
    assert again.memory_conv_state_slots == [(0, 0), (1, 0), (2, 0)]
    assert again.layer_types == ["hybrid", "hybrid", "hybrid", "full_attention"] and again.number_of_conv_states == 1


@pytest.mark.parametrize(
    "memory_layers, slots",
    [
        ([[0, 1], [0, 2], [1, 3], [2, 3], [3, 3]], [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]),  # 5 states: one layer
        ([[1, 1]] * 6, [(1, 0), (1, 1), (0, 0), (0, 1), (2, 0), (2, 1)]),  # 6 = 3 layers x 2, the read block first
        ([[0, 3]] * 4, [(0, 0), (1, 0), (2, 0), (3, 0)]),
    ],
)
def test_conv_states_fill_every_slot_of_their_cache_layers(memory_layers, slots):
    """Each hybrid cache layer has `number_of_conv_states` slots; an unfilled one breaks Transformers' `crop`."""
    config = small_config(memory_layers=memory_layers)
    assert config.memory_conv_state_slots == slots
    hybrid = [i for i, kind in enumerate(config.layer_types) if kind == "hybrid"]
    filled = sorted(set(slots))
    assert filled == [(layer, state) for layer in hybrid for state in range(config.number_of_conv_states)]


@pytest.mark.parametrize("name", sorted(PAPER_FIGURES))
def test_preset_parameters_within_three_percent_of_paper(name):
    counts = count_parameters(get_config(name))
    paper_params, _ = PAPER_FIGURES[name]
    assert abs(counts["total"] / 1e9 / paper_params - 1) < 0.03, (name, counts["total"])


def test_preset_flops_and_activation():
    dense = count_parameters(get_config("dense-151m"))
    ultramem = count_parameters(get_config("ultramem-151m-x12"))
    moe = count_parameters(get_config("moe-151m-2in32"))
    assert dense["activated"] == dense["total"]
    # sparse models activate about the dense compute: within 20% of dense, far below their totals
    for sparse in (ultramem, moe):
        assert dense["flops_per_token"] < sparse["flops_per_token"] < 1.2 * dense["flops_per_token"]
        assert sparse["activated"] < 0.1 * sparse["total"]
    assert ultramem["memory_slots"] == 3 * 2200**2 and ultramem["physical_values"] == 3 * 1100**2


def test_presets_kinds_overrides_and_errors():
    assert isinstance(get_config("moe-151m-2in32"), MixtralConfig)
    assert get_config("moe-151m-2in32").intermediate_size == 1688  # 2/3 of 2528, 8-aligned
    config = get_config("tiny-ultramem", memory_topk=8)
    assert isinstance(config, UltraMemConfig) and config.memory_topk == 8
    assert get_config("ultramem-151m-x12").memory_layers == [[2, 4], [5, 7], [8, 10]]
    assert get_config("ultramem-680m-x12").memory_layers == [[2, 6], [7, 11], [12, 16], [17, 21]]
    with pytest.raises(KeyError, match="Unknown preset 'ultramem-9b'"):
        get_config("ultramem-9b")
    with pytest.raises(UltraMemConfigError, match="memory_topk"):
        get_config("tiny-ultramem", memory_topk=10_000)
    assert {"tiny-dense", "tiny-ultramem", "tiny-pkm", "tiny-moe"} <= set(PRESETS)


def test_preset_table_prints_every_row_beside_the_paper():
    table = format_table(preset_table())
    for name in PRESETS:
        assert name in table
    assert "+0.1%" in table or "-0.3%" in table


def test_ablation_ladder_changes_one_improvement_per_row():
    ladder = ablation_ladder("tiny")
    assert [row for row, _ in ladder] == list(LADDER_ROWS)
    first, last = ladder[0][1], ladder[-1][1]
    assert first.retrieval_mode == "product_key" and first.memory_score_softmax and not first.value_projection
    assert last.to_dict() | {"max_position_embeddings": 0} == get_config("tiny-ultramem").to_dict() | {
        "max_position_embeddings": 0
    }
    totals = [count_parameters(config)["total"] for _, config in ladder]
    assert max(totals) / min(totals) < 1.1  # matched in total parameters
    for (_, before), (row, after) in zip(ladder, ladder[1:]):
        changed = {k for k, v in after.to_dict().items() if before.to_dict().get(k) != v}
        changed -= {"memory_num_keys", "memory_num_values", "memory_topk", "layer_types", "number_of_conv_states"}
        training = ladder_training_arguments(row), ladder_training_arguments(LADDER_ROWS[LADDER_ROWS.index(row) - 1])
        if row == "+value lr decay":  # the one row that changes training, not the model
            assert not changed and training == ({}, {"value_lr_decay": False}), (row, changed, training)
        else:
            assert 1 <= len(changed) <= 3 and training[0] == training[1], (row, changed, training)
    assert ladder_training_arguments(LADDER_ROWS[0]) == get_training_arguments("tiny-pkm")
    assert ladder_training_arguments(LADDER_ROWS[-1]) == get_training_arguments("tiny-ultramem") == {}


def test_presets_save_no_training_settings_and_recommend_them_apart():
    """The value-table learning rate is a training argument: no preset writes it into config.json (ultramem < 0.2
    did); the PKM presets recommend a constant one, the others the training defaults."""
    for name in PRESETS:
        saved = get_config(name).to_json_string(use_diff=False)
        assert "value_lr" not in saved, name
        constant = name.startswith("pkm-") or name.endswith(("-pkm", "-memoryplus"))  # PKM's and Memory+'s recipes
        expected = {"value_lr_decay": False} if constant else {}
        if name == "ultramemv2-227m":  # the official 227M recipe: 4x decaying to 1x
            expected = {"value_lr_multiplier": 4.0}
        assert get_training_arguments(name) == expected, name
    with pytest.raises(KeyError, match="Unknown preset 'nope'"):
        get_training_arguments("nope")


def test_paper_presets_carry_the_papers_dropout():
    """The paper trains with dropout 0.1 (Table "Training hyper-parameters"); the tiny and small presets use none."""
    for name in PRESETS:
        config = get_config(name)
        expected = 0.0 if name.startswith(("tiny-", "small-")) else 0.1
        assert config.attention_dropout == expected, name
        if not isinstance(config, MixtralConfig):  # Mixtral has attention dropout only
            assert config.hidden_dropout == expected, name
    assert all(config.hidden_dropout == 0.1 for _, config in ablation_ladder("151m"))
    assert all(config.hidden_dropout == 0.0 for _, config in ablation_ladder("tiny"))
