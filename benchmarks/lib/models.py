"""The models the speed benchmarks compare, built alike, the one decoding step every decode benchmark times, and the
bytes that step must read (the paper's memory-access model)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, StaticCache

from ultramem.presets import get_config
from ultramem.sizing import build_model

from . import step_account, timing

# The three models of equal compute at each size: this project's dense backbone, UltraMem, and Mixtral.
PEERS: dict[str, dict[str, str]] = {
    "tiny": {"dense": "tiny-dense", "ultramem": "tiny-ultramem", "moe": "tiny-moe"},
    "small": {"dense": "small-dense", "ultramem": "small-ultramem", "moe": "small-moe"},
    "151m": {"dense": "dense-151m", "ultramem": "ultramem-151m-x12", "moe": "moe-151m-2in32"},
    "680m": {"dense": "dense-680m", "ultramem": "ultramem-680m-x12", "moe": "moe-680m-2in33"},
    "1.6b": {"dense": "dense-1.6b", "ultramem": "ultramem-1.6b-x12", "moe": "moe-1.6b-2in34"},
}
# Engram's n-gram memory holding the UltraMem preset's sparse parameters, at the sizes it has presets for: a peer
# the decode benchmarks time on request (`--kinds ...,engram`), kept apart from PEERS, whose three kinds every
# script builds
ENGRAM_PEERS: dict[str, str] = {"tiny": "tiny-engram", "151m": "engram-151m", "680m": "engram-680m"}
# A kind's suffix for the same model with its value tables memory-mapped from files (`set_value_store("disk")`, each
# table written once to the folder the script gives) instead of held in memory: `engram-disk`, `ultramem-disk`
ON_DISK = "-disk"
# A kind's suffix for the same model with the C++ CPU kernels as its memory implementation ("cpp"): `ultramem-cpp`
CPP_KERNELS = "-cpp"
# Transformers' expert paths for Mixtral (integrations/moe.py), tried in this order; the fastest is kept.
MOE_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(preset: str, device: torch.device | str, dtype: torch.dtype, **overrides: Any) -> PreTrainedModel:
    """A randomly initialised preset model, created directly on `device` in `dtype` (no host copy of big tables)."""
    config = get_config(preset, **overrides)
    with torch.device(device), default_dtype(dtype):
        return build_model(config)


class WithMemoryImplementation:
    """`model`, whose `generate` first sets its memory implementation: two benchmark peers that differ only in their
    kernels share one copy of the weights (two copies of a 151M model's value tables do not fit beside each other in
    24 GB, and paging distorts their ratio)."""

    def __init__(self, model: PreTrainedModel, implementation: str | None) -> None:
        self.model, self.implementation = model, implementation

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        use_memory_implementation(self.model, self.implementation)
        return self.model.generate(*args, **kwargs)


def use_memory_implementation(model: PreTrainedModel, name: str | None) -> PreTrainedModel:
    """Compute `model`'s memory lookups with `name` ("torch", "embedding_bag", "triton", "cpp"): the one place the
    benchmarks choose the kernel (`set_memory_implementation` where the model has it, the deprecated
    `config.memory_kernel` before that)."""
    if hasattr(model, "set_memory_implementation"):
        model.set_memory_implementation(name)
    else:
        model.config.memory_kernel = name
    return model


def decode_cache_length(args: argparse.Namespace) -> int:
    """Cache slots a decoding benchmark needs: the context, the 2-token prefill, every timed and profiled step
    (with `args.account`, one more and that many accounted steps)."""
    account = getattr(args, "account", 0) or 0
    return args.context + 3 + args.warmup + args.iters + (account + 1 if account else 0)


def decode_overrides(preset: str, args: argparse.Namespace, positions: int | None = None) -> dict[str, Any]:
    """Config overrides for decoding benchmarks: positions for the whole cache (`positions`, else
    `decode_cache_length`), no router-logit collection."""
    overrides: dict[str, Any] = {"max_position_embeddings": positions or decode_cache_length(args)}
    if preset.startswith(("moe", "tiny-moe")):
        overrides["output_router_logits"] = False
    return overrides


def filled_static_cache(model: PreTrainedModel, batch: int, context: int, max_len: int) -> StaticCache:
    """A StaticCache holding `context` tokens of random keys and values (and primed query-conv states).

    A 2-token prefill initializes every cache layer through the model's own code path; the KV buffers are then
    filled with random values and the lengths set to `context`, which costs the decode step exactly what a real
    prompt of that length would, without a long prefill at every batch size.
    """
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    prompt = torch.randint(1, model.config.vocab_size, (batch, 2), device=model.device)
    model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys[:, :, :context].normal_()
            layer.values[:, :, :context].normal_()
            layer.cumulative_length.fill_(context)
    return cache


@contextmanager
def as_generate_runs(*models: PreTrainedModel) -> Iterator[None]:
    """Decode steps as `generate` runs them: inside each UltraMem backbone's `fixed_weights`, where every memory layer
    builds its one-token step from the weights once and reuses it (a compiled step traces the modules as before)."""
    with ExitStack() as scopes:
        for model in models:
            backbone = getattr(model, "model", None)
            if hasattr(backbone, "fixed_weights"):
                scopes.enter_context(backbone.fixed_weights())
        yield


def decode_step(model: PreTrainedModel, batch: int, args: argparse.Namespace) -> Callable[[], None]:
    """One decoding step (sequence length 1) for `batch` sequences with `args.context` cached tokens, as a call.

    Every model runs alike: StaticCache, SDPA attention, eager or torch.compile(mode="reduce-overhead") with static
    shapes (dynamic batch shapes made CPU decode steps 10x slower in a trial), compiled afresh for each batch size:
    the reset also releases the previous size's CUDA graphs, which hold their cache's memory.
    """
    cache = filled_static_cache(model, batch, args.context, decode_cache_length(args))
    tokens = torch.randint(1, model.config.vocab_size, (batch, 1), device=model.device)
    forward, refresh = model.forward, None
    if args.mode == "compile":
        torch._dynamo.reset()
        forward = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
        # UltraMem: the step then reads the tensors cached from the weights instead of computing them in its graph,
        # as in `generate` (see `ultramem.inference_cache`)
        refresh = getattr(model, "refresh_inference_cache", None)

    def step() -> None:
        if refresh is not None:
            refresh()
        forward(input_ids=tokens, cache=cache, use_cache=True)

    return step


def time_decode(model: PreTrainedModel, batch: int, args: argparse.Namespace, account: int = 0) -> dict[str, Any]:
    """Time of one decoding step (`decode_step`), then one more step under the profiler counting its launches, and
    with `account` that many profiled steps split into kernels, copies, gaps and host time (`step_account`); the
    steps as `generate` runs them (`as_generate_runs`)."""
    with as_generate_runs(model):
        step = decode_step(model, batch, args)
        measured = timing.measure(step, args.device, args.warmup, args.iters, args.statistic)
        return {**measured, **timing.count_launches(step, args.device), **account_decode(model, step, args, account)}


def account_decode(model: PreTrainedModel, step: Callable[[], None], args: argparse.Namespace, steps: int) -> dict:
    """{"account": the `step_account` split of `steps` profiled calls of `step`}, or {} for none. Memory layers
    are annotated in eager mode only: hooks added to a compiled model would recompile it, and their ranges
    vanish inside compiled code anyway."""
    if not steps:
        return {}
    modules = step_account.memory_layers(model) if args.mode == "eager" else None
    return {"account": step_account.account_call(step, args.device, steps, modules)}


def build_peer(
    size: str,
    kind: str,
    args: argparse.Namespace,
    probe: Callable[[PreTrainedModel], dict[str, float]],
    positions: int | None = None,
    tables_dir: Path | None = None,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The eval-mode model of `kind` at `size` for decoding (`decode_overrides`) and its description; for MoE, the
    expert path `choose_moe_implementation` picks under `probe`. A kind ending in `ON_DISK` has its tables written to
    `tables_dir/<kind>` and memory-mapped from there."""
    base = kind.removesuffix(ON_DISK)
    preset = ENGRAM_PEERS[size] if base == "engram" else PEERS[size][base]
    model = build(preset, args.device, args.dtype, **decode_overrides(preset, args, positions)).eval()
    info: dict[str, Any] = {"size": size, "kind": kind, "preset": preset}
    if kind.endswith(ON_DISK):
        model.set_value_store("disk", directory=tables_dir / kind)
        info["value_store"] = "disk"
    if kind == "moe":
        with torch.no_grad():
            info["moe_implementation"], info["moe_probe_ms"] = choose_moe_implementation(model, args.moe_impl, probe)
    return model, info


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing (a model that did not run)."""
    return a / b if a and b else None


def choose_moe_implementation(
    model: PreTrainedModel, requested: str, probe: Callable[[PreTrainedModel], dict[str, float]]
) -> tuple[str, dict[str, Any]]:
    """The Mixtral expert path to benchmark: `requested`, or with 'auto' the fastest under `probe(model)`.

    Returns the choice and the probe times (or errors) of every candidate, for the JSON.
    """
    candidates = MOE_IMPLEMENTATIONS if requested == "auto" else (requested,)
    probes: dict[str, Any] = {}
    for implementation in candidates:
        model.set_experts_implementation(implementation)
        try:
            probes[implementation] = probe(model)["ms"] if requested == "auto" else None
        except (RuntimeError, NotImplementedError, ValueError) as error:
            if requested != "auto":
                raise
            probes[implementation] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    timed = {k: v for k, v in probes.items() if isinstance(v, float)}
    choice = min(timed, key=timed.get) if timed else candidates[0]
    model.set_experts_implementation(choice)
    return choice, probes


@dataclass(frozen=True)
class DecodeAccess:
    """Bytes one decoding step must read, split as in the paper's section "Why UltraMem instead of MoE"."""

    dense_weights: int  # every weight read once per step regardless of batch (attention, MLP, keys, projectors, head)
    sparse_weights: int  # MoE: min(k*B, N_moe) experts per layer; UltraMem: min(B*H*m, N) value rows per memory layer
    kv_cache: int  # keys and values of the context

    @property
    def total(self) -> int:
        return self.dense_weights + self.sparse_weights + self.kv_cache


