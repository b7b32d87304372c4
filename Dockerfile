# gpuguard: one image, one CLI (`gpuguard enforce`, `gpuguard agent`, `inspect`, `explain`, ...).
# NVML comes from the host through the NVIDIA container toolkit; nothing NVIDIA is installed here.
# Dependencies come from requirements.lock (exact versions and hashes); the base image is pinned
# to a patch release. tests/test_dockerfile.py keeps both in step with pyproject.toml.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY requirements.lock ./
RUN pip install --no-cache-dir --require-hashes --prefix=/install -r requirements.lock
COPY pyproject.toml README.md ./
COPY gpuguard ./gpuguard
RUN pip install --no-cache-dir --no-deps --prefix=/install .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpuguard" \
      org.opencontainers.image.description="Kubernetes node agent that makes time-sliced NVIDIA GPUs safe to share" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gpuguard/gpuguard"
COPY --from=build /install /usr/local
# The enforcer runs as root with only CAP_KILL, the agent as 65534 with no capabilities (the
# DaemonSet sets both); nothing here needs a shell or a writable root filesystem.
ENTRYPOINT ["gpuguard"]
CMD ["--help"]
