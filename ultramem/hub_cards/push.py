"""`ultramem-push`: publish a checkpoint folder to the Hub in one commit.

    ultramem-push CKPT --repo-id USER/NAME [--private] [--revision BRANCH] [--results results.json] [--dry-run]

The commit holds the safetensors weights, config.json (with `auto_map`), the model code files that
`save_pretrained` copied next to them, the tokenizer and a generated model card. It goes through
`HfApi.create_commit` with one `CommitOperationAdd` per file: `upload_folder` would also send optimizer
states and, with hf_xet installed, bypass `create_commit`. Before anything is sent the repo id is checked, then
the folder (an UltraMem checkpoint: weights, code, tokenizer), then the scores, then the token. The checkpoint
folder is never written to: the card goes to the Hub only (`--dry-run` prints it and the files, sending nothing).

Scores (`--results`): the entry of an `ultramem-eval` results JSON whose `fingerprint` (SHA-256 of the config and
the safetensors bytes, recorded when it was scored) equals this checkpoint's; a results JSON written before
fingerprints were recorded is matched by the checkpoint's path instead. Any other entry, even the only one, is
refused: a card never shows another model's scores (or this folder's scores from before it changed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import validate_repo_id

from ultramem.eval.checkpoint import check_weights, fingerprint, require_checkpoint, require_tokenizer
from ultramem.eval.report import ModelResult, read_results
from ultramem.hub_cards.card import render_card, require_ultramem

WEIGHT_GLOBS = ("*.safetensors", "model.safetensors.index.json")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class PushError(ValueError):
    """The push cannot start: bad repo id, no token, or an incomplete checkpoint folder."""


def check_repo_id(repo_id: str) -> str:
    """`USER/NAME` as the Hub accepts it; the namespace is required so the target is never a guess."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise PushError(f"--repo-id {repo_id!r} is not a valid Hub repo id: {err}") from err
    if repo_id.count("/") != 1:
        raise PushError(f"--repo-id {repo_id!r}: expected USER/NAME (or ORG/NAME)")
    return repo_id


def require_token(token: str | None) -> str:
    found = token or get_token()
    if not found:
        raise PushError("no Hugging Face token: pass --token, set HF_TOKEN, or run `hf auth login`")
    return found


def files_to_push(folder: Path) -> list[Path]:
    """Weights, configs, code and tokenizer of the checkpoint; never optimizer states or pickles."""
    weights = sorted({p for pattern in WEIGHT_GLOBS for p in folder.glob(pattern)})
    if not any(p.suffix == ".safetensors" for p in weights):
        raise PushError(f"checkpoint {folder}: no *.safetensors weights (save with save_pretrained)")
    check_weights(folder, option="checkpoint")  # a truncated file is named before anything is sent
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    code = sorted(folder.glob("*.py"))
    if "auto_map" not in config or not code:
        raise PushError(f"checkpoint {folder}: config.json has no auto_map or the model code files are missing")
    require_tokenizer(folder, option="checkpoint")
    named = [folder / name for name in (*CONFIG_FILES, *TOKENIZER_FILES) if (folder / name).is_file()]
    return weights + named + code


def build_operations(folder: Path, card: str) -> list[CommitOperationAdd]:
    operations = [
        CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path)) for path in files_to_push(folder)
    ]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")))
    return operations


def prepare_push(
    checkpoint: str | Path,
    repo_id: str,
    result: ModelResult | None = None,
    settings: Mapping[str, Any] | None = None,
    datasets: Sequence[str] = (),
    base_model: str | None = None,
) -> tuple[Path, str, list[CommitOperationAdd]]:
    """Every local check of a push, and what it would send: (folder, card, operations). Nothing is written."""
    check_repo_id(repo_id)
    folder = require_ultramem(require_checkpoint(checkpoint, option="checkpoint"))
    card = render_card(folder, repo_id, result=result, settings=settings, datasets=datasets, base_model=base_model)
    return folder, card, build_operations(folder, card)


def push_checkpoint(
    checkpoint: str | Path,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    result: ModelResult | None = None,
    settings: Mapping[str, Any] | None = None,
    datasets: Sequence[str] = (),
    base_model: str | None = None,
) -> CommitInfo:
    """Push the checkpoint as one commit; the repo (and branch) are created when the first commit finds none."""
    folder, _, operations = prepare_push(checkpoint, repo_id, result, settings, datasets, base_model)
    api = HfApi(token=require_token(token))  # after the folder's checks: what can be fixed locally is said first
    message = f"Upload {folder.name} with ultramem-push"

    def commit() -> CommitInfo:
        return api.create_commit(repo_id, operations, commit_message=message, revision=revision, repo_type="model")

    try:
        return commit()
    except RepositoryNotFoundError:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    except RevisionNotFoundError:
        pass
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return commit()


