"""Offloaded value tables (`memory_offload="cpu" | "disk"`, ultramem.offload): same tokens, only selected rows read."""

import copy
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_support import greedy_static_cache, small_config
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.testing_utils import CaptureLogger

from ultramem import UltraMemConfig, UltraMemConfigError, UltraMemForCausalLM
from ultramem.diagnostics import retrieval_diagnostics
from ultramem.offload import DiskValueStore, HostValueStore, OffloadCheckpointError, SafetensorsCheckpoint
from ultramem.offload.random_checkpoint import write_random_checkpoint
from ultramem.offload.stores import logger as stores_logger
from ultramem.value_stores import MemoryValueTable, offloaded_by_accelerate
from ultramem.value_stores import logger as modeling_logger

OFFLOADS = ("cpu", "disk")
PROMPT = {
    "input_ids": torch.tensor([[0, 0, 5, 9, 3, 44], [8, 1, 7, 2, 6, 90]]),
    "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),  # left padded
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, UltraMemForCausalLM]:
    folder = tmp_path_factory.mktemp("offload")
    torch.manual_seed(3)
    model = UltraMemForCausalLM(small_config(query_conv_kernel_size=3)).eval()
    model.save_pretrained(folder)
    return folder, model


def greedy(model, **kwargs) -> torch.Tensor:
    return model.generate(**PROMPT, max_new_tokens=10, do_sample=False, **kwargs)


@pytest.mark.numerics
@pytest.mark.parametrize("offload", OFFLOADS)
def test_generation_equals_in_memory_model_dynamic_cache(saved, offload):
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload=offload).eval()
    store = HostValueStore if offload == "cpu" else DiskValueStore
    assert all(type(layer.values) is store for layer in model.model.memory_layers)
    torch.testing.assert_close(model(**PROMPT).logits, reference(**PROMPT).logits, rtol=0, atol=0)
    assert torch.equal(greedy(model), greedy(reference))
    for layer in model.model.memory_layers:  # the synchronous path gives the same tokens
        layer.values.asynchronous = False
    assert torch.equal(greedy(model), greedy(reference))


@pytest.mark.numerics
@pytest.mark.parametrize("offload", OFFLOADS)
def test_generation_equals_in_memory_model_static_cache(saved, offload):
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload=offload).eval()
    assert torch.equal(greedy_static_cache(model, PROMPT, 10), greedy_static_cache(reference, PROMPT, 10))


@pytest.mark.parametrize("offload", OFFLOADS)
def test_retrieval_diagnostics_of_an_offloaded_model_are_the_in_memory_models(saved, offload):
    """The diagnostics read each layer's output where it leaves the layer: an offloaded store's background read
    skips the layer's own call, which the diagnostics used to hook (KeyError 'layer')."""
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload=offload).eval()
    batch = {"input_ids": PROMPT["input_ids"], "attention_mask": PROMPT["attention_mask"]}
    assert retrieval_diagnostics(model, **batch) == pytest.approx(retrieval_diagnostics(reference, **batch))


@pytest.mark.numerics
def test_generation_with_cache_implementation_static(saved):
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload="disk").eval()
    assert torch.equal(greedy(model, cache_implementation="static"), greedy(reference, cache_implementation="static"))


@pytest.mark.numerics
def test_only_the_selected_rows_are_read(saved):
    """An instrumented read: each store gathers exactly the distinct rows the layer selected, once per step."""
    folder, _ = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload="disk").eval()
    selected = {i: [] for i in range(len(model.model.memory_layers))}
    for i, layer in enumerate(model.model.memory_layers):
        physical = layer.value_expansion.physical_slots
        layer.value_expansion.physical_slots = lambda v, i=i, f=physical: selected[i].append(f(v)[0]) or f(v)
    model(**PROMPT)
    for i, layer in enumerate(model.model.memory_layers):
        assert layer.values.rows_read == selected[i][0].unique().numel() < layer.values.num_embeddings


