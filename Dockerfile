# gpumon container image: build with `buildah bud -t gpumon:0.1.0 .` or `docker build -t gpumon:0.1.0 .`
# Tags and the run command for plain Docker hosts are in docs/deployment.md.
#
# Two stages: the first installs gpumon and its dependencies into a virtual environment (all of them
# ship binary wheels, so neither stage needs a compiler); the second copies only that venv onto a
# fresh slim base and runs it as an unprivileged user.
ARG PYTHON_IMAGE=docker.io/library/python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=all
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY . /src
# Online, pip fetches the dependencies from the index. For an air-gapped build (or behind a TLS-
# intercepting proxy) put every wheel in ./wheels first (`pip wheel -w wheels '.[all]' cyclonedx-bom`):
# the build then installs from there with --no-index. The last step writes the venv's CycloneDX SBOM
# (scripts/sbom.sh, with cyclonedx-bom in a throwaway venv) to /opt/gpumon/sbom.cdx.json.
RUN set -eu; \
    python3 -m venv /opt/gpumon; \
    if ls /src/wheels/*.whl >/dev/null 2>&1; then \
        /opt/gpumon/bin/pip install --no-index --only-binary=:all: --find-links /src/wheels "gpumon-exporter[${EXTRAS}]"; \
        export PIP_NO_INDEX=1 PIP_FIND_LINKS=/src/wheels; \
    else \
        /opt/gpumon/bin/pip install "/src[${EXTRAS}]"; \
    fi; \
    /opt/gpumon/bin/pip uninstall --yes pip; \
    /opt/gpumon/bin/gpumon --version; \
    /src/scripts/sbom.sh venv /opt/gpumon /opt/gpumon/sbom.cdx.json

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="gpumon" \
      org.opencontainers.image.description="GPU (NVML) and InfiniBand telemetry exporter: Prometheus, OpenTelemetry, Azure Monitor" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.source="https://github.com/gpumon/gpumon"
RUN groupadd --system --gid 10001 gpumon \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/gpumon --no-create-home \
        --shell /usr/sbin/nologin gpumon \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/gpumon
COPY --from=build /opt/gpumon /opt/gpumon
# The container defaults: host /sys mounted at /host/sys, JSON log lines. Mount another file over
# it, or set GPUMON_<SECTION>_<KEY> variables, to change them.
COPY deploy/kubernetes/base/gpumon.toml /etc/gpumon/gpumon.toml
# With the NVIDIA container runtime these two put every GPU's device node and libnvidia-ml in the
# container ("utility" is all NVML needs) without reserving the GPUs.
ENV PATH=/opt/gpumon/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
USER 10001:10001
WORKDIR /var/lib/gpumon
VOLUME ["/var/lib/gpumon"]
EXPOSE 9470
# /healthz answers 200 while the collector loop is alive, 503 otherwise.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9470/healthz', timeout=4).status != 200)"]
ENTRYPOINT ["gpumon"]
CMD ["run"]
