# The Sortie image: one `sortie` binary, every component is a subcommand
# (`reducer`, `executor`, `gateway`, `topology`, `graph`, `registry`, ...).
#
#   docker build -t sortie:0.1.0 .
#
# dev/image.sh builds the same image without a container engine or an image registry
# (a Debian root file system made with mmdebstrap, written as an OCI archive); keep the
# two in step: runtime packages, user, paths, labels, entrypoint.
#
# Layout of the image:
#   /usr/local/bin/sortie            the binary (ENTRYPOINT)
#   /usr/share/sortie/schemas/       the Avro contract (schemas/)
#   /usr/share/sortie/topology/      topics.yaml and the example graphs (topology/)
#   /var/lib/sortie/                 WORKDIR, owned by uid 10001; `topology` and `schemas`
#                                    there link to /usr/share/sortie, so the defaults
#                                    (`--file topology/topics.yaml`) work as in the repo
# User 10001:10001 (`sortie`), matching the Helm chart's podSecurityContext.

ARG RUST_VERSION=1.95
ARG DEBIAN_SUITE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_SUITE} AS build
# librdkafka is built from source by rdkafka-sys (OpenSSL and zlib linked from the system).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        build-essential cmake pkg-config libssl-dev zlib1g-dev python3 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p sortie \
 && install -D -m 0755 target/release/sortie /out/sortie

FROM debian:${DEBIAN_SUITE}-slim
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=1970-01-01T00:00:00Z
# What `ldd sortie` needs beyond libc: libssl3 (librdkafka's TLS, native-tls) and
# ca-certificates for TLS to brokers and the registry. zlib is already in the base.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates libssl3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 sortie \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/sortie \
        --no-create-home --shell /usr/sbin/nologin sortie \
 && install -d -o 10001 -g 10001 -m 0755 /var/lib/sortie \
 && ln -s /usr/share/sortie/topology /var/lib/sortie/topology \
 && ln -s /usr/share/sortie/schemas /var/lib/sortie/schemas
COPY --from=build /out/sortie /usr/local/bin/sortie
COPY schemas/ /usr/share/sortie/schemas/
COPY topology/ /usr/share/sortie/topology/
LABEL org.opencontainers.image.title="sortie" \
      org.opencontainers.image.description="Durable execution for AI agent runs on Kafka: the sortie binary (reducer, executor, gateway, topology, graph, registry)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="debian:${DEBIAN_SUITE}-slim"
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /var/lib/sortie
USER 10001:10001
ENTRYPOINT ["sortie"]
CMD ["--help"]
