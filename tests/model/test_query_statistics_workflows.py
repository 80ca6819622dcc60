"""The query's statistics in the workflows that follow pretraining: `generate` after `Trainer.train()` (which leaves the
model in train mode), gradient accumulation, batches of a few tokens. They change only in a training forward with
gradients and fold once per optimizer step, for the default (`batch_whiten`) and the running mode alike."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from model_support import small_config
from transformers import Trainer, TrainingArguments, default_data_collator

from ultramem import UltraMemForCausalLM
from ultramem.presets import get_config
from ultramem.query_normalization import QueryNormalization
from ultramem.sizing import build_model

MODES = ["batch_whiten", "running_whiten"]


def _statistics(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers() if ".across_tokens." in name}


def _trained(model: torch.nn.Module, steps: int, shape: tuple[int, int]) -> torch.nn.Module:
    """`steps` AdamW steps on random tokens: running statistics that are not the identity."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        input_ids = torch.randint(3, model.config.vocab_size, shape, generator=generator)
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("mode", MODES)
def test_generate_after_trainer_train_changes_no_statistic_and_decodes_as_in_eval_mode(tmp_path, mode):
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(query_norm=mode))
    tokens = torch.randint(1, 97, (16, 16), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(tmp_path, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in tokens]
    Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator).train()
    assert model.training  # as the Trainer leaves it
    trained = _statistics(model)
    assert int(trained["model.memory_layers.0.query.across_tokens.batches_tracked"]) == 4  # folded after each step
    prompt = tokens[:2, :5]
    in_train_mode = [model.generate(prompt, max_new_tokens=6, do_sample=False) for _ in range(3)]
    assert model.training
    for name, buffer in _statistics(model).items():
        torch.testing.assert_close(buffer, trained[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        train_mode_logits = model(tokens[:2]).logits
    model.eval()
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert all(torch.equal(output, expected) for output in in_train_mode)
    with torch.no_grad():
        torch.testing.assert_close(train_mode_logits, model(tokens[:2]).logits)


@pytest.mark.parametrize("mode", MODES)
def test_accumulated_micro_batches_gather_the_statistics_of_their_union(mode):
    """Four micro-batches of one sequence and one batch of four gather the same pending sums, which fold once, after
    the optimizer's step. With the default the gradients are the full batch's too; with batch statistics each
    micro-batch is normalised by its own (the documented difference: docs/usage.md)."""
    model = _trained(UltraMemForCausalLM(small_config(query_norm=mode)), steps=3, shape=(4, 16))
    accumulated = copy.deepcopy(model)
    input_ids = torch.randint(1, 97, (4, 16), generator=torch.Generator().manual_seed(2))
    model(input_ids, labels=input_ids).loss.backward()
    for row in input_ids:
        (accumulated(row[None], labels=row[None]).loss / len(input_ids)).backward()
    norms = [[m for m in each.modules() if isinstance(m, QueryNormalization)] for each in (model, accumulated)]
    for whole, parts in zip(*norms):  # the micro-batches' sums add up to the batch's
        torch.testing.assert_close(parts.pending_sums(), whole.pending_sums(), rtol=1e-9, atol=1e-9)
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), accumulated.parameters()) if p.grad is not None]
    full, micro = (torch.cat([g.flatten() for g in side]) for side in zip(*grads))
    cosine = torch.nn.functional.cosine_similarity(full, micro, dim=0)
    if mode == "running_whiten":
        torch.testing.assert_close(micro, full, rtol=1e-4, atol=1e-6)
    else:
        assert cosine < 0.9999, cosine
    torch.optim.SGD([*model.parameters(), *accumulated.parameters()], lr=0.0).step()  # folds both, once
    for name, buffer in _statistics(accumulated).items():
        torch.testing.assert_close(buffer, _statistics(model)[name], rtol=1e-6, atol=1e-7, msg=name)


@functools.cache
def _gradient_norm_at_four_tokens(mode: str) -> float:
    """The whole gradient's norm for a batch of 4 tokens, `tiny-ultramem` after 6 steps of 4 x 64 tokens."""
    torch.manual_seed(0)
    config = get_config("tiny-ultramem")
    config.query_norm = mode
    model = _trained(build_model(config), steps=6, shape=(4, 64))
    input_ids = torch.randint(3, config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(4))
    model(input_ids, labels=input_ids).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()


@pytest.mark.parametrize("mode", MODES)
def test_a_few_tokens_do_not_blow_up_the_gradient(mode):
    """Four tokens: a 32-dimensional query part's batch covariance has rank 3, and whitening by it alone amplified the
    empty directions (gradient norm 87,000 against 12 without normalisation, tiny-ultramem after 10 steps). With the
    running statistics weighing as 32 more tokens, or alone, it stays within 3x of the unnormalised query's."""
    norm, unnormalised = _gradient_norm_at_four_tokens(mode), _gradient_norm_at_four_tokens("none")
    assert norm <= 3.0 * unnormalised, (norm, unnormalised)


@pytest.mark.parametrize("mode", MODES)
def test_tokens_the_loss_ignores_are_not_counted(mode):
    """Pads marked only by `labels=-100` (no attention mask, as a custom SFT loop may pad): the statistics gathered, and
    with batch statistics the normalisation of the real tokens, are those of the batch without the pads."""
    model = _trained(UltraMemForCausalLM(small_config(query_norm=mode)), steps=3, shape=(4, 16))
    padded_model = copy.deepcopy(model)
    input_ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    padded = torch.cat([input_ids, torch.zeros(2, 4, dtype=torch.long)], dim=1)  # right padding, pad id 0
    labels = torch.cat([input_ids, torch.full((2, 4), -100)], dim=1)
    plain = model(input_ids, labels=input_ids)
    with_pads = padded_model(padded, labels=labels)
    torch.testing.assert_close(with_pads.logits[:, :12], plain.logits, rtol=1e-5, atol=1e-5)
    norms = [[m for m in each.modules() if isinstance(m, QueryNormalization)] for each in (model, padded_model)]
    for real, pads in zip(*norms):
        assert int(pads.pending_sums()[-1]) == input_ids.numel()
        torch.testing.assert_close(pads.pending_sums(), real.pending_sums(), rtol=1e-5, atol=1e-6)  # fp32 queries
