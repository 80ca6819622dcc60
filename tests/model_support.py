"""What the model tests share: the small config with every improvement of the paper on, its successors' switches,
models whose inputs are not the init's, padded batches, the float64 memory layer written from the equations, and a
saved model loaded in a fresh process with and without the package."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import torch
import torch.nn.functional as F

from ultramem import UltraMemConfig, UltraMemForCausalLM


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


def perturbed_model(config, seed: int = 0) -> UltraMemForCausalLM:
    """A model whose query convs also look at past tokens (their init is the identity on the current one), and whose
    queries' running statistics are not the identity's (as after training)."""
    torch.manual_seed(seed)
    model = UltraMemForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.memory_layers:
            if layer.query.conv is not None:
                layer.query.conv.weight.normal_(std=0.5)
                layer.query.conv.bias.normal_(std=0.1)
            statistics = layer.query.across_tokens
            if statistics is not None:
                statistics.running_mean.normal_(std=0.3)
                statistics.running_cov.copy_(torch.diag_embed(torch.rand_like(statistics.running_cov[..., 0]) + 0.5))
                statistics.whitening.add_(torch.randn_like(statistics.whitening), alpha=0.2)
    return model


# n-gram memories (Engram) at blocks 1 and 3 of `small_config`: tables of 88 and 152 rows of 4 values
NGRAM = dict(ngram_layers=[1, 3], ngram_order=3, ngram_heads=2, ngram_head_dim=4, ngram_table_size=60)


def perturbed_ngram_tables(model: UltraMemForCausalLM, std: float = 1.0) -> UltraMemForCausalLM:
    """`model` with its n-gram memories' tables, convs and canonical maps off their init (zero rows, identity conv,
    identity map), so that every one of them matters to the logits."""
    with torch.no_grad():
        for ngram in model.model.ngram_memories:
            ngram.values.weight.normal_(std=std)
            ngram.conv.weight.normal_(std=0.5)
            ngram.conv.bias.normal_(std=0.1)
            canonical = torch.arange(ngram.vocab_size + 1)
            canonical[10:20] = 10  # ten ids share one canonical id
            ngram.set_canonical_ids(canonical)
    return model


@torch.no_grad()
def greedy_static_cache(model, prompt: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
    """Greedy decoding of `prompt` (input_ids, attention_mask), one token at a time through a StaticCache built
    here (the conv states and n-gram ids in it)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=32)
    mask, tokens = prompt["attention_mask"], [prompt["input_ids"]]
    for _ in range(steps):
        logits = model(input_ids=tokens[-1], attention_mask=mask, cache=cache, use_cache=True).logits
        tokens.append(logits[:, -1:].argmax(-1))
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.cat(tokens, dim=1)


