#!/usr/bin/env bash
# bash pipelines/torchrun_multi_gpu.sh pipelines/gpu_qwen_math.toml 4 20 \
#     --set policy_model=/models/Qwen2.5-0.5B-Instruct --set generate.prompts=/data/gsm8k_train.jsonl
#
# Usage: torchrun_multi_gpu.sh CONFIG [GPUS (4)] [ITERATIONS (1)] [--set KEY=VALUE ...]
# One iteration at a time on GPUS GPUs of one machine: generate, score and train run under
# torchrun (ranks write disjoint parts; train uses DistributedDataParallel, or FSDP2 with
# train.fsdp = true); advantage is one DuckDB process. Every command skips completed work, so
# the script can simply be run again. `rlhf-batch` and `torchrun` must be on PATH (an activated
# venv).
set -euo pipefail
config=${1:?usage: torchrun_multi_gpu.sh CONFIG [GPUS] [ITERATIONS] [--set KEY=VALUE ...]}
gpus=${2:-4}; iterations=${3:-1}
shift $(($# < 3 ? $# : 3))
for ((it = 0; it < iterations; it++)); do
  torchrun --standalone --nproc-per-node "$gpus" -m rlhf_batch generate "$config" --iter "$it" --quiet "$@"
  torchrun --standalone --nproc-per-node "$gpus" -m rlhf_batch score "$config" --iter "$it" --quiet "$@"
  rlhf-batch advantage "$config" --iter "$it" --quiet "$@"
  torchrun --standalone --nproc-per-node "$gpus" -m rlhf_batch train "$config" --iter "$it" --quiet "$@"
done
