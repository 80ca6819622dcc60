"""The carried kit: the wheels the GPU campaign needs that the GPU machine's image lacks or has at an unusable version.

The GPU machine cannot reach a package registry; files reach it only inside the working tree. This script compares
what the campaign requires (this package's `pyproject.toml` dependencies plus `CAMPAIGN_REQUIREMENTS`) with the
image's declared versions (`IMAGE`), downloads exactly the wheels that are missing or too old for the image's Python
and platform (and, transitively, what those wheels need that the image cannot give; DeepSpeed, an sdist only, is
built here into a pure-Python wheel), and prints the one command that installs and runs them there:

    python benchmarks/gpu/kit.py                        # builds .whl/ for the GPU image (CPython 3.12, x86_64)
    python benchmarks/gpu/kit.py --python-version 3.11  # the same kit for this machine's Python (the CPU check)

Nothing is installed on the GPU machine from the network: `pip install --no-index --no-deps --target` unpacks the
kit into a temporary folder, which goes on `PYTHONPATH` before the image's site-packages.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / ".whl"
LIMIT_MIB = 40
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# The GPU machine's image as last read (issue 22). None: present, because a listed package requires it, at a version
# not recorded; such a package is taken to satisfy any requirement (the kit prints which ones it assumed).
IMAGE: dict[str, str | None] = {
    "python": "3.12",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "tokenizers": "0.23.2",
    "safetensors": "0.8.0",
    **dict.fromkeys(["peft", "numpy", "matplotlib", "pandas", "pyarrow"]),
    # required by the packages above (torch: filelock, fsspec, jinja2, networkx, sympy, typing-extensions;
    # transformers / huggingface-hub / accelerate: packaging, pyyaml, regex, tqdm, typer, httpx, hf-xet, psutil;
    # matplotlib / typer: pillow, pygments, rich, click)
    **dict.fromkeys(
        [
            "filelock",
            "fsspec",
            "jinja2",
            "networkx",
            "sympy",
            "typing-extensions",
            "packaging",
            "pyyaml",
            "regex",
            "tqdm",
            "typer",
            "httpx",
            "hf-xet",
            "psutil",
            "pillow",
            "pygments",
            "rich",
            "click",
        ]
    ),  # fmt: skip
}
# What the campaign imports beyond the package's own dependencies: its correctness step is a pytest suite (tests/gpu);
# the mission (benchmarks/gpu/mission.py, call 8) trains under DeepSpeed and scores with lm-eval (pyproject's extras).
# lm-eval imports requests (lm_eval.utils) without requiring it.
CAMPAIGN_REQUIREMENTS = ["pytest>=8", "deepspeed>=0.19,<0.20", "lm-eval==0.4.13", "requests"]
# Only an sdist on PyPI: built here into a pure-Python wheel, its C++/CUDA ops left to be JIT-built (never, in the
# mission: the Trainer's torch AdamW, no DeepSpeed optimizer), so nothing needs nvcc on the GPU machine.
SDIST_ONLY = {"deepspeed"}
# lm-eval's requirements that `lm_eval --model hf` with the mission's tasks (ARC-C, BoolQ, WinoGrande, HellaSwag: acc,
# acc_norm) never imports: left out, not carried (scikit-learn alone would bring SciPy, ~50 MiB). The kit check
# (.ci/gpu_kit_check.sh) runs the mission's smoke without them.
NOT_IMPORTED = {
    "scikit-learn": "lm-eval imports it inside its f1/mcc metrics only",
    "evaluate": "lm-eval's HF-evaluate metrics only",
    "rouge-score": "lm-eval's ROUGE metric only",
    "sqlitedict": "lm-eval's --use_cache only",
    "word2number": "lm-eval's math-task filters only",
    "more-itertools": "lm-eval's tasks other than the mission's",
    "jsonlines": "lm-eval's decontamination tooling only",
    "zstandard": "lm-eval's decontamination tooling only",
}


def campaign_requirements() -> list[Requirement]:
    """pyproject's dependencies (the `ultramem` package, imported from the clone) and the campaign's own."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in [*project["dependencies"], *CAMPAIGN_REQUIREMENTS]]


