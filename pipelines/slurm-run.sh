#!/usr/bin/env bash
# The whole run on Slurm, one iteration's chain at a time, from a login node:
#   pipelines/slurm-run.sh CONFIG FIRST_ITER ITERATIONS [--set KEY=VALUE ...]
#   e.g. pipelines/slurm-run.sh /opt/run/gpu_qwen_math.toml 0 29 --set run_dir=s3://bucket/run7
# Submits iteration K = FIRST_ITER's chain with sbatch and returns:
#   eval   (array, --if-due: nothing unless K is an eval iteration)
#   generate (array of WORKERS tasks, `--world-size auto`) -> score (array, afterok:generate)
#   -> train (afterok:score: topup and advantage on the first node, then srun torchrun on every
#      node, --nproc-per-node from the GPUs Slurm gives a node)
#   -> this script again for K + 1 (afterok:train and eval K: a failed eval stops the chain as a
#   failed train does), until K = ITERATIONS (the last eval only).
# Every dependent job is submitted with --kill-on-invalid-dep=yes: when a job fails, Slurm
# cancels the jobs that wait on it (none stays pending forever); if a submission fails, the jobs
# of the chain already submitted are cancelled (scancel). Every command skips completed work, so
# resubmitting the same K after a fix resumes the run.
# No shared filesystem is needed with the run directory on a store (run_dir=s3://...): the job
# scripts travel inside the submissions (sbatch reads them from standard input; this script's
# own copy is the one Slurm spooled), and each node reads AWS_* from its environment. CONFIG
# (and the prompt files and models it names, unless on the store) must exist on every node at
# the same path: bake them into the image, or copy them. `rlhf-batch` must be on PATH there.
# Tuning (environment, read at each submission): WORKERS (tasks of the generate/score/eval
# arrays, default 8), SAMPLE_SBATCH (their sbatch options, default "--gpus-per-task=1
# --cpus-per-task=8"), TRAIN_SBATCH (train's, default "--nodes=2 --ntasks-per-node=1
# --gpus-per-node=8 --cpus-per-task=32"), RDZV_PORT (torchrun's rendezvous port, default 29500).
set -euo pipefail
usage="usage: slurm-run.sh CONFIG FIRST_ITER ITERATIONS [--set KEY=VALUE ...]"
config=${1:?$usage}; it=${2:?$usage}; iterations=${3:?$usage}
shift 3
workers=${WORKERS:-8}
read -r -a sample_opts <<<"${SAMPLE_SBATCH:---gpus-per-task=1 --cpus-per-task=8}"
read -r -a train_opts <<<"${TRAIN_SBATCH:---nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=32}"
args=$(printf ' %q' "$config" --iter "$it" --quiet "$@" --set "iterations=$iterations")
submitted=()

chained=0
cancel_chain() {  # a submission failed: nothing of this chain may run half-way
  if ((!chained && ${#submitted[@]})); then scancel "${submitted[@]}" || true; fi
}
trap cancel_chain EXIT

submit() {  # submit [SBATCH OPTIONS...] < script: the job id in $job
  job=$(sbatch --parsable "$@")
  job=${job%%;*}  # "id;cluster" on a federation
  submitted+=("$job")
}

fanout_script() {  # the batch script of a generate/score/eval array task
  printf '#!/usr/bin/env bash\nset -euo pipefail\nexec rlhf-batch %s%s --world-size auto%s\n' "$1" "$args" "${2:-}"
}

train_script() {
  cat <<SCRIPT
#!/usr/bin/env bash
set -euo pipefail
rlhf-batch topup$args
rlhf-batch advantage$args
head=\$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads every line: no SIGPIPE under pipefail
gpus=\${SLURM_GPUS_ON_NODE:-\${SLURM_GPUS_PER_NODE:-1}}
srun torchrun --nnodes "\$SLURM_NNODES" --nproc-per-node "\${gpus##*:}" \\
  --rdzv-id "\$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "\$head:\${RDZV_PORT:-29500}" \\
  -m rlhf_batch train$args
SCRIPT
}

array=(--array="0-$((workers - 1))" "${sample_opts[@]}")
after() { echo --dependency=afterok:"$1" --kill-on-invalid-dep=yes; }
submit --job-name="rlhf-eval-$it" "${array[@]}" < <(fanout_script eval " --if-due"); e=$job
if ((it >= iterations)); then
  chained=1
  echo "iteration $it: eval $job (the last)"
  exit 0
fi
submit --job-name="rlhf-generate-$it" "${array[@]}" < <(fanout_script generate); g=$job
# shellcheck disable=SC2046
submit --job-name="rlhf-score-$it" $(after "$g") "${array[@]}" < <(fanout_script score); s=$job
# shellcheck disable=SC2046
submit --job-name="rlhf-train-$it" $(after "$s") "${train_opts[@]}" < <(train_script); t=$job
# shellcheck disable=SC2046
submit --job-name="rlhf-run-$((it + 1))" $(after "$t:$e") --ntasks=1 "$0" "$config" "$((it + 1))" "$iterations" "$@"
chained=1
echo "iteration $it: generate $g, score $s, train $t; iteration $((it + 1)): $job"
