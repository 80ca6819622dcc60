"""The hashed n-gram memories (Engram) on vLLM's flat token batch: `ngram_memory.NGramMemory`'s own modules, with the
two things they need from a request's past kept by vLLM as conv states.

At each token an n-gram memory reads the last N-1 token ids of its request, and its conv (k taps dilated by N) the
last (k-1) N of its inputs. Both ride on `QueryConv`, the state layer of the query convolutions, so continuous
batching, chunked prefill, prefix caching ("align" mode) and preemption keep them as they keep the query convs':

- the conv is `QueryConv` with `dilation=N` (its k taps spread over (k-1) N + 1, zero between them);
- the ids come from `TokenWindow`, a conv with one-hot weights whose output at each token is its last N ids: one
  for the model, whose n-gram memories all read the same ids.

Both have the state shape of the model's other state layers (`state_span`): one KV cache group for all of them.

From each token's window the memory's own code does the rest (`NGramMemory.canonical_ngrams`: canonical ids, no
n-gram across an EOS; `rows`: the hash; `start_read`: the table, in memory, quantized, or this rank's rows under
tensor parallel; `forward`: gate, projection, conv), so there is no second copy of its math.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from vllm.config import CacheConfig, ModelConfig

from ultramem.ngram_memory import NGramMemory
from ultramem.value_stores import deferred_value_tables

from .memory import served_tables, state_span
from .query_conv import QueryConv

DIGIT_BITS = 8  # an id is held in base-256 digits: bf16, whose significand has 8 bits, holds each exactly


def window_digits(vocab_size: int) -> int:
    """Base-256 digits of the values a token window holds (0..vocab_size)."""
    return max(1, (vocab_size.bit_length() + DIGIT_BITS - 1) // DIGIT_BITS)


class TokenWindow(QueryConv):
    """Each token's last N token ids in its request, itself included: the n-gram memories' history, as a conv state.

    A depthwise conv with one-hot weights: channel group j copies its input from j tokens back (j < N), so its
    output at a token is the ids of the N tokens up to it and its state holds each request's last N-1 ids. An id is
    held as vocab_size - id, so that the zeros before a request's first token read as the no-token id vocab_size, in
    base-256 digits (a group of channels each), which every float dtype of the state holds exactly; the one-hot sums
    add only zeros to them. It has the model's state shape (D, span - 1): the channels past the N groups and the taps
    before the last N stay zero.
    """

    def __init__(self, config, model_config: ModelConfig, cache_config: CacheConfig, prefix: str):
        order, digits, span = config.ngram_order, window_digits(config.vocab_size), state_span(config)
        if order * digits > config.hidden_size:
            raise ValueError(
                f"hidden_size={config.hidden_size} holds fewer than the {order * digits} channels of the n-gram "
                f"memories' token window (ngram_order={order} ids of {digits} base-256 digits)"
            )
        super().__init__(config.hidden_size, span, model_config, cache_config, prefix)
        self.order, self.vocab_size, self.digits = order, config.vocab_size, digits
        one_hot = torch.zeros(config.hidden_size, span)  # [j digits + digit, tap]: group j reads j tokens back
        for back in range(order):
            one_hot[back * digits : (back + 1) * digits, span - 1 - back] = 1.0
        del self.weight, self.bias  # fixed, not the checkpoint's
        self.register_buffer("weight", one_hot[:, None], persistent=False)
        self.register_buffer("bias", torch.zeros(config.hidden_size), persistent=False)
        self.register_buffer("shifts", torch.arange(digits) * DIGIT_BITS, persistent=False)  # each digit's bits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,), the flat batch -> (T, N): each token's window of ids, oldest first (vocab_size: none)."""
        shifts = self.shifts
        digits = ((self.vocab_size - input_ids)[:, None] >> shifts) & ((1 << DIGIT_BITS) - 1)  # (T, digits)
        groups = digits.repeat(1, self.order)  # (T, N digits): every group gets the id
        channels = F.pad(groups, (0, self.channels - groups.shape[1])).to(self.weight.dtype)  # (T, D)
        window = super().forward(channels[None])[0, :, : groups.shape[1]].reshape(-1, self.order, self.digits)
        return (self.vocab_size - (window.long() << shifts).sum(-1)).flip(-1)  # (T, N digits) -> (T, N), j back


def build_ngram_memory(
    config, ngram_idx: int, model_config: ModelConfig, cache_config: CacheConfig, prefix: str
) -> NGramMemory:
    """The Transformers n-gram memory `ngram_idx`, its conv (k > 1) a dilated vLLM state layer, its table this rank's
    (`served_tables`, quantized where the checkpoint's is). `prefix`: the memory's module name."""
    with deferred_value_tables():
        memory = NGramMemory(config, ngram_idx, *config.ngram_state_slots[ngram_idx])
    if memory.conv.kernel_size > 1:
        memory.conv = QueryConv(
            config.hidden_size,
            memory.conv.kernel_size,
            model_config,
            cache_config,
            f"{prefix}.conv",
            dilation=memory.order,
            span=state_span(config),
        )
    memory.values, _ = served_tables(
        config, f"ngram_memories.{ngram_idx}.values", memory.values, None, config.memory_quantization
    )
    return memory


def start_ngram_reads(
    memories: list[NGramMemory], window: TokenWindow | None, input_ids: torch.Tensor
) -> list[Callable[[], torch.Tensor]]:
    """Each memory's read of the step's rows, started before the first block as the Transformers model starts them:
    input_ids (T,) -> for each memory, a call that returns its retrieved memory e (1, T, (N-1) K d), the flat batch
    as one sequence."""
    if window is None:
        return []
    windows = window(input_ids)  # (T, N): each token's ids, a row of its own
    reads = []
    for memory in memories:
        rows = memory.rows(memory.canonical_ngrams(windows))  # (T, 1, (N-1) K)
        reads.append(memory.start_read(rows.transpose(0, 1)))
    return reads