def left_padded_batch(vocab_size: int, lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(1, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def reference_memory_layer(
    layer, hidden: torch.Tensor, params: dict[str, torch.Tensor], tables: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """One token and one head at a time, in float64, from the equations (no code shared with the model).

    Covers the paper's layer (TDQKR or PKM retrieval, MCS, IVE) and the successors' switches: PEER pre-value gates
    (UltraMemV2 Eq. 15, GELU for PEER's Eq. 13), Memory+'s silu gate, V2's single projector (Eq. 12) and a value pool
    read through each layer's window. `tables`: "values" (and "pre_values") when the model's pool holds them.
    """
    config = layer.config
    tables = tables or params
    batch, length, hidden_size = hidden.shape
    heads, m, n, rank, cores_n = (
        config.memory_heads,
        config.memory_topk,
        config.memory_num_keys,
        config.tucker_rank,
        config.mcs_cores,
    )
    part, value_dim = config.memory_key_dim // rank, config.memory_value_dim
    groups = 1 if config.ive_single_projector else config.ive_expansion
    num_values, eps = config.memory_num_values, config.layer_norm_eps
    shuffle = layer.value_expansion.virtual_to_physical
    permutation = shuffle.tolist() if shuffle is not None else list(range(n * n))
    pool = config.value_pool_size
    window_start = layer.memory_idx * pool // config.num_memory_layers if pool else 0

    x = F.layer_norm(hidden, (hidden_size,), params["norm.weight"], params["norm.bias"], eps)
    convolved = x
    if config.use_query_conv:
        kernel = config.query_conv_kernel_size
        conv_weight = params["query.conv.weight"][:, 0, :]  # (D, k)
        convolved = []
        for t in range(length):
            acc = params["query.conv.bias"].expand(batch, hidden_size)
            for j in range(kernel):
                source = t - (kernel - 1) + j
                if source >= 0:
                    acc = acc + conv_weight[:, j] * x[:, source]
            convolved.append(acc)
        convolved = torch.stack(convolved, dim=1)
    num_queries = 1 if config.share_query else 2
    query = convolved @ params["query.proj.weight"].T  # (B, T, F)
    if config.query_norm != "none":  # at inference, every mode uses the running statistics
        statistics = layer.query.across_tokens
        query = query - statistics.running_mean.double()
        if config.query_norm == "batch_norm":
            query = query / (torch.diagonal(statistics.running_cov.double(), dim1=-2, dim2=-1).flatten() + eps).sqrt()
        if config.query_norm == "batch_whiten":  # each (head, query, part) block times its whitening matrix
            whitening = statistics.whitening.double()
            blocks = query.view(batch, length, -1, part)
            query = torch.stack([blocks[:, :, g] @ whitening[g] for g in range(len(whitening))], dim=2).flatten(2)
    query = query.view(batch, length, heads, num_queries, rank, part)
    query = F.layer_norm(query, (part,), params["query.norm.weight"], params["query.norm.bias"], eps)
    key_norm = (params["retrieval.key_norm.weight"], params["retrieval.key_norm.bias"])
    row_keys = F.layer_norm(params["retrieval.row_keys"], (part,), *key_norm, eps)
    col_keys = F.layer_norm(params["retrieval.col_keys"], (part,), *key_norm, eps)
    values = tables["values.weight"]
    chunk = value_dim // cores_n

    outputs = []
    for b in range(batch):
        for t in range(length):
            pooled = [[] for _ in range(groups)]
            for h in range(heads):
                s_row = torch.stack([row_keys[h, a] @ query[b, t, h, 0, a] for a in range(rank)])  # (r, n)
                s_col = torch.stack([col_keys[h, a] @ query[b, t, h, -1, a] for a in range(rank)])
                candidates = []
                if config.retrieval_mode == "product_key":
                    rows = np.argsort(-s_row[0].detach().numpy(), kind="stable")[:m]
                    cols = np.argsort(-s_col[0].detach().numpy(), kind="stable")[:m]
                    for i in rows:
                        for j in cols:
                            score = s_row[0, i] + s_col[0, j]
                            candidates.append((score.item(), int(i), int(j), [score]))
                else:
                    cores = params["retrieval.cores"]
                    core = cores[h].sum(0).detach().numpy()
                    left, _, right_h = np.linalg.svd(core)
                    proj_row, proj_col = left[:, 0] @ s_row.detach().numpy(), right_h[0] @ s_col.detach().numpy()
                    # the quadrant (both large or both very negative) with the higher best rank-1 score
                    if proj_row.max() * proj_col.max() < proj_row.min() * proj_col.min():
                        proj_row, proj_col = -proj_row, -proj_col
                    rows = np.argsort(-proj_row, kind="stable")[:m]
                    cols = np.argsort(-proj_col, kind="stable")[:m]
                    for i in rows:
                        for j in cols:
                            per_core = [s_row[:, i] @ cores[h, c] @ s_col[:, j] for c in range(cores_n)]
                            candidates.append((sum(per_core).item(), int(i), int(j), per_core))
                candidates.sort(key=lambda item: -item[0])
                selected = candidates[:m]
                weights = [per_core for *_, per_core in selected]
                if config.memory_score_softmax:  # PKM / Memory+: softmax over the head's m scores (one core)
                    weights = [[w] for w in torch.softmax(torch.stack([w[0] for w in weights]), 0)]
                for (_, i, j, _), per_core in zip(selected, weights):
                    shuffled = permutation[i * n + j]
                    row, group = shuffled % num_values, shuffled // num_values
                    if pool:
                        row = (row + window_start) % pool
                    if config.value_gate in ("peer", "peer_gelu"):  # g = <W_p x, P[row]> multiplies every core
                        gate = (params["pre_value_gate.proj.weight"] @ x[b, t]) @ tables["pre_values.weight"][row]
                        gate = F.gelu(gate) if config.value_gate == "peer_gelu" else gate
                        per_core = [w * gate for w in per_core]
                    pooled[group if groups > 1 else 0].append(
                        torch.cat([per_core[c] * values[row, c * chunk : (c + 1) * chunk] for c in range(cores_n)])
                    )
            stacked = torch.cat(
                [torch.stack(p).sum(0) if p else values.new_zeros(value_dim) for p in pooled]
            )  # (E * Dv,)
            if config.value_gate == "swilu":  # Memory+: y * silu(W_1 x) before the projector
                stacked = stacked * F.silu(params["value_expansion.gate.proj.weight"] @ x[b, t])
            outputs.append(params["value_expansion.projector.weight"] @ stacked)
    return torch.stack(outputs).view(batch, length, hidden_size)


# Loads the folder argv[1] in a fresh process, with the package (argv[2] == "package") or through the checkpoint's own
# code alone ("remote": `ultramem` unimportable), and saves its logits for the saved inputs
LOAD_IN_A_FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    if sys.argv[2] == "remote":
        sys.modules["ultramem"] = None
    else:
        import ultramem
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=sys.argv[2] == "remote").eval()
    with torch.no_grad():
        torch.save(model(torch.load(sys.argv[1] + "/inputs.pt")).logits, sys.argv[1] + "/" + sys.argv[2] + ".pt")
    """
)


def assert_loads_alike_with_and_without_the_package(
    model: UltraMemForCausalLM, input_ids: torch.Tensor, folder
) -> None:
    """`model` saved to `folder` gives the same logits for `input_ids`, bit for bit, loaded in a fresh process with the
    package and through the checkpoint's own code alone. All on one thread: a kernel's sums may split by thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            expected = model(input_ids).logits
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(folder)
    torch.save(input_ids, folder / "inputs.pt")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode in ("package", "remote"):
        command = [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(folder), mode]
        subprocess.run(command, check=True, env=environment, cwd=folder)
        torch.testing.assert_close(torch.load(folder / f"{mode}.pt"), expected, rtol=0, atol=0)
