"""PEFT/LoRA on an UltraMem model, on the target modules the README documents, trained with the Trainer."""

from pathlib import Path

import pytest
import torch
from model_support import small_config
from transformers import Trainer, TrainingArguments, default_data_collator

from ultramem import UltraMemForCausalLM

peft = pytest.importorskip("peft")

# The README's list: attention and MLP projections, the memory layers' query projection (`query.proj`) and value
# projector (`value_expansion.projector`). The value tables stay frozen (see README).
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "proj", "projector"]


def test_lora_trains_only_the_adapters_and_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    UltraMemForCausalLM(small_config()).save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(
        UltraMemForCausalLM.from_pretrained(tmp_path / "base"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGET_MODULES, task_type="CAUSAL_LM"),
    )
    wrapped = {name.removesuffix(".base_layer") for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert {name.rsplit(".", 1)[-1] for name in wrapped} == set(TARGET_MODULES)
    assert any(".query.proj" in name for name in wrapped)
    assert any(".value_expansion.projector" in name for name in wrapped)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    tokens = torch.randint(1, 97, (8, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = TrainingArguments(tmp_path / "run", max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator).train()

    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable and all("lora_" in name for name in trainable)
    assert any("query.proj.lora_B" in name for name in changed)  # the memory layers' adapters learn too

    model.eval()
    with torch.no_grad():
        trained_logits = model(input_ids=tokens[:2]).logits
    model.save_pretrained(tmp_path / "adapter")
    saved = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert saved == ["README.md", "adapter_config.json", "adapter_model.safetensors"]  # the adapters only
    base = UltraMemForCausalLM.from_pretrained(tmp_path / "base")
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=tokens[:2]).logits, trained_logits)


def test_lora_on_the_value_tables_is_refused_and_modules_to_save_trains_them() -> None:
    input_ids = torch.randint(1, small_config().vocab_size, (2, 8))
    lora = peft.get_peft_model(UltraMemForCausalLM(small_config()), peft.LoraConfig(r=2, target_modules=["values"]))
    with pytest.raises(ValueError, match=r"PEFT adapters cannot target the value tables \(`values`\)"):
        lora(input_ids=input_ids)
    saved = peft.get_peft_model(
        UltraMemForCausalLM(small_config()), peft.LoraConfig(r=2, target_modules=["proj"], modules_to_save=["values"])
    )
    saved(input_ids=input_ids, labels=input_ids).loss.backward()
    copies = [p for name, p in saved.named_parameters() if "values.modules_to_save" in name]
    assert copies and all(p.grad is not None and p.grad.abs().sum() > 0 for p in copies)


def test_an_adapter_on_the_query_projection_is_not_folded_away_at_inference() -> None:
    """At inference the query's normalisation is folded into a plain projection's weight; a LoRA-wrapped projection is
    not an nn.Linear and runs its own forward, so the adapter's delta stays in the query."""
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(query_norm="batch_whiten")).eval()
    input_ids = torch.randint(1, 97, (2, 6))
    with torch.no_grad():
        plain = model(input_ids).logits
    config = peft.LoraConfig(target_modules=["query.proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config).eval()
    query = lora.base_model.model.model.memory_layers[0].query
    assert query.cached_entries() == {}
    with torch.no_grad():
        adapted = lora(input_ids=input_ids).logits
    assert not torch.allclose(adapted, plain, rtol=1e-3, atol=1e-3)
