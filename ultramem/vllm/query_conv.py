"""A memory layer's causal query convolution as a vLLM state layer: its last k-1 inputs per request live in vLLM's
hybrid cache, as LFM2's short convolution does, so continuous batching, chunked prefill and prefix caching ("align"
mode) keep each request's history.

The layer is a `MambaBase` of type SHORT_CONV: vLLM allocates one (D, span-1) state per request and block, and builds
the short-conv metadata (decode tokens first, then the prefills with their start offsets, state slots and whether each
prefill continues a cached state). The convolution itself is vLLM's: the CPU kernels on CPU, the Triton ones on CUDA.
A dilated conv (an n-gram memory's, `ultramem.vllm.ngram`) is the same layer with its taps spread out, and every
such layer of a model spans as many inputs (`span` >= k, zero taps in front): vLLM keeps state layers of one shape in
one KV cache group, where each shape would otherwise be a group of its own (its own block tables and metadata, every
step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import CacheConfig, ModelConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import CpuArchEnum, current_platform
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum


class QueryConv(MambaBase, nn.Module):
    """Depthwise causal Conv1d over each request's tokens, in place of `memory_query.CausalDepthwiseConv`: its
    parameter names (`weight`, `bias` (D,)) and call, on the flat batch as one sequence (1, T, D).

    The k taps of the checkpoint's weight (D, 1, k), `dilation` d apart, are the last of the undilated weight
    (D, 1, span), zero before and between them: the same convolution, whose state is the last span - 1 inputs
    (span >= (k-1) d + 1; by default equal)."""

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        model_config: ModelConfig | None,
        cache_config: CacheConfig | None,
        prefix: str,
        dilation: int = 1,
        span: int | None = None,
    ):
        super().__init__()
        reach = (kernel_size - 1) * dilation + 1
        self.channels, self.kernel_size = channels, span or reach
        if self.kernel_size < reach:
            raise ValueError(
                f"span={span} is shorter than the {reach} inputs of {kernel_size} taps dilated by {dilation}"
            )
        self.taps = slice(self.kernel_size - reach, None, dilation)  # the checkpoint's taps in the undilated weight
        self.weight = nn.Parameter(torch.empty(channels, 1, self.kernel_size))
        set_weight_attrs(self.weight, {"weight_loader": self._load_taps})
        self.bias = nn.Parameter(torch.empty(channels))
        self.model_config, self.cache_config, self.prefix = model_config, cache_config, prefix
        # vLLM binds this layer's state pages by its name, as it does an attention layer's KV cache
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def _load_taps(self, target: torch.Tensor, taps: torch.Tensor) -> None:
        """The checkpoint's taps (D, 1, k) at their places in the weight (`taps`), zeros elsewhere."""
        target.data.zero_()
        target.data[..., self.taps] = taps

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    def get_state_shape(self) -> tuple[tuple[int, ...]]:
        return MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=1, intermediate_size=self.channels, conv_kernel=self.kernel_size
        )

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return MambaStateDtypeCalculator.short_conv_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype
        )

    def forward(self, x: torch.Tensor, inputs=None) -> torch.Tensor:
        """x (1, T, D): the flat batch, decode tokens first, as vLLM orders it. `inputs` are the Transformers conv's
        (padding, its cache, packed sequences): vLLM has none of them, its state is this layer's.

        Through a custom op (`vllm::ultramem_query_conv`), as vLLM's short conv: torch.compile keeps it whole, since
        it reads the step's metadata and states from the forward context, which a compiled graph cannot."""
        output = torch.empty_like(x[0])
        torch.ops.vllm.ultramem_query_conv(x[0], output, self.prefix)
        return output.unsqueeze(0)

    def _convolve(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, D) -> (T, D)."""
        metadata = (get_forward_context().attn_metadata or {}).get(self.prefix)
        weight = self.weight[:, 0]  # (D, k)
        if metadata is None:  # the profiling run: no states yet, the values do not matter
            return F.conv1d(F.pad(x.t(), (self.kernel_size - 1, 0)), self.weight, self.bias, groups=self.channels).t()
        state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)  # (S, D, k-1)
        num_decodes, num_prefill_tokens = metadata.num_decode_tokens, metadata.num_prefill_tokens
        decode_x, prefill_x = torch.split(x[: num_decodes + num_prefill_tokens], [num_decodes, num_prefill_tokens])
        outputs = []
        if num_decodes > 0:
            outputs.append(self._decode(decode_x, weight, state, metadata.state_indices_tensor_d.flatten()))
        if metadata.num_prefills > 0:
            outputs.append(self._prefill(prefill_x, weight, state, metadata))
        output = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        if output.shape[0] < x.shape[0]:  # padding tokens past the scheduled ones (CUDA graphs): zeros
            output = F.pad(output, (0, 0, 0, x.shape[0] - output.shape[0]))
        return output

    def _prefill(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, metadata) -> torch.Tensor:
        """Each prefill request's tokens, continuing its cached state where it has one (chunked prefill, prefix hit)."""
        if current_platform.is_cpu():
            from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu as conv_fn
        else:
            from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn as conv_fn
        output = conv_fn(
            x.t(),
            weight,
            self.bias,
            conv_states=state,
            query_start_loc=metadata.query_start_loc_p,
            cache_indices=metadata.state_indices_tensor_p.flatten(),
            has_initial_state=metadata.has_initial_states_p,
            activation=None,
            metadata=metadata,
        )  # (D, T)
        return output.t()[: x.shape[0]]

    def _decode(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token per request: the state's k-1 inputs and the token, then the state shifts by one."""
        if current_platform.is_cpu() and current_platform.get_cpu_architecture() == CpuArchEnum.ARM:
            from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_torch

            window = state[slots]  # (n, D, k-1), a copy: updated, then written back (as vLLM's ShortConv on Arm)
            output = causal_conv1d_update_torch(x.unsqueeze(-1), window, weight, self.bias, activation=None)
            state[slots] = window
            return output.squeeze(-1)
        if current_platform.is_cpu():
            from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu as update
        else:
            from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update as update
        return update(x.contiguous(), state, weight, self.bias, activation=None, conv_state_indices=slots)


def ultramem_query_conv(x: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """The query conv of layer `layer_name` on the flat batch x (T, D), written into `output` (T, D)."""
    output.copy_(get_forward_context().no_compile_layers[layer_name]._convolve(x))


def _ultramem_query_conv_fake(x: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(
    op_name="ultramem_query_conv",
    op_func=ultramem_query_conv,
    mutates_args=["output"],
    fake_impl=_ultramem_query_conv_fake,
)
