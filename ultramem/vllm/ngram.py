"""The hashed n-gram memories (Engram) on vLLM's flat token batch: `ngram_memory.NGramMemory`'s own modules, with the
two things they need from a request's past kept by vLLM as conv states.

At each token an n-gram memory reads the last N-1 token ids of its request, and its conv (k taps dilated by N) the
last (k-1) N of its inputs. Both ride on `QueryConv`, the state layer of the query convolutions, so continuous
batching, chunked prefill, prefix caching ("align" mode) and preemption keep them as they keep the query convs':

- the conv is `QueryConv` with `dilation=N` (its k taps spread over (k-1) N + 1, zero between them);
- the ids come from `TokenWindow`, a conv with one-hot weights whose output at each token is its last N ids: one
  for the model, whose n-gram memories all read the same ids.

From each token's window the memory's own code does the rest (`NGramMemory.canonical_ngrams`: canonical ids, no
n-gram across an EOS; `rows`: the hash; `start_read`: the table, in memory, quantized, or this rank's rows under
tensor parallel; `forward`: gate, projection, conv), so there is no second copy of its math.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.config import CacheConfig, ModelConfig

from ultramem.ngram_memory import NGramMemory
from ultramem.value_stores import deferred_value_tables

from .memory import served_tables
from .query_conv import QueryConv

DIGIT_BITS = 8  # an id is held in base-256 digits: bf16, whose significand has 8 bits, holds each exactly


def window_digits(vocab_size: int) -> int:
    """Base-256 digits of the values a token window holds (0..vocab_size)."""
    return max(1, (vocab_size.bit_length() + DIGIT_BITS - 1) // DIGIT_BITS)


def ngram_state_sizes(config) -> list[tuple[int, int]]:
    """(channels, undilated taps) of the model's n-gram state layers: each memory's conv (k > 1), the token window."""
    if not config.ngram_layers:
        return []
    order, kernel_size = config.ngram_order, config.ngram_conv_kernel_size
    convs = [(config.hidden_size, (kernel_size - 1) * order + 1)] if kernel_size > 1 else []
    return [*convs, (order * window_digits(config.vocab_size), order)]


class TokenWindow(QueryConv):
    """Each token's last N token ids in its request, itself included: the n-gram memories' history, as a conv state.

    A depthwise conv of N taps with one-hot weights: channel group j copies its input from j tokens back, so its output
    at a token is the ids of the N tokens up to it and its state is each request's last N-1 ids. An id is held as
    vocab_size - id, so that the zeros before a request's first token read as the no-token id vocab_size, in
    base-256 digits (a group of channels each), which every float dtype of the state holds exactly; the one-hot sums
    add only zeros to them.
    """

    def __init__(self, order: int, vocab_size: int, model_config: ModelConfig, cache_config: CacheConfig, prefix: str):
        digits = window_digits(vocab_size)
        super().__init__(order * digits, order, model_config, cache_config, prefix)
        self.order, self.vocab_size, self.digits = order, vocab_size, digits
        one_hot = torch.zeros(order, digits, order)  # [j, digit, tap]: group j reads the tap j tokens back
        for back in range(order):
            one_hot[back, :, order - 1 - back] = 1.0
        del self.weight, self.bias  # fixed, not the checkpoint's
        self.register_buffer("weight", one_hot.reshape(self.channels, 1, order), persistent=False)
        self.register_buffer("bias", torch.zeros(self.channels), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,), the flat batch -> (T, N): each token's window of ids, oldest first (vocab_size: none)."""
        shifts = torch.arange(self.digits, device=input_ids.device) * DIGIT_BITS
        digits = ((self.vocab_size - input_ids)[:, None] >> shifts) & ((1 << DIGIT_BITS) - 1)  # (T, digits)
        channels = digits.repeat(1, self.order).to(self.weight.dtype)  # (T, N digits): every group gets the id
        window = super().forward(channels[None])[0].view(-1, self.order, self.digits)  # (T, N, digits), j back
        return (self.vocab_size - (window.long() << shifts).sum(-1)).flip(-1)


def build_ngram_memory(
    config, ngram_idx: int, model_config: ModelConfig, cache_config: CacheConfig, prefix: str
) -> NGramMemory:
    """The Transformers n-gram memory `ngram_idx`, its conv (k > 1) a dilated vLLM state layer, its table this rank's
    (`served_tables`, quantized where the checkpoint's is). `prefix`: the memory's module name."""
    with deferred_value_tables():
        memory = NGramMemory(config, ngram_idx, *config.ngram_state_slots[ngram_idx])
    if memory.conv.kernel_size > 1:
        memory.conv = QueryConv(
            config.hidden_size, memory.conv.kernel_size, model_config, cache_config, f"{prefix}.conv", memory.order
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
