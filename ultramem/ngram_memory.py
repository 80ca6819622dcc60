"""Hashed n-gram memory (Engram: Cheng et al. 2026, "Conditional Memory via Scalable Lookup"): a memory layer whose
addresses depend only on the token ids, so that for a whole step they are known before the first block runs.

For token t and each n-gram order n = 2..N, K hash heads map the canonical ids of tokens t-n+1..t to a row of their
own: a multiplicative-XOR hash, id_0 * c_0 ^ id_1 * c_1 ^ ... ^ id_{n-1} * c_{n-1} (id_j the token j positions back),
modulo a prime of the head's own. The (N-1) K rows side by side are the retrieved memory e. A context gate decides how
much of it the token takes, and a short convolution mixes in the neighbours':

    alpha = sigmoid(signed_sqrt(RMSNorm(h) . RMSNorm(W_k e) / sqrt(D)))      h: the residual stream entering the block
    v = alpha * W_v e
    y = v + SiLU(Conv(RMSNorm(v)))       causal depthwise conv of kernel k dilated by N, zero at init (y = v)

and y is added to the stream. The table is a value store (`value_stores`): in memory, quantized, offloaded or sharded
like a product-key table; its rows are read as they are (`read`). The model hashes every n-gram memory's n-grams and
starts their reads before its first block (`start`): an offloaded table gathers its rows in the background while
the blocks below the memory compute. The canonical ids (`canonical_token_ids`: NFKC, lower case, spaces stripped) are a
buffer of the model, saved with it. An n-gram never reaches across a document boundary (the token after an EOS starts
a new document), into padding or across packed sequences: positions outside the token's document hash as `vocab_size`
(no token). The last N-1 ids and the conv's inputs live in the generation cache, as the query conv's state does.

At inference the layer runs with its weights folded, kept in its `inference_cache` (`NGramMemory.cached_entries`):
one matmul for W_k and W_v, one weight for the gate's norms; its conv keeps a decode step's taps spread over its
window (`CausalDepthwiseConv`).

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only relatively.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache

from .configuration_ultramem import UltraMemConfig
from .inference_cache import CacheEntry, InferenceCache, held_here
from .memory_implementations import memory_ops_for
from .memory_query import CausalDepthwiseConv, MemoryInputs
from .value_stores import DeferredValueTable, MemoryValueTable, tables_deferred

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


def _splitmix64(state: int) -> int:
    """One output of splitmix64 (Steele et al. 2014) for `state`: a well-mixed 64-bit integer, the same everywhere."""
    z = (state + _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def hash_multipliers(vocab_size: int, order: int, layer: int, seed: int) -> list[int]:
    """The N odd multipliers c_0..c_{N-1} of memory layer `layer`: each below 2^63 / (vocab_size + 1), so a product
    with any id (the no-token id `vocab_size` included) and the XOR of such products fit a signed 64-bit integer."""
    bound = ((1 << 63) - 1) // (vocab_size + 1)
    return [2 * (_splitmix64(seed * 1_000_003 + layer * 64 + j) % (bound // 2)) + 1 for j in range(order)]


def _is_prime(value: int) -> bool:
    return value >= 2 and all(value % divisor for divisor in range(2, math.isqrt(value) + 1))


def head_moduli(rows_per_head: int, count: int, skip: int) -> list[int]:
    """`count` distinct primes, the (skip+1)-th to (skip+count)-th at or above `rows_per_head`: every head of every
    layer hashes modulo a prime of its own."""
    primes, candidate = [], max(rows_per_head, 2)
    while len(primes) < skip + count:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes[skip:]


def layer_moduli(config: UltraMemConfig, ngram_idx: int) -> list[int]:
    """Each head's prime of n-gram memory `ngram_idx`, distinct from every other head's of the model: the layer's share
    of the table, whose rows are their sum (`ngram_table_rows`)."""
    num_heads = (config.ngram_order - 1) * config.ngram_heads
    return head_moduli(config.ngram_table_size // num_heads, num_heads, ngram_idx * num_heads)


def ngram_table_rows(config: UltraMemConfig) -> list[int]:
    """The rows of each n-gram memory's table, in `ngram_layers` order."""
    return [sum(layer_moduli(config, idx)) for idx in range(len(config.ngram_layers or []))]


