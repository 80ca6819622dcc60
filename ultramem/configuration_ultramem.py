"""UltraMem model configuration."""

import functools
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, Literal, get_args

from huggingface_hub.dataclasses import as_validated_field, strict
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from transformers import AutoTokenizer
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .missing_tokenizer import MissingTokenizer

# The allowed values of the mode fields, defined once: code compares with these names, never with string literals.
RetrievalMode = Literal["product_key", "tucker"]
RETRIEVAL_MODES: tuple[RetrievalMode, ...] = get_args(RetrievalMode)
PRODUCT_KEY: RetrievalMode = "product_key"  # PKM's product keys (the baseline)
TUCKER: RetrievalMode = "tucker"  # UltraMem's Tucker-decomposed query-key retrieval (TDQKR)
MemoryOffload = Literal["cpu", "disk"]
MEMORY_OFFLOADS: tuple[MemoryOffload | None, ...] = (None, *get_args(MemoryOffload))
# Where a memory layer reads and writes: the stream entering its read block (UltraMem), or the block's MLP input,
# beside the MLP (UltraMemV2) or in its place (Memory+)
MemorySite = Literal["block", "mlp", "instead_of_mlp"]
MEMORY_SITES: tuple[MemorySite, ...] = get_args(MemorySite)
BLOCK_SITE, MLP_SITE, INSTEAD_OF_MLP_SITE = MEMORY_SITES
# How the input modulates the retrieved values: not at all, PEER's pre-values (UltraMemV2 Eq. 15; with GELU, PEER's
# Eq. 13), or Memory+'s silu gate on the pooled value
ValueGate = Literal["none", "peer", "peer_gelu", "swilu"]
VALUE_GATES: tuple[ValueGate, ...] = get_args(ValueGate)
NO_GATE, PEER, PEER_GELU, SWILU = VALUE_GATES
# How the memory query is normalised across tokens before its per-token LayerNorm (`ultramem.query_normalization`):
# not at all (the paper); minus a running mean; PKM's BatchNorm; each query part whitened by the batch's statistics in
# training; each query part whitened by running statistics in training and inference alike
QueryNorm = Literal["none", "running_center", "batch_norm", "batch_whiten", "running_whiten"]
QUERY_NORMS: tuple[QueryNorm, ...] = get_args(QueryNorm)
NO_QUERY_NORM, RUNNING_CENTER, BATCH_NORM, BATCH_WHITEN, RUNNING_WHITEN = QUERY_NORMS
# A saved config without `query_norm` predates it: it loads as it computed then
QUERY_NORM_BEFORE_FIELD: QueryNorm = NO_QUERY_NORM
# The built-in memory implementations; "auto", as None, is the device's default
MEMORY_IMPLEMENTATIONS: tuple[str, ...] = ("auto", "torch", "embedding_bag", "triton")
MEMORY_KERNELS = MEMORY_IMPLEMENTATIONS  # the name from when the choice was the saved field `memory_kernel`


class UltraMemConfigError(ValueError):
    """A config field is outside its allowed range; the message names the field, its value and the range."""


def _require(condition: bool, field: str, value: Any, allowed: str) -> None:
    if not condition:
        raise UltraMemConfigError(f"UltraMemConfig.{field}={value!r} is invalid: {allowed}.")


def _checked(allowed: str, ok: Callable[[Any], bool]):
    """A `@strict` field validator: `ok(value)`, else `allowed` (the error line adds the field and the value)."""

    def check(value: Any) -> None:
        if not ok(value):
            raise ValueError(allowed)

    return as_validated_field(check)


def one_of(allowed: tuple):
    return _checked(f"must be one of {allowed}", lambda value: value in allowed)


positive = _checked("must be a positive integer", lambda value: value is None or value > 0)  # None: int | None fields
non_negative = _checked("must be >= 0", lambda value: value >= 0)
dropout = _checked("must be in [0, 1)", lambda value: 0 <= value < 1)
perfect_square = _checked("must be a positive perfect square", lambda n: n > 0 and math.isqrt(n) ** 2 == n)


@as_validated_field
def ngram_placement(blocks: list | None) -> None:
    for i, block in enumerate(blocks or []):
        ok = isinstance(block, numbers.Integral) and not isinstance(block, bool)
        _require(ok, f"ngram_layers[{i}]", block, "must be a block index (the n-gram memory adds to its input)")