def result_for(path: Path, checkpoint: Path) -> tuple[ModelResult, dict[str, Any]]:
    """The entry of an ultramem-eval results JSON that scored this checkpoint, and the run's settings.

    Matched by content (`fingerprint`: config + safetensors bytes); an entry without one (results JSON of an older
    ultramem-eval) by the checkpoint's resolved path. Never the only entry just because it is the only one.
    """
    try:
        results, settings = read_results(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PushError(f"--results {path}: not a results JSON of ultramem-eval ({err})") from err
    identity = fingerprint(checkpoint)
    for result in results:
        if result.fingerprint == identity:
            return result, settings
    here = checkpoint.resolve()
    for result in results:
        if result.fingerprint is None and Path(result.checkpoint).resolve() == here:
            return result, settings
    changed = [r for r in results if r.fingerprint is not None and Path(r.checkpoint).resolve() == here]
    if changed:
        raise PushError(
            f"--results {path}: its entry for {checkpoint} scored other files (config or weights changed since); "
            "score this checkpoint again with ultramem-eval"
        )
    names = ", ".join(f"{r.name} ({r.checkpoint})" for r in results) or "none"
    raise PushError(
        f"--results {path}: no entry scored this checkpoint {checkpoint} (entries: {names}); "
        f"run ultramem-eval --model {checkpoint}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ultramem-push", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="checkpoint folder (save_pretrained of model and tokenizer)")
    parser.add_argument("--repo-id", required=True, help="USER/NAME on the Hub")
    parser.add_argument("--private", action="store_true", help="create the repo private (when it does not exist yet)")
    parser.add_argument("--revision", help="branch to commit to (created if missing); default: main")
    parser.add_argument("--results", type=Path, help="results.json of ultramem-eval, for the card's scores")
    parser.add_argument("--dataset", action="append", default=[], help="training dataset id for the card (repeatable)")
    parser.add_argument("--base-model", help="model this checkpoint was fine-tuned from, for the card")
    parser.add_argument("--token", help="Hub token; default: HF_TOKEN or the stored login")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the card and the files that would be pushed; send nothing"
    )
    return parser


def _dry_run(folder: Path, repo_id: str, card: str, operations: list[CommitOperationAdd]) -> None:
    """The card on stdout (redirect it to a file to read it), the files of the commit on stderr."""
    print(card, end="" if card.endswith("\n") else "\n")
    sizes = {op.path_in_repo: op.upload_info.size for op in operations}
    listing = ", ".join(f"{name} ({size:,} B)" for name, size in sizes.items())
    total = sum(sizes.values())
    print(
        f"ultramem-push: dry run, nothing sent: {repo_id} would get {len(sizes)} files, {total:,} bytes ({listing})",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_repo_id(args.repo_id)
        folder = require_ultramem(require_checkpoint(args.checkpoint, option="checkpoint"))
        files_to_push(folder)  # weights, code, tokenizer: before the scores, whose match reads the weights
        result, settings = result_for(args.results, folder) if args.results else (None, None)
        card_args = dict(result=result, settings=settings, datasets=args.dataset, base_model=args.base_model)
        if args.dry_run:
            _dry_run(folder, args.repo_id, *prepare_push(folder, args.repo_id, **card_args)[1:])
            return 0
        info = push_checkpoint(
            folder, args.repo_id, token=args.token, private=args.private, revision=args.revision, **card_args
        )
    except ValueError as err:  # PushError, CheckpointError
        parser.exit(2, f"ultramem-push: error: {err}\n")
    except (ConnectionError, httpx2.TransportError) as err:  # no network, HF_HUB_OFFLINE=1, a proxy refusing
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        parser.exit(
            2, f"ultramem-push: error: cannot reach the Hub at {constants.ENDPOINT} ({reason}); nothing was pushed\n"
        )
    except HfHubHTTPError as err:  # the Hub answered with an error (bad token, no rights, ...)
        parser.exit(2, f"ultramem-push: error: the Hub refused the push: {str(err).strip().splitlines()[0]}\n")
    print(f"pushed {args.checkpoint} to {info.commit_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
