#!/usr/bin/env bash
# The carried GPU kit (issue 22), checked on CPU: a fresh virtual environment holding the GPU image's versions of the
# packages that matter (not this project's dependencies), the kit built by benchmarks/gpu/kit.py for this Python and
# installed exactly as on the GPU machine (--no-index --no-deps --target), then the campaign's smoke run end to end,
# the mission's included (call 8: ultramem-train under DeepSpeed ZeRO-2 and lm_eval, both from the kit; issue 35).
# The image-like environment is built once per set of versions outside the clone, in $ULTRAMEM_CI_CACHE (default
# ~/.cache/ultramem-ci), and reused by later runs and clones; the kit and its install live in .gpu-kit-check/ inside
# the clone and are deleted afterwards. pip caches nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PIP_NO_CACHE_DIR=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
work=.gpu-kit-check
# DeepSpeed JIT-builds its CPU ops into TORCH_EXTENSIONS_DIR: this job's own, so that it never rebuilds (for another
# Python's headers) an op that the test suite running beside it is loading
export TORCH_EXTENSIONS_DIR="$PWD/$work/torch_extensions"
trap 'rm -rf "$work"' EXIT
rm -rf "$work"
image="torch==2.13.0 transformers==5.17.0 accelerate==1.15.0 huggingface_hub==1.33.0 tokenizers==0.23.2 \
safetensors==0.8.0 triton==3.6.0 numpy<2.4 $(python3 --version)"
. .ci/env_cache.sh
venv=$(cached_env gpu-image "$image")
start=$(date +%s)
if [ "$(cat "$venv/image-ready" 2>/dev/null)" != "$image" ]; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    . "$venv/bin/activate"
    # The image (issue 22): torch as CI has it (CPU), then the image's own pins; its triton for the smoke run's
    # interpreted kernels, whose interpreter (3.6) converts 1-element arrays to int, which NumPy 2.4 refuses: numpy<2.4
    # (the image's NumPy is not recorded; on the GPU the kernels are compiled and NumPy plays no part in them).
    python -m pip install -q torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 10  # the CPU build, as README; 1 retry where that index is unreachable
    python -m pip install -q transformers==5.17.0 accelerate==1.15.0 huggingface_hub==1.33.0 tokenizers==0.23.2 \
        safetensors==0.8.0 triton==3.6.0 matplotlib "numpy<2.4" pandas pyarrow pytest pytest-timeout psutil
    echo "$image" > "$venv/image-ready"
fi
. "$venv/bin/activate"
python -c "import transformers; assert transformers.__version__ == '5.17.0', transformers.__version__"  # the image's
echo "gpu_kit_check: image-like environment ready in $(( $(date +%s) - start )) s"
# The kit for this Python, and the install line it prints for the GPU machine, run here with this Python's wheels.
python benchmarks/gpu/kit.py --kit "$work/kit" \
    --python-version "$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
python -m pip install -q --no-index --no-deps --target "$work/site" "$work"/kit/*.whl
# The campaign's test (every step at smoke size, resumed by call, stopped by its budget; the mission's record checked)
# with the kit on the path: deepspeed and lm-eval come from it alone (the image has neither)
python -c "import importlib.util as u; assert not u.find_spec('deepspeed') and not u.find_spec('lm_eval')"
PYTHONPATH="$PWD/$work/site:$PWD" ULTRAMEM_GPU_KIT_CHECK=1 python -m pytest -q -p no:cacheprovider \
    tests/benchmarks/test_gpu_campaign.py::test_gpu_campaign_smoke_runs_by_call_resumes_and_stops_within_its_budget
echo "gpu_kit_check: passed in $(( $(date +%s) - start )) s"
