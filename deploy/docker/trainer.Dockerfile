# syntax=docker/dockerfile:1
# The demo trainer (croupier.demos.demo_train) under torchrun, CPU only, gloo.
#
#   docker build -f deploy/docker/trainer.Dockerfile -t croupier-trainer:0.1.0 .
#   docker run -v croupier-work:/work croupier-trainer:0.1.0
#
# Alone, it trains with two workers and an embedded coordinator; docker-compose.yml and the
# Kubernetes Job run it on several nodes against `croupier serve` (CROUPIER_ADDRESS) instead.
# Checkpoints, progress and the audit log go to /work, which every node of a job must share.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/croupier
ENV PATH=/opt/croupier/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
# torch's CPU build from PyTorch's index (PyPI's default build pulls several GB of CUDA libraries).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --constraint constraints.txt --index-url "${TORCH_INDEX_URL}" torch
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY core/ core/
COPY server/ server/
COPY client/ client/
COPY tools/ tools/
COPY harness/ harness/
COPY demos/ demos/
COPY integrations/ integrations/
COPY data/ data/
RUN pip install --constraint constraints.txt . \
 && python -c "import croupier.demos.demo_train"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/croupier/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    CROUPIER_JOB=demo \
    CROUPIER_AUDIT_DIR=/work/audit \
    CROUPIER_STATE_DIR=/work/coordinator \
    DEMO='{"workdir": "/work", "n": 6000, "epochs": 4, "batch_size": 32, "ckpt_every": 15}'
RUN groupadd --system --gid 10001 croupier \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin croupier \
 && mkdir /work \
 && chown 10001:10001 /work
COPY --from=build /opt/croupier /opt/croupier
USER 10001:10001
WORKDIR /work
VOLUME ["/work"]
# torchrun's c10d rendezvous, on the node that hosts it.
EXPOSE 29400
# A batch job, not a service: torchrun and the coordinator's health check watch over it.
HEALTHCHECK NONE
ENTRYPOINT ["torchrun"]
CMD ["--standalone", "--nproc-per-node=2", "--max-restarts=3", "-m", "croupier.demos.demo_train"]
