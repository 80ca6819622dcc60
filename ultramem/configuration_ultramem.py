"""UltraMem model configuration."""


import dataclasses
import math
import numbers
from typing import Any, Literal, get_args

from huggingface_hub.dataclasses import strict
from transformers import AutoTokenizer
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .missing_tokenizer import MissingTokenizer

# The allowed values of the mode fields, defined once: code compares with these names, never with string literals.
MemoryKernel = Literal["auto", "triton", "torch", "embedding_bag"]
RetrievalMode = Literal["product_key", "tucker"]
MEMORY_KERNELS: tuple[MemoryKernel, ...] = get_args(MemoryKernel)
RETRIEVAL_MODES: tuple[RetrievalMode, ...] = get_args(RetrievalMode)
MemoryOffload = Literal["cpu", "disk"]
MEMORY_OFFLOADS: tuple[MemoryOffload | None, ...] = (None, *get_args(MemoryOffload))
PRODUCT_KEY: RetrievalMode = "product_key"  # PKM's product keys (the baseline)
TUCKER: RetrievalMode = "tucker"  # UltraMem's Tucker-decomposed query-key retrieval (TDQKR)


class UltraMemConfigError(ValueError):
    """A config field is outside its allowed range; the message names the field, its value and the range."""


def _require(condition: bool, field: str, value, allowed: str) -> None:
    if not condition:
        raise UltraMemConfigError(f"UltraMemConfig.{field}={value!r} is invalid: {allowed}.")


def validate_memory_offload(value) -> None:
    """`memory_offload` is also set by `from_pretrained` keywords after construction: checked again at load."""
    _require(value in MEMORY_OFFLOADS, "memory_offload", value, f"must be one of {MEMORY_OFFLOADS}")


