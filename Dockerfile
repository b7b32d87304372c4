# gpuguard: one image, one CLI (`gpuguard enforce`, `inspect`, `explain`, ...).
# NVML comes from the host through the NVIDIA container toolkit; nothing NVIDIA is installed here.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpuguard ./gpuguard
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim-bookworm
COPY --from=build /install /usr/local
# Runs as root with only CAP_KILL (see manifests/daemonset.yaml); no shell tools are needed.
ENTRYPOINT ["gpuguard"]
CMD ["--help"]
