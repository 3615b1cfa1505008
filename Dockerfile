# gpumon container image: build with `buildah bud -t gpumon:0.1.0 .` or `docker build -t gpumon:0.1.0 .`
# Tags and the run command for plain Docker hosts are in docs/deployment.md.
#
# Two stages: the first installs gpumon and its dependencies into a virtual environment (all of them
# ship binary wheels, so neither stage needs a compiler); the second copies only that venv onto a
# fresh slim base and runs it as an unprivileged user.
#
# The first stage runs on the build machine's own platform (BUILDPLATFORM) and installs the wheels of
# the target's (TARGETARCH) with pip's --platform, so an arm64 image built on an amd64 machine runs
# no pip under emulation: only the second stage's two short RUN steps are emulated. The venv's
# interpreter is the base image's python3, the same version and path on both platforms. docker buildx
# sets BUILDPLATFORM, TARGETPLATFORM and TARGETARCH itself; buildah before 1.29 takes them as --build-arg
# (see docs/deployment.md). Without them the first stage runs on the target platform, as a plain build does.
# BUILD_IMAGE is the first stage's base: the same image (a multi-platform one resolves to the build
# machine's variant); give it apart only where the two platforms' bases have different names.
ARG PYTHON_IMAGE=docker.io/library/python:3.12-slim-bookworm
ARG BUILD_IMAGE=${PYTHON_IMAGE}
ARG BUILDPLATFORM
ARG TARGETPLATFORM

FROM --platform=${BUILDPLATFORM} ${BUILD_IMAGE} AS build
ARG EXTRAS=all
ARG TARGETARCH
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY . /src
# Online, pip fetches the dependencies from the index. For an air-gapped build (or behind a TLS-
# intercepting proxy) put every wheel in ./wheels first: gpumon's and its dependencies' for the
# target platform, cyclonedx-bom's for the build machine (docs/deployment.md shows the two pip
# commands); the build then installs from there with --no-index. The last step writes the venv's
# CycloneDX SBOM (scripts/sbom.sh, with cyclonedx-bom in a throwaway venv) to /opt/gpumon/sbom.cdx.json.
RUN set -eu; \
    python3 -m venv /opt/gpumon; \
    py=/opt/gpumon/bin/python; \
    site=$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
    platforms=$($py /src/scripts/wheel_platforms.py "${TARGETARCH:-}"); \
    if ls /src/wheels/*.whl >/dev/null 2>&1; then \
        export PIP_NO_INDEX=1 PIP_FIND_LINKS=/src/wheels; \
        own=gpumon-exporter; \
    else \
        $py -m pip wheel --quiet --no-deps -w /tmp/own /src; \
        own=$(ls /tmp/own/gpumon_exporter-*.whl); \
    fi; \
    $py -m pip install --target "$site" --only-binary=:all: --implementation cp \
        --python-version "$($py -c 'import sys; print("%d.%d" % sys.version_info[:2])')" $platforms \
        "${own}${EXTRAS:+[$EXTRAS]}"; \
    mv "$site"/bin/* /opt/gpumon/bin/; rmdir "$site/bin"; \
    $py -m pip uninstall --quiet --yes pip; \
    /src/scripts/sbom.sh venv /opt/gpumon /opt/gpumon/sbom.cdx.json

FROM --platform=${TARGETPLATFORM} ${PYTHON_IMAGE}
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
# The venv was made on the build machine's platform: prove it runs on the image's own.
RUN gpumon --version
USER 10001:10001
WORKDIR /var/lib/gpumon
VOLUME ["/var/lib/gpumon"]
EXPOSE 9470
# /healthz answers 200 while the collector loop is alive, 503 otherwise.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9470/healthz', timeout=4).status != 200)"]
ENTRYPOINT ["gpumon"]
CMD ["run"]
