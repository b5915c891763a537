# The vLLM runtime image that `vllm-ple-offload service --compose` runs by default (write-up 002: 4xA100, TP4).
# It is this kit's own runtime, not an image's own vLLM: install.sh builds vllm 0.33.0 from the hash lock
# (every wheel hash-checked), installs the kit, applies the patches and verifies every patched file's hash;
# the build fails if any of that fails. Build from the repository root:
#
#   docker build -f scripts/docker/vllm-runtime.Dockerfile -t qwen38-vllm-ple:0.1.0 .
#
# The tag is the kit's version (pyproject.toml), the compose file's default image. Not yet built here: this
# box has no Docker daemon (tests/operate/test_docker_image.py checks the steps and the compose reference).
ARG BASE_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# CPython 3.12 (Ubuntu 24.04; hashes/locks/ has its locks), and the C compiler the sidecar's native code and
# Triton need at the first start.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv gcc g++ libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kit
COPY pyproject.toml README.md install.sh ./
COPY sglang_ssd_stream ./sglang_ssd_stream
COPY vllm_ple_offload ./vllm_ple_offload
COPY patches ./patches
COPY hashes ./hashes

RUN sh install.sh --engine vllm --python python3 --prefix /opt/runtime --bin-dir /usr/local/bin \
 && sh install.sh --engine vllm --python python3 --prefix /opt/runtime --bin-dir /usr/local/bin --check

ENV PATH=/opt/runtime/vllm-0.33.0/venv/bin:$PATH
# The compose file's `command:` is the serve arguments (the profile's flags, the model at /model).
ENTRYPOINT ["vllm", "serve"]