def _resident_pages(tensor: torch.Tensor) -> torch.Tensor:
    """Which pages of `tensor`'s mapped bytes are in the page cache (mincore)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = (length + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0, os.strerror(ctypes.get_errno())
    return torch.tensor(list(vector), dtype=torch.uint8) & 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and fadvise")
def test_disk_table_pages_that_were_not_selected_never_become_resident(tmp_path):
    """A 4 MB file-backed table, evicted from the page cache: after a forward only pages of selected rows are in it."""
    torch.manual_seed(0)
    config = small_config(memory_num_keys=128, memory_value_dim=256, memory_layers=[[0, 2]])
    UltraMemForCausalLM(config).save_pretrained(tmp_path)
    model = UltraMemForCausalLM.from_pretrained(tmp_path, memory_offload="disk").eval()
    for tensor in [*model.parameters(), *model.buffers()]:  # the loader may map the other weights from the same
        tensor.data = tensor.data.clone()  # file, and their read-ahead would reach the table's pages
    with open(tmp_path / "model.safetensors", "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    table = model.model.memory_layers[0].values.table
    before = _resident_pages(table)  # a few pages may stay, held by mappings of the loader
    if before.sum() > before.numel() // 10:  # e.g. tmpfs, where pages cannot be evicted
        pytest.skip("this filesystem keeps the file's pages resident")
    rows = []
    physical = model.model.memory_layers[0].value_expansion.physical_slots
    model.model.memory_layers[0].value_expansion.physical_slots = lambda v: rows.append(physical(v)[0]) or physical(v)
    model(input_ids=torch.tensor([[5, 9, 3]]))
    row_bytes = table.shape[1] * table.element_size()
    first_byte = table.data_ptr() % mmap.PAGESIZE
    expected = torch.zeros_like(_resident_pages(table))
    for row in rows[0].unique().tolist():
        start = first_byte + row * row_bytes
        expected[start // mmap.PAGESIZE : (start + row_bytes - 1) // mmap.PAGESIZE + 1] = 1
    read = _resident_pages(table) & ~before.bool()
    assert 0 < read.sum() <= expected.sum() < read.numel() // 10
    assert not (read & ~expected.bool()).any()  # no page outside the selected rows was read


@pytest.mark.numerics
@pytest.mark.parametrize("offload", OFFLOADS)
def test_save_pretrained_of_an_offloaded_model_writes_an_ordinary_checkpoint(saved, offload, tmp_path):
    folder, reference = saved
    UltraMemForCausalLM.from_pretrained(folder, memory_offload=offload).save_pretrained(tmp_path)
    assert "memory_offload" not in json.loads((tmp_path / "config.json").read_text())
    model = UltraMemForCausalLM.from_pretrained(tmp_path)
    assert all(isinstance(layer.values, MemoryValueTable) for layer in model.model.memory_layers)
    torch.testing.assert_close(model(**PROMPT).logits, reference(**PROMPT).logits, rtol=0, atol=0)


REMOTE_SCRIPT = """
import sys, torch
if sys.argv[2] == "without-ultramem":
    sys.modules["ultramem"] = None
from transformers import AutoModelForCausalLM
try:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, memory_offload="disk").eval()
except ImportError as error:
    print("ERROR", error)
    sys.exit(0)
print("STORES", type(model).__module__, {type(layer.values).__name__ for layer in model.model.memory_layers})
tokens = model.generate(**torch.load(sys.argv[1] + "/prompt.pt"), max_new_tokens=10, do_sample=False)
torch.save(tokens, sys.argv[1] + "/tokens.pt")
"""


def test_sharded_checkpoint_through_the_remote_code_class(saved, tmp_path):
    """Tables found through the shard index; the `trust_remote_code` copy of the model (a fresh process that never
    imported `ultramem`) uses the package's stores, or says it needs the package when it is not importable."""
    folder, reference = saved
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    torch.save(PROMPT, tmp_path / "prompt.pt")
    run = lambda mode: (
        subprocess.run(  # noqa: E731
            [sys.executable, "-c", REMOTE_SCRIPT, str(tmp_path), mode], capture_output=True, text=True, check=True
        ).stdout
    )
    assert "STORES transformers_modules" in run("with-ultramem") and "{'DiskValueStore'}" in run("with-ultramem")
    assert torch.equal(torch.load(tmp_path / "tokens.pt"), greedy(reference))
    assert "memory_offload='disk' needs the `ultramem` package installed" in run("without-ultramem")


