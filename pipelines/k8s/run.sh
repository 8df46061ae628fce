#!/usr/bin/env bash
# The whole run on Kubernetes, iteration after iteration, from any machine with kubectl:
#   IMAGE=reg.example.com/rlhf-batch:cuda RUN_DIR=s3://bucket/run7 pipelines/k8s/run.sh FIRST_ITER ITERATIONS
# For each iteration K from FIRST_ITER: eval (Indexed Job, --if-due: nothing unless K is an eval
# iteration) beside generate (Indexed Job) -> score (Indexed Job) -> advantage (Job: top-up rounds
# and advantage) -> train (Indexed Job of NODES pods running torchrun); then K = ITERATIONS: the
# last eval. Each Job is rendered from pipelines/k8s/STAGE.yaml, applied, and waited for; the
# first Job that fails stops the loop (exit 1) and names it: fix the cause, `kubectl delete job
# NAME`, and run this again from K (every command skips completed work, a Job already complete is
# left as it is). Set up once (docs/across-machines.md, Kubernetes): the ConfigMap
# rlhf-batch-config (run.toml), the Secret rlhf-batch-s3 (AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY), optionally the ConfigMap rlhf-batch-store (AWS_ENDPOINT_URL,
# AWS_DEFAULT_REGION), and the PersistentVolumeClaim rlhf-batch-inputs (models and prompts, read
# only, under /inputs).
# Environment: IMAGE, RUN_DIR (required); WORKERS (pods of the fan-out Jobs, default 4), NODES
# (train's pods, 1), GPUS (GPUs a train pod, 1), TOPUP_GPUS (advantage's pod, 0), BACKOFF (retries
# of a fan-out pod, 4), POLL (seconds between looks at a Job, 10), KUBECTL (default kubectl),
# RUN_NAME (the run's part of the Job and Service names, rlhf-RUN_NAME-STAGE-K; default from RUN_DIR).
set -euo pipefail
usage="usage: IMAGE=... RUN_DIR=... run.sh FIRST_ITER ITERATIONS"
first=${1:?$usage}; iterations=${2:?$usage}
: "${IMAGE:?$usage}" "${RUN_DIR:?$usage}"
here=$(cd "$(dirname "$0")" && pwd)
kubectl=${KUBECTL:-kubectl}
# the run's part of every Job and Service name (several runs share a namespace): RUN_NAME, else
# RUN_DIR's last folder as a DNS label (at most 20 characters) and 8 hex digits of its hash
base=$(basename "$RUN_DIR" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9\n' '-' | cut -c1-20 | sed -e 's/^-*//' -e 's/-*$//')
run=${RUN_NAME:-${base:-run}-$(printf '%s' "$RUN_DIR" | sha256sum | cut -c1-8)}
[[ $run =~ ^[a-z0-9]([a-z0-9-]{0,29}[a-z0-9])?$ ]] || { echo "RUN_NAME=$run: must be a DNS label of at most 31 characters (a-z, 0-9, -)" >&2; exit 2; }

render() {  # render STAGE K: the manifest with its placeholders filled in
  sed -e "s|@K@|$2|g" -e "s|@RUN@|$run|g" -e "s|@IMAGE@|$IMAGE|g" -e "s|@RUN_DIR@|$RUN_DIR|g" \
    -e "s|@ITERATIONS@|$iterations|g" -e "s|@WORKERS@|${WORKERS:-4}|g" -e "s|@NODES@|${NODES:-1}|g" \
    -e "s|@GPUS@|${GPUS:-1}|g" -e "s|@TOPUP_GPUS@|${TOPUP_GPUS:-0}|g" -e "s|@BACKOFF@|${BACKOFF:-4}|g" \
    "$here/$1.yaml"
}

start() {  # start STAGE K: apply its Job
  render "$1" "$2" | "$kubectl" apply -f -
}

wait_for() {  # wait_for STAGE K: until the Job is Complete (0) or Failed (exit 1)
  local job="rlhf-$run-$1-$2" state
  while true; do
    state=$("$kubectl" get job "$job" -o jsonpath='{.status.conditions[?(@.status=="True")].type}')
    case " $state " in
      *" Complete "*) return 0 ;;
      *" Failed "*)
        echo "job/$job failed: see kubectl logs -l job-name=$job; then kubectl delete job $job and run again from iteration $2" >&2
        exit 1 ;;
    esac
    sleep "${POLL:-10}"
  done
}

for ((k = first; k <= iterations; k++)); do
  start eval "$k"
  if ((k < iterations)); then
    for stage in generate score advantage train; do
      start "$stage" "$k"
      wait_for "$stage" "$k"
    done
  fi
  wait_for eval "$k"
  echo "iteration $k: complete"
done