@strict
class UltraMemConfig(PreTrainedConfig):
    r"""
    Configuration of an UltraMem model ("Ultra-Sparse Memory Network", ICLR 2025).

    The backbone is a pre-norm decoder with rotary embeddings on the full head dim, LayerNorm and a
    2-matrix GeLU MLP: the shape of `GPTNeoXForCausalLM` with `use_parallel_residual=False` and
    `rotary_pct=1.0`. Memory layers are placed by `memory_layers`, a list of `(a, b)` pairs of 0-based
    block indices: the layer reads the residual stream entering block `a` (through its own pre-norm)
    and its output is added to the residual stream leaving block `b`. `a == b` is PKM's placement in
    parallel with a block; `a < b` is UltraMem's skip-layer placement. The paper's "3:5" (1-based) is
    `(2, 4)` here.

    Every improvement of the paper is a switch, so each row of the paper's ablation ladder is a config
    (see `ultramem.presets.ABLATION_LADDER`); the plain PKM baseline is a config of the same model.

    Memory notation: H heads (`memory_heads`), m top-m per head (`memory_topk`), Dk key dim
    (`memory_key_dim`), n keys per axis (`memory_num_keys`, already including the sqrt(E) of IVE),
    r Tucker rank (`tucker_rank`; `tdqkr_signed_candidates` also keeps the most negative rank-1
    projections as candidates, see `TuckerQueryKeyRetrieval.candidates`), h MCS cores (`mcs_cores`), E IVE expansion (`ive_expansion`),
    Dv value dim (`memory_value_dim`), N physical values per layer (`memory_num_values` = n^2 / E).

    `memory_kernel` picks the memory ops (one of `MEMORY_KERNELS`): "torch" is the pure-PyTorch reference,
    "embedding_bag" the reference with its lookup-reduce as one `F.embedding_bag` (the fast path on CPU,
    training and prefill), "triton" the fused kernels of `ultramem.kernels`; "auto" takes embedding_bag on
    CPU, Triton on CUDA when installed, the reference elsewhere.

    Example:
    ```python
    >>> from ultramem import UltraMemConfig, UltraMemForCausalLM
    >>> config = UltraMemConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    ...                         intermediate_size=1024, memory_layers=[[0, 1], [2, 3]], memory_num_keys=64,
    ...                         memory_key_dim=64, memory_value_dim=128, memory_topk=8)
    >>> model = UltraMemForCausalLM(config)
    ```
    """

    model_type = "ultramem"
    # The Trainer's predictions are the logits alone, as for Llama (the loss parts are logged, not predictions)
    keys_to_ignore_at_inference = ["cache", "lm_loss", "aux_loss"]

    # Backbone
    vocab_size: int = 50432
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    rope_parameters: RopeParameters | dict | None = None
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float | int = 0.0  # float | int as Llama's: 0 and 1 are natural to write
    hidden_dropout: float | int = 0.0
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = 0

    # Memory placement: list of [a, b] block pairs (read before block a, write after block b)
    memory_layers: list | None = None

    # Retrieval
    memory_heads: int = 2
    memory_topk: int = 16
    memory_key_dim: int = 256
    memory_num_keys: int = 2200
    retrieval_mode: str = TUCKER  # a RetrievalMode; typed str so __post_init__'s error names the allowed range
    tucker_rank: int = 2
    mcs_cores: int = 2
    tdqkr_signed_candidates: bool = False
    share_query: bool = True
    qk_layernorm: bool = True
    use_query_conv: bool = True
    query_conv_kernel_size: int = 4
    memory_score_softmax: bool = False

    # Values
    ive_expansion: int = 4
    memory_value_dim: int = 512
    memory_num_values: int | None = None
    value_projection: bool = True
    ive_shuffle_seed: int = 0

    # Aux loss on the Tucker core's non-leading singular values
    aux_loss_alpha: float | int = 0.001
    aux_loss_tau: float | int = 0.15

    # Init and optimisation switches
    improved_init: bool = True
    value_lr_multiplier: float | int = 10.0
    value_lr_decay: bool = True

    # Which implementation of the memory ops runs (MEMORY_KERNELS): "torch" = the PyTorch reference, "embedding_bag" =
    # its lookup as one F.embedding_bag (fast on CPU), "triton" = fused kernels; "auto" = embedding_bag on CPU,
    # Triton on CUDA when installed, the reference elsewhere
    memory_kernel: str = "auto"  # a MemoryKernel (typed str, as retrieval_mode)

    # Where `from_pretrained` puts the value tables: None = with the other weights, "cpu" = host memory,
    # "disk" = memory-mapped from the checkpoint's safetensors (ultramem.offload). A loading setting: never saved.
    memory_offload: str | None = None

    # Derived, for the generation cache: blocks whose cache layer also holds query-conv states
    layer_types: list[str] | None = None
    number_of_conv_states: int = 1

    def __post_init__(self, **kwargs):
        self._validate_memory_layer_pairs()
        self.memory_layers = [[int(a), int(b)] for a, b in (self.memory_layers or [])]
        if self.memory_num_values is None and self.ive_expansion > 0 and self.memory_num_keys > 0:
            self.memory_num_values = self.memory_num_keys**2 // self.ive_expansion
        self._derive_cache_layout()
        # Accept the legacy `rope_theta` keyword as every Transformers config does.
        super().__post_init__(**kwargs)
        self.validate_ultramem()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "UltraMemConfig":
        """`PreTrainedConfig.from_dict`, with this config's own fields among `kwargs` built in, not set afterwards.

        Transformers builds the config from the saved dict, then sets each `from_pretrained(path, field=...)` keyword
        as an attribute, past `__post_init__`: `memory_topk=0` passed that way reached a kernel as a crash deep in
        it, and `memory_layers` left the cache layout derived from the saved pairs. Built in, every keyword is
        derived from and checked like the saved fields (`from_pretrained`, `AutoConfig`, `pipeline`, lm-eval's
        `model_args`).
        """
        own = {name: kwargs.pop(name) for name in list(kwargs) if name in _OWN_FIELDS}
        return super().from_dict({**config_dict, **own}, **kwargs)

    def prepare_for_model(self) -> None:
        """Check every field and derive the cache layout again, before a model is built from this config.

        A field assigned after construction (`config.memory_layers = ...`) skips `__post_init__`. The check comes
        first: the derivation unpacks the `memory_layers` pairs.
        """
        self.validate_ultramem()
        self._derive_cache_layout()

    def _validate_memory_layer_pairs(self) -> None:
        for i, pair in enumerate(self.memory_layers or []):
            _require(
                isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, numbers.Integral) for x in pair),
                f"memory_layers[{i}]",
                pair,
                "must be a pair [a, b] of block indices (read before block a, write after block b)",
            )

    def _derive_cache_layout(self) -> None:
        """Cache layers that hold a memory layer's query-conv state are "hybrid" (KV and conv states)."""
        slots = self.memory_conv_state_slots
        hybrid = {layer for layer, _ in slots}
        self.layer_types = ["hybrid" if i in hybrid else "full_attention" for i in range(max(self.num_hidden_layers, 0))]
        self.number_of_conv_states = max([state + 1 for _, state in slots], default=1)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_memory_layers(self) -> int:
        return len(self.memory_layers)

    @property
    def memory_conv_state_slots(self) -> list[tuple[int, int]]:
        """(cache layer, state index) of each memory layer's query-conv state, in `memory_layers` order; [] without one.

        Every hybrid cache layer is built with `number_of_conv_states` slots, and Transformers' `crop` (assisted and
        prompt-lookup decoding) fails on a slot no layer fills. So the M states fill h cache layers of s slots
        exactly (h * s = M, s the fewest that fit in the blocks: s = 1 while M <= blocks), each memory layer in its
        read block's cache layer where that has room, the rest in the first free slots.
        """
        read_blocks = [a for a, _ in self.memory_layers]
        if not (self.use_query_conv and self.query_conv_kernel_size > 1 and read_blocks) or self.num_hidden_layers < 1:
            return []
        count = len(read_blocks)
        states = next(s for s in range(-(-count // self.num_hidden_layers), count + 1) if count % s == 0)
        by_preference = list(dict.fromkeys(read_blocks + list(range(self.num_hidden_layers))))
        free = {layer: list(range(states)) for layer in by_preference[: count // states]}  # hybrid layer -> free states
        slots = [(a, free[a].pop(0)) if free.get(a) else None for a in read_blocks]  # the read block's, in order
        spare = iter([(layer, state) for layer, left in free.items() for state in left])
        return [slot or next(spare) for slot in slots]

    def to_dict(self) -> dict:
        """Without `memory_offload`: where this process keeps its tables is not part of what a checkpoint means."""
        output = super().to_dict()
        output.pop("memory_offload", None)
        return output

    def validate_ultramem(self) -> None:
        """Check every field against what the model can build; raise `UltraMemConfigError` naming the field."""
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            _require(value > 0, field, value, "must be a positive integer")
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size",
            self.hidden_size,
            f"must be divisible by num_attention_heads={self.num_attention_heads}",
        )
        _require(
            self.head_dim % 2 == 0, "num_attention_heads", self.num_attention_heads, "head dim must be even for RoPE"
        )
        _require(self.layer_norm_eps > 0, "layer_norm_eps", self.layer_norm_eps, "must be > 0")
        for field in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, field)
            _require(0.0 <= value < 1.0, field, value, "must be in [0, 1)")
        _require(
            self.memory_kernel in MEMORY_KERNELS, "memory_kernel", self.memory_kernel, f"must be one of {MEMORY_KERNELS}"
        )
        validate_memory_offload(self.memory_offload)
        self._validate_memory_layer_pairs()
        for i, (a, b) in enumerate(self.memory_layers or []):
            for value in (a, b):
                _require(
                    0 <= value < self.num_hidden_layers,
                    f"memory_layers[{i}]",
                    [a, b],
                    f"block indices must be in [0, {self.num_hidden_layers}) (num_hidden_layers)",
                )
            _require(a <= b, f"memory_layers[{i}]", [a, b], "needs a <= b (read before block a, write after block b)")
        if not self.memory_layers:
            return
        for field in (
            "memory_heads",
            "memory_topk",
            "memory_key_dim",
            "memory_num_keys",
            "tucker_rank",
            "mcs_cores",
            "ive_expansion",
            "memory_value_dim",
            "memory_num_values",
        ):
            value = getattr(self, field)
            _require(value is not None and value > 0, field, value, "must be a positive integer")
        _require(
            self.retrieval_mode in RETRIEVAL_MODES,
            "retrieval_mode",
            self.retrieval_mode,
            f"must be one of {RETRIEVAL_MODES}",
        )
        root = math.isqrt(self.ive_expansion)
        _require(root * root == self.ive_expansion, "ive_expansion", self.ive_expansion, "must be a perfect square")
        _require(
            self.memory_topk <= self.memory_num_keys,
            "memory_topk",
            self.memory_topk,
            f"must be <= memory_num_keys={self.memory_num_keys} (keys per axis)",
        )
        if self.tdqkr_signed_candidates and self.retrieval_mode == "tucker":
            _require(
                2 * self.memory_topk <= self.memory_num_keys,
                "memory_topk",
                self.memory_topk,
                f"must be <= memory_num_keys / 2 = {self.memory_num_keys // 2} with tdqkr_signed_candidates=True "
                "(the m largest and m smallest projections per axis must be disjoint)",
            )
        _require(
            self.memory_num_keys**2 == self.ive_expansion * self.memory_num_values,
            "memory_num_values",
            self.memory_num_values,
            f"must equal memory_num_keys^2 / ive_expansion = {self.memory_num_keys}^2 / {self.ive_expansion} "
            "(every virtual address maps to one physical row and one projector)",
        )
        _require(
            self.memory_key_dim % self.tucker_rank == 0,
            "memory_key_dim",
            self.memory_key_dim,
            f"must be divisible by tucker_rank={self.tucker_rank}",
        )
        _require(
            self.memory_value_dim % self.mcs_cores == 0,
            "memory_value_dim",
            self.memory_value_dim,
            f"must be divisible by mcs_cores={self.mcs_cores}",
        )
        if self.retrieval_mode == PRODUCT_KEY:
            _require(self.tucker_rank == 1, "tucker_rank", self.tucker_rank, "must be 1 with retrieval_mode='product_key'")
            _require(self.mcs_cores == 1, "mcs_cores", self.mcs_cores, "must be 1 with retrieval_mode='product_key'")
        if not self.value_projection:
            _require(
                self.ive_expansion == 1,
                "ive_expansion",
                self.ive_expansion,
                "must be 1 when value_projection=False (IVE needs one projector per virtual block)",
            )
            _require(
                self.memory_value_dim == self.hidden_size,
                "memory_value_dim",
                self.memory_value_dim,
                f"must equal hidden_size={self.hidden_size} when value_projection=False",
            )
        if self.use_query_conv:
            _require(
                self.query_conv_kernel_size >= 1,
                "query_conv_kernel_size",
                self.query_conv_kernel_size,
                "must be >= 1 when use_query_conv=True",
            )
        _require(self.aux_loss_alpha >= 0, "aux_loss_alpha", self.aux_loss_alpha, "must be >= 0")
        _require(self.aux_loss_tau >= 0, "aux_loss_tau", self.aux_loss_tau, "must be >= 0")
        _require(self.value_lr_multiplier > 0, "value_lr_multiplier", self.value_lr_multiplier, "must be > 0")


# UltraMemConfig's fields beyond those every Transformers config has (its `from_dict` builds them in)
_OWN_FIELDS = frozenset(field.name for field in dataclasses.fields(UltraMemConfig)) - frozenset(
    field.name for field in dataclasses.fields(PreTrainedConfig)
)

# Here, not in the package's __init__: a checkpoint's copy of this module runs it too (see missing_tokenizer).
AutoTokenizer.register(UltraMemConfig, MissingTokenizer, exist_ok=True)

__all__ = ["UltraMemConfig", "UltraMemConfigError"]
