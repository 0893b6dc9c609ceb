# imagegen in two stages. The build stage runs the same install script as CI and a fresh machine
# (deploy/install-deps.sh: Debian's packages, LibTorch from the pinned wheel, the CUDA toolkit
# LibTorch's CMake wants, assembled from NVIDIA's wheels). The runtime stages hold the daemon,
# the CLI, the bundled models and their shared libraries only: no compiler, headers or Python.
#
#   docker build -t imagegen .                        # CPU image (the default target)
#   docker build -t imagegen:gpu --target gpu .       # GPU image: docker run --gpus all ...
#   docker run --rm -p 50051:50051 -p 9464:9464 -p 8080:8080 --stop-timeout 40 imagegen
#   docker run --rm --gpus all -p 50051:50051 --stop-timeout 40 imagegen:gpu --device cuda
#   docker compose -f deploy/docker-compose.yml up    # + Prometheus + Grafana
#   deploy/test-image.sh                              # builds and smoke-tests the image
#
# Arguments after the image name are flags of imagegen-server (--help lists them). The ports are
# IMAGEGEN_PORT (gRPC; the HEALTHCHECK follows it), IMAGEGEN_METRICS_PORT and IMAGEGEN_HTTP_PORT
# (the OpenAI Images API and the playground page at /; -e IMAGEGEN_HTTP_PORT= turns it off).
# Give `docker stop` (--stop-timeout, compose's stop_grace_period, Kubernetes'
# terminationGracePeriodSeconds) more than --grace-seconds (30 s by default): Docker's default
# of 10 s kills a draining daemon.
#
# Behind a TLS-intercepting proxy, hand pip its CA bundle as a build secret:
#   docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt .
ARG DEBIAN_BASE=debian:bookworm-20250520-slim

FROM ${DEBIAN_BASE} AS build
ENV DEBIAN_FRONTEND=noninteractive
WORKDIR /src
COPY deploy/install-deps.sh deploy/python-constraints.txt deploy/
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends ca-certificates python3 > /dev/null \
    && IMAGEGEN_NO_BROWSER=1 bash deploy/install-deps.sh \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /root/.cache/pip
COPY . .
# Two builds: the GPU image's links all of LibTorch; the CPU image's links its CPU libraries only
# (IMAGEGEN_TORCH_CPU_ONLY), so that it needs none of the NVIDIA libraries. Each runtime stage
# copies the one it needs; BuildKit builds only the stages its target depends on.
FROM build AS build-gpu
# The GPU architectures imagegen's own kernels are built for: 90 is the H100 and H200; on another
# GPU the daemon runs without them ("fused kernels off" at start). "80;90" adds the A100.
ARG CUDA_ARCHITECTURES=90
RUN cmake --preset release -DIMAGEGEN_BUILD_TESTS=OFF -DIMAGEGEN_BUILD_SERVER=ON \
      "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}" \
    && cmake --build --preset release --target imagegen-server imagegen imagegen-generate

FROM build AS build-cpu
RUN cmake --preset release -DIMAGEGEN_BUILD_TESTS=OFF -DIMAGEGEN_BUILD_SERVER=ON \
      -DIMAGEGEN_TORCH_CPU_ONLY=ON \
    && cmake --build --preset release --target imagegen-server imagegen imagegen-generate \
    && bash deploy/runtime-libs.sh /runtime-libs build/release/server/imagegen-server \
         build/release/client/imagegen build/release/bench/imagegen-generate

FROM ${DEBIAN_BASE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libabsl20220623 libprometheus-cpp-core1.0 libre2-9 libc-ares2 \
      libssl3 libmicrohttpd12 libgnutls30 libpng16-16 libpcre2-8-0 libicu72 ca-certificates > /dev/null \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/*.log \
    && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin imagegen
# Readable by the daemon's user whatever the modes of the checkout they came from.
COPY models /models
RUN chmod -R a+rX,go-w /models
ARG VERSION=0.1.0
ARG DEBIAN_BASE
LABEL org.opencontainers.image.title="imagegen" \
      org.opencontainers.image.description="gRPC daemon for autoregressive image generation with lossless speculative Jacobi decoding" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.base.name="${DEBIAN_BASE}"
# XDG_CACHE_HOME: where the daemon keeps its step-cost calibration between starts (the user
# has no home directory; /tmp is writable, also under a read-only root with an emptyDir).
ENV IMAGEGEN_MODELS_DIR=/models IMAGEGEN_PORT=50051 IMAGEGEN_METRICS_PORT=9464 \
    IMAGEGEN_HTTP_PORT=8080 XDG_CACHE_HOME=/tmp/.cache
USER 10001:10001
EXPOSE 50051 9464 8080
STOPSIGNAL SIGTERM
# grpc.health.v1 on the generation service: NOT_SERVING while the models load and once the
# daemon drains, so an orchestrator stops sending work before the listener closes.
HEALTHCHECK --interval=10s --timeout=6s --start-period=60s --retries=3 \
  CMD ["/bin/sh", "-c", "exec imagegen health --target 127.0.0.1:${IMAGEGEN_PORT} --timeout 5"]
ENTRYPOINT ["/bin/sh", "-c", "exec imagegen-server --listen 0.0.0.0:${IMAGEGEN_PORT} --metrics-listen 0.0.0.0:${IMAGEGEN_METRICS_PORT} ${IMAGEGEN_HTTP_PORT:+--http-listen 0.0.0.0:${IMAGEGEN_HTTP_PORT}} \"$@\"", "imagegen-server"]

# The GPU image: all of LibTorch and the NVIDIA libraries (run with --gpus all and --device cuda;
# the NVIDIA container toolkit mounts the driver).
FROM runtime AS gpu
ARG SITE=/opt/imagegen/venv/lib/python3.11/site-packages
COPY --from=build-gpu ${SITE}/torch/lib ${SITE}/torch/lib
COPY --from=build-gpu ${SITE}/nvidia ${SITE}/nvidia
COPY --from=build-gpu /src/build/release/server/imagegen-server \
     /src/build/release/client/imagegen /src/build/release/bench/imagegen-generate \
     /usr/local/bin/

# The CPU image (the default target): LibTorch's CPU libraries, the only ones its binaries load.
FROM runtime AS cpu
COPY --from=build-cpu /runtime-libs/ /
COPY --from=build-cpu /src/build/release/server/imagegen-server \
     /src/build/release/client/imagegen /src/build/release/bench/imagegen-generate \
     /usr/local/bin/
