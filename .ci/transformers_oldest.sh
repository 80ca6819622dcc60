#!/usr/bin/env bash
# CI on the oldest Transformers release the package supports (5.17.0, the GPU image's), beside .ci/run's newest:
# a virtual environment with that release and the versions of the packages around it the image carries (built once
# per version set outside the clone, .ci/env_cache.sh), the project installed into it without its dependency pins,
# then the model tests and the Trainer tests (single process, one DDP launch). Optional packages are not installed:
# their tests skip (peft, triton, deepspeed) or are deselected below (the two that run lm_eval). Transformers' own
# common tests need that release's sources (.ci/transformers_tests.sh) and are skipped here; the retrieval-health
# runs (the model's own math, through the Trainer the other training tests cover) run in the main suite only. About
# 3 minutes on 2 CPU cores, 1 more where the environment is built.
#
#   .ci/transformers_oldest.sh [pytest args]     e.g. -x, or a test path to run instead of the selection
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
export ULTRAMEM_SKIP_TRANSFORMERS_COMMON=1
packages="transformers==5.17.0 accelerate==1.15.0 huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 \
datasets pytest pytest-timeout pytest-xdist psutil pyyaml matplotlib tqdm numpy"
. .ci/env_cache.sh
venv=$(cached_env transformers-oldest "torch==2.13.0 $packages $(python3 --version)")
start=$(date +%s)

if [ "$(cat "$venv/.ready" 2>/dev/null)" != "$packages" ]; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 10  # the CPU build, as README; 1 retry where that index is unreachable
    # shellcheck disable=SC2086  # one word per package
    "$venv/bin/pip" install -q $packages
    echo "$packages" > "$venv/.ready"
fi
. "$venv/bin/activate"
pip install -q --no-deps -e .  # this clone's package, into the reused environment
python -c "import transformers, ultramem; assert transformers.__version__ == '5.17.0', transformers.__version__"
echo "environment ready in $(( $(date +%s) - start )) s: $(pip list 2>/dev/null | grep -E '^(torch|transformers|accelerate) ' | tr -s ' ' | paste -sd ',')"

if [ "$#" -gt 0 ]; then
    python -m pytest -q -p no:cacheprovider "$@"
else
    python -m pytest -q -p no:cacheprovider -n auto --dist loadscope tests/model tests/training \
        --ignore tests/training/test_training_distributed.py --ignore tests/training/test_retrieval_health.py \
        --deselect tests/model/test_save_load.py::test_tools_name_the_fix_for_a_folder_without_tokenizer \
        --deselect tests/model/test_save_load.py::test_lm_eval_cli_names_the_fix_for_a_folder_without_tokenizer
    python -m pytest -q -p no:cacheprovider tests/training/test_training_distributed.py::test_ddp_matches_single_process
fi
echo "transformers 5.17 CI finished in $(( $(date +%s) - start )) s"
