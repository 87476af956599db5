# MARBLE Studio image: the web app and its job worker, served on 0.0.0.0:7860 for port mapping.
#   CPU (default):  docker build -t marble-studio .
#                   docker run -p 7860:7860 -e MARBLE_USERNAME=me -e MARBLE_PASSWORD=secret \
#                              -v $PWD/runs:/app/runs marble-studio
#   CUDA:           docker build --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t marble-studio:cuda .
#                   docker run --gpus all -p 7860:7860 -e MARBLE_USERNAME=me -e MARBLE_PASSWORD=secret \
#                              -v $PWD/runs:/app/runs marble-studio:cuda
# Off loopback the app requires a login: without MARBLE_USERNAME and MARBLE_PASSWORD it exits at once, saying so.
# `docker stop` stops the app, its worker and any job (everything lives in the container); runs left running
# show as interrupted within two minutes of the next start and resume from their last checkpoint (Runs → Resume).
# Model weights are never downloaded inside the container: mount a Hugging Face cache
# (-v ~/.cache/huggingface:/root/.cache/huggingface) or a local model folder.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False \
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860 MARBLE_HOME=/app/runs
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv && \
      rm -rf /var/lib/apt/lists/*; fi
WORKDIR /app
COPY requirements.txt .
# torch first, from the index that matches the base (CPU wheels by default), then the rest.
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir \
      --index-url ${TORCH_INDEX} "$(grep '^torch==' requirements.txt)" && \
    /opt/venv/bin/pip install --no-cache-dir -r requirements.txt
ENV PATH=/opt/venv/bin:$PATH
COPY . .
EXPOSE 7860
VOLUME ["/app/runs"]
# The app starts its job worker itself (jobs.runner.ensure_worker), as `make run` does.
CMD ["python", "-m", "app"]
