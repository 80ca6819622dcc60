"""Two processes on CPU (gloo): DDP (torchrun), ZeRO-2 (deepspeed launcher), ZeRO-3 and FSDP2 (accelerate launch with
the shipped configs) train like one process on the same global batch; ZeRO-3 and FSDP2 shard the parameters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from launch_support import base_args, losses, python_module, run_command, training_logs, write_config, write_corpus
from model_support import small_config
from transformers import AutoModelForCausalLM

STEPS, GLOBAL_BATCH = 6, 4
LOSS_TOLERANCE = 1e-4  # absolute, per logged step: fp32 reduction order differs between 1 and 2 processes
DIAGNOSTICS_BATCH = 2

# Runs the real CLI with a callback that records, on every rank, the ZeRO-3 partition of each value table
# (at train begin) and the logits of the trained model on fixed tokens (at train end, rank 0 writes them).
ZERO3_PROBE = """
import json, sys
from pathlib import Path
import torch
from transformers import TrainerCallback
from ultramem.training.cli import main

class Probe(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        params = dict(model.named_parameters())
        self.partition = {name: {"full": params[name].ds_numel, "local": params[name].ds_tensor.numel(),
                                 "shape": list(params[name].ds_shape)} for name in model.get_value_table_names()}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        out = Path(args.output_dir)
        (out / f"partition_{args.process_index}.json").write_text(json.dumps(self.partition))
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.arange(64).reshape(2, 32) * 97 % 50000).logits
        model.train()
        if args.process_index == 0:
            torch.save(logits, out / "rank0_logits.pt")

main(sys.argv[1:], callbacks=[Probe()])
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distributed")
    config, corpus = write_config(folder, aux_loss_alpha=10.0), write_corpus(folder)  # aux visible in the loss

    def argv(name: str, batch: int, diagnostics: int = 0) -> list[str]:
        # query_statistics_batches=0: the saved model is the one the run logged and probed (no recomputed statistics)
        return base_args(config, corpus, folder / name, max_steps=STEPS, per_device_train_batch_size=batch,
                         diagnostics_batch_size=diagnostics, query_statistics_batches=0)  # fmt: skip

    run_command(python_module("ultramem.training", *argv("single", GLOBAL_BATCH)))
    return folder, argv