def decode_memory_access(model: PreTrainedModel, batch: int, context: int, bytes_per_value: int) -> DecodeAccess:
    """The paper's memory-access model for one step of `batch` tokens with a KV cache of `context` tokens.

    MoE layer: min(k*B, N_moe) x (one expert's weights); the paper's experts are 2-matrix GeLU (2 x D x 2D),
    Mixtral's are SwiGLU (3 x D x 2/3*2D), the same bytes. UltraMem memory layer: min(B*H*m, N) x Dv for the
    values; keys, query and projectors are read whole. n-gram memory: B*(N-1)*K rows of its table. Input embeddings
    count B rows; everything else once.
    `model` may live on the meta device: only parameter shapes are read.
    """
    config = model.config
    embedding = model.get_input_embeddings().weight
    value_tables = set(model.get_value_table_names()) if hasattr(model, "get_value_table_names") else set()
    dense = sparse = 0
    for name, param in model.named_parameters():
        if param is embedding and not config.tie_word_embeddings:
            dense += min(batch, param.shape[0]) * param.shape[1]
        elif name in value_tables:
            if ".ngram_memories." in name:  # one row per hash head and n-gram order, per token
                slots = (config.ngram_order - 1) * config.ngram_heads * batch
            else:
                slots = config.memory_heads * config.memory_topk * batch
            sparse += min(slots, param.shape[0]) * param.shape[1]
        elif ".experts." in name:
            experts = param.shape[0]
            sparse += min(config.num_experts_per_tok * batch, experts) * (param.numel() // experts)
        else:
            dense += param.numel()
    kv_width = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * batch * context * config.num_hidden_layers * kv_width * head_dim
    return DecodeAccess(dense * bytes_per_value, sparse * bytes_per_value, kv * bytes_per_value)
