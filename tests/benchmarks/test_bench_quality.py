"""Smoke test of benchmarks/bench_quality.py: two rows, a few real Trainer steps, and the committed row configs."""

import json
from contextlib import nullcontext
from pathlib import Path

import bench_quality
import pytest
import torch
import torch.nn.functional as F

from ultramem import UltraMemConfig, ablation
from ultramem.presets import get_config
from ultramem.sizing import build_model

SMOKE = [
    "--rows",
    "Dense,UltraMem",
    "--seeds",
    "1",
    "--max-steps",
    "3",
    "--batch-size",
    "2",
    "--block-size",
    "32",
    "--eval-points",
    "1",
    "--eval-blocks",
    "4",
    "--learning-rate",
    "3e-3",
]


@pytest.mark.parametrize("scale", sorted(bench_quality.COMPARISON))
def test_committed_configs_are_the_presets(scale):
    """Each committed row config builds what ultramem.presets builds today, and the committed training arguments are
    what the presets and the ladder recommend (rerun --write-configs after changing them)."""
    for _, _, config, path in bench_quality.row_files(scale):
        committed = bench_quality.built_config(json.loads(path.read_text()))
        assert bench_quality.config_dict(committed) == bench_quality.config_dict(config), f"{path} is stale"
    stored = bench_quality.CONFIG_DIR / scale / bench_quality.TRAINING_ARGUMENTS_FILE
    assert json.loads(stored.read_text()) == bench_quality.row_training_arguments(scale), f"{stored} is stale"


def test_tiny_ladder_ends_are_the_comparison_models():
    """At "tiny" the ladder's first and last rows are the PKM and UltraMem presets, so their runs are shared; every
    other row trains something of its own ("+value lr decay": the model of the row above, with the value LR decaying)."""
    loaded = {row.name: row for row in bench_quality.load_rows("tiny", "all")}
    rows = {name: row.key for name, row in loaded.items()}
    assert rows["PKM x10"] == rows["PKM"]
    assert rows["+query conv"] == rows["UltraMem"]
    # + Dense and MoE, + V2, V2 w/o PEER, Memory+, + the V2 ladder's rows between UltraMem and UltraMemV2, + the query
    # normalisation's other modes for UltraMem and "none" for V2 and Memory+ (their default rows are the presets), + the
    # n-gram shares 25%, 50% and 100% (0% is UltraMem)
    others = len(bench_quality.QUERY_NORMS) - 1 + 2 + 3
    assert len(set(rows.values())) == len(ablation.LADDER_ROWS) + 2 + 3 + len(ablation.V2_LADDER_ROWS) - 2 + others
    assert rows["n-gram share 0% (UltraMem)"] == rows["UltraMem"] and rows["MoE baseline"] == rows["MoE"]
    default = UltraMemConfig().query_norm
    assert rows[f"UltraMem (query_norm={default})"] == rows["UltraMem"]
    assert rows[f"UltraMemV2 (query_norm={default})"] == rows["UltraMemV2"]
    assert rows["V2 ladder: UltraMem"] == rows["UltraMem"] and rows["V2 ladder: +MLP rebalanced"] == rows["UltraMemV2"]
    assert rows["UltraMem (V1)"] == rows["UltraMem"] and rows["Dense baseline"] == rows["Dense"]
    decay, before = loaded["+value lr decay"], loaded["+improved init"]
    assert decay.config == before.config
    assert before.training_arguments == {**decay.training_arguments, "value_lr_decay": False}
    assert decay.training_arguments["value_lr_decay"] is True


def test_two_rows_train_and_report(tmp_path):
    out, cache = tmp_path / "results", tmp_path / "cache"
    argv = [*SMOKE, "--results-dir", str(out), "--cache-dir", str(cache)]
    result = json.loads(bench_quality.main(argv).read_text())

    table = {row["name"]: row for row in result["table"]}
    assert set(table) == {"Dense", "UltraMem"}
    assert table["Dense"]["counts"]["sparse"] == 0
    ultramem = table["UltraMem"]["counts"]
    assert (
        ultramem["sparse"] == ultramem["physical_values"] * 128
        and ultramem["dense"] == ultramem["total"] - ultramem["sparse"]
    )
    assert table["UltraMem"]["diff_to_reference"] == pytest.approx(
        table["UltraMem"]["val_loss"] - table["Dense"]["val_loss"]
    )
    for run in result["runs"]:
        first, last = run["curve"][0], run["curve"][-1]
        assert (first["step"], last["step"], last["tokens"]) == (0, 3, 3 * 2 * 32)
        assert last["val_loss"] < first["val_loss"] - 0.01, run["curve"]  # three steps at 3e-3 must lower the loss
    files = {name: str(path) for _, name, _, path in bench_quality.row_files("tiny")}
    assert [run["argv"][run["argv"].index("--config_file") + 1] for run in result["runs"]] == [
        files["Dense"],
        files["UltraMem"],
    ]
    ultramem_argv = result["runs"][1]["argv"]  # the row's training arguments are flags of its command line
    assert ultramem_argv[ultramem_argv.index("--value_lr_decay") + 1] == "true"
    assert result["runs"][1]["final_diagnostics"]["memory/slot_usage"] > 0

    markdown = (out / "quality_tiny.md").read_text()
    assert "| Dense | 1 |" in markdown and "| UltraMem | 1 |" in markdown
    assert (out / "quality_tiny_comparison.png").stat().st_size > 1000
    assert not (out / "quality_tiny_ladder.png").exists()  # no ladder rows were run

    # a second call with the same settings finds both runs recorded and trains nothing
    again = json.loads(bench_quality.main(argv).read_text())
    assert [run["wall_s"] for run in again["runs"]] == [run["wall_s"] for run in result["runs"]]
    (out / "quality_tiny.md").unlink()
    bench_quality.main([*argv, "--report-only"])
    assert (out / "quality_tiny.md").read_text() == markdown
    # other settings never overwrite recorded runs
    with pytest.raises(ValueError, match="holds runs made with other settings"):
        bench_quality.main([*argv, "--max-steps", "4"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval-points", "9", "--max-steps", "3"], "--eval-points 9: allowed range is 1..--max-steps (3)"),
        (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (["--learning-rate", "-1"], "--learning-rate -1.0: must be positive"),
    ],
)
def test_bad_flags_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_quality.parse_args(flags)
    assert message in capsys.readouterr().err


def test_unknown_row_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"--rows: unknown row\(s\) \['Nope'\]; allowed: all, comparison, ladder"):
        bench_quality.load_rows("tiny", "Nope")


