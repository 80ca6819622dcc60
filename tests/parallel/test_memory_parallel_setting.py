"""The `memory_parallel` setting: its choices, the fit checks against the table and the cores, `auto`'s choice."""

from __future__ import annotations

import logging

import pytest
from model_support import small_config

from ultramem import UltraMemForCausalLM
from ultramem.parallel import apply_memory_parallel, plan_memory_parallel
from ultramem.parallel.setup import lookup_shape
from ultramem.parallel.volume import LookupShape, dimension_volume, number_volume


def test_unknown_choice_names_the_allowed_ones():
    with pytest.raises(ValueError, match="memory_parallel='rows': allowed: none, number, dimension, auto"):
        plan_memory_parallel(small_config(), "rows", 2, 64)


def test_number_needs_a_size_dividing_the_rows():
    config = small_config()  # 36 rows per table
    with pytest.raises(ValueError, match="splits the 36 value rows over 5 ranks, which does not divide them"):
        plan_memory_parallel(config, "number", 5, 64)


def test_dimension_needs_a_size_that_fits_the_cores():
    config = small_config(memory_value_dim=12, mcs_cores=2)
    with pytest.raises(ValueError, match="memory_value_dim=12 with mcs_cores=2 over 3 ranks"):
        plan_memory_parallel(config, "dimension", 3, 64)
    assert plan_memory_parallel(config, "dimension", 4, 64) == ("dimension", {"num_cores": 2})  # 2 ranks per core
    assert plan_memory_parallel(small_config(mcs_cores=4), "dimension", 2, 64)[0] == "dimension"  # 2 cores per rank


def test_auto_takes_the_smaller_volume_and_logs_both(caplog):
    config = small_config(memory_value_dim=12, mcs_cores=2)
    shape = LookupShape(tokens=64, slots=8, value_dim=12, num_cores=2, num_groups=4)
    with caplog.at_level(logging.WARNING, logger="ultramem.parallel.setup"):
        store, _ = plan_memory_parallel(config, "auto", 2, 64)
    number, dimension = sum(number_volume(shape, 2).values()), sum(dimension_volume(shape, 2).values())
    assert (store == "dimension") == (dimension < number)
    assert f"number {number:.0f}" in caplog.text and f"dimension {dimension:.0f}" in caplog.text
    with pytest.raises(ValueError, match="memory_parallel='auto' with memory_parallel_size=7"):
        plan_memory_parallel(config, "auto", 7, 64)  # neither 36 rows nor 12 columns split over 7


def test_auto_counts_quantized_rows_as_stored():
    """Number-wise, owners send quantized rows back as stored (here 40 bytes against 256 in float32), so `auto` takes
    it where float tables would take dimension-wise; owner and dimension pooling still send float32 rows."""
    float_config = small_config(memory_value_dim=64, mcs_cores=2)
    int4_config = small_config(memory_value_dim=64, mcs_cores=2, memory_quantization="int4")
    assert lookup_shape(float_config, 64).row_bytes == 4 * 64
    assert lookup_shape(int4_config, 64).row_bytes == 2 * (32 // 2 + 4)  # two 32-column groups (each chunk's)
    assert lookup_shape(int4_config, 64).pooled_bytes == 4
    assert plan_memory_parallel(float_config, "auto", 2, 64) == ("dimension", {"num_cores": 2})
    assert plan_memory_parallel(int4_config, "auto", 2, 64) == ("number", {"pool_at": "source"})


def test_memory_parallel_without_a_process_group():
    model = UltraMemForCausalLM(small_config())
    assert apply_memory_parallel(model, "none") == "local"
    with pytest.raises(ValueError, match="needs an initialized torch.distributed process group"):
        apply_memory_parallel(model, "number")
