"""Every `python benchmarks/<script>.py ...` command written in the docs parses with that script's own parser.

The scripts' flags change (comma-separated lists, renamed options) while the commands in the docs are pasted as
written, often on a GPU slot where a refused flag costs minutes. Each command is parsed, not run: argparse stops the
script right after parsing, so a misspelt flag, a removed option or a value its type refuses fails here.
"""

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "benchmarks/README.md", "benchmarks/gpu/README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]  # fmt: skip
COMMAND = re.compile(r"python3? (benchmarks/(?:gpu/)?[a-z_]+\.py)((?:\\\n|[^`\n#&>|;\\])*)")  # to the line's end


class Parsed(Exception):
    """Raised by argparse's `parse_args` in place of returning: the command parsed and nothing ran."""


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page:line, script, argv) of each distinct benchmark command on the pages."""
    found = {}
    for page in PAGES:
        text = (REPO / page).read_text(encoding="utf-8")
        for match in COMMAND.finditer(text):
            argv = shlex.split(match.group(2).replace("\\\n", " "))
            line = text.count("\n", 0, match.start()) + 1
            found.setdefault((match.group(1), tuple(argv)), f"{page}:{line}")
    return [(where, script, list(argv)) for (script, argv), where in found.items()]


COMMANDS = documented_commands()


def test_the_pages_hold_benchmark_commands():
    scripts = {script for _, script, _ in COMMANDS}
    assert len(COMMANDS) >= 20 and {"benchmarks/bench_decode.py", "benchmarks/gpu/campaign.py"} <= scripts, scripts


@pytest.mark.parametrize(("where", "script", "argv"), COMMANDS, ids=[where for where, _, _ in COMMANDS])
def test_documented_command_parses(where, script, argv, monkeypatch):
    def parse_args(self, args=None, namespace=None):
        namespace, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise Parsed(namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    module = importlib.import_module(script.removeprefix("benchmarks/").removesuffix(".py").replace("/", "."))
    with pytest.raises(Parsed):
        try:
            module.main()
        except SystemExit as exit:
            pytest.fail(f"{where}: `python {script} {shlex.join(argv)}` is refused by its parser (exit {exit.code})")
