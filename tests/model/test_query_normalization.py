"""The query's across-token normalisation (`ultramem.query_normalization`): its statistics, when they change, that
inference stays per token, across processes as in one, and that checkpoints from before it compute as they did."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_support import small_config

from ultramem import UltraMemConfig, UltraMemForCausalLM
from ultramem.configuration_ultramem import QUERY_NORMS
from ultramem.query_normalization import QueryNormalization, collecting_statistics, update_running_statistics

pytestmark = pytest.mark.numerics  # run again under a second CPU dispatch level (.ci/run)

BLOCKS, BLOCK_DIM = 2, 3
FEATURES = BLOCKS * BLOCK_DIM


def _norm(mode: str, momentum: float = 0.1) -> QueryNormalization:
    return QueryNormalization(BLOCKS, BLOCK_DIM, mode, momentum=momentum, eps=1e-5)


def _gathering(norm: QueryNormalization, query: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A training forward of the normalisation alone, its statistics gathered as the model's training forward does."""
    with collecting_statistics([norm]):
        return norm(query, mask)


def _queries(seed: int = 0, shape=(3, 5)) -> torch.Tensor:
    """Queries with a large component every token shares and features that vary together (what whitening undoes)."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(FEATURES, generator=generator) * 4
    mixing = torch.randn(FEATURES, FEATURES, generator=generator)
    return common + torch.randn(*shape, FEATURES, generator=generator) @ mixing


@pytest.mark.parametrize("mode", ["batch_norm", "batch_whiten"])
def test_training_uses_the_batch_statistics_without_padded_tokens(mode):
    """The batch's mean and its covariance (padding left out), the covariance mixed with the running one as if that
    were P more tokens: the batch weighs N / (N + P), here 13 / 16 (the running covariance starts as the identity)."""
    norm = _norm(mode).train()
    query, mask = _queries(), torch.ones(3, 5)
    mask[0, :2] = 0
    output = _gathering(norm, query, mask)
    real = query[mask.bool()].double()
    trust = 13 / (13 + BLOCK_DIM)
    mean = real.mean(0)  # gradients flow through the batch's mean (and the variance, for BatchNorm)
    spread = (real - mean).view(-1, BLOCKS, BLOCK_DIM)
    identity = torch.eye(BLOCK_DIM, dtype=torch.float64)
    covs = [trust * spread[:, g].T @ spread[:, g] / len(real) + (1 - trust) * identity for g in range(BLOCKS)]
    expected = (real - mean).view(-1, BLOCKS, BLOCK_DIM)
    for g, cov in enumerate(covs):
        if mode == "batch_norm":
            expected[:, g] = expected[:, g] / (torch.diagonal(cov) + 1e-5).sqrt()
        else:  # each block's covariance, shrunk towards its median eigenvalue, is the identity after
            eigenvalues, eigenvectors = torch.linalg.eigh(cov)
            shrunk = 0.99 * eigenvalues + 0.01 * eigenvalues.median() + 1e-5
            expected[:, g] = expected[:, g] @ eigenvectors @ torch.diag(shrunk.rsqrt()) @ eigenvectors.T
    torch.testing.assert_close(output[mask.bool()].double(), expected.flatten(1), rtol=1e-4, atol=1e-4)
    sums = norm.pending_sums()  # about the running mean, zero here
    assert sums.dtype == torch.float64 and int(sums[-1]) == 13
    torch.testing.assert_close(sums[:FEATURES] / 13, real.mean(0))


def test_whitening_keeps_the_small_directions_beside_a_massive_one():
    """Tokens that vary along one direction 1,000 times more than along the others (measured on tiny-memoryplus: 93%
    of its memory input's variance along one direction): every direction leaves with unit variance. Shrinking towards
    the mean eigenvalue, which the massive direction sets, flattened the others and the query was rank one; raw
    moments lost the small directions to float32 cancellation against the shared component (moments are taken about
    the running mean, so from the second batch on)."""
    generator = torch.Generator().manual_seed(0)
    block_dim, tokens = 16, 4096
    direction = torch.nn.functional.normalize(torch.randn(block_dim, generator=generator), dim=0)
    query = torch.randn(tokens, block_dim, generator=generator) * 1e-3
    query += 1.0 * torch.randn(tokens, 1, generator=generator) * direction + 5.0 * direction
    norm = QueryNormalization(1, block_dim, "batch_whiten", momentum=0.1, eps=1e-12).train()
    _gathering(
        norm, query.unsqueeze(0) + 0.01, torch.ones(1, tokens)
    )  # a first batch: the running mean the moments are about
    update_running_statistics([norm])
    output = norm(query.unsqueeze(0), torch.ones(1, tokens)).squeeze(0).double()
    eigenvalues = torch.linalg.eigvalsh(torch.cov(output.T))
    assert eigenvalues.min() > 0.9 and eigenvalues.max() < 1.1, eigenvalues


@pytest.mark.parametrize("mode", ["running_center", "running_whiten"])
def test_running_modes_are_per_token_in_training_too(mode):
    """The running modes compute in training what inference computes: a token's query never depends on the other
    tokens of its batch."""
    norm = _norm(mode).train()
    norm.running_mean.normal_()
    norm.whitening.add_(torch.randn_like(norm.whitening), alpha=0.3)
    query = _queries()
    alone = norm(query[:1, :1])
    together = norm(query)
    torch.testing.assert_close(together[:1, :1], alone)
    torch.testing.assert_close(alone, norm.eval()(query[:1, :1]))


@pytest.mark.parametrize("mode", ["batch_whiten", "running_whiten"])
def test_statistics_fold_at_the_next_training_forward_cumulatively_then_with_momentum(mode):
    """Mean and covariance average cumulatively, then with the momentum; the covariance is the spread about the mean
    the forward subtracted (the batch's, or the running one), and the whitening matrix its shrunk inverse square root."""
    norm = _norm(mode, momentum=0.25).train()
    mean, cov = torch.zeros(FEATURES), torch.eye(BLOCK_DIM).repeat(BLOCKS, 1, 1)
    for step in range(1, 7):
        query = _queries(seed=step).flatten(0, 1)
        before = norm.running_mean.clone()
        _gathering(norm, query)
        torch.testing.assert_close(norm.running_mean, before)  # not inside the forward
        centre = query.mean(0) if mode == "batch_whiten" else mean
        spread = (query - centre).view(-1, BLOCKS, BLOCK_DIM)
        weight = max(0.25, 1 / step)  # 1, 1/2, 1/3, then the momentum
        mean = mean.lerp(query.mean(0), weight)
        cov = cov.lerp(torch.einsum("ngi,ngj->gij", spread, spread) / len(query), weight)
        update_running_statistics([norm])
    torch.testing.assert_close(norm.running_mean, mean)
    torch.testing.assert_close(norm.running_cov, cov, rtol=1e-4, atol=1e-4)
    assert int(norm.batches_tracked) == 6 and norm.pending is None
    for cov, whitening in zip(norm.running_cov, norm.whitening):
        shrunk = 0.99 * cov + (0.01 * torch.linalg.eigvalsh(cov).median() + 1e-5) * torch.eye(BLOCK_DIM)
        torch.testing.assert_close(whitening @ shrunk @ whitening, torch.eye(BLOCK_DIM), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["running_center", "batch_norm", "batch_whiten", "running_whiten"])
def test_a_trained_model_reads_one_token_as_its_batch_does(mode):
    """At inference every mode uses the running statistics: a sequence alone gives the logits it gets in a batch."""
    config = small_config(query_norm=mode)
    torch.manual_seed(0)
    model = UltraMemForCausalLM(config).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # the statistics fold after each optimizer step
    input_ids = torch.randint(1, config.vocab_size, (4, 9))
    for _ in range(3):
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
    statistics = model.model.memory_layers[0].query.across_tokens
    assert statistics.running_mean.abs().sum() > 0 and int(statistics.batches_tracked) == 3
    model.eval()
    with torch.no_grad():
        batch = model(input_ids).logits
        alone = model(input_ids[1:2]).logits
    torch.testing.assert_close(alone, batch[1:2], rtol=1e-5, atol=1e-5)


def test_saved_configs_without_the_field_load_as_before_it(tmp_path):
    config = small_config()
    assert config.query_norm == "batch_whiten"  # new configs get the fix
    saved = config.to_dict()
    del saved["query_norm"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = UltraMemConfig.from_pretrained(tmp_path)
    assert loaded.query_norm == "none"
    assert UltraMemForCausalLM(loaded).model.memory_layers[0].query.across_tokens is None
    assert UltraMemConfig.from_pretrained(tmp_path, query_norm="batch_norm").query_norm == "batch_norm"


def test_bad_mode_and_momentum_are_one_line_errors():
    with pytest.raises(ValueError, match=r"query_norm='layer'.*one of"):
        small_config(query_norm="layer")
    with pytest.raises(ValueError, match=r"query_norm_momentum=0.*\(0, 1\]"):
        small_config(query_norm_momentum=0)
    assert set(QUERY_NORMS) == {"none", "running_center", "batch_norm", "batch_whiten", "running_whiten"}


def test_a_bfloat16_model_still_gathers_in_float64():
    """The pending sums are no buffers: a model cast to bfloat16 still counts and sums its tokens exactly."""
    norm = _norm("running_whiten", momentum=1.0).to(torch.bfloat16).train()
    query = _queries(shape=(1, 1001)).to(torch.bfloat16)
    _gathering(norm, query)
    assert norm.pending_sums().dtype == torch.float64 and norm.pending_sums()[-1] == 1001
    torch.testing.assert_close(norm.pending_sums()[:FEATURES], query.double().flatten(0, 1).sum(0))


def _two_ranks(rank: int, port: int, mode: str, queries: torch.Tensor, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        norm = _norm(mode, momentum=0.5).train()
        mine = (queries[:1] if rank == 0 else queries[1:]).clone().requires_grad_()  # 5 and 10 tokens
        output = _gathering(norm, mine)
        (output * _upstream(output.shape, rank)).sum().backward()
        update_running_statistics([norm])
        results[rank] = (output.detach(), mine.grad, norm.running_mean.clone(), norm.running_cov.clone())
    finally:
        dist.destroy_process_group()


def _upstream(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["batch_whiten", "batch_norm", "running_whiten"])
def test_ranks_compute_what_one_process_holding_the_global_batch_does(mode):
    """Batch statistics and running ones are summed over the process group (uneven token counts): outputs, gradients
    and the folded statistics of each rank are those of one process holding every rank's tokens."""
    queries = _queries(shape=(3, 5))
    port = 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_ranks, args=(port, mode, queries, results), nprocs=2)
        per_rank = dict(results)
    one = _norm(mode, momentum=0.5).train()
    whole = queries.clone().requires_grad_()
    output = _gathering(one, whole)
    upstream = torch.cat([_upstream(output[:1].shape, 0), _upstream(output[1:].shape, 1)])
    (output * upstream).sum().backward()
    update_running_statistics([one])
    for rank, part in ((0, slice(0, 1)), (1, slice(1, 3))):
        rank_output, rank_grad, mean, cov = per_rank[rank]
        torch.testing.assert_close(rank_output, output[part].detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rank_grad, whole.grad[part], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mean, one.running_mean)
        torch.testing.assert_close(cov, one.running_cov, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["running_center", "batch_norm", "batch_whiten", "running_whiten"])
def test_inference_folds_the_normalisation_into_the_projection(mode):
    """At inference the normalisation is linear (running statistics), so the memory query folds it into its projection:
    one GEMM gives what the projection then the normalisation give, for every mode, from trained statistics."""
    norm = _norm(mode).train()
    for step in range(3):
        _gathering(norm, _queries(seed=step).flatten(0, 1))
        update_running_statistics([norm])
    norm.eval()
    generator = torch.Generator().manual_seed(5)
    weight, x = torch.randn(FEATURES, 7, generator=generator), torch.randn(4, 7, generator=generator)
    folded_weight, bias = norm.folded(weight)
    assert norm.running_mean.abs().sum() > 0
    torch.testing.assert_close(torch.nn.functional.linear(x, folded_weight, bias), norm(x @ weight.T))


def test_the_folded_projection_follows_new_statistics_and_zero3_weights_stay_unfolded():
    """The folded projection is cached at inference like the keys: a change of the running statistics in place is
    seen at the next forward. A weight ZeRO-3 partitions runs unfolded, through the projection's own forward (an
    adapter on the projection: tests/model/test_peft.py)."""
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(query_norm="batch_whiten")).eval()
    input_ids = torch.randint(1, 97, (2, 6))
    with torch.no_grad():
        before = model(input_ids).logits
        for layer in model.model.memory_layers:
            layer.query.across_tokens.running_mean.add_(0.5)
        after = model(input_ids).logits
    with torch.enable_grad():  # grad mode bypasses the cache: the same computation from the current statistics
        fresh = model(input_ids).logits.detach()
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)
    query = model.model.memory_layers[0].query
    query.proj.weight.ds_id = 0  # as ZeRO-3 marks the parameters it partitions: whole only inside proj's forward
    assert query.cached_entries() == {}
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, after)  # unfolded: the same query, up to rounding