def marker_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of the target: CPython `python_version` on Linux x86_64."""
    environment = default_environment()
    environment.update(python_version=python_version, python_full_version=f"{python_version}.0", sys_platform="linux",
                       platform_system="Linux", platform_machine="x86_64", implementation_name="cpython",
                       platform_python_implementation="CPython", os_name="posix")  # fmt: skip
    return environment


def image_satisfies(requirement: Requirement) -> bool | None:
    """True / False when the image's version is known, None when the package is present at an unrecorded version
    (taken to satisfy), False when the image lacks the package."""
    name = canonicalize_name(requirement.name)
    if name not in IMAGE:
        return False
    version = IMAGE[name]
    return None if version is None else requirement.specifier.contains(Version(version), prereleases=True)


def download(requirements: list[Requirement], folder: Path, python_version: str) -> list[Path]:
    """The newest wheels meeting `requirements` for the target, without their dependencies (resolved here)."""
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--python-version", python_version, "--implementation", "cp", *platforms, "--dest", str(folder)]  # fmt: skip
    before = set(folder.glob("*.whl"))
    binary = [r for r in requirements if canonicalize_name(r.name) not in SDIST_ONLY]
    if binary:
        subprocess.run([*command, *[str(r) for r in binary]], check=True)
    for requirement in requirements:
        if canonicalize_name(requirement.name) in SDIST_ONLY:
            build_wheel(requirement, folder)
    return sorted(set(folder.glob("*.whl")) - before)


def build_wheel(requirement: Requirement, folder: Path) -> None:
    """A pure-Python wheel of `requirement` built from its sdist with this environment's torch (DS_BUILD_OPS=0)."""
    if not can_build_wheels():  # without build isolation, setuptools builds with what this environment has
        raise SystemExit(f"gpu_kit: building {requirement.name}'s wheel from its sdist needs `pip install wheel` in "
                         f"this environment ({sys.executable}): its setuptools has no bdist_wheel before 70.1")  # fmt: skip
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-cache-dir",
               "--no-binary", requirement.name, "--wheel-dir", str(folder), str(requirement)]  # fmt: skip
    subprocess.run(command, check=True, env=dict(os.environ, DS_BUILD_OPS="0"))


def can_build_wheels() -> bool:
    """Whether setuptools here can build a wheel: from 70.1 on by itself, before that with the `wheel` package."""
    if importlib.util.find_spec("wheel") is not None:
        return True
    try:
        return Version(importlib.metadata.version("setuptools")) >= Version("70.1")
    except importlib.metadata.PackageNotFoundError:
        return False


