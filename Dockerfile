# imagegen on Debian bookworm, built with the same install script as CI.
#   docker build -t imagegen .
#   docker run --rm -v "$PWD/out:/out" imagegen --class sneaker --count 8 --out /out/sneakers.png
FROM debian:bookworm
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends ca-certificates python3 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN bash deploy/install-deps.sh && rm -rf /var/lib/apt/lists/* /root/.cache/pip
COPY . .
RUN cmake --preset release -DIMAGEGEN_BUILD_TESTS=OFF && cmake --build --preset release \
    && install -m 755 build/release/bench/imagegen-generate build/release/bench/imagegen-eval /usr/local/bin/
ENV IMAGEGEN_MODELS_DIR=/src/models
# The gRPC daemon (issue 5) will become the entry point; until then the local generator is.
ENTRYPOINT ["imagegen-generate"]
