# diloco-node: one swarm member per container.
#
#   docker build -t diloco-node .
#   docker run --rm -v diloco-keys:/keys -v diloco-checkpoints:/checkpoints -p 31337:31337 \
#       diloco-node join --identity /keys/identity.key --checkpoint-dir /checkpoints/my-node
#
# Conventions: the identity key lives on the /keys volume, checkpoints on /checkpoints, peers
# connect on TCP 31337. docker-compose.yml runs a bootstrap node and two workers this way.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src

# Dependencies first, from pyproject.toml alone (placeholder packages stand in for the
# sources), so that editing the code does not reinstall torch. torch==2.13.0 is the tested
# release; pip picks the build for the platform (CUDA on linux/amd64).
COPY pyproject.toml ./
RUN mkdir node dht merge dashboard \
    && touch README.md node/__init__.py dht/__init__.py merge/__init__.py dashboard/__init__.py \
    && pip install torch==2.13.0 . \
    && rm -rf README.md node dht merge dashboard build ./*.egg-info

# Then the project itself; its dependencies are already in place.
COPY README.md ./
COPY node ./node
COPY dht ./dht
COPY merge ./merge
COPY dashboard ./dashboard
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# Run as an unprivileged user. The volume mount points are created here, owned by that user,
# so fresh named volumes mounted on them are writable by it (and /keys by it alone).
RUN useradd --create-home --uid 10001 --user-group diloco \
    && mkdir -p /keys /checkpoints \
    && chown diloco:diloco /keys /checkpoints \
    && chmod 700 /keys
USER diloco
WORKDIR /home/diloco

VOLUME ["/keys", "/checkpoints"]
EXPOSE 31337

ENTRYPOINT ["diloco-node"]
CMD ["--help"]