def test_ddp_matches_single_process(setup):
    """...without DDP's search for unused parameters, which found none and warned so on every rank."""
    folder, argv = setup
    result = run_command(python_module("torch.distributed.run", "--nproc_per_node", "2", "-m", "ultramem.training",
                                       *argv("ddp", GLOBAL_BATCH // 2)))  # fmt: skip
    assert losses(folder / "ddp") == pytest.approx(losses(folder / "single"), abs=LOSS_TOLERANCE)
    assert "find_unused_parameters=True" not in result.stderr


def test_memory_parallel_plan_is_printed_once(setup):
    """The plan of --memory_parallel (its predicted communication volumes) was printed by every rank."""
    folder, argv = setup
    result = run_command(python_module("torch.distributed.run", "--nproc_per_node", "2", "-m", "ultramem.training",
                                       *argv("ddp-number", GLOBAL_BATCH // 2), "--memory_parallel", "number"))  # fmt: skip
    plans = [line for line in result.stderr.splitlines() if "memory_parallel=number over 2 ranks" in line]
    assert len(plans) == 1, result.stderr[-3000:]


def test_zero2_matches_single_process(setup):
    """...and leaves nothing in /dev/shm: DeepSpeed's CPU shared-memory all-reduce (which it never unlinks, 66 MB a
    rank under the `deepspeed` launcher) is not built for training."""
    folder, argv = setup
    result = run_command(["deepspeed", "--num_gpus", "2", "--module", "ultramem.training", "--deepspeed", "zero2",
                          *argv("zero2", GLOBAL_BATCH // 2)], DS_ACCELERATOR="cpu")  # fmt: skip
    assert losses(folder / "zero2") == pytest.approx(losses(folder / "single"), abs=LOSS_TOLERANCE)
    port = result.args[result.args.index("--master_port") + 1]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert "deepspeed_shm_comm" not in result.stdout + result.stderr


@pytest.fixture(scope="module")
def zero3(setup):
    folder, argv = setup
    script = folder / "zero3_probe.py"
    script.write_text(ZERO3_PROBE)
    run_command(["accelerate", "launch", "--config_file", "ultramem/configs/accelerate/zero3.yaml", str(script),
                 *argv("zero3", GLOBAL_BATCH // 2, DIAGNOSTICS_BATCH)], DS_ACCELERATOR="cpu")  # fmt: skip
    return folder / "zero3"


def test_zero3_partitions_every_value_table_in_halves(zero3):
    ranks = [json.loads((zero3 / f"partition_{rank}.json").read_text()) for rank in (0, 1)]
    config = json.loads((zero3 / "config.json").read_text())
    assert ranks[0] and ranks[0].keys() == ranks[1].keys()
    assert len(ranks[0]) == len(config["memory_layers"])
    for name, part in ranks[0].items():
        assert part["shape"] == [config["memory_num_values"], config["memory_value_dim"]]
        assert part["full"] == config["memory_num_values"] * config["memory_value_dim"]
        assert part["local"] == ranks[1][name]["local"] == part["full"] // 2


def test_zero3_trains_with_the_value_lr_group(zero3):
    """(Losses are not compared with the single process: `zero.Init` draws the initial weights differently.)"""
    logs = training_logs(zero3)
    assert logs[-1]["lm_loss"] < logs[0]["lm_loss"] - 0.2
    assert [entry["value_lr_multiplier"] for entry in logs] == pytest.approx(
        [10.0 - 9.0 * step / (STEPS - 1) for step in range(STEPS)]
    )
    for entry in logs[1:]:  # the optimizer's value group really runs at multiplier x base LR
        assert entry["value_learning_rate"] / entry["learning_rate"] == pytest.approx(entry["value_lr_multiplier"])


def test_zero3_consolidated_checkpoint_gives_the_training_ranks_logits(zero3):
    model = AutoModelForCausalLM.from_pretrained(zero3, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(64).reshape(2, 32) * 97 % 50000).logits
    torch.testing.assert_close(logits, torch.load(zero3 / "rank0_logits.pt"), rtol=1e-5, atol=1e-5)


def _single_process_diagnostics(checkpoint, argv: list[str]) -> dict[str, float]:
    """`retrieval_diagnostics` of the saved model, in this process, on the batch the run logged them for."""
    from ultramem.diagnostics import retrieval_diagnostics
    from ultramem.tokenization import load_tokenizer
    from ultramem.training.cli import parse_args
    from ultramem.training.data import load_raw_datasets, tokenize_and_pack

    _, data_args, training_args = parse_args(argv)
    raw = load_raw_datasets(data_args)
    blocks = tokenize_and_pack(raw, load_tokenizer(), data_args, training_args.main_process_first)
    input_ids = torch.tensor(blocks["validation"][:DIAGNOSTICS_BATCH]["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    return {f"memory/{name}": value for name, value in retrieval_diagnostics(model, input_ids).items()}


def test_zero3_logs_the_memory_diagnostics_of_the_unpartitioned_model(setup, zero3):
    """They used to be skipped under ZeRO-3: every rank now gathers the keys and cores; at the last step (the saved
    weights) they equal those of the consolidated checkpoint in one process."""
    _, argv = setup
    logs = training_logs(zero3)
    expected = _single_process_diagnostics(zero3, argv("zero3", GLOBAL_BATCH // 2, DIAGNOSTICS_BATCH))
    assert all(set(expected) <= set(entry) for entry in logs)
    assert {name: logs[-1][name] for name in expected} == pytest.approx(expected, rel=1e-4, abs=1e-5)


ZERO_INIT_SCALES = """
import dataclasses, json, sys
import deepspeed, torch
sys.path.insert(0, "tests")
from model_support import small_config
from ultramem.modeling_ultramem import MemoryInitScales
deepspeed.init_distributed(dist_backend="gloo")
ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
with deepspeed.zero.Init(dtype=torch.bfloat16, config_dict_or_path=ds_config):  # as Transformers under ZeRO-3 + bf16
    scales = MemoryInitScales.from_config(small_config())
print(json.dumps(dataclasses.asdict(scales)))
"""


def test_init_scales_under_zero3_bf16_equal_the_single_process_ones(tmp_path):
    """`zero.Init` casts what torch.randn makes to its dtype: the sampled MCS init gain's SVD then had no bfloat16
    kernel, and ZeRO-3 with --bf16 failed to build any UltraMem model."""
    from ultramem.modeling_ultramem import MemoryInitScales

    script = tmp_path / "zero_init_scales.py"
    script.write_text(ZERO_INIT_SCALES)
    result = run_command(["torchrun", "--nproc_per_node", "1", str(script)], DS_ACCELERATOR="cpu")
    scales = json.loads(result.stdout.strip().splitlines()[-1])
    assert scales == dataclasses.asdict(MemoryInitScales.from_config(small_config()))


def test_fsdp2_config_shards_every_parameter(setup):
    """accelerate launch with the shipped FSDP2 config, 2 CPU processes (gloo): parameters are sharded DTensors, and
    the run logs the memory diagnostics."""
    folder, argv = setup
    result = run_command(["accelerate", "launch", "--config_file", "ultramem/configs/accelerate/fsdp2.yaml",
                          "-m", "ultramem.training", *argv("fsdp2", GLOBAL_BATCH // 2, DIAGNOSTICS_BATCH)])  # fmt: skip
    # FSDP2 warned that the model returned a view (the aux loss gathered from the sharded cores): a copy now
    assert "returned a view tensor" not in result.stderr
    report = [line for line in result.stdout.splitlines() if line.startswith("ultramem-train: FSDP2 shards")]
    assert len(report) == 1 and "over 2 processes ((Shard(dim=0),))" in report[0], result.stdout[-3000:]
    sharded, total = (int(word) for word in report[0].split()[3:6:2])
    assert sharded == total > 0
    assert losses(folder / "fsdp2") == pytest.approx(losses(folder / "single"), abs=LOSS_TOLERANCE)
    assert AutoModelForCausalLM.from_pretrained(folder / "fsdp2", trust_remote_code=True).num_parameters() > 0
    # the memory diagnostics (once skipped under FSDP) are those of the unsharded model at the saved weights
    expected = _single_process_diagnostics(folder / "fsdp2", argv("fsdp2", GLOBAL_BATCH // 2, DIAGNOSTICS_BATCH))
    logged = training_logs(folder / "fsdp2")[-1]
    assert {name: logged[name] for name in expected} == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_torchrun_fsdp_flag_shards_for_real_or_refuses_fsdp1(setup):
    """`torchrun ... --fsdp "full_shard auto_wrap"` used to train as DDP on CPU; it now shards (FSDP2, the default
    version), and FSDP1, which cannot shard there, is refused in one line."""
    folder, argv = setup
    launch = python_module("torch.distributed.run", "--nproc_per_node", "2", "-m", "ultramem.training")
    result = run_command([*launch, *argv("torchrun-fsdp", GLOBAL_BATCH // 2), "--fsdp", "full_shard auto_wrap"])
    assert "ultramem-train: FSDP2 shards" in result.stdout, result.stdout[-3000:]
    assert losses(folder / "torchrun-fsdp") == pytest.approx(losses(folder / "single"), abs=LOSS_TOLERANCE)
    command = [*launch, *argv("fsdp1", GLOBAL_BATCH // 2), "--fsdp", "full_shard auto_wrap",
               "--fsdp_config", '{"version": 1}']  # fmt: skip
    result = run_command(command, check=False)
    errors = {line for line in result.stderr.splitlines() if line.startswith("ultramem-train: error:")}
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert "--fsdp: FSDP1 does not shard on CPU process groups (it would run as DDP)" in errors.pop()
