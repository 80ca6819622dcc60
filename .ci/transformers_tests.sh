#!/usr/bin/env bash
# Transformers' own common tests (ModelTesterMixin, ConfigTester) against UltraMem: tests/model/test_transformers_common.py.
#
# Those tests are not in the transformers wheel. The source distribution of the installed release carries the
# top-level tests/test_*.py (test_modeling_common.py, test_configuration_common.py, ...) but not their subpackages
# (generation/, exporters/, utils/, causal_lm_tester.py): the test module supplies what test_modeling_common imports
# from those, see its docstring. This script downloads that sdist from PyPI with pip, into the ignored folder
# .transformers-src/ of this clone (nothing is cached outside it), and unpacks its tests/ as the package
# `transformers_tests` (not `tests`, which is this repository's own test folder).
#
#   .ci/transformers_tests.sh --fetch-only    fetch the sources (once per transformers version), run nothing
#   .ci/transformers_tests.sh [pytest args]   fetch if needed, then run the common-test module with pytest
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

version=$(python -c "import transformers; print(transformers.__version__)")
root=.transformers-src
dest="$root/$version/transformers_tests"

if [ ! -f "$dest/test_modeling_common.py" ]; then
    mkdir -p "$root"
    printf '*\n' > "$root/.gitignore"  # the folder ignores itself: no change to the repository's .gitignore
    work=$(mktemp -d "$root/download.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    python -m pip download -q --no-cache-dir --no-binary :all: --no-deps --dest "$work" "transformers==$version"
    sdist=$(ls "$work"/transformers-*.tar.gz)
    tar -xzf "$sdist" -C "$work" "transformers-$version/tests"
    rm -rf "$root/$version"
    mkdir -p "$root/$version"
    mv "$work/transformers-$version/tests" "$dest"
    # Upstream's tests/__init__.py (empty) is not in the sdist; test_configuration_common imports it as a file.
    touch "$dest/__init__.py"
    echo "Transformers $version test sources: $dest ($(ls "$dest"/*.py | wc -l) files from $(basename "$sdist"))"
fi

# test_modeling_common.py imports `parameterized`, which is not among the project's dependencies.
python -c "import parameterized" 2>/dev/null || python -m pip install -q "parameterized>=0.9"

if [ "${1:-}" = "--fetch-only" ]; then
    exit 0
fi
exec python -m pytest -q tests/model/test_transformers_common.py "$@"
