"""The documented snippets, run as written: every ```bash and ```python block of README.md and docs/ (model_doc too).

Convention (also in the docs' contributor notes): an HTML comment on the line before the fence (blank lines between
them allowed) says what the test does with the block, and every bash or python block has one, so none is skipped
silently:

- `<!-- tested -->`: run. A bash block runs command by command (a line ending in `\\` continues on the next; `#`
  lines are comments), each with bash; a python block runs whole, as a script, in a fresh interpreter.
- `<!-- tested: quick -->`: run, adding the flags the docs name for a quick check to a command that has none of its
  own: `--limit 1 --gen_kwargs max_gen_toks=4` to `lm_eval`, `--limit 1 --max-gen-toks 4` to `ultramem-eval`.
- `<!-- tested: vllm -->`: needs vLLM (docs/serving.md): skipped where vLLM is not installed, run by
  .ci/vllm_tests.sh in its own environment.
- `<!-- untested: REASON -->`: not run, for the reason given (a CUDA device, the Hub, several GPUs, hours).

Blocks without a language (output, tables, layouts) are not code. All blocks run, in file order, in one temporary
working directory that holds what a reader has after the main job (`python -m ultramem.training.main_job`):
`runs/main_job/tiny-ultramem` and `runs/main_job/tiny-dense`, trained for 2 steps here; a block may use what an
earlier block of its page wrote there, as a reader would. Substituted, whole words: `CKPT` -> `runs/main_job/tiny-
ultramem` (bash only: python snippets define their names), `tests/eval/fixtures/eval` -> its absolute path (the
benchmark files of the test fixtures, in the reference layout of `ultramem/eval/local_data.py`), `/tmp/...` -> a
path in the working directory.
Every command and script must exit 0. Set ULTRAMEM_DOCS_ROOT to check the blocks of another checkout's docs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS_ROOT = Path(os.environ.get("ULTRAMEM_DOCS_ROOT", REPO))
FIXTURE_DATA = REPO / "tests" / "eval" / "fixtures" / "eval"
MAIN_JOB = Path("runs") / "main_job"
MARKER = re.compile(r"^<!--\s*(?P<kind>tested|untested)(?::\s*(?P<mode>.*?))?\s*-->$")
FENCE = re.compile(r"^```\s*(?P<language>[\w+-]*)\s*$")
CODE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
MODES = (None, "quick", "vllm")
QUICK_FLAGS = {
    "lm_eval": {"--limit": "1", "--gen_kwargs": "max_gen_toks=4"},
    "ultramem-eval": {"--limit": "1", "--max-gen-toks": "4"},
}
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Block:
    source: str  # file:line of the fence
    language: str  # "bash" or "python" (None: not code)
    kind: str | None  # "tested", "untested" or None (no marker)
    mode: str | None  # tested: None, "quick" or "vllm"; untested: the reason
    code: str  # the block's text, dedented

    def __str__(self) -> str:
        return self.source

    @property
    def commands(self) -> list[str]:
        return _commands(self.code.splitlines())


def doc_files(root: Path = DOCS_ROOT) -> list[Path]:
    return [path for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if path.is_file()]


def code_blocks(root: Path = DOCS_ROOT) -> list[Block]:
    """The fenced bash and python blocks of README.md and docs/**/*.md in file order, each with its marker (if any).

    A marker followed by anything but blank lines and a bash or python fence is an error: it cannot drift off its
    block."""
    blocks = []
    for path in doc_files(root):
        lines = path.read_text(encoding="utf-8").splitlines()
        number, marker = 0, None
        while number < len(lines):
            line, where = lines[number].strip(), f"{path.relative_to(root).as_posix()}:{number + 1}"
            fence = FENCE.match(line)
            language = CODE.get(fence.group("language")) if fence else None
            if marker and line and not language:
                raise AssertionError(f"{where}: `{marker.group(0)}` must be followed by a bash or python block")
            if fence:
                end = next((i for i in range(number + 1, len(lines)) if lines[i].strip() == "```"), len(lines))
                if language:
                    kind, mode = (marker.group("kind"), marker.group("mode") or None) if marker else (None, None)
                    code = textwrap.dedent("\n".join(lines[number + 1 : end]))
                    blocks.append(Block(where, language, kind, mode, code))
                number, marker = end + 1, None
                continue
            marker = MARKER.match(line) or marker
            number += 1
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


def prepare(text: str, block: Block, workdir: Path) -> str:
    """A command or script as it runs here: placeholders substituted, quick flags added where the block asks."""
    # /tmp/ first: the substituted paths may themselves lie under /tmp (a clone there)
    text = re.sub(r"(?<![\w.])/tmp/", f"{workdir}/tmp/", text)
    text = text.replace("tests/eval/fixtures/eval", str(FIXTURE_DATA))  # the clone's path, from the working directory
    if block.language == "python":
        return text
    text = re.sub(r"\bCKPT\b", str(MAIN_JOB / "tiny-ultramem"), text)
    if block.mode == "quick":  # each command of an `&&` chain
        commands = []
        for command in text.split(" && "):
            words = shlex.split(command)
            for tool, flags in QUICK_FLAGS.items():
                if words and words[0] == tool:
                    command += "".join(f" {flag} {value}" for flag, value in flags.items() if flag not in words)
            commands.append(command)
        text = " && ".join(commands)
    return text


BLOCKS = code_blocks()
TESTED = [block for block in BLOCKS if block.kind == "tested"]


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


def test_every_code_block_is_tested_or_says_why_not() -> None:
    """No snippet is skipped silently: each bash/python block is marked tested, or untested with its reason."""
    unmarked = [f"{block} ({block.language})" for block in BLOCKS if block.kind is None]
    missing = "code blocks without <!-- tested --> or <!-- untested: REASON --> before them"
    assert not unmarked, f"{missing}: {', '.join(unmarked)}"
    for block in BLOCKS:
        if block.kind == "untested":
            assert block.mode, f"{block}: <!-- untested: REASON --> needs its reason"
        else:
            assert block.mode in MODES, f"{block}: unknown mode {block.mode!r}; one of {MODES}"


def test_the_docs_mark_snippets_for_this_test() -> None:
    """The convention cannot be dropped silently: the evaluation commands and python snippets are run."""
    commands = [command for block in TESTED if block.language == "bash" for command in block.commands]
    assert any(command.startswith("lm_eval ") for command in commands), "no tested lm_eval command in the docs"
    assert any(command.startswith("ultramem-eval ") for command in commands), "no tested ultramem-eval command"
    assert any(block.language == "python" for block in TESTED), "no tested python snippet in the docs"


def test_ci_runs_the_readmes_test_command() -> None:
    """.ci/run runs README.md's command 2 (install, then the tests) exactly as a reader pastes it."""
    (quick_start,) = [block for block in BLOCKS if block.source.startswith("README.md") and "pytest" in block.code]
    readme_command = next(command for command in quick_start.commands if "pytest" in command)
    ci_commands = _commands((REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines())
    assert readme_command in ci_commands, f".ci/run does not run README.md's test command: {readme_command}"


def run_as_written(block: Block, workdir: Path) -> None:
    """Every command of a bash block (or a python block as a script) exits 0, in the reader's working directory."""
    if block.mode == "vllm":  # needs vLLM's own environment: .ci/vllm_tests.sh runs these blocks
        pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed: .ci/vllm_tests.sh runs this block")
    env = {**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if block.language == "python":
        script = workdir / "tmp" / (re.sub(r"\W", "_", block.source) + ".py")
        script.write_text(prepare(block.code, block, workdir), encoding="utf-8")
        runs = [(f"python {script.name}", [sys.executable, str(script)])]
    else:
        runs = [(ran, ["bash", "-c", ran]) for ran in (prepare(command, block, workdir) for command in block.commands)]
    before = written_into(workdir)
    for ran, argv in runs:
        done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{block}: `{ran}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    shown = [name for name in sorted(written_into(workdir) - before) if not ignored_in_the_clone(workdir / name)]
    assert not shown, f"{block}: writes {shown} where a reader runs it, the clone: git would show them (.gitignore)"


def written_into(workdir: Path) -> set[str]:
    """What is in the reader's working directory, the clone, except `tmp` (the blocks' /tmp)."""
    return {path.name for path in workdir.iterdir()} - {"tmp"}


def ignored_in_the_clone(path: Path) -> bool:
    """Whether the clone's .gitignore covers a file or folder of this name at its top."""
    name = path.name + ("/" if path.is_dir() else "")
    return subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", name]).returncode == 0


def page_tests(page: str, blocks: list[Block]) -> type:
    """One test class per page, its blocks in file order: a class is one unit of pytest-xdist's `--dist loadscope`,
    so a page runs on one worker while the pages spread over the workers."""

    @pytest.mark.parametrize("block", blocks, ids=str)
    def test_runs_as_written(self, block: Block, workdir: Path) -> None:
        run_as_written(block, workdir)

    name = "TestBlocksOf" + "".join(part.capitalize() for part in re.split(r"[\W_]+", page))
    return type(name, (), {"test_runs_as_written": test_runs_as_written, "__doc__": f"The tested blocks of {page}."})


for _page, _blocks in groupby(TESTED, key=lambda block: block.source.rsplit(":", 1)[0]):
    _tests = page_tests(_page, list(_blocks))
    globals()[_tests.__name__] = _tests