def canonical_token_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab_size + 1,) int64: each token id's canonical id, the smallest id whose text, NFKC-normalised, lower-cased
    and stripped of spaces, is the same ("Apple", " apple" and "APPLE" share one). Special tokens and ids past the
    tokenizer's vocabulary keep their own; the last entry maps the no-token id to itself."""
    canonical = list(range(vocab_size + 1))
    first: dict[str, int] = {}
    special = set(getattr(tokenizer, "all_special_ids", []))
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
    for token_id, token in enumerate(tokens):
        if token is None or token_id in special:
            continue
        text = unicodedata.normalize("NFKC", tokenizer.convert_tokens_to_string([token])).lower().strip()
        canonical[token_id] = first.setdefault(text, token_id)
    return torch.tensor(canonical, dtype=torch.int64)


def use_canonical_ids(model: nn.Module, tokenizer) -> None:
    """Every n-gram memory of `model` hashes `tokenizer`'s canonical ids (a fresh model's are the token ids): for a
    model trained from scratch, before its first step; the map is saved with the model."""
    for module in model.modules():
        if isinstance(module, NGramMemory):
            module.set_canonical_ids(canonical_token_ids(tokenizer, module.vocab_size).to(module.canonical_ids.device))


def ngram_tokens(
    tokens: torch.Tensor, no_token: int, eos_ids: torch.Tensor, order: int, sequences: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, T, N): [:, t, j] the token j positions back (j = 0..N-1) from each of the last T of `tokens` (B, N-1+T), or
    `no_token` where that is not of t's document: padding, before the first token, before an EOS that ended the
    document (the token after an EOS starts the next) or, with `sequences` (B, N-1+T), another packed sequence.

    All N positions at once, as each token's window of N ids (a decode step runs a few operators, not a set per
    order). The token j back is of t's document unless one of the j tokens before t is an EOS: unless the EOS counted
    from t back to j outnumber t's own."""
    windows = tokens.unfold(1, order, 1).flip(-1)  # (B, T, N): [:, t, j] the token j back from t
    is_eos = windows == eos_ids if eos_ids.numel() == 1 else torch.isin(windows, eos_ids)  # isin costs more per call
    eos = is_eos.cumsum(-1)  # (B, T, N): the EOS among t and the j tokens before it
    outside = eos != eos[..., :1]
    if sequences is not None:
        sequence = sequences.unfold(1, order, 1).flip(-1)  # (B, T, N)
        outside |= sequence != sequence[..., :1]
    return windows.masked_fill(outside, no_token)


