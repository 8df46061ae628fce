# The rlhf-batch image: every stage command (`rlhf-batch ...`, `torchrun -m rlhf_batch ...`).
#   make image                    # VARIANT=cpu: torch's CPU build
#   make image VARIANT=cuda       # torch's CUDA build (its CUDA libraries come as wheels; the
#                                 # node needs the NVIDIA driver and container toolkit)
# Optional: --build-arg VLLM_VERSION=0.x.y adds vLLM in /opt/vllm, with rlhf-batch, for
# generate.engine = "vllm" (set generate.python = "/opt/vllm/bin/python").
# Models, prompts and configs are not in the image: mount them, or put them on the store.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG VARIANT=cpu
ARG VLLM_VERSION=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    RLHF_BATCH_CACHE=/cache
WORKDIR /opt/rlhf-batch

COPY pyproject.toml constraints.txt README.md ./
COPY rlhf_batch ./rlhf_batch
COPY pipelines ./pipelines

# Versions: every dependency is pinned by constraints.txt (the project's own pins).
# hadolint ignore=DL3013
RUN case "$VARIANT" in \
      cpu) index=https://download.pytorch.org/whl/cpu ;; \
      cuda) index=https://pypi.org/simple ;; \
      *) echo "VARIANT must be cpu or cuda, got $VARIANT" >&2; exit 1 ;; \
    esac \
    && pip install --extra-index-url "$index" -c constraints.txt ".[s3]" \
    && rlhf-batch --help > /dev/null

# hadolint ignore=DL3013
RUN if [ -n "$VLLM_VERSION" ]; then \
      python -m venv /opt/vllm \
      && /opt/vllm/bin/pip install "vllm==$VLLM_VERSION" ".[s3]"; \
    fi

RUN useradd --create-home --uid 1000 rlhf && mkdir -p /cache && chown rlhf /cache
USER 1000
ENTRYPOINT ["rlhf-batch"]
CMD ["--help"]
