"""`python -m ultramem.quantize` refuses, in one line naming the field and what to do instead, before writing anything,
checkpoints it would turn into ones the loader refuses: UltraMemV2 and Memory+ (a shared value pool, PEER pre-values:
no quantized store serves them, and it used to write float pools under an int8 config), checkpoints without memory
layers (nothing to quantize), and a format that does not exist (argparse printed its 4-line usage)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from model_support import small_config

from ultramem import UltraMemForCausalLM
from ultramem.presets import MEMORY_PLUS_SWITCHES, V2_SWITCHES
from ultramem.quantize import main

# Small configs of the successors with the presets' switches (docs/variants.md); 12 keys per axis, E = 4: windows of
# 36 rows, so a pool of 72 rows is two layers' windows (V2's ring) and Memory+'s one table holds all 144 product keys
VARIANTS = {
    "ultramemv2": (
        dict(V2_SWITCHES, memory_layers=[[b, b] for b in range(4)], pre_value_dim=4, value_pool_size=72),
        r"value_gate='peer' \(PEER pre-value tables\) and value_pool_size=72",
    ),
    "memoryplus": (
        dict(MEMORY_PLUS_SWITCHES, memory_layers=[[1, 1], [3, 3]], memory_value_dim=32, value_pool_size=144),
        r"value_pool_size=144 \(a value pool shared by the memory layers\)",
    ),
    "peer": (dict(value_gate="peer", pre_value_dim=4), r"value_gate='peer' \(PEER pre-value tables\):"),
    "dense": (dict(memory_layers=[]), r"has no memory layers \(memory_layers=\[\]\): there are no value tables"),
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    for name, (overrides, _) in VARIANTS.items():
        UltraMemForCausalLM(small_config(**overrides)).save_pretrained(root / name)
    return {name: root / name for name in VARIANTS}


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("format", ["int8", "int4"])
def test_unsupported_checkpoints_are_refused_in_one_line_before_anything_is_written(variants, name, format, tmp_path):
    out = tmp_path / "out" / "q"
    with pytest.raises(SystemExit) as refused:
        main([str(variants[name]), str(out), "--format", format])
    message = str(refused.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert re.search(VARIANTS[name][1], message), message
    if name != "dense":  # the alternative: float tables, offloaded
        assert "memory_offload='cpu' | 'disk'" in message, message
    assert not (tmp_path / "out").exists()


def test_an_unknown_format_is_one_line_from_the_command_line(variants, tmp_path):
    """The real command: one line on stderr, nothing on stdout, a non-zero exit, nothing written."""
    command = [
        sys.executable,
        "-m",
        "ultramem.quantize",
        str(variants["peer"]),
        str(tmp_path / "q"),
        "--format",
        "int3",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "real_accelerator" not in line]  # DeepSpeed's import notice
    assert lines == ["error: --format 'int3' is invalid: choose one of int8, int4"], done.stderr
    assert done.stdout == "" and not (tmp_path / "q").exists()
