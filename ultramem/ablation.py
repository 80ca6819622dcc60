"""The paper's ablation ladder (Table "Ablation study of model improvements") as configs of this model, the
training arguments of its one training row, and the ladder from UltraMem to UltraMemV2."""

from __future__ import annotations

import math
from typing import Any

from .configuration_ultramem import MLP_SITE, PEER, TUCKER, UltraMemConfig
from .presets import BACKBONES, PKM_SWITCHES, PKM_TRAINING, VOCAB_SIZE, get_config

# The paper's ablation ladder (Table "Ablation study of model improvements"): each row changes exactly
# one improvement of the previous row. Sizes that an improvement changes are derived from the row above.
# "+value lr decay" changes training, not the model: its config is the row above's, its training arguments differ
# (`ladder_training_arguments`).
LADDER_ROWS: tuple[str, ...] = (
    "PKM x10",
    "+rm softmax",
    "+half vdim+proj",
    "+share query",
    "+split big mem&skip",
    "+query/key LN",
    "+IVE",
    "+TDQKR",
    "+MCS",
    "+improved init",
    "+value lr decay",
    "+query conv",
)


def _ladder_step(row: str, previous: dict[str, Any], skip_layers: list[list[int]]) -> dict[str, Any]:
    config = dict(previous)
    if row == "+rm softmax":
        config["memory_score_softmax"] = False
    elif row == "+half vdim+proj":  # half Dv, twice the values and twice the top-m: same activated params
        config["memory_value_dim"] //= 2
        config["value_projection"] = True
        config["memory_num_keys"] = round(config["memory_num_keys"] * math.sqrt(2))
        config["memory_topk"] *= 2
    elif row == "+share query":
        config["share_query"] = True
    elif row == "+split big mem&skip":  # same total values and activated values, spread over skip layers
        parts = len(skip_layers)
        config["memory_layers"] = skip_layers
        config["memory_num_keys"] = round(config["memory_num_keys"] / math.sqrt(parts))
        config["memory_topk"] = max(1, config["memory_topk"] // parts)
    elif row == "+query/key LN":
        config["qk_layernorm"] = True
    elif row == "+IVE":  # E = 4 virtual blocks: keys per axis x sqrt(E), same physical values
        config["ive_expansion"] = 4
        config["memory_num_keys"] *= 2
    elif row == "+TDQKR":
        config["retrieval_mode"] = TUCKER
        config["tucker_rank"] = 2
    elif row == "+MCS":
        config["mcs_cores"] = 2
    elif row == "+improved init":
        config["improved_init"] = True
    elif row == "+query conv":
        config["use_query_conv"] = True
    config.pop("memory_num_values", None)
    return config


LADDER_SCALES = ("tiny", "151m")


def ablation_ladder(scale: str = "tiny", **overrides: Any) -> list[tuple[str, UltraMemConfig]]:
    """The ablation ladder at `scale` ("tiny" or "151m"), as (row name, config) pairs.

    The first row is PKM in one memory layer in parallel with the middle block, with ~10x the dense
    parameters at "151m" (the paper's PKM-151M-x10) and ~5x at "tiny"; the last row is full UltraMem
    (at "tiny", exactly the `tiny-ultramem` preset). `overrides` apply to every row (e.g. max_position_embeddings).
    """
    if scale not in LADDER_SCALES:
        raise ValueError(f"ablation ladder scale={scale!r}: allowed values are {', '.join(LADDER_SCALES)}")
    backbone = BACKBONES[scale]
    blocks = backbone.num_hidden_layers
    if scale == "tiny":
        skip_layers, knum, key_dim, heads, topk = [[0, 1], [2, 3]], 256, 64, 2, 16
    else:
        skip_layers, knum, key_dim, heads, topk = [[2, 4], [5, 7], [8, 10]], 1224, 256, 2, 16
    row_config: dict[str, Any] = dict(
        **backbone.kwargs(),
        **PKM_SWITCHES,
        vocab_size=VOCAB_SIZE,
        memory_layers=[[blocks // 2, blocks // 2]],
        memory_heads=heads,
        memory_topk=topk,
        memory_key_dim=key_dim,
        memory_num_keys=knum,
        memory_value_dim=backbone.hidden_size,
        **overrides,
    )
    ladder = []
    for row in LADDER_ROWS:
        if row != LADDER_ROWS[0]:
            row_config = _ladder_step(row, row_config, skip_layers)
        ladder.append((row, UltraMemConfig(**row_config)))
    return ladder


def ladder_training_arguments(row: str) -> dict[str, Any]:
    """The training arguments of ladder row `row` beyond `UltraMemTrainingArguments`' defaults: the PKM recipe's
    constant value learning rate until the "+value lr decay" row, the paper's recipe (the defaults) from there on."""
    if row not in LADDER_ROWS:
        raise ValueError(f"ablation ladder row={row!r}: allowed values are {', '.join(LADDER_ROWS)}")
    return {} if LADDER_ROWS.index(row) >= LADDER_ROWS.index("+value lr decay") else dict(PKM_TRAINING)


# From UltraMem to UltraMemV2 (V2 paper, section 3.2), one change a row, from `{scale}-ultramem` to
# `{scale}-ultramemv2`. A memory in every block and the shared pool come in one row: with the tables' rows kept,
# per-layer tables of half or a quarter the rows have no whole number of keys per axis at these sizes, while a pool
# of the same rows read through windows of the V1 table's size does (rings of blocks / V1 layers).
V2_LADDER_ROWS: tuple[str, ...] = (
    "UltraMem",
    "+single projector",
    "+per-rank queries",
    "-query conv",
    "-Tucker penalty",
    "+every block, shared pool",
    "+PEER (Dp:Dv = 1:3)",
    "+MLP rebalanced",
)
V2_LADDER_SCALES = ("tiny", "small")


def ultramemv2_ladder(scale: str = "tiny") -> list[tuple[str, UltraMemConfig]]:
    """The ladder from `{scale}-ultramem` (first row) to `{scale}-ultramemv2` (last row), as (row name, config)."""
    if scale not in V2_LADDER_SCALES:
        raise ValueError(f"UltraMemV2 ladder scale={scale!r}: allowed values are {', '.join(V2_LADDER_SCALES)}")
    config = get_config(f"{scale}-ultramem").to_dict()
    final = get_config(f"{scale}-ultramemv2")
    ladder = []
    for row in V2_LADDER_ROWS:
        if row == "+single projector":
            config["ive_single_projector"] = True
        elif row == "+per-rank queries":
            config["share_query"] = False
        elif row == "-query conv":
            config["use_query_conv"] = False
        elif row == "-Tucker penalty":
            config["aux_loss_alpha"] = 0.0
        elif row == "+every block, shared pool":  # the same slots per token and value rows
            slots = config["memory_heads"] * config["memory_topk"] * len(config["memory_layers"])
            rows = config["memory_num_values"] * len(config["memory_layers"])
            blocks = config["num_hidden_layers"]
            config.update(
                memory_layers=[[block, block] for block in range(blocks)],
                memory_site=MLP_SITE,
                memory_heads=1,
                memory_topk=slots // blocks,
                value_pool_size=rows,
            )
        elif row == "+PEER (Dp:Dv = 1:3)":  # the same floats per row
            config.update(value_gate=PEER, pre_value_dim=config["memory_value_dim"] // 4)
            config["memory_value_dim"] -= config["pre_value_dim"]
        elif row == "+MLP rebalanced":  # V1's activated parameters
            config["intermediate_size"] = final.intermediate_size
        ladder.append((row, UltraMemConfig(**config)))
    return ladder