@as_validated_field
def memory_placement(pairs: list | None) -> None:
    for i, pair in enumerate(pairs or []):
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, numbers.Integral) for x in pair)
        _require(
            ok, f"memory_layers[{i}]", pair, "must be a pair [a, b] of block indices (read before a, write after b)"
        )


def _one_line_errors(cls):
    """`@strict` wraps a failed check in a two-line `StrictDataclass*Error`, which is no ValueError: give the
    `UltraMemConfigError` out as raised, and name the field and the value of a field check's plain ValueError.
    Type errors stay `@strict`'s own."""
    strict_init, strict_setattr = cls.__init__, cls.__setattr__

    @functools.wraps(strict_init)
    def __init__(self, *args, **kwargs):
        try:
            strict_init(self, *args, **kwargs)
        except StrictDataclassClassValidationError as error:
            if isinstance(error.__cause__, UltraMemConfigError):
                raise error.__cause__ from None
            raise

    @functools.wraps(strict_setattr)
    def __setattr__(self, name, value):
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as error:
            if isinstance(error.__cause__, UltraMemConfigError):
                raise error.__cause__ from None
            if isinstance(error.__cause__, ValueError):  # a `_checked` field: name the field and the value
                raise UltraMemConfigError(f"UltraMemConfig.{name}={value!r} is invalid: {error.__cause__}.") from None
            raise

    cls.__init__, cls.__setattr__ = __init__, __setattr__
    return cls