def ngram_rows(
    ngrams: torch.Tensor, multipliers: torch.Tensor, moduli: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """The table rows of every head for n-grams (B, T, N) (`ngram_tokens`, canonical ids).

    The hash of order n: id_0 c_0 XOR ... XOR id_{n-1} c_{n-1}, modulo each of its heads' primes, plus the head's first
    row. multipliers: (N,) int64 c_j. moduli, offsets: ((N-1) K,) int64, order-major (the K bigram heads first).
    Returns (B, T, (N-1) K) int64 rows, order-major.
    """
    products = (ngrams * multipliers).unbind(-1)  # N of (B, T): id_j c_j
    heads = moduli.shape[0] // (len(products) - 1)
    mixed, hashes = products[0], []
    for product in products[1:]:  # XOR in the next token back: the hash of the next order, once for each of its heads
        mixed = torch.bitwise_xor(mixed, product)
        hashes += [mixed] * heads
    return torch.remainder(torch.stack(hashes, dim=-1), moduli) + offsets  # (B, T, (N-1) K)


def _squashed(score: torch.Tensor) -> torch.Tensor:
    """The gate from its score: sigmoid(signed_sqrt(score)), |score| clamped to 1e-6 below (a finite gradient at 0)."""
    return torch.sigmoid(score.sign() * score.abs().clamp_min(1e-6).sqrt())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim at inference. On CPU as the LayerNorm of [x, -x], whose mean is 0 and whose variance
    is mean(x^2) (the same values to rounding: both 4e-7 from float64): one kernel, which the backbone's blocks keep
    warm, where `F.rms_norm` runs a chain of five that a decode step finds cold (tiny-engram's layer inside `generate`,
    one thread: 445 -> 385 us a step with `_folded_gated_value`'s matmul score). Elsewhere `F.rms_norm`, one kernel."""
    dim = x.shape[-1]
    if x.device.type != "cpu":
        return F.rms_norm(x, (dim,), weight, eps)
    normed = F.layer_norm(torch.cat([x, x.neg()], dim=-1), (2 * dim,), None, None, eps)[..., :dim]
    return normed if weight is None else normed * weight


def _folded_gated_value(
    hidden_states: torch.Tensor, memory: torch.Tensor, key_value_t: torch.Tensor, gate_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """alpha W_v e (B, T, D) from the folded weights ([W_k; W_v]^T (E, 2D), w (D, 1)): see `NGramMemory._folded_entry`."""
    dim = hidden_states.shape[-1]
    key_value = torch.mm(memory.reshape(-1, memory.shape[-1]), key_value_t)  # (B*T, 2D): W_k e, then W_v e
    both = torch.cat([hidden_states.reshape(-1, dim), key_value[:, :dim]])  # (2 B*T, D): h, then W_k e
    normed, tokens = _rms_norm(both, None, eps), key_value.shape[0]
    score = torch.mm(normed[:tokens] * normed[tokens:], gate_weight)  # (B*T, 1): RMSNorm(h) . RMSNorm(W_k e) / sqrt(D)
    return (_squashed(score) * key_value[:, dim:]).view(hidden_states.shape)


class NGramMemory(nn.Module):
    """One n-gram memory layer (Engram): added to the residual stream entering block `block`.

    Its table (`values`, one row of `ngram_head_dim` per hash bucket, the heads' buckets one after the other) is a
    value store: a `MemoryValueTable` in memory, or any store of `value_stores` (quantized, offloaded, sharded), left
    deferred for it when the model is built to have its tables attached (`tables_deferred`).
    """

    def __init__(
        self, config: UltraMemConfig, ngram_idx: int, id_slot: tuple[int, int], conv_slot: tuple[int, int] | None
    ):
        super().__init__()
        self.config = config
        self.ngram_idx = ngram_idx
        self.block = config.ngram_layers[ngram_idx]
        self.order = config.ngram_order
        self.num_heads = (config.ngram_order - 1) * config.ngram_heads
        self.vocab_size = config.vocab_size
        self.seed = config.ngram_hash_seed
        self.id_slot = id_slot
        moduli = self._moduli()
        self.table_rows = sum(moduli)
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        self.eos = [token for token in eos if token is not None]
        # The hash's constants and the canonical ids: buffers saved with the model (a checkpoint alone reproduces its
        # addresses), filled here too so that every rank of a ZeRO-3 run holds them (as the IVE shuffle)
        on_meta = torch.empty(0).device.type == "meta"
        for name, values in (
            ("canonical_ids", list(range(config.vocab_size + 1))),
            ("multipliers", hash_multipliers(config.vocab_size, self.order, ngram_idx, self.seed)),
            ("moduli", moduli),
            ("offsets", [sum(moduli[:i]) for i in range(len(moduli))]),
            ("eos_ids", self.eos),
        ):
            buffer = torch.empty(len(values), dtype=torch.int64) if on_meta else torch.tensor(values, dtype=torch.int64)
            self.register_buffer(name, buffer, persistent=name != "eos_ids")
        table_cls = DeferredValueTable if tables_deferred(config) else MemoryValueTable
        self.values = table_cls(self.table_rows, config.ngram_head_dim, 0.0)  # init std 0: zero rows, as init_ultramem
        width = self.num_heads * config.ngram_head_dim
        self.key_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.value_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.key_norm = nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.value_norm = nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.conv = CausalDepthwiseConv(
            config.hidden_size, config.ngram_conv_kernel_size, conv_slot, dilation=config.ngram_order
        )
        self.inference_cache = InferenceCache()
        self.fixed_weights = False  # inside `UltraMemModel.fixed_weights`: decode steps run `decode_step`
        self._decode: Callable[[torch.Tensor, torch.Tensor, MemoryInputs], torch.Tensor] | bool | None = None

    def init_ultramem(self) -> None:
        """The hash's constants and identity canonical ids (a tokenizer's map replaces them: `set_canonical_ids`), a
        zero conv (y = v, Engram's identity start) and a zero table: a row no training n-gram reached adds nothing
        instead of noise (the main job's recipe, tiny-engram: validation loss 6.599 against 6.708 with N(0, 0.02)
        rows, of which 5% are read in 120 steps)."""
        init.copy_(self.canonical_ids, torch.arange(self.vocab_size + 1))
        init.copy_(
            self.multipliers, torch.tensor(hash_multipliers(self.vocab_size, self.order, self.ngram_idx, self.seed))
        )
        moduli = torch.tensor(self._moduli())
        init.copy_(self.moduli, moduli)
        init.copy_(self.offsets, torch.cumsum(moduli, 0) - moduli)
        init.copy_(self.eos_ids, torch.tensor(self.eos, dtype=torch.int64))  # not saved: a load builds it here
        init.zeros_(self.conv.weight)
        init.zeros_(self.conv.bias)
        if isinstance(self.values, MemoryValueTable):  # (a store attached at load reads or draws its own rows)
            init.zeros_(self.values.weight)

    def _moduli(self) -> list[int]:
        """Each head's prime, distinct from every other head's of the model: the layer's share of the table."""
        return layer_moduli(self.config, self.ngram_idx)

    @torch.no_grad()
    def set_canonical_ids(self, canonical_ids: torch.Tensor) -> None:
        """Use a tokenizer's canonical map (`canonical_token_ids`), (vocab_size + 1,) int64."""
        if canonical_ids.shape != self.canonical_ids.shape:
            raise ValueError(
                f"canonical_ids has {canonical_ids.shape[0]} entries; the n-gram memory needs vocab_size + 1 = "
                f"{self.canonical_ids.shape[0]} (one per token id and the no-token id last)"
            )
        self.canonical_ids.copy_(canonical_ids)

    def ngrams(self, input_ids: torch.Tensor, inputs: MemoryInputs = MemoryInputs()) -> torch.Tensor:
        """(B, T) token ids -> the canonical n-grams the hash reads (B, T, N) (`ngram_tokens`); the last N-1 ids go to
        the cache."""
        padding_mask = inputs.padding_mask
        ids = input_ids if padding_mask is None else input_ids.masked_fill(padding_mask == 0, self.vocab_size)
        tokens = self._tokens(ids, inputs.cache)  # (B, N-1+T)
        sequences = None
        if inputs.sequence_ids is not None:  # packed rows (no cache): the history is no token, of no sequence
            sequences = F.pad(inputs.sequence_ids, (self.order - 1, 0), value=-1)
        return self.canonical_ngrams(tokens, sequences)

    def canonical_ngrams(self, tokens: torch.Tensor, sequences: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, N-1+T), the N-1 before the first of T included (the no-token id where there are none) -> the
        canonical n-grams (B, T, N) the hash reads (`ngram_tokens`). The vLLM model, which keeps each request's last
        ids itself, gives every token's window of N ids as a row of its own (T, N)."""
        canonical = torch.take(self.canonical_ids, tokens)  # an index's machinery costs more per call
        return ngram_tokens(canonical, self.vocab_size, self.eos_ids, self.order, sequences)

    def rows(self, ngrams: torch.Tensor) -> torch.Tensor:
        """The n-grams (B, T, N) of `ngrams` -> (B, T, (N-1) K) table rows, with this layer's hash."""
        return ngram_rows(ngrams, self.multipliers, self.moduli, self.offsets)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (B, T, (N-1) K) -> the retrieved memory e (B, T, (N-1) K d): the heads' rows side by side."""
        return self.start_read(rows, ahead=False)()

    def start_read(self, rows: torch.Tensor, ahead: bool = True) -> Callable[[], torch.Tensor]:
        """Start reading rows (B, T, (N-1) K) of the table; the returned call gives e (B, T, (N-1) K d).

        A table in memory is one embedding, read when called. An offloaded store (`read_async`) reads the rows as
        they are, in the background with `ahead`. Any other store serves them through its lookup-reduce, each row a
        token of its own with one slot of weight 1 (the row as it is: no pooling). The result is in the store's dtype
        (float32 from a quantized one).
        """
        table = self.values
        if isinstance(table, MemoryValueTable):
            return lambda: F.embedding(rows, table.weight).flatten(-2)
        if hasattr(table, "read_async"):
            pending = table.read_async(rows, background=ahead)
            return lambda: pending.result().flatten(-2)
        slots = rows.reshape(-1, 1)  # (B T (N-1) K, 1)
        ops = memory_ops_for(getattr(self.config, "_memory_implementation", None), rows.device)
        ones = torch.ones(*slots.shape, 1, device=rows.device)
        lookup = (slots, torch.zeros_like(slots), ones, 1, ops)
        return lambda: table(*lookup).reshape(*rows.shape[:-1], -1)

    def start(self, input_ids: torch.Tensor, inputs: MemoryInputs = MemoryInputs()) -> Callable[[], torch.Tensor]:
        """Hash the step's n-grams (the last N-1 ids go to the cache) and start reading their rows (`start_read`).

        The addresses depend only on the token ids, so the model calls it for every n-gram memory before its first
        block and hands the result to the layer's call (`started`): an offloaded table's rows are gathered while the
        blocks below the layer compute.
        """
        return self.start_read(self.rows(self.ngrams(input_ids, inputs)))

    def _decode_step(
        self, input_ids: torch.Tensor, inputs: MemoryInputs
    ) -> Callable[[torch.Tensor, torch.Tensor, MemoryInputs], torch.Tensor] | None:
        """The decode step (`decode_step`) for one-token ids inside `UltraMemModel.fixed_weights`, built at the first."""
        if not self.fixed_weights or input_ids.shape[1] != 1 or torch.is_grad_enabled():
            return None
        if inputs.sequence_ids is not None or torch.compiler.is_compiling():
            return None
        step = self._decode  # read once: a scope ending on another thread resets it
        if step is None:
            step = self._decode = self.decode_step() or False
        return step or None

    def decode_step(self) -> Callable[[torch.Tensor, torch.Tensor, MemoryInputs], torch.Tensor] | None:
        """`forward` for decode steps (h (B, 1, D), e (B, 1, (N-1) K d) -> (B, 1, D)) on the weights as they are now,
        for the steps of one `generate` call, whose weights do not change (`UltraMemModel.fixed_weights`): the same
        operators without the module calls, checks and look-ups. None where `forward` does not fold its weights."""
        if self.training or not self._folds():
            return None
        convolve = self.conv.decode_step()
        if convolve is None:
            return None
        folded, eps = self.inference_cache.get("folded", *self._folded_entry()), self.key_norm.eps
        value_norm = (self.value_norm.weight, self.value_norm.eps)

        def step(hidden_states: torch.Tensor, memory: torch.Tensor, inputs: MemoryInputs) -> torch.Tensor:
            value = _folded_gated_value(hidden_states, memory, *folded, eps)
            return value + F.silu(convolve(_rms_norm(value, *value_norm), inputs))

        return step

    def gate(self, hidden_states: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """alpha (B, T, 1) = sigmoid(signed_sqrt(RMSNorm(h) . RMSNorm(W_k e) / sqrt(D)))."""
        score = (self.hidden_norm(hidden_states) * self.key_norm(self.key_proj(memory))).sum(-1, keepdim=True)
        return _squashed(score / math.sqrt(hidden_states.shape[-1]))

    def cached_entries(self) -> dict[str, CacheEntry]:
        """What `inference_cache` keeps (for `refresh_inference_cache`): the projections and the gate's norm weights
        folded for inference (`_folded_entry`); its conv keeps its own."""
        return {"folded": self._folded_entry()} if self._folds() else {}

    def _folds(self) -> bool:
        """Whether inference runs the folded projections and gate (`_folded_entry`) and `_rms_norm`: plain `nn.Linear`
        and `nn.RMSNorm` whose weights are held here. An adapter or a quantized layer runs its own forward; a weight that ZeRO-3
        partitions or accelerate offloads (meta) is only whole inside its module's own forward, which its hooks
        wrap."""
        modules = (self.key_proj, self.value_proj, self.hidden_norm, self.key_norm, self.value_norm)
        if [type(module) for module in modules] != [nn.Linear, nn.Linear, nn.RMSNorm, nn.RMSNorm, nn.RMSNorm]:
            return False
        if self.hidden_norm.eps != self.key_norm.eps:  # (both the config's) h and W_k e are normalised as one stack
            return False
        return held_here(*(module.weight for module in modules))

    def _folded_entry(self) -> CacheEntry:
        """([W_k; W_v]^T (E, 2D), w (D, 1)): the key and the value as one matmul, e [W_k; W_v]^T, and the gate's score
        RMSNorm(h) . RMSNorm(W_k e) / sqrt(D) as the matmul (rms_norm(h) rms_norm(W_k e)) w, h and W_k e normalised
        together without weights, w = w_h w_k / sqrt(D): fewer operators, each of which costs an eager step host time."""
        parameters = (self.key_proj.weight, self.value_proj.weight, self.hidden_norm.weight, self.key_norm.weight)
        return parameters, self._folded_weights

    def _folded_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        key_value = torch.cat([self.key_proj.weight, self.value_proj.weight])  # (2D, E)
        gate_weight = self.hidden_norm.weight * self.key_norm.weight / math.sqrt(self.key_norm.weight.shape[0])
        return key_value.T, gate_weight[:, None]

    def _folded_value(self, hidden_states: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """alpha W_v e (B, T, D), as `gate` and `value_proj` compute it, with the folded weights (`_folded_entry`)."""
        folded = self.inference_cache.get("folded", *self._folded_entry())
        return _folded_gated_value(hidden_states, memory, *folded, self.key_norm.eps)

    def _tokens(self, ids: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        """(B, T) ids -> (B, N-1+T): the N-1 ids before them (the no-token id where there are none), from the cache, then
        them; the cache then keeps the last N-1."""
        context, width = self.order - 1, self.order - 1 + ids.shape[1]
        layer, slot = self.id_slot
        if cache is None or not cache.layers[layer].has_previous_state[slot]:
            tokens = F.pad(ids, (context, 0), value=self.vocab_size)
            if cache is not None:
                cache.update_conv_state(tokens[:, None], layer, slot, conv_kernel_size=context)
            return tokens
        # the cache returns its state, then the new ids: the tokens themselves (while `generate` records the past for
        # assisted decoding the state is longer or shorter than N-1)
        updated = cache.update_conv_state(ids[:, None], layer, slot, conv_kernel_size=context)[:, 0]  # (B, S+T)
        if updated.shape[1] >= width:
            return updated if updated.shape[1] == width else updated[:, -width:]
        return F.pad(updated, (width - updated.shape[1], 0), value=self.vocab_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        inputs: MemoryInputs = MemoryInputs(),
        started: Callable[[], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The residual stream entering the block (B, T, D) and the token ids (B, T) -> the layer's output (B, T, D).

        `started`: this step's read of the ids, from `start` (given by the model); else the ids are hashed and read
        here."""
        memory = (started if started is not None else self.start(input_ids, inputs))().to(hidden_states.dtype)  # e
        step = self._decode_step(input_ids, inputs)
        if step is not None:
            return step(hidden_states, memory, inputs)
        if not self.training and self._folds():
            value = self._folded_value(hidden_states, memory)
            normed = _rms_norm(value, self.value_norm.weight, self.value_norm.eps)
        else:
            value = self.gate(hidden_states, memory) * self.value_proj(memory)
            normed = self.value_norm(value)
        return value + F.silu(self.conv(normed, inputs))
