# Dataflow worker image for `python -m pipelines.generate --runner DataflowRunner`.
#
#   docker build -t REGION-docker.pkg.dev/PROJECT/dspark/worker:2.78.0-py3.11 \
#       --build-arg BEAM_VERSION=$(python -c 'import apache_beam; print(apache_beam.__version__)') \
#       --build-arg PYTHON_VERSION=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') .
#   docker push REGION-docker.pkg.dev/PROJECT/dspark/worker:2.78.0-py3.11
#
# BEAM_VERSION and PYTHON_VERSION must equal the launcher's (Dataflow refuses or misbehaves
# otherwise): always pass both, as above. The defaults are only the Beam release the test suite
# last ran on and the project's baseline Python; install.sh refuses an image whose Beam differs
# from BEAM_VERSION. The Beam SDK's boot entrypoint comes from the official SDK image of that version;
# CUDA user-space libraries come with the PyPI torch wheel; the GPU driver is installed on the
# VM by Dataflow (install-nvidia-driver in worker_accelerator).
ARG BEAM_VERSION=2.78.0
ARG PYTHON_VERSION=3.11

FROM apache/beam_python${PYTHON_VERSION}_sdk:${BEAM_VERSION} AS beam_sdk

FROM python:${PYTHON_VERSION}-slim
ARG BEAM_VERSION
ARG TORCH_VERSION=""
ARG TORCH_INDEX=""

COPY --from=beam_sdk /opt/apache/beam /opt/apache/beam

ENV DSPARK_CACHE_DIR=/opt/dspark/cache \
    HF_HUB_OFFLINE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/dspark/src
COPY pyproject.toml README.md ./
COPY dspark ./dspark
COPY transforms ./transforms
COPY pipelines ./pipelines
COPY configs ./configs
COPY docker/install.sh ./docker/install.sh
RUN bash docker/install.sh --beam-version "${BEAM_VERSION}" \
        ${TORCH_VERSION:+--torch-version "${TORCH_VERSION}"} ${TORCH_INDEX:+--torch-index "${TORCH_INDEX}"} \
        --warm-embedded . \
    && chmod -R a+rX /opt/dspark

ENTRYPOINT ["/opt/apache/beam/boot"]