def conv_state_slots(read_blocks: list[int], num_blocks: int) -> list[tuple[int, int]]:
    """(cache layer, slot) for the query-conv state of each memory layer, given the block each one reads.

    Transformers gives every hybrid cache layer the same number of conv-state slots (`number_of_conv_states`), and its
    `crop` (assisted and prompt-lookup decoding) fails on a slot no layer fills. So the M states fill whole layers: s
    slots in each of M / s layers, s the fewest that divide M and fit in the blocks (s = 1 while M <= blocks). The
    read blocks' layers come first; a state goes to its read block's layer while that has room, else to the first
    slot left.
    """
    count = len(read_blocks)
    if count == 0:
        return []
    per_layer = math.ceil(count / num_blocks)
    while count % per_layer:
        per_layer += 1
    layers = list(dict.fromkeys([*read_blocks, *range(num_blocks)]))[: count // per_layer]
    free = {layer: list(range(per_layer)) for layer in layers}  # cache layer -> its slots not yet taken
    placed = [(block, free[block].pop(0)) if free.get(block) else None for block in read_blocks]
    left = [(layer, slot) for layer, slots in free.items() for slot in slots]
    return [slot or left.pop(0) for slot in placed]


@_one_line_errors
@strict
class UltraMemConfig(PreTrainedConfig):
    r"""
    Configuration of an UltraMem model ("Ultra-Sparse Memory Network", ICLR 2025).

    The backbone is a pre-norm decoder with rotary embeddings on the full head dim, LayerNorm and a 2-matrix GeLU MLP:
    `GPTNeoXForCausalLM` with `use_parallel_residual=False` and `rotary_pct=1.0`. Memory layers are placed by
    `memory_layers`, pairs `[a, b]` of 0-based block indices: the layer reads the residual stream entering block `a`
    (through its own pre-norm) and its output is added to the stream leaving block `b`. `a == b` is PKM's placement
    beside a block, `a < b` UltraMem's skip-layer placement; the paper's "3:5" (1-based) is `[2, 4]` here.

    Every improvement of the paper is a switch, so each row of the paper's ablation ladder is a config
    (`ultramem.ablation.ablation_ladder`), and the plain PKM baseline is a config of the same model.

    Memory notation: H heads (`memory_heads`), m top-m per head (`memory_topk`), Dk key dim (`memory_key_dim`),
    n keys per axis (`memory_num_keys`, already including the sqrt(E) of IVE), r Tucker rank (`tucker_rank`),
    h MCS cores (`mcs_cores`), E IVE expansion (`ive_expansion`), Dv value dim (`memory_value_dim`),
    N physical values per layer (`memory_num_values` = n^2 / E).

    Each field is checked when it is set, how the fields fit together (`validate_architecture`) when the config is
    built and again when a model is (`prepare_for_model`); a bad value raises one `UltraMemConfigError` line naming
    the field, the value and the allowed range.

    Loading settings are never saved: `memory_offload` (where `from_pretrained` puts the value tables) and the memory
    implementation, a keyword of the constructor, `from_dict` and `from_pretrained`: `memory_implementation=` one of
    `MEMORY_IMPLEMENTATIONS` (unset: the device's default), kept as `config._memory_implementation`. The older
    `memory_kernel` keyword still sets it, with a deprecation warning; a `memory_kernel` in a saved config.json is
    ignored, so a checkpoint never chooses the kernels of the machine that loads it.

    The value tables' learning rate (`value_lr_multiplier`, `value_lr_decay`) is a training argument
    (`UltraMemTrainingArguments`). The former fields are still accepted, deprecated and unsaved: given (or saved by an
    older version with other than the default), the trainer uses them where its arguments leave them unset.

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
    keys_to_ignore_at_inference = ["cache", "lm_loss", "aux_loss"]  # noqa: RUF012 (Transformers' class attribute)

    # Backbone
    vocab_size: int = positive(default=50432)
    hidden_size: int = positive(default=1024)
    intermediate_size: int = positive(default=4096)
    num_hidden_layers: int = positive(default=12)
    num_attention_heads: int = positive(default=16)
    hidden_act: str = "gelu"
    max_position_embeddings: int = positive(default=2048)
    rope_parameters: RopeParameters | dict | None = None
    layer_norm_eps: float = _checked("must be > 0", lambda value: value > 0)(default=1e-5)
    initializer_range: float = 0.02
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float | int = dropout(default=0.0)  # float | int as Llama's: 0 and 1 are natural to write
    hidden_dropout: float | int = dropout(default=0.0)
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = 0

    # Memory placement: [a, b] block pairs (read before block a, write after block b); None or [] = a dense model
    memory_layers: list | None = memory_placement(default=None)

    # Retrieval (`retrieval_mode` is typed str, not RetrievalMode, so that its error names the allowed range)
    memory_heads: int = positive(default=2)
    memory_topk: int = positive(default=16)
    memory_key_dim: int = positive(default=256)
    memory_num_keys: int = positive(default=2200)
    retrieval_mode: str = one_of(RETRIEVAL_MODES)(default=TUCKER)
    tucker_rank: int = positive(default=2)
    mcs_cores: int = positive(default=2)
    tdqkr_signed_candidates: bool = False  # also the most negative rank-1 projections (see TuckerQueryKeyRetrieval)
    share_query: bool = True
    qk_layernorm: bool = True
    use_query_conv: bool = True
    query_conv_kernel_size: int = _checked("must be >= 1", lambda value: value >= 1)(default=4)
    memory_score_softmax: bool = False
    # Across-token normalisation of the query against retrieval collapse (docs/design.md); momentum of its statistics
    query_norm: str = one_of(QUERY_NORMS)(default=BATCH_WHITEN)
    query_norm_momentum: float | int = _checked("must be in (0, 1]", lambda value: 0 < value <= 1)(default=0.1)

    # Values
    ive_expansion: int = perfect_square(default=4)
    memory_value_dim: int = positive(default=512)
    memory_num_values: int | None = positive(default=None)  # None: n^2 / E
    value_projection: bool = True
    ive_shuffle_seed: int = 0

    # The successors' switches (docs/variants.md), all off by default: UltraMemV2 (Huang et al. 2025) reads the MLP's
    # input in every block (`memory_site="mlp"`), gates slots by PEER pre-values of width `pre_value_dim`, pools the
    # IVE groups into one projector and shares one value pool of `value_pool_size` rows among the memory layers, each
    # reading a window of `memory_num_values` rows (a ring); Memory+ (Berges et al. 2024) replaces MLPs, gates with
    # silu and shares one table. `key_balance_loss_coef` is V2's key-balance loss (Eq. 18-20), 0 = off.
    memory_site: str = one_of(MEMORY_SITES)(default=BLOCK_SITE)
    value_gate: str = one_of(VALUE_GATES)(default=NO_GATE)
    pre_value_dim: int = non_negative(default=0)
    ive_single_projector: bool = False
    value_pool_size: int | None = positive(default=None)
    key_balance_loss_coef: float | int = non_negative(default=0.0)

    # Hashed n-gram memory (Engram, `ngram_memory`): the blocks whose input stream an n-gram memory adds to (None or []:
    # none); n-grams of orders 2..ngram_order, `ngram_heads` hash heads each with rows of `ngram_head_dim` values;
    # about `ngram_table_size` rows per layer, each head's share a prime of its own; a depthwise conv of
    # `ngram_conv_kernel_size` taps dilated by ngram_order; `ngram_hash_seed` picks the hash's multipliers
    ngram_layers: list | None = ngram_placement(default=None)
    ngram_order: int = _checked("must be >= 2 (bigrams and longer)", lambda value: value >= 2)(default=3)
    ngram_heads: int = positive(default=4)
    ngram_head_dim: int = positive(default=32)
    ngram_table_size: int = positive(default=65536)
    ngram_conv_kernel_size: int = _checked("must be >= 1", lambda value: value >= 1)(default=4)
    ngram_hash_seed: int = non_negative(default=0)

    # Aux loss on the Tucker core's non-leading singular values
    aux_loss_alpha: float | int = non_negative(default=0.001)
    aux_loss_tau: float | int = non_negative(default=0.15)

    # Init
    improved_init: bool = True

    # Where `from_pretrained` puts the value tables: None = with the other weights, "cpu" = host memory,
    # "disk" = memory-mapped from the checkpoint's safetensors (ultramem.offload). A loading setting: never saved.
    memory_offload: str | None = one_of(MEMORY_OFFLOADS)(default=None)

    # Storage format of the value tables (ultramem.quantized): None = float, "int8" / "int4" = rowwise quantized with a
    # scale and bias per group of `memory_quantization_group_size` columns (None: the format's default), the group
    # dividing memory_value_dim / mcs_cores. Saved: it says what the checkpoint's table tensors are.
    memory_quantization: str | None = one_of((None, "int8", "int4"))(default=None)
    memory_quantization_group_size: int | None = positive(default=None)

    # Derived from `memory_layers`, for the generation cache: blocks whose cache layer also holds query-conv states
    layer_types: list[str] | None = None
    number_of_conv_states: int = 1

    def __post_init__(
        self,
        memory_implementation: str | None = None,
        memory_kernel: str | None = None,
        value_lr_multiplier: float | None = None,
        value_lr_decay: bool | None = None,
        **kwargs,
    ):
        self.memory_layers = [[int(a), int(b)] for a, b in (self.memory_layers or [])]
        self.ngram_layers = [int(block) for block in (self.ngram_layers or [])]
        if self.memory_num_values is None:
            self.memory_num_values = self.memory_num_keys**2 // self.ive_expansion
        self._derive_cache_layout()
        # Private and unsaved, as `_attn_implementation`: None is the device's default
        self._memory_implementation = _implementation_keyword(memory_implementation, memory_kernel)
        # Deprecated training settings, unsaved: the trainer's fallback where its own arguments leave them unset
        self._value_lr: dict[str, float | bool] = {}
        for name, value in (("value_lr_multiplier", value_lr_multiplier), ("value_lr_decay", value_lr_decay)):
            if value is not None:
                _set_value_lr(self, name, value, stacklevel=6)  # the caller of UltraMemConfig(...), past 5 frames
        super().__post_init__(**kwargs)  # also takes the legacy `rope_theta` keyword, as every Transformers config

    def validate_architecture(self) -> None:
        """How the fields fit together; `@strict` runs it once per construction, `prepare_for_model` once per model."""
        super().validate_architecture()
        heads, blocks = self.num_attention_heads, self.num_hidden_layers
        divisible = f"must be divisible by num_attention_heads={heads}"
        _require(self.hidden_size % heads == 0, "hidden_size", self.hidden_size, divisible)
        _require(self.head_dim % 2 == 0, "num_attention_heads", heads, "head dim must be even for RoPE")
        for i, (a, b) in enumerate(self.memory_layers):
            inside = f"block indices must be in [0, {blocks}) (num_hidden_layers)"
            _require(0 <= a < blocks and 0 <= b < blocks, f"memory_layers[{i}]", [a, b], inside)
            _require(a <= b, f"memory_layers[{i}]", [a, b], "needs a <= b (read before block a, write after block b)")
        self._validate_ngram_memories()
        if not self.memory_layers:
            return
        n, m, expansion = self.memory_num_keys, self.memory_topk, self.ive_expansion
        _require(m <= n, "memory_topk", m, f"must be <= memory_num_keys={n} (keys per axis)")
        if self.tdqkr_signed_candidates and self.retrieval_mode == TUCKER:
            disjoint = f"must be <= memory_num_keys / 2 = {n // 2} with tdqkr_signed_candidates=True (the m largest "
            _require(2 * m <= n, "memory_topk", m, disjoint + "and m smallest projections per axis must be disjoint)")
        exact = f"must equal memory_num_keys^2 / ive_expansion = {n}^2 / {expansion} (one row per virtual address)"
        _require(n**2 == expansion * self.memory_num_values, "memory_num_values", self.memory_num_values, exact)
        for field, divisor in (("memory_key_dim", "tucker_rank"), ("memory_value_dim", "mcs_cores")):
            value, by = getattr(self, field), getattr(self, divisor)
            _require(value % by == 0, field, value, f"must be divisible by {divisor}={by}")
        for field in ("tucker_rank", "mcs_cores") if self.retrieval_mode == PRODUCT_KEY else ():
            value = getattr(self, field)
            _require(value == 1, field, value, "must be 1 with retrieval_mode='product_key'")
        group = self.memory_quantization_group_size
        if self.memory_quantization and group is not None:
            chunk = self.memory_value_dim // self.mcs_cores
            divides = f"must divide memory_value_dim / mcs_cores = {chunk} (a group never straddles two cores' chunks)"
            _require(chunk % group == 0, "memory_quantization_group_size", group, divides)
        self._validate_successor_switches()
        if not self.value_projection:
            one = "must be 1 when value_projection=False (IVE needs one projector per virtual block)"
            _require(expansion == 1, "ive_expansion", expansion, one)
            same = f"must equal hidden_size={self.hidden_size} when value_projection=False"
            _require(self.memory_value_dim == self.hidden_size, "memory_value_dim", self.memory_value_dim, same)

    def _validate_ngram_memories(self) -> None:
        blocks = self.num_hidden_layers
        for i, block in enumerate(self.ngram_layers):
            _require(0 <= block < blocks, f"ngram_layers[{i}]", block, f"must be in [0, {blocks}) (num_hidden_layers)")
        once = "must name each block once (one n-gram memory per block)"
        _require(len(set(self.ngram_layers)) == len(self.ngram_layers), "ngram_layers", self.ngram_layers, once)
        heads = (self.ngram_order - 1) * self.ngram_heads
        enough = f"must be >= the {heads} hash heads of a layer ((ngram_order - 1) x ngram_heads): each needs its rows"
        _require(self.ngram_table_size >= heads, "ngram_table_size", self.ngram_table_size, enough)

    def _validate_successor_switches(self) -> None:
        """The UltraMemV2 / Memory+ / PEER switches (see the field comments), with memory layers present."""
        peer = self.value_gate in (PEER, PEER_GELU)
        if peer:
            _require(self.pre_value_dim > 0, "pre_value_dim", 0, f"must be > 0 with value_gate={self.value_gate!r}")
        else:
            unused = f"must be 0 unless value_gate is {PEER!r} or {PEER_GELU!r} (it is the width of PEER's pre-values)"
            _require(self.pre_value_dim == 0, "pre_value_dim", self.pre_value_dim, unused)
        if self.value_gate == SWILU:
            needs = "must be True with value_gate='swilu' (the gate acts before the projector)"
            _require(self.value_projection, "value_projection", self.value_projection, needs)
        if self.memory_site != BLOCK_SITE:
            for i, (a, b) in enumerate(self.memory_layers):
                same = f"must be [a, a] with memory_site={self.memory_site!r} (read and written in block a's MLP site)"
                _require(a == b, f"memory_layers[{i}]", [a, b], same)
        pool, layers, window = self.value_pool_size, self.num_memory_layers, self.memory_num_values
        if pool is not None:
            _require(pool % layers == 0, "value_pool_size", pool, f"must be divisible by the {layers} memory layers")
            fits = f"must be >= memory_num_values={window} (each layer reads a window of that many pool rows)"
            _require(pool >= window, "value_pool_size", pool, fits)
            covered = f"must be <= {layers} x memory_num_values={layers * window} (else no window reaches some rows)"
            _require(pool <= layers * window, "value_pool_size", pool, covered)
        if self.memory_quantization is not None:
            plain = f"must be None with memory_quantization={self.memory_quantization!r} (quantized stores hold no"
            _require(not peer, "value_gate", self.value_gate, plain + " pre-values yet)")
            _require(pool is None, "value_pool_size", pool, plain + " shared pool yet)")

    @property
    def num_pooled_groups(self) -> int:
        """How many pooled groups enter the projector: E, or 1 with UltraMemV2's single projector."""
        return 1 if self.ive_single_projector else self.ive_expansion

    @property
    def blocks_without_mlp(self) -> set[int]:
        """Blocks whose MLP a memory layer replaces (`memory_site="instead_of_mlp"`)."""
        return {a for a, _ in self.memory_layers} if self.memory_site == INSTEAD_OF_MLP_SITE else set()

    def prepare_for_model(self) -> None:
        """Check how the fields fit together and derive the cache layout again, before a model is built from this
        config: a field assigned after construction (`config.memory_layers = ...`) was checked alone when set."""
        self.validate_architecture()
        self._derive_cache_layout()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "UltraMemConfig":
        """`PreTrainedConfig.from_dict`, with this config's keywords among `kwargs` built in, not set afterwards.

        Transformers builds the config from the saved dict, then sets each `from_pretrained(path, field=...)` keyword
        as an attribute, past `validate_architecture` (`memory_layers=[[0, 9]]` silently dropped a memory layer) and
        past the cache layout derived from the saved `memory_layers`. Built in, a keyword is checked and derived from
        like a saved field (`from_pretrained`, `AutoConfig`, `pipeline`, lm-eval's `model_args`). A kernel choice in
        the dict (`memory_kernel`, saved by older versions) is dropped; given as a keyword, it counts.
        """
        saved = {key: value for key, value in config_dict.items() if key not in _NEVER_LOADED}
        if "model_type" in saved:  # a saved config: one from before `query_norm` computes as it did then
            saved.setdefault("query_norm", QUERY_NORM_BEFORE_FIELD)
        for key, default in _VALUE_LR_DEFAULTS.items():  # saved by older versions; the default changes nothing
            if key in saved and saved[key] == default and isinstance(saved[key], bool) == isinstance(default, bool):
                del saved[key]
        keywords = {name: kwargs.pop(name) for name in list(kwargs) if name in _KEYWORDS}
        return super().from_dict({**saved, **keywords}, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Without the loading settings: where this process keeps its tables and which kernels it runs are not part
        of what a checkpoint means."""
        output = super().to_dict()
        output.pop("memory_offload", None)
        output.pop("_memory_implementation", None)
        output.pop("_value_lr", None)
        return output

    @property
    def memory_kernel(self) -> str:
        """Deprecated, read-only: `_memory_implementation`, "auto" for the device's default."""
        return self._memory_implementation or "auto"

    @property
    def value_lr_multiplier(self) -> float | None:
        """Deprecated (a training argument now): the value given to this config, else None."""
        return self._value_lr.get("value_lr_multiplier")

    @value_lr_multiplier.setter
    def value_lr_multiplier(self, value: float) -> None:
        _set_value_lr(self, "value_lr_multiplier", value, stacklevel=6)

    @property
    def value_lr_decay(self) -> bool | None:
        """Deprecated (a training argument now): the value given to this config, else None."""
        return self._value_lr.get("value_lr_decay")

    @value_lr_decay.setter
    def value_lr_decay(self, value: bool) -> None:
        _set_value_lr(self, "value_lr_decay", value, stacklevel=6)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """Read by Llama's attention, which the backbone reuses: no grouped KV heads."""
        return self.num_attention_heads

    @property
    def num_memory_layers(self) -> int:
        return len(self.memory_layers)

    @property
    def memory_conv_state_slots(self) -> list[tuple[int, int]]:
        """(cache layer, slot) of each memory layer's query-conv state, in `memory_layers` order; [] without one."""
        return self._state_slots()[0]

    @property
    def ngram_state_slots(self) -> list[tuple[tuple[int, int], tuple[int, int] | None]]:
        """(cache layer, slot) of each n-gram memory's last N-1 token ids and of its conv's inputs (None for a conv of
        one tap, which keeps none), in `ngram_layers` order."""
        return self._state_slots()[1]

    def _state_slots(self) -> tuple[list[tuple[int, int]], list[tuple[tuple[int, int], tuple[int, int] | None]]]:
        query_blocks = (
            [a for a, _ in self.memory_layers] if self.use_query_conv and self.query_conv_kernel_size > 1 else []
        )
        conv_blocks = self.ngram_layers if self.ngram_conv_kernel_size > 1 else []
        slots = conv_state_slots([*query_blocks, *self.ngram_layers, *conv_blocks], self.num_hidden_layers)
        queries, ids = slots[: len(query_blocks)], slots[len(query_blocks) : len(query_blocks) + len(self.ngram_layers)]
        convs = slots[len(query_blocks) + len(self.ngram_layers) :] or [None] * len(ids)
        return queries, list(zip(ids, convs, strict=True))

    def _derive_cache_layout(self) -> None:
        """Cache layers that hold a memory layer's query-conv state or an n-gram memory's states are "hybrid" (KV and
        conv states)."""
        queries, ngrams = self._state_slots()
        slots = [*queries, *(slot for pair in ngrams for slot in pair if slot is not None)]
        hybrid = {layer for layer, _ in slots}
        self.layer_types = ["hybrid" if i in hybrid else "full_attention" for i in range(self.num_hidden_layers)]
        self.number_of_conv_states = max([slot + 1 for _, slot in slots], default=1)


def _implementation_keyword(implementation: str | None, kernel: str | None) -> str | None:
    """The `memory_implementation` keyword, else the deprecated `memory_kernel`; "auto" is None."""
    keyword, name = ("memory_kernel", kernel) if implementation is None else ("memory_implementation", implementation)
    # Any registered name (`ultramem.memory_implementations`, where users register their own): the model checks it
    # against the registry when it is built, before any weight loads
    allowed = f"must be a registered name such as {MEMORY_IMPLEMENTATIONS[1:]}, or None (the device's default)"
    _require(name is None or isinstance(name, str), keyword, name, allowed)
    if kernel is not None:
        message = "UltraMemConfig(memory_kernel=...) is deprecated and no longer saved: use memory_implementation=..."
        message += " (also a from_pretrained keyword) or model.set_memory_implementation(...)."
        warnings.warn(message, FutureWarning, stacklevel=6)  # the caller of UltraMemConfig(...), past 5 init frames
    return None if name == "auto" else name


# The value-table learning rate was a config field until 0.2; these defaults are the training arguments' own
_VALUE_LR_DEFAULTS: dict[str, float | bool] = {"value_lr_multiplier": 10.0, "value_lr_decay": True}


def _set_value_lr(config: UltraMemConfig, name: str, value: float | bool, stacklevel: int) -> None:
    """Keep a deprecated value-LR setting (checked, unsaved) for the trainer, with a FutureWarning."""
    if name == "value_lr_multiplier":
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        _require(number and value > 0, name, value, "must be > 0")
        value = float(value)
    else:
        _require(isinstance(value, bool), name, value, "must be True or False")
    message = f"UltraMemConfig.{name} is deprecated and no longer saved: it is a training argument now "
    message += f"(UltraMemTrainingArguments.{name}, `ultramem-train --{name}`). Until it is removed, the trainer uses "
    message += "the config's value when that argument is not given."
    warnings.warn(message, FutureWarning, stacklevel=stacklevel)
    config._value_lr[name] = value


# `from_dict` builds these keywords into the config: its own fields (not those of every Transformers config, which
# `PreTrainedConfig.from_dict` handles) and the memory implementation. It never loads the saved kernel choice.
_KEYWORDS = {*UltraMemConfig.__dataclass_fields__, "memory_implementation", "memory_kernel", *_VALUE_LR_DEFAULTS}
_KEYWORDS -= set(PreTrainedConfig.__dataclass_fields__)
_NEVER_LOADED = ("memory_kernel", "memory_implementation", "_memory_implementation")  # a kernel choice in a saved dict

# `import ultramem` registers the tokenizer fallback (see missing_tokenizer). A checkpoint's copy of this file, loaded
# with trust_remote_code, is the only UltraMem code `AutoTokenizer` imports there: that copy registers it itself.
if __package__ != "ultramem":
    AutoTokenizer.register(UltraMemConfig, MissingTokenizer, exist_ok=True)

__all__ = ["UltraMemConfig", "UltraMemConfigError"]
