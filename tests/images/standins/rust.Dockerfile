# A local stand-in for the official rust:<x.y.z>-slim-<debian> image, for machines that reach no container
# registry (tests/images/base_images.py builds it only when the real image cannot be pulled). Made the way
# the official image is (docker-library/rust, Dockerfile-slim.template): rustup-init from
# static.rust-lang.org, checked against its published sha256, installs the minimal profile of the pinned
# toolchain into /usr/local/rustup and /usr/local/cargo.
ARG BASE
FROM ${BASE}

ARG RUST_VERSION
ARG RUSTUP_VERSION=1.28.2
ARG RUSTUP_SHA256=20a06e644b0d9bd2fbdbfd52d42540bdde820ea7df86e92e533c073da0cdd43c
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev wget \
 && wget -q -O /tmp/rustup-init \
      "https://static.rust-lang.org/rustup/archive/${RUSTUP_VERSION}/x86_64-unknown-linux-gnu/rustup-init" \
 && echo "${RUSTUP_SHA256} */tmp/rustup-init" | sha256sum -c - \
 && chmod +x /tmp/rustup-init \
 && /tmp/rustup-init -y --no-modify-path --profile minimal --default-toolchain "${RUST_VERSION}" \
 && rm /tmp/rustup-init \
 && chmod -R a+w "$RUSTUP_HOME" "$CARGO_HOME" \
 && apt-get purge -y --auto-remove wget \
 && rm -rf /var/lib/apt/lists/* \
 && rustc --version | grep -q "^rustc ${RUST_VERSION} "
