# syntax=docker/dockerfile:1
# The croupier coordinator: `croupier serve` on port 50051, its SQLite store on the volume /data
# (or, for several replicas, a PostgreSQL database: CROUPIER_STORE, see deploy/README.md).
#
#   docker build -f deploy/docker/coordinator.Dockerfile -t croupier-coordinator:0.1.0 .
#   docker run -p 50051:50051 -v croupier-data:/data croupier-coordinator:0.1.0
#
# NOTE: the coordinator carries torch (the CPU build) because it computes the epoch order itself,
# and `permutation="torch"` is torch's own randperm.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/croupier
ENV PATH=/opt/croupier/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
# torch's CPU build from PyTorch's index (PyPI's default build pulls several GB of CUDA libraries),
# in a layer of its own so that a change to croupier's source does not download it again.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --constraint constraints.txt --index-url "${TORCH_INDEX_URL}" torch
# The postgresql:// store, which several replicas share (deploy/compose.ha.yml, kubernetes-ha/):
# psycopg with the libpq of its binary wheel (the slim image has none), and its connection pool.
RUN pip install --constraint constraints.txt "psycopg[binary]>=3.3" "psycopg-pool>=3.3"
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
 && croupier serve --help > /dev/null \
 && python -c "import croupier.server._pg_store"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/croupier/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 croupier \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin croupier \
 && mkdir /data \
 && chown 10001:10001 /data
COPY --from=build /opt/croupier /opt/croupier
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
EXPOSE 50051
# The standard gRPC health service; NOT_SERVING (exit 1) while the coordinator shuts down.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(service='croupier.v1.Coordinator'), timeout=4); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["croupier", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--store", "sqlite:////data/croupier.db"]
