# Prometheus from Debian's own package, for hosts that reach Debian's mirror but no container
# registry (deploy/compose/compose.host.yaml's PROMETHEUS_IMAGE; deploy/docker/local_image.py builds
# it on the same base as the project's image). Elsewhere prom/prometheus does the same job.
# Runs like prom/prometheus: the binary is the entrypoint, data in /prometheus, as nobody (65534).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o 65534 -g 65534 /prometheus
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