@pytest.mark.numerics
@pytest.mark.parametrize("offload", OFFLOADS)
def test_training_through_an_offloaded_store_leaves_the_tables_and_says_so(saved, offload):
    """Every other weight trains (the scores carry gradients back to queries, keys and cores); the table does not."""
    folder, _ = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload=offload).train()
    store = model.model.memory_layers[0].values
    table, cores = store.table.clone(), model.model.memory_layers[0].retrieval.cores.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stores_logger.warning_once.cache_clear()  # said once per process
    with CaptureLogger(stores_logger) as captured:
        model(**PROMPT, labels=PROMPT["input_ids"]).loss.backward()
    optimizer.step()
    assert "read-only" in captured.out
    assert torch.equal(store.table, table)
    assert not torch.equal(model.model.memory_layers[0].retrieval.cores, cores)


def test_deepcopy_of_a_disk_offloaded_model_shares_the_mapped_tables(saved):
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload="disk").eval()
    clone = copy.deepcopy(model)
    for original, copied in zip(model.model.memory_layers, clone.model.memory_layers):
        assert copied.values is not original.values and copied.values.table is original.values.table
        assert copied.query.proj.weight.data_ptr() != original.query.proj.weight.data_ptr()
    assert torch.equal(greedy(clone), greedy(reference))


def test_set_value_store_cpu_offloads_an_in_memory_model(saved):
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder).eval()
    model.set_value_store("cpu")
    assert torch.equal(greedy(model), greedy(reference))


def test_set_value_store_disk_writes_an_in_memory_models_tables_and_maps_them(saved, tmp_path):
    """The tables go to one file each in the named folder and are served from its map; writing another model's
    tables there later replaces the files without changing what the first model reads."""
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder).eval()
    model.set_value_store("disk", directory=tmp_path / "tables")
    names = model.get_value_table_names()
    assert sorted(path.name for path in (tmp_path / "tables").iterdir()) == sorted(f"{n}.safetensors" for n in names)
    assert all(type(layer.values) is DiskValueStore for layer in model.model.memory_layers)
    assert set(model.state_dict()) == set(reference.state_dict())
    assert torch.equal(greedy(model), greedy(reference))

    other = UltraMemForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        for layer in other.model.memory_layers:
            layer.values.weight.neg_()
    other.set_value_store("disk", directory=tmp_path / "tables")
    assert torch.equal(other.model.memory_layers[0].values.table, -reference.model.memory_layers[0].values.weight)
    assert torch.equal(greedy(model), greedy(reference))


