"""How UltraMemConfig checks itself on `@strict`'s terms, packs the query-conv states, and keeps the kernel choice
private: one error line per bad value, one cross-field check per construction, nothing machine-specific saved."""

import json
import warnings

import pytest
from huggingface_hub.errors import StrictDataclassError
from model_support import small_config
from transformers import AutoConfig

from ultramem import UltraMemConfig, UltraMemConfigError, UltraMemForCausalLM, configuration_ultramem
from ultramem.configuration_ultramem import MEMORY_IMPLEMENTATIONS, MEMORY_KERNELS, conv_state_slots


@pytest.fixture
def cross_field_checks(monkeypatch) -> list[int]:
    """Counts runs of the cross-field check: it checks `memory_num_values` against n^2 / E exactly once per run."""
    calls = []
    require = configuration_ultramem._require

    def counting(condition, field, *args):
        calls.extend([field] if field == "memory_num_values" else [])
        return require(condition, field, *args)

    monkeypatch.setattr(configuration_ultramem, "_require", counting)
    return calls


def test_the_cross_field_check_runs_once_per_construction(cross_field_checks):
    config = small_config()
    assert len(cross_field_checks) == 1
    UltraMemConfig.from_dict(config.to_dict(), memory_topk=3)
    assert len(cross_field_checks) == 2
    assert [v.__name__ for v in UltraMemConfig.__class_validators__].count("validate_architecture") == 1


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: small_config(memory_topk=0), "UltraMemConfig.memory_topk=0 is invalid: must be a positive integer."),
        (
            lambda: small_config().__setattr__("hidden_dropout", 1.5),
            "hidden_dropout=1.5 is invalid: must be in [0, 1).",
        ),
        (
            lambda: small_config(memory_topk=13),
            "memory_topk=13 is invalid: must be <= memory_num_keys=12 (keys per axis).",
        ),
        (
            lambda: small_config(memory_layers=[[0, 1, 2]]),
            "memory_layers[0]=[0, 1, 2] is invalid: must be a pair [a, b]",
        ),
        (
            lambda: small_config(memory_offload="gpu"),
            "memory_offload='gpu' is invalid: must be one of (None, 'cpu', 'disk').",
        ),
        (lambda: UltraMemConfig.from_dict(small_config().to_dict(), memory_topk=0), "memory_topk=0 is invalid"),
    ],
)
def test_strict_wrapped_errors_come_out_as_one_config_error_line(build, message):
    """`@strict` wraps a failed check in a two-line StrictDataclass*Error that is no ValueError; ours comes out as raised."""
    with pytest.raises(UltraMemConfigError) as error:
        build()
    assert isinstance(error.value, ValueError) and not isinstance(error.value, StrictDataclassError)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert error.value.__suppress_context__


def test_a_field_alone_is_checked_when_set_and_against_the_others_when_a_model_is_built():
    config = small_config()
    with pytest.raises(UltraMemConfigError, match="memory_topk=0 is invalid"):
        config.memory_topk = 0
    config.memory_topk = 13  # fine alone; memory_num_keys is 12
    with pytest.raises(UltraMemConfigError, match="memory_topk=13 is invalid: must be <= memory_num_keys=12"):
        config.prepare_for_model()
    config.memory_topk, config.memory_layers = 4, [[3, 3]]
    config.prepare_for_model()
    assert config.layer_types == ["full_attention"] * 3 + ["hybrid"]


def test_a_value_of_the_wrong_type_keeps_stricts_own_error():
    """The training CLI names the field of a type error from @strict's message (tests/training)."""
    with pytest.raises(StrictDataclassError, match="Field 'memory_topk' expected int"):
        small_config(memory_topk="4")


