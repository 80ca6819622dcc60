"""The documented commands, run as written: every ```bash block of README.md and docs/*.md marked `<!-- tested -->`.

Convention (also in the docs' contributor notes): an HTML comment `<!-- tested -->` or `<!-- tested: quick -->` on
the line before a fenced `bash` block (blank lines between them allowed). Each command of the block (a line ending
in `\\` continues on the next; `#` lines are comments) runs with bash, in order, in one temporary working directory
that holds what a reader of the docs has after the main job (`python -m ultramem.training.main_job`):
`runs/main_job/tiny-ultramem` and `runs/main_job/tiny-dense`, the main job's own configs and tokenizer, trained for
a few steps here. Substituted, whole words: `CKPT` -> `runs/main_job/tiny-ultramem`, `/path/to/eval` -> the
benchmark files of the test fixtures (the reference layout of `ultramem/eval/local_data.py`), `/tmp/...` -> a path
in the working directory. `quick` adds to each command the flags the docs name for a quick check, where it has none
of its own: `--limit 1 --gen_kwargs max_gen_toks=4` to `lm_eval`, `--limit 1 --max-gen-toks 4` to `ultramem-eval`.
Every command must exit 0. Set ULTRAMEM_DOCS_ROOT to check the marked blocks of another checkout's docs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS_ROOT = Path(os.environ.get("ULTRAMEM_DOCS_ROOT", REPO))
FIXTURE_DATA = REPO / "tests" / "eval" / "fixtures" / "eval"
MAIN_JOB = Path("runs") / "main_job"
MARKER = re.compile(r"^<!--\s*tested(?::\s*(?P<mode>[\w-]+))?\s*-->\s*$")
QUICK_FLAGS = {
    "lm_eval": {"--limit": "1", "--gen_kwargs": "max_gen_toks=4"},
    "ultramem-eval": {"--limit": "1", "--max-gen-toks": "4"},
}
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Block:
    source: str  # file:line of the fence
    mode: str | None
    commands: tuple[str, ...]

    def __str__(self) -> str:
        return self.source


def marked_blocks(root: Path = DOCS_ROOT) -> list[Block]:
    """The marked bash blocks of root/README.md and root/docs/*.md, in file order."""
    blocks = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            marker = MARKER.match(line.strip())
            if not marker:
                continue
            fence = number + 1
            while fence < len(lines) and not lines[fence].strip():
                fence += 1
            if fence == len(lines) or lines[fence].strip() != "```bash":
                raise AssertionError(f"{path.name}:{number + 1}: <!-- tested --> must precede a ```bash block")
            end = next(i for i in range(fence + 1, len(lines)) if lines[i].strip() == "```")
            source = f"{path.relative_to(root)}:{fence + 1}"
            blocks.append(Block(source, marker.group("mode"), tuple(_commands(lines[fence + 1 : end]))))
    return blocks


def _commands(lines: list[str]) -> list[str]:
    commands, current = [], ""
    for line in lines:
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
        else:
            commands.append(current.strip())
            current = ""
    if current:
        commands.append(current.strip())
    return commands


def prepare(command: str, mode: str | None, workdir: Path) -> str:
    """The command as it runs here: placeholders substituted, quick flags added where the block asks for them."""
    # /tmp/ first: the substituted paths may themselves lie under /tmp (a clone there)
    command = re.sub(r"(?<![\w.])/tmp/", f"{workdir}/tmp/", command)
    command = re.sub(r"\bCKPT\b", str(MAIN_JOB / "tiny-ultramem"), command)
    command = command.replace("/path/to/eval", str(FIXTURE_DATA))
    if mode == "quick":
        words = shlex.split(command)
        for tool, flags in QUICK_FLAGS.items():
            if words and words[0] == tool:
                command += "".join(f" {flag} {value}" for flag, value in flags.items() if flag not in words)
    return command


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the reader has after the main job: its two checkpoints, here after 2 steps instead of 120."""
    from ultramem.training import main_job

    folder = tmp_path_factory.mktemp("readme")
    (folder / "tmp").mkdir()
    previous = Path.cwd()
    os.chdir(folder)
    try:
        main_job.main(["--output_dir", str(MAIN_JOB), "--max_steps", "2", "--eval_blocks", "2"])
    finally:
        os.chdir(previous)
    return folder


def test_the_docs_mark_commands_for_this_test() -> None:
    """The convention cannot be dropped silently: the evaluation commands at least are marked."""
    commands = [command for block in marked_blocks() for command in block.commands]
    assert any(command.startswith("lm_eval ") for command in commands), "no marked lm_eval command in the docs"
    assert any(command.startswith("ultramem-eval ") for command in commands), "no marked ultramem-eval command"


@pytest.mark.parametrize("block", marked_blocks(), ids=str)
def test_documented_commands_run_as_written(block: Block, workdir: Path) -> None:
    env = {**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command in block.commands:
        ran = prepare(command, block.mode, workdir)
        done = subprocess.run(["bash", "-c", ran], cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{block}: `{ran}` exited {done.returncode}:\n{done.stderr[-3000:]}"
