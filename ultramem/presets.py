"""Named configs: the paper's Table "Model parameter setting", tiny CPU models and small single-GPU models.

Conventions (see docs/design.md): memory placement pairs are 0-based (paper "3:5" -> (2, 4)); the paper's
"Top-m" column "16x2" is m=16 values per head times H=2 heads; its "Knum" is sqrt(N physical values),
so the keys per axis are sqrt(E) * Knum. MoE rows are Transformers' Mixtral with SwiGLU experts of
2/3 the paper's GeLU expert width, which matches the paper's parameters and FLOPs per token.

Two rows of the paper's table are inconsistent with their own parameter column and are corrected:
"UltraMem-151M-x10" lists a 2048/8192/32 backbone (not provided: it is a typo for the 151M backbone),
and "PKM-1.6B-x12" lists Knum 1792, which gives 8.2B parameters instead of 21.44B with its full value
dim of 2048; Knum 3104 reproduces 21.44B.

Dropout: the paper trains with dropout 0.1 (its Table "Training hyper-parameters"), which every paper-scale
preset and the 151M ablation ladder carry (attention and residual dropout; Mixtral has attention dropout
only). The tiny presets (a few dozen steps on CPU) and the small ones (the GPU campaign's few-minute quality
comparison) train far from overfitting and keep dropout 0.

Training: a preset is a model config (`get_config`) and, where its recipe differs from the training defaults (the
paper's UltraMem recipe), the training arguments it recommends (`get_training_arguments`): the PKM presets train their
value tables at a constant learning rate, without UltraMem's decay.

Run `python -m ultramem.presets` for the table, side by side with the paper's figures. Building a model from
any of these configs and counting its parameters is `ultramem.sizing`; the paper's ablation ladder is
`ultramem.ablation`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transformers import MixtralConfig, PreTrainedConfig

from .configuration_ultramem import INSTEAD_OF_MLP_SITE, MLP_SITE, PEER, PRODUCT_KEY, SWILU, UltraMemConfig
from .sizing import count_parameters

VOCAB_SIZE = 50432
PAPER_DROPOUT = 0.1


@dataclass(frozen=True)
class Backbone:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    dropout: float = PAPER_DROPOUT

    def kwargs(self) -> dict[str, int | float]:
        return dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_hidden_layers=self.num_hidden_layers,
            attention_dropout=self.dropout,
            hidden_dropout=self.dropout,
        )


BACKBONES = {
    "tiny": Backbone(256, 1024, 4, 4, dropout=0.0),
    "small": Backbone(512, 2048, 8, 8, dropout=0.0),
    "151m": Backbone(1024, 4096, 16, 12),
    "680m": Backbone(1536, 6144, 16, 24),
    "1.6b": Backbone(2048, 8192, 16, 32),
    "6.5b": Backbone(4096, 16384, 32, 32),
}

# The plain PKM baseline: product keys, softmax, full value dim, one layer in parallel with a block.
PKM_SWITCHES: dict[str, Any] = dict(
    retrieval_mode=PRODUCT_KEY,
    memory_score_softmax=True,
    value_projection=False,
    share_query=False,
    qk_layernorm=False,
    ive_expansion=1,
    tucker_rank=1,
    mcs_cores=1,
    improved_init=False,
    use_query_conv=False,
)
# ... and its training: value tables at a constant 10x the base learning rate (the decay to 1x is UltraMem's)
PKM_TRAINING: dict[str, Any] = dict(value_lr_decay=False)


def _ultramem(scale: str, topk: int, key_dim: int, knum: int, layers: list[list[int]]) -> dict[str, Any]:
    backbone = BACKBONES[scale]
    return dict(
        **backbone.kwargs(),
        memory_layers=layers,
        memory_heads=2,
        memory_topk=topk,
        memory_key_dim=key_dim,
        memory_num_keys=2 * knum,  # sqrt(E) * Knum with E = 4
        memory_value_dim=backbone.hidden_size // 2,
        ive_expansion=4,
        tucker_rank=2,
        mcs_cores=2,
    )


# UltraMemV2 (Huang et al. 2025, section 3.2): a memory beside the MLP in every block, PEER pre-values (Dp:Dv = 1:3),
# per-rank queries without a conv, the IVE groups into one projector, a value pool shared as rings of g layers'
# tables, no Tucker penalty
V2_SWITCHES: dict[str, Any] = dict(
    memory_site=MLP_SITE,
    memory_heads=1,
    share_query=False,
    use_query_conv=False,
    value_gate=PEER,
    ive_single_projector=True,
    aux_loss_alpha=0.0,
)


def _ultramemv2(
    scale: str, topk: int, key_dim: int, value_dim: int, window_keys: int, ring: int, inner: int, expansion: int = 4
) -> dict[str, Any]:
    """V2 in every block of `scale`; `window_keys` keys per axis, each layer's window the tables of `ring` layers.

    `inner` is the MLP width that gives the V1 preset's activated parameters (found with `count_parameters`).
    """
    backbone = BACKBONES[scale]
    blocks = backbone.num_hidden_layers
    window = window_keys**2 // expansion
    return dict(
        **{**backbone.kwargs(), "intermediate_size": inner},
        **V2_SWITCHES,
        memory_layers=[[block, block] for block in range(blocks)],
        memory_topk=topk,
        memory_key_dim=key_dim,
        memory_num_keys=window_keys,
        memory_value_dim=value_dim * 3 // 4,
        pre_value_dim=value_dim // 4,
        ive_expansion=expansion,
        value_pool_size=blocks * window // ring,
    )


# Memory+ (Berges et al. 2024): PKM with softmax in place of a few blocks' MLPs, one table shared by them, values of
# the model's width, the silu gate before the projector
MEMORY_PLUS_SWITCHES: dict[str, Any] = {
    **PKM_SWITCHES,
    "memory_site": INSTEAD_OF_MLP_SITE,
    "value_projection": True,
    "value_gate": SWILU,
}


def _memory_plus(scale: str, blocks: list[int], heads: int, topk: int, knum: int) -> dict[str, Any]:
    backbone = BACKBONES[scale]
    return dict(
        **backbone.kwargs(),
        **MEMORY_PLUS_SWITCHES,
        memory_layers=[[block, block] for block in blocks],
        memory_heads=heads,
        memory_topk=topk,
        memory_key_dim=backbone.hidden_size // 2,
        memory_num_keys=knum,
        memory_value_dim=backbone.hidden_size,
        value_pool_size=knum**2,  # each layer's window is the whole table
    )


def _pkm(scale: str, topk: int, heads: int, key_dim: int, knum: int, block: int) -> dict[str, Any]:
    backbone = BACKBONES[scale]
    return dict(
        **backbone.kwargs(),
        **PKM_SWITCHES,
        memory_layers=[[block, block]],
        memory_heads=heads,
        memory_topk=topk,
        memory_key_dim=key_dim,
        memory_num_keys=knum,
        memory_value_dim=backbone.hidden_size,
    )


def _moe(scale: str, experts: int, paper_expert_inner: int) -> dict[str, Any]:
    backbone = BACKBONES[scale]
    return dict(
        attention_dropout=backbone.dropout,  # Mixtral has no residual dropout
        hidden_size=backbone.hidden_size,
        # SwiGLU: 3 matrices of 2/3 the width; a multiple of 8 keeps grouped-GEMM strides 16-byte aligned
        intermediate_size=8 * round(paper_expert_inner * 2 / 3 / 8),
        num_attention_heads=backbone.num_attention_heads,
        num_key_value_heads=backbone.num_attention_heads,
        num_hidden_layers=backbone.num_hidden_layers,
        num_local_experts=experts,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
    )


def _skip_layers(num_layers: int, span: int) -> list[list[int]]:
    """Paper placement a:a+span (1-based), every span+1 blocks from block 3 -> 0-based (a-1, a-1+span)."""
    return [[2 + i * (span + 1), 2 + i * (span + 1) + span] for i in range(num_layers)]


# Engram's n-gram memory (Cheng et al. 2026) at tiny scale: bigrams and trigrams, 4 hash heads each of 32 values, a
# conv of 4 taps dilated by 3
TINY_NGRAM: dict[str, Any] = dict(ngram_order=3, ngram_heads=4, ngram_head_dim=32, ngram_conv_kernel_size=4)

# ... and at the GPU plan's scales, 16 hash heads whose rows side by side are the hidden size: the n-gram tables of
# `engram-*` hold the sparse parameters of the UltraMem preset of the scale (two layers); `ultramem-engram-*` splits
# them 3:1 between product keys (fewer keys per axis) and one n-gram layer at block 1
GPU_NGRAM: dict[str, Any] = dict(ngram_order=3, ngram_heads=8, ngram_conv_kernel_size=4)


def _engram(scale: str, blocks: list[int], rows_per_layer: int) -> dict[str, Any]:
    backbone = BACKBONES[scale]
    head_dim = backbone.hidden_size // 16
    return dict(
        **backbone.kwargs(), **GPU_NGRAM, ngram_head_dim=head_dim, ngram_layers=blocks, ngram_table_size=rows_per_layer
    )


# MLP widths of the V2 presets that give the activated parameters of tiny-/small-ultramem (`count_parameters`)
TINY_V2_INNER = 1056
SMALL_V2_INNER = 1776

# Context of the tiny and small presets. Rotary positions have no weights, so the context is free: it changes no
# weight, loss or FLOP, only the longest sequence the model accepts. 2048 (lm-eval's default length) leaves room for
# every benchmark of the `ultramem_paper` group to generate its whole budget (BBH CoT: 1024 new tokens; lm-eval
# needs context > budget), so the README's evaluation commands run on the main job's checkpoint.
TINY_CONTEXT = 2048
SMALL_CONTEXT = 2048

# name -> (kind, config kwargs)
_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense-151m": ("ultramem", BACKBONES["151m"].kwargs()),
    "dense-680m": ("ultramem", BACKBONES["680m"].kwargs()),
    "dense-1.6b": ("ultramem", BACKBONES["1.6b"].kwargs()),
    "dense-6.5b": ("ultramem", BACKBONES["6.5b"].kwargs()),
    "moe-151m-2in32": ("mixtral", _moe("151m", 32, 2528)),
    "moe-680m-2in33": ("mixtral", _moe("680m", 33, 3584)),
    "moe-1.6b-2in34": ("mixtral", _moe("1.6b", 34, 4672)),
    "pkm-151m-x12": ("ultramem", _pkm("151m", 16, 6, 512, 1347, 5)),
    "pkm-680m-x12": ("ultramem", _pkm("680m", 35, 8, 768, 2308, 11)),
    "pkm-1.6b-x12": ("ultramem", _pkm("1.6b", 42, 12, 896, 3104, 15)),
    "ultramem-151m-x12": ("ultramem", _ultramem("151m", 16, 256, 1100, _skip_layers(3, span=2))),
    "ultramem-680m-x12": ("ultramem", _ultramem("680m", 35, 384, 1632, _skip_layers(4, span=4))),
    "ultramem-1.6b-x12": ("ultramem", _ultramem("1.6b", 42, 448, 1792, _skip_layers(6, span=4))),
    "engram-151m": ("ultramem", _engram("151m", [1, 6], 14_520_000)),
    "ultramem-engram-151m": (
        "ultramem",
        {**_ultramem("151m", 16, 256, 953, _skip_layers(3, span=2)), **_engram("151m", [1], 7_243_600)},
    ),
    "engram-680m": ("ultramem", _engram("680m", [1, 12], 42_613_000)),
    "ultramem-engram-680m": (
        "ultramem",
        {**_ultramem("680m", 35, 384, 1413, _skip_layers(4, span=4)), **_engram("680m", [1], 21_340_000)},
    ),
    # Models that train in minutes on 2 CPU cores; tiny-ultramem is the last row of the tiny ablation ladder.
    "tiny-dense": ("ultramem", dict(**BACKBONES["tiny"].kwargs(), max_position_embeddings=TINY_CONTEXT)),
    "tiny-ultramem": (
        "ultramem",
        dict(**_ultramem("tiny", 16, 64, 256, [[0, 1], [2, 3]]), max_position_embeddings=TINY_CONTEXT),
    ),
    "tiny-pkm": ("ultramem", dict(**_pkm("tiny", 16, 2, 64, 256, 2), max_position_embeddings=TINY_CONTEXT)),
    # Engram's memory at block 1 holding tiny-ultramem's sparse parameters (524,288 rows of 32: 16.8M); and both kinds
    # in one model, the same sparse total split 3:1 between product keys (n = 448) and n-grams (122,880 rows)
    "tiny-engram": (
        "ultramem",
        dict(
            **BACKBONES["tiny"].kwargs(),
            **TINY_NGRAM,
            ngram_layers=[1],
            ngram_table_size=524288,
            max_position_embeddings=TINY_CONTEXT,
        ),
    ),
    "tiny-ultramem-engram": (
        "ultramem",
        dict(
            **_ultramem("tiny", 16, 64, 224, [[0, 1], [2, 3]]),
            **TINY_NGRAM,
            ngram_layers=[1],
            ngram_table_size=122880,
            max_position_embeddings=TINY_CONTEXT,
        ),
    ),
    # 16 experts of GeLU width 516 (SwiGLU 344): total parameters of tiny-ultramem, 2 active ~ tiny-dense MLP
    "tiny-moe": ("mixtral", dict(**_moe("tiny", 16, 516), max_position_embeddings=TINY_CONTEXT)),
    # The GPU campaign's quality comparison: trains to a useful loss in minutes on one GPU. 25.2M dense; the
    # sparse models hold ~11x that (UltraMem 281.7M, PKM 279.5M, MoE 284.3M total parameters).
    "small-dense": ("ultramem", dict(**BACKBONES["small"].kwargs(), max_position_embeddings=SMALL_CONTEXT)),
    "small-ultramem": (
        "ultramem",
        dict(**_ultramem("small", 16, 128, 704, _skip_layers(2, span=2)), max_position_embeddings=SMALL_CONTEXT),
    ),
    "small-pkm": ("ultramem", dict(**_pkm("small", 16, 4, 128, 704, 4), max_position_embeddings=SMALL_CONTEXT)),
    "small-moe": ("mixtral", dict(**_moe("small", 33, 1024), max_position_embeddings=SMALL_CONTEXT)),
    # The successors, each with the total and activated parameters of the UltraMem preset of its scale (the MLP
    # width balances the activated count): UltraMemV2 and Memory+
    "tiny-ultramemv2": (
        "ultramem",
        dict(
            **_ultramemv2("tiny", 16, 64, 128, 512, ring=2, inner=TINY_V2_INNER), max_position_embeddings=TINY_CONTEXT
        ),
    ),
    "small-ultramemv2": (
        "ultramem",
        dict(**_ultramemv2("small", 8, 128, 256, 1408, 4, SMALL_V2_INNER), max_position_embeddings=SMALL_CONTEXT),
    ),
    "ultramemv2-151m": ("ultramem", _ultramemv2("151m", 8, 256, 512, 2200, 4, 3632)),
    # The paper's 227M/1.2B row (V2 Table 10, the official 227M recipe) on this project's backbone: GeLU MLP of 1.5x
    # the SwiGLU width (the same parameters), LayerNorm, untied head; no IVE, windows of half the pool
    "ultramemv2-227m": (
        "ultramem",
        dict(
            **{**Backbone(768, 3744, 12, 20).kwargs(), **V2_SWITCHES},
            memory_layers=[[block, block] for block in range(20)],
            memory_topk=32,
            memory_key_dim=384,
            memory_num_keys=1138,
            memory_value_dim=192,
            pre_value_dim=192,
            ive_expansion=1,
            value_pool_size=20 * 360**2,
        ),
    ),
    "tiny-memoryplus": (
        "ultramem",
        dict(**_memory_plus("tiny", [1, 3], 2, 16, 262), max_position_embeddings=TINY_CONTEXT),
    ),
    "small-memoryplus": (
        "ultramem",
        dict(**_memory_plus("small", [2, 5], 4, 16, 704), max_position_embeddings=SMALL_CONTEXT),
    ),
}

PRESETS: tuple[str, ...] = tuple(_PRESETS)

# name -> the `UltraMemTrainingArguments` fields its recipe sets beyond their defaults (the paper's UltraMem recipe)
_TRAINING_ARGUMENTS: dict[str, dict[str, Any]] = {
    **{name: PKM_TRAINING for name in ("pkm-151m-x12", "pkm-680m-x12", "pkm-1.6b-x12", "tiny-pkm", "small-pkm")},
    # Memory+ trains its table at a fixed rate (1e-3 at a base rate of 1e-4 in its 373M recipe)
    **{name: PKM_TRAINING for name in ("tiny-memoryplus", "small-memoryplus")},
    # The official 227M recipe: values at 4x decaying to 1x over the run
    "ultramemv2-227m": dict(value_lr_multiplier=4.0),
}

# The paper's "Param (B)" and "FLOPs (G)" columns, embeddings and head excluded.
PAPER_FIGURES: dict[str, tuple[float, float]] = {
    "dense-151m": (0.15, 0.30),
    "dense-680m": (0.68, 1.36),
    "dense-1.6b": (1.61, 3.21),
    "dense-6.5b": (6.44, 12.88),
    "moe-151m-2in32": (2.04, 0.35),
    "moe-680m-2in33": (8.95, 1.50),
    "moe-1.6b-2in34": (21.36, 3.52),
    "pkm-151m-x12": (2.04, 0.35),
    "pkm-680m-x12": (8.95, 1.50),
    "pkm-1.6b-x12": (21.44, 3.52),
    "ultramem-151m-x12": (2.03, 0.35),
    "ultramem-680m-x12": (8.93, 1.49),
    "ultramem-1.6b-x12": (21.41, 3.50),
}


def get_config(name: str, **overrides: Any) -> PreTrainedConfig:
    """The preset `name` as a config (`UltraMemConfig`, or `MixtralConfig` for the MoE rows).

    Overrides replace preset fields; unknown or invalid fields raise with the field named.
    """
    if name not in _PRESETS:
        raise KeyError(f"Unknown preset {name!r}; available: {', '.join(PRESETS)}")
    kind, kwargs = _PRESETS[name]
    kwargs = {"vocab_size": VOCAB_SIZE, **kwargs, **overrides}
    if kind == "mixtral":
        return MixtralConfig(rope_theta=10000.0, tie_word_embeddings=False, **kwargs)
    return UltraMemConfig(**kwargs)


def get_training_arguments(name: str) -> dict[str, Any]:
    """The training arguments the preset `name` is meant to train with, beyond `UltraMemTrainingArguments`' defaults:
    what its recipe changes in the optimizer, which is no field of the model's config. `ultramem.training.train` applies
    them where the caller leaves the argument unset."""
    if name not in _PRESETS:
        raise KeyError(f"Unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return dict(_TRAINING_ARGUMENTS.get(name, {}))


def _describe(name: str, config: PreTrainedConfig) -> dict[str, Any]:
    counts = count_parameters(config)
    paper_params, paper_flops = PAPER_FIGURES.get(name, (None, None))
    row = {
        "preset": name,
        "hidden": config.hidden_size,
        "inner": config.intermediate_size,
        "heads": config.num_attention_heads,
        "layers": config.num_hidden_layers,
        "top_m": "-",
        "experts": "-",
        "kdim": "-",
        "knum": "-",
        "mem_layers": "-",
        "params_b": counts["total"] / 1e9,
        "paper_params_b": paper_params,
        "flops_g": counts["flops_per_token"] / 1e9,
        "paper_flops_g": paper_flops,
    }
    if isinstance(config, MixtralConfig):
        row.update(top_m=config.num_experts_per_tok, experts=config.num_local_experts)
    if not isinstance(config, MixtralConfig) and config.memory_layers:
        row.update(
            top_m=f"{config.memory_topk}x{config.memory_heads}",
            kdim=config.memory_key_dim,
            knum=round(math.sqrt(config.memory_num_values)),
            mem_layers=len(config.memory_layers),
        )
    if getattr(config, "ngram_layers", None):  # n-gram memories counted beside: "2+1ng"
        row.update(mem_layers=f"{len(config.memory_layers)}+{len(config.ngram_layers)}ng")
    return row


def preset_table() -> list[dict[str, Any]]:
    """One row per preset: shape, our parameter and FLOP counts, and the paper's."""
    return [_describe(name, get_config(name)) for name in PRESETS]


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'preset':<20}{'hidden':>7}{'inner':>7}{'heads':>6}{'L':>4}{'top-m':>7}{'exp':>5}{'kdim':>6}"
        f"{'knum':>6}{'mem':>7}{'params(B)':>11}{'paper':>8}{'diff':>8}{'FLOPs(G)':>10}{'paper':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        paper_p, paper_f = r["paper_params_b"], r["paper_flops_g"]
        diff = f"{100 * (r['params_b'] / paper_p - 1):+.1f}%" if paper_p else "-"
        lines.append(
            f"{r['preset']:<20}{r['hidden']:>7}{r['inner']:>7}{r['heads']:>6}{r['layers']:>4}{r['top_m']!s:>7}"
            f"{r['experts']!s:>5}{r['kdim']!s:>6}{r['knum']!s:>6}{r['mem_layers']!s:>7}{r['params_b']:>11.3f}"
            f"{paper_p if paper_p else '-'!s:>8}{diff:>8}{r['flops_g']:>10.3f}{paper_f if paper_f else '-'!s:>8}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(preset_table()))