def wheel_metadata(wheel: Path) -> tuple[str, Version, list[Requirement]]:
    """(name, version, Requires-Dist) read from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)))
    fields = [line.split(": ", 1) for line in metadata.decode().split("\n\n", 1)[0].splitlines() if ": " in line]
    value = lambda key: [v for k, v in fields if k == key]  # noqa: E731
    return (
        canonicalize_name(value("Name")[0]),
        Version(value("Version")[0]),
        [Requirement(r) for r in value("Requires-Dist")],
    )


def with_extras(requires: list[Requirement], extras: set[str], environment: dict[str, str]) -> list[Requirement]:
    """A wheel's requirements without extras, and those of the `extras` asked for (marker `extra == "..."`, decided
    here: the marker is dropped)."""
    base = [r for r in requires if not r.marker or "extra" not in str(r.marker)]
    chosen = [Requirement(str(r).split(";")[0]) for r in requires if r.marker and "extra" in str(r.marker)
              and any(r.marker.evaluate({**environment, "extra": extra}) for extra in extras)]  # fmt: skip
    return base + chosen


def build(python_version: str, kit: Path = KIT) -> dict:
    """Resolve and download the kit into `kit` (replaced); returns its record (also written to kit/kit.json)."""
    environment = marker_environment(python_version)
    carried: dict[str, dict] = {}  # name -> {"version", "wheel", "why"}
    assumed: set[str] = set()
    left_out: dict[str, str] = {}
    pending = [(r, "campaign") for r in campaign_requirements()]
    pending_extras: list[tuple[Requirement, str]] = []
    with tempfile.TemporaryDirectory() as staging:
        staging = Path(staging)
        while pending:
            wave: dict[str, tuple[Requirement, list[str]]] = {}
            for requirement, why in pending:
                if requirement.marker is not None and not requirement.marker.evaluate(environment):
                    continue
                name = canonicalize_name(requirement.name)
                if name in NOT_IMPORTED and why != "campaign":
                    left_out[name] = f"{why}: {NOT_IMPORTED[name]}"
                    continue
                if name in carried:
                    if not requirement.specifier.contains(carried[name]["version"], prereleases=True):
                        raise SystemExit(
                            f"gpu_kit: {why} needs {requirement}, but the kit carries {name} {carried[name]['version']}"
                        )
                    new = requirement.extras - carried[name]["extras"]  # e.g. typepy[datetime] after typepy
                    carried[name]["extras"] |= new
                    pending_extras += [(r, f"{name}[{','.join(sorted(new))}]")
                                       for r in with_extras(carried[name]["requires"], new, environment)]  # fmt: skip
                    continue
                fits = image_satisfies(requirement)
                if fits is None:
                    assumed.add(name)
                elif not fits:  # several requirements of one missing package in a wave: all of them at once
                    merged, whys = wave.get(name, (Requirement(name), []))
                    merged.specifier &= requirement.specifier
                    merged.extras |= requirement.extras
                    wave[name] = (merged, [*whys, why])
            pending, pending_extras = pending_extras, []
            if wave:
                for wheel in download([r for r, _ in wave.values()], staging, python_version):
                    name, version, requires = wheel_metadata(wheel)
                    image = (IMAGE[name] or "present") if name in IMAGE else "absent"
                    extras = set(wave[name][0].extras)
                    carried[name] = {
                        "version": version,
                        "wheel": wheel.name,
                        "why": f"{'; '.join(wave[name][1])} (image: {image})",
                        "extras": extras,
                        "requires": requires,
                    }
                    pending += [(r, f"{name} {version}") for r in with_extras(requires, extras, environment)]
        if kit.exists():
            shutil.rmtree(kit)
        kit.mkdir(parents=True)
        for entry in carried.values():
            shutil.copy2(staging / entry["wheel"], kit / entry["wheel"])
    size = sum(f.stat().st_size for f in kit.glob("*.whl"))
    record = {
        "python_version": python_version,
        "platforms": PLATFORMS,
        "image": IMAGE,
        "carried": {
            name: {"version": str(entry["version"]), "wheel": entry["wheel"], "why": entry["why"]}
            for name, entry in sorted(carried.items())
        },
        "assumed_present": sorted(assumed),
        "left_out": dict(sorted(left_out.items())),
        "size_mib": round(size / 2**20, 2),
        "install": install_command(kit),
    }
    (kit / "kit.json").write_text(json.dumps(record, indent=1) + "\n")
    if size > LIMIT_MIB * 2**20:
        raise SystemExit(f"gpu_kit: {size / 2**20:.1f} MiB of wheels, over the {LIMIT_MIB} MiB a device call can carry")
    return record


def install_command(kit: Path = KIT, call: int = 1, target: str = "/tmp/ultramem-kit") -> str:
    """The one line to run on the GPU machine from the repository root: unpack the kit (again, harmlessly, on a warm
    machine), run one call of the campaign."""
    wheels = f"{kit.relative_to(REPO)}/*.whl" if kit.is_relative_to(REPO) else f"{kit}/*.whl"
    # python3: the GPU image's interpreter with PyTorch (`python` may be another); --upgrade: a warm machine's next
    # call replaces the kit quietly instead of warning once per package
    return (f"python3 -m pip install --quiet --upgrade --no-index --no-deps --target {target} {wheels} && "
            f"PYTHONPATH={target}:$PWD python3 benchmarks/gpu/campaign.py --call {call}")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default=IMAGE["python"],
                        help=f"CPython version of the target (default {IMAGE['python']}, the GPU image's)")  # fmt: skip
    parser.add_argument(
        "--kit", type=Path, default=KIT, help=f"the folder to (re)build (default {KIT.relative_to(REPO)}/)"
    )
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version}: expected 3.N (e.g. 3.12)")
    record = build(args.python_version, args.kit.resolve())
    for name, entry in record["carried"].items():
        print(f"  {name} {entry['version']:<10} {entry['why']}")
    print(f"gpu_kit: {len(record['carried'])} wheels, {record['size_mib']} MiB in {args.kit}; assumed present in the "
          f"image at an unrecorded version: {', '.join(record['assumed_present']) or 'none'}")  # fmt: skip
    print(
        f"on the GPU machine, from the repository root, with {args.kit.name}/ carried (call 2: the same with --call 2):"
    )
    print(record["install"])
    return record


if __name__ == "__main__":
    main()
