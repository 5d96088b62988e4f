# The rbdkit image: one binary for the provisioner, the CSI driver and the
# FUSE mapper (deploy/*.yaml use it as rbdkit:latest).
#
# Not built by CI: the build machines have no container engine. Build with
#   docker build -t rbdkit:latest .
# (or podman/buildah) from the repository root.

# --- build --------------------------------------------------------------------
FROM rust:1-bookworm AS build
# bindgen (rbd-sys) needs libclang; the headers come with the -dev packages.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      clang libclang-dev librados-dev librbd-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p rbdkit --bin rbdkit \
 && install -m 0755 target/release/rbdkit /usr/local/bin/rbdkit

# --- runtime ------------------------------------------------------------------
FROM debian:bookworm-slim
# librados/librbd for the binary; mkfs and fsck for ext4 and xfs; fuse3 for
# the userspace mapper; CA certificates for the Kubernetes API.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      librados2 librbd1 e2fsprogs xfsprogs fuse3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/rbdkit /usr/local/bin/rbdkit
ENTRYPOINT ["/usr/local/bin/rbdkit"]