def test_unknown_seeded_row_is_refused(tmp_path):
    argv = [*SMOKE, "--seeded-rows", "Dense,Ultramem", "--results-dir", str(tmp_path), "--cache-dir", str(tmp_path)]
    with pytest.raises(ValueError, match=r"--seeded-rows: unknown row\(s\) \['Ultramem'\]; allowed: all or"):
        bench_quality.main(argv)


def test_differences_pair_runs_by_seed():
    """Rows are compared seed by seed (same data order); unpaired means only when they share no seed."""
    diff, se = bench_quality._paired_difference({0: 2.0, 1: 3.0, 2: 9.0}, {0: 1.0, 1: 2.5})
    assert (diff, se) == (pytest.approx(0.75), pytest.approx(0.25))
    assert bench_quality._paired_difference({0: 2.0, 1: 4.0}, {2: 1.0}) == (2.0, None)
    assert bench_quality._paired_difference({0: 2.0}, None) == (None, None)


def test_corpus_is_the_shipped_one_unless_given(tmp_path, capsys):
    """The script needs nothing beside the clone: its default corpus is the Gutenberg slice the package ships."""
    from ultramem.training.data import embedded_corpus_files

    assert bench_quality.parse_args([]).corpus_dir == [Path(embedded_corpus_files()["train"]).parent]
    with pytest.raises(SystemExit):
        bench_quality.parse_args(["--corpus-dir", str(tmp_path)])
    assert f"--corpus-dir {tmp_path}: no train.jsonl.xz or valid.jsonl.xz" in capsys.readouterr().err


def test_validation_blocks_are_ultramem_trains_draw_across_the_split(tmp_path):
    """The runs evaluate on `ultramem-train`'s draw from a pool spread along the book, not on the pool's first blocks
    (Treasure Island's title page, poem and contents: about uniform guessing), the same blocks in every run."""
    from ultramem.tokenization import load_tokenizer
    from ultramem.training.data import embedded_corpus_files, load_raw_datasets, tokenize_and_pack

    corpus = [Path(embedded_corpus_files()["train"]).parent]
    pool = bench_quality.prepare_text(tmp_path, corpus, "valid", 32 * 128 * bench_quality.VALIDATION_POOL)
    row = bench_quality.load_rows("tiny", "Dense")[0]
    settings = dict(max_steps=4, batch_size=2, block_size=128, learning_rate=1e-3, eval_points=2, eval_blocks=32,
                    logging_steps=1, bf16=False)  # fmt: skip
    (_, data, _), _ = bench_quality.train_arguments(row, 0, settings, {"train": pool, "valid": pool}, tmp_path)
    tokenizer = load_tokenizer()
    blocks = tokenize_and_pack(load_raw_datasets(data), tokenizer, data, lambda desc: nullcontext())["validation"]
    assert len(blocks) == 32 and len(blocks[0]["input_ids"]) == 128
    text = tokenizer.decode(sum(blocks[:4]["input_ids"], []))
    assert "TREASURE ISLAND" not in text and "CONTENTS" not in text


@pytest.mark.parametrize("preset", ["tiny-ultramem", "tiny-moe"])
def test_evaluation_loss_is_the_language_model_cross_entropy_alone(preset):
    """`lm_loss_only`: in evaluation the loss without UltraMem's TDQKR aux loss or Mixtral's router loss; in training
    the model's own loss."""
    torch.manual_seed(0)
    model = build_model(get_config(preset)).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids)
        model.register_forward_hook(bench_quality.lm_loss_only)
        hooked = model(input_ids=ids, labels=ids).loss
        trained = model.train()(input_ids=ids, labels=ids).loss
    cross_entropy = F.cross_entropy(plain.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()
    assert hooked.item() == pytest.approx(cross_entropy, abs=1e-5)
    if preset == "tiny-moe":
        assert (plain.loss - hooked).item() == pytest.approx(0.01 * plain.aux_loss.item(), rel=1e-3)  # the router's
        assert trained.item() == pytest.approx(plain.loss.item(), abs=1e-5)  # training: the hook leaves it alone