@pytest.mark.parametrize(
    "read_blocks, num_blocks, slots",
    [
        ([], 4, []),
        ([0, 1, 2], 4, [(0, 0), (1, 0), (2, 0)]),
        ([2, 0], 4, [(2, 0), (0, 0)]),
        ([0, 1, 1], 4, [(0, 0), (1, 0), (2, 0)]),  # a second state in block 1: the first layer no one reads
        ([0, 0, 0, 0], 4, [(0, 0), (1, 0), (2, 0), (3, 0)]),  # M = blocks: one slot per layer
        ([1] * 6, 4, [(1, 0), (1, 1), (0, 0), (0, 1), (2, 0), (2, 1)]),  # 6 = 3 layers x 2, the read block first
        ([3] * 8, 4, [(3, 0), (3, 1), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]),  # 8 = 4 x 2
        ([0, 0, 1, 2, 3], 4, [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]),  # 5 is prime: one layer of 5
        ([1, 1, 1], 2, [(1, 0), (1, 1), (1, 2)]),  # 3 states in 2 blocks: 2 does not divide 3
        ([0, 5], 6, [(0, 0), (5, 0)]),
    ],
)
def test_conv_state_slots_fill_whole_cache_layers(read_blocks, num_blocks, slots):
    assert conv_state_slots(read_blocks, num_blocks) == slots
    per_layer = max([slot + 1 for _, slot in slots], default=1)
    layers = {layer for layer, _ in slots}
    assert sorted(slots) == [(layer, slot) for layer in sorted(layers) for slot in range(per_layer)]


# UltraMemConfig itself below: tests' small_config sets the private choice after construction
def test_memory_implementation_is_a_private_unsaved_keyword(tmp_path):
    assert MEMORY_KERNELS is MEMORY_IMPLEMENTATIONS and "auto" in MEMORY_IMPLEMENTATIONS
    assert UltraMemConfig()._memory_implementation is None
    assert UltraMemConfig(memory_implementation="auto")._memory_implementation is None
    config = UltraMemConfig(memory_implementation="torch")
    assert config._memory_implementation == "torch" and config.memory_kernel == "torch"
    with pytest.raises(UltraMemConfigError, match=r"memory_implementation=5 is invalid: must be a registered name"):
        UltraMemConfig(memory_implementation=5)
    # a name is checked against the registry (where users register their own kernels) when a model is built
    with pytest.raises(ValueError, match=r"memory_implementation='cuda' is not registered; choose one of"):
        UltraMemForCausalLM(small_config(memory_implementation="cuda"))
    with pytest.raises(AttributeError):
        config.memory_kernel = "triton"  # read-only: the model's set_memory_implementation sets it
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not {"memory_kernel", "_memory_implementation", "memory_implementation", "memory_offload"} & set(saved)
    assert AutoConfig.from_pretrained(tmp_path)._memory_implementation is None
    assert (
        AutoConfig.from_pretrained(tmp_path, memory_implementation="embedding_bag")._memory_implementation
        == "embedding_bag"
    )


def test_the_deprecated_memory_kernel_keyword_still_works_and_a_saved_one_is_ignored(tmp_path):
    with pytest.warns(FutureWarning, match=r"memory_kernel=\.\.\.\) is deprecated .* memory_implementation="):
        config = UltraMemConfig(memory_kernel="torch")
    assert config._memory_implementation == "torch"
    with pytest.warns(FutureWarning):
        assert UltraMemConfig(memory_kernel="auto")._memory_implementation is None
    with (
        pytest.warns(FutureWarning),
        pytest.raises(ValueError, match=r"memory_implementation='cuda' is not registered"),
    ):
        UltraMemForCausalLM(small_config(memory_kernel="cuda"))
    # a config.json written before the kernel choice became private: read, and its kernel ignored
    UltraMemConfig().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "memory_kernel": "triton"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning for what a checkpoint carries
        loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded._memory_implementation is None and "memory_kernel" not in loaded.__dict__
    with pytest.warns(FutureWarning):
        assert AutoConfig.from_pretrained(tmp_path, memory_kernel="torch")._memory_implementation == "torch"


def test_a_saved_model_carries_no_kernel_choice_and_loads_with_the_one_asked_for(tmp_path):
    from transformers import AutoModelForCausalLM

    from ultramem import UltraMemForCausalLM

    config = UltraMemConfig(**{**small_config().to_dict(), "memory_implementation": "torch", "memory_offload": "cpu"})
    UltraMemForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not {"memory_kernel", "_memory_implementation", "memory_implementation", "memory_offload"} & set(saved)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._memory_implementation is None
    for load in (AutoModelForCausalLM.from_pretrained, UltraMemForCausalLM.from_pretrained):
        assert load(tmp_path, memory_implementation="embedding_bag").config._memory_implementation == "embedding_bag"
