# imagegen in two stages: the build stage uses the same install script as CI; the runtime stage
# holds only the daemon, the CLI, the bundled models and their shared libraries (Debian's gRPC,
# protobuf and Abseil runtime; LibTorch and the CUDA libraries from the pinned wheel), without
# compilers, headers or Python.
#
#   docker build -t imagegen .
#   docker run --rm -p 50051:50051 -p 9464:9464 imagegen             # CPU
#   docker run --rm --gpus all -p 50051:50051 imagegen --device cuda  # with the NVIDIA toolkit
#   docker compose -f deploy/docker-compose.yml up                    # + Prometheus + Grafana
FROM debian:bookworm AS build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends ca-certificates python3 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN bash deploy/install-deps.sh && rm -rf /var/lib/apt/lists/* /root/.cache/pip
COPY . .
RUN cmake --preset release -DIMAGEGEN_BUILD_TESTS=OFF -DIMAGEGEN_BUILD_SERVER=ON \
    && cmake --build --preset release

FROM debian:bookworm AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends ca-certificates \
      libgrpc++1.51 libprotobuf32 libabsl20220623 libprometheus-cpp-core1.0 libre2-9 libc-ares2 \
      libssl3 libmicrohttpd12 libpng16-16 \
    && rm -rf /var/lib/apt/lists/*
# The binaries find LibTorch through their RPATH: keep the wheel's layout.
ARG SITE=/opt/imagegen/venv/lib/python3.11/site-packages
COPY --from=build ${SITE}/torch/lib ${SITE}/torch/lib
COPY --from=build ${SITE}/nvidia ${SITE}/nvidia
COPY --from=build /src/build/release/server/imagegen-server /src/build/release/client/imagegen \
     /src/build/release/bench/imagegen-generate /usr/local/bin/
COPY models /models
ENV IMAGEGEN_MODELS_DIR=/models
RUN useradd --system --no-create-home imagegen
USER imagegen
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s \
  CMD ["imagegen", "models", "--target", "127.0.0.1:50051", "--timeout", "4"]
ENTRYPOINT ["imagegen-server", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9464"]
