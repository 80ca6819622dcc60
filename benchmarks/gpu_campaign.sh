#!/usr/bin/env bash
# The GPU campaign: correctness of the Triton path on real hardware, then the speed benchmarks.
# Usage (on the GPU machine, repository root):  bash benchmarks/gpu_campaign.sh PART OUT_DIR
#   PART 1: check_gpu.py, bench_kernels.py, bench_decode.py at 680M
#   PART 2: bench_decode.py at 1.6B, bench_train.py at 151M, bench_scaling.py at 1.6B
# Each step has its own time limit so that a slow step cannot take the others' results with it; every
# step's log and results land in OUT_DIR (results/ and logs/), the exact commands in OUT_DIR/commands.txt,
# and all of it in OUT_DIR.tgz.
set -uo pipefail
part=${1:?part 1 or 2}; out=${2:?output folder}
mkdir -p "$out/results" "$out/logs"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2; shift 2
    echo "$*" >> "$out/commands.txt"
    echo "=== $name ($(date +%T), limit ${seconds}s): $*"
    local start=$(date +%s)
    timeout "$seconds" "$@" > "$out/logs/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $(( $(date +%s) - start ))s"; tail -n 40 "$out/logs/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/logs/nvidia-smi.csv"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee "$out/logs/versions.txt"
R="$out/results"
if [ "$part" = 1 ]; then
    step check_gpu 150 python3 benchmarks/check_gpu.py --results-dir "$R"
    step bench_kernels 170 python3 benchmarks/bench_kernels.py --device cuda --out-dir "$R"
    step decode_680m 230 python3 benchmarks/bench_decode.py --device cuda --sizes 680m --batch-sizes 1,4,16,64 \
        --moe-impl grouped_mm --name decode_680m_h100 --results-dir "$R"
else
    step decode_1.6b 250 python3 benchmarks/bench_decode.py --device cuda --sizes 1.6b --batch-sizes 1,4,16 \
        --moe-impl grouped_mm --name decode_1.6b_h100 --results-dir "$R"
    step train_151m 150 python3 benchmarks/bench_train.py --device cuda --sizes 151m --batch 16 --seq-len 2048 \
        --results-dir "$R"
    step scaling_1.6b 150 python3 benchmarks/bench_scaling.py --device cuda --size 1.6b --batch 16 --results-dir "$R"
fi
tar -C "$out" -czf "$out.tgz" results logs commands.txt
