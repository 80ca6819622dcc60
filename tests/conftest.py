"""Shared test setup: offline Hub, few threads, and small UltraMem configs with every feature switched on."""

import getpass
import os
import tempfile

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor's compiled-graph cache is not keyed on the CPU vector width (torch 2.13): a graph generated for AVX-512 and
# reloaded under ATEN_CPU_CAPABILITY=avx2 stores 8 of every 16 lanes (garbage indices), the reverse overruns its
# buffers. Each dispatch level the suite runs under gets a cache of its own (inherited by launched subprocesses).
if capability := os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{capability}"),
    )

import pytest  # noqa: E402

from ultramem import UltraMemConfig  # noqa: E402

# Two threads, shared between pytest-xdist's workers (`-n auto`: one per core) rather than oversubscribing the cores
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def small_config(memory_implementation: str | None = None, **overrides) -> UltraMemConfig:
    """A model small enough for exact float64 references: every improvement of the paper is on.

    `memory_implementation` sets the private kernel choice (None: the device's default), as
    `from_pretrained(..., memory_implementation=...)` does."""
    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=128,
        memory_layers=[[0, 2], [1, 3], [1, 1]],
        memory_heads=2,
        memory_topk=4,
        memory_key_dim=8,
        memory_num_keys=12,
        memory_value_dim=12,
        tucker_rank=2,
        mcs_cores=2,
        ive_expansion=4,
        query_conv_kernel_size=3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return UltraMemConfig(**kwargs, memory_implementation=memory_implementation)


def assert_trains_like_the_reference(memory_implementation: str, input_ids: torch.Tensor) -> None:
    """UltraMemForCausalLM with `memory_implementation` gives the loss and every gradient of the reference ('torch')."""
    from ultramem import UltraMemForCausalLM

    torch.manual_seed(0)
    reference = UltraMemForCausalLM(small_config(memory_implementation="torch"))
    other = UltraMemForCausalLM(small_config(memory_implementation=memory_implementation))
    other.load_state_dict(reference.state_dict())
    losses = []
    for model in (reference, other):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    other_params = dict(other.named_parameters())
    for name, parameter in reference.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(other_params[name].grad, parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def config() -> UltraMemConfig:
    return small_config()


# The successors as switches on `small_config` (docs/variants.md): UltraMemV2 (every block, beside the MLP, PEER
# pre-values, one projector, a ring-shared pool), its GELU-gated form, and Memory+ (PKM with softmax in place of two
# MLPs, the silu gate, one shared table)
VARIANTS = {
    "ultramemv2": dict(
        memory_layers=[[i, i] for i in range(4)],
        memory_site="mlp",
        share_query=False,
        value_gate="peer",
        pre_value_dim=4,
        ive_single_projector=True,
        value_pool_size=72,  # 4 layers x 18: windows of 36 rows overlapping by half
        aux_loss_alpha=0.0,
    ),
    "peer_gelu": dict(memory_layers=[[0, 2], [1, 1]], value_gate="peer_gelu", pre_value_dim=6),
    "memoryplus": dict(
        memory_layers=[[1, 1], [3, 3]],
        memory_site="instead_of_mlp",
        retrieval_mode="product_key",
        tucker_rank=1,
        mcs_cores=1,
        memory_score_softmax=True,
        value_gate="swilu",
        ive_expansion=1,
        value_pool_size=144,  # one table of n^2 rows, shared
        improved_init=False,
    ),
}