def test_bad_inputs_fail_with_one_clear_error(saved, tmp_path):
    folder, reference = saved
    (tmp_path / "bin").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "bin")
    torch.save(reference.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(OffloadCheckpointError, match="needs the checkpoint in safetensors .* has neither"):
        UltraMemForCausalLM.from_pretrained(tmp_path / "bin", memory_offload="disk")
    invalid = r"memory_offload='gpu' is invalid: must be one of \(None, 'cpu', 'disk'\)"
    with pytest.raises(UltraMemConfigError, match=invalid):
        UltraMemForCausalLM.from_pretrained(folder, memory_offload="gpu")
    with pytest.raises(RuntimeError, match="attaches the value tables in from_pretrained"):
        UltraMemForCausalLM(small_config(memory_offload="disk"))(**PROMPT)
    with pytest.raises(OffloadCheckpointError, match=r"pass set_value_store\('disk', directory=\.\.\.\)"):
        UltraMemForCausalLM(small_config()).set_value_store("disk")
    with pytest.raises(OffloadCheckpointError, match="has no table in memory to write"):
        UltraMemForCausalLM(small_config(memory_offload="disk")).set_value_store("disk", directory=tmp_path / "t")


def test_random_checkpoint_streams_tables_and_checks_disk_space(tmp_path, monkeypatch):
    config = small_config(memory_num_keys=32)
    write_random_checkpoint(config, tmp_path / "ckpt", torch.bfloat16)
    checkpoint = SafetensorsCheckpoint.find(tmp_path / "ckpt")
    assert len({location.path for location in checkpoint.locations.values()}) == 1 + len(config.memory_layers)
    for name in UltraMemForCausalLM(config).get_value_table_names():
        table = checkpoint.read(name)
        assert table.shape == (config.memory_num_values, config.memory_value_dim) and table.dtype == torch.bfloat16
        assert 0 < table.float().std() < 1
    memory = UltraMemForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    disk = UltraMemForCausalLM.from_pretrained(tmp_path / "ckpt", memory_offload="disk").eval()
    assert torch.equal(greedy(memory), greedy(disk))
    assert UltraMemConfig.from_pretrained(tmp_path / "ckpt").memory_offload is None
    assert AutoTokenizer.from_pretrained(tmp_path / "ckpt")("The whale").input_ids  # the folder serves pipelines too
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(OSError, match=r"not enough disk space in .*: the checkpoint needs .* GB, 0.0 GB free"):
        write_random_checkpoint(config, tmp_path / "full", torch.bfloat16)


@pytest.mark.parametrize("entry", ["pipeline", "lm_eval"])
def test_memory_offload_reaches_the_model_from_pipeline_and_lm_eval(saved, entry, tmp_path):
    from ultramem.tokenization import load_tokenizer

    folder = shutil.copytree(saved[0], tmp_path / "with-tokenizer")
    load_tokenizer().save_pretrained(folder)
    if entry == "pipeline":
        from transformers import pipeline

        model = pipeline("text-generation", model=str(folder), model_kwargs={"memory_offload": "disk"}).model
    else:
        from lm_eval.models.huggingface import HFLM

        arguments = f"pretrained={folder},memory_offload=disk,trust_remote_code=True,dtype=float32"
        model = HFLM.create_from_arg_string(arguments, {"device": "cpu", "batch_size": 1}).model
    assert {type(layer.values).__name__ for layer in model.model.memory_layers} == {"DiskValueStore"}


@pytest.mark.numerics
def test_accelerate_device_map_disk_offload_matches_in_memory_model(saved, tmp_path):
    """Transformers' own big-model path (`device_map`, `max_memory`, `offload_folder`) runs the model: Accelerate's
    hooks load the offloaded value tables in their forward and the cores for the aux loss, and a warning points to
    `memory_offload`, which reads only the selected rows."""
    folder, reference = saved
    half = sum(p.numel() * p.element_size() for p in reference.parameters()) // 2
    with CaptureLogger(modeling_logger) as captured:
        model = UltraMemForCausalLM.from_pretrained(
            folder, device_map="auto", max_memory={"cpu": half}, offload_folder=tmp_path
        ).eval()
    placements = set(model.hf_device_map.values())
    assert "disk" in placements and len(placements) > 1, model.hf_device_map  # part kept in memory, part on disk
    assert any(offloaded_by_accelerate(layer.values) for layer in model.model.memory_layers)
    assert "reads only the selected rows" in captured.out
    output = model(**PROMPT)
    torch.testing.assert_close(output.logits, reference(**PROMPT).logits, rtol=0, atol=0)
    torch.testing.assert_close(model.model.aux_loss(), reference.model.aux_loss(), rtol=0, atol=0)
    assert torch.equal(greedy(model), greedy(reference))


def test_a_truncated_checkpoint_is_one_line_naming_the_file(saved, tmp_path):
    """A file cut by an interrupted copy: one line naming it, for both offloaded stores, before anything loads."""
    folder, _ = saved
    shutil.copytree(folder, tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    for offload in ("disk", "cpu"):
        with pytest.raises(
            OffloadCheckpointError, match=r"model\.safetensors: not a complete safetensors file .*truncated"
        ):
            AutoModelForCausalLM.from_pretrained(tmp_path / "cut", memory_offload=offload)
