"""Builds the project's image where no container registry is reachable, on a Docker daemon that
leaves the host's network alone.

- `docker_daemon()`: the daemon that builds and runs. One already running is used as it is
  (`docker info` answers, through DOCKER_HOST or the default socket). Otherwise `dockerd` is
  started here, as root, with host networking only (`--iptables=false --ip-forward=false
  --bridge=none`: a default dockerd sets the host's iptables FORWARD policy to DROP, which breaks
  every later test whose traffic crosses network namespaces), its data, exec root, socket and pid
  file under one directory, and stopped when the `with` block ends.
- `Docker.base_image`: a Debian bookworm root filesystem made from Debian's packages
  (debootstrap, from the mirror apt uses here) with python3 (3.11, also as `python`), venv,
  ca-certificates and tini, the host's CA bundle and pip's index settings, imported as
  `diloco-base:bookworm`: the stand-in for `python:3.11-slim-bookworm`. Made once per daemon.
- `Docker.build_image`: deploy/docker/Dockerfile as users build it, PYTHON_IMAGE set to that base
  and, where pip's find-links hold a torch wheel for it, that wheel in deploy/docker/wheels/ with
  TORCH_INDEX_URL empty (so the build needs no torch index).
- `Docker.build_prometheus`: deploy/docker/prometheus.Dockerfile (Debian's prometheus) on the base.

    python3 deploy/docker/local_image.py build    # diloco:latest and diloco-prometheus:latest
    python3 deploy/docker/local_image.py daemon   # a daemon holding them, until Ctrl-C

Where docker, dockerd or debootstrap cannot run it prints one line, `local-image: skipped: WHY`,
and exits 77; tests catch `Unavailable` and skip.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
PROMETHEUS_DOCKERFILE = REPO / "deploy" / "docker" / "prometheus.Dockerfile"
WHEELS = REPO / "deploy" / "docker" / "wheels"  # the Dockerfile's find-links folder
BASE_TAG = "diloco-base:bookworm"
BASE_PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates,tini"
PYTHON_TAG = "cp311"  # bookworm's python3
SKIPPED = 77  # the exit status of "cannot run here" (automake's and meson's skip code)


class Unavailable(RuntimeError):
    """Images cannot be built or run here: no docker client, no dockerd (or not root), dockerd or
    debootstrap failing to start."""


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class Docker:
    """A daemon to talk to: `docker(...)` runs the client against it, `env` reaches it (for
    docker-compose too)."""

    def __init__(self, env: dict[str, str], log: Path | None = None) -> None:
        self.env = env
        self.log = log  # the log of a dockerd started here

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True, stdin: int | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`docker ARGS`, its output captured; RuntimeError with that output if it fails (check)."""
        r = subprocess.run(
            ["docker", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=stdin,
        )
        if check and r.returncode != 0:
            raise RuntimeError(
                f"`docker {' '.join(args)}` exited {r.returncode}:\n{_tail(r.stdout + r.stderr)}"
            )
        return r

    def has_image(self, tag: str) -> bool:
        return self("image", "inspect", tag, check=False, timeout=30).returncode == 0

    def build(
        self, dockerfile: Path, tag: str, args: dict[str, str], context: Path | None, verbose: bool
    ) -> None:
        """`docker build` with host networking; no context (Dockerfile on stdin) when None."""
        cmd = ["docker", "build", "--network", "host", "-t", tag]
        cmd += [f"--build-arg={k}={v}" for k, v in args.items()]
        cmd += ["-f", str(dockerfile), str(context)] if context else ["-"]
        with open(dockerfile, "rb") if context is None else contextlib.nullcontext() as stdin:
            r = subprocess.run(
                cmd,
                env=self.env,
                stdin=stdin,
                timeout=1800,
                text=True,
                stdout=None if verbose else subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        if r.returncode != 0:
            raise RuntimeError(
                f"building {tag} from {dockerfile} failed ({r.returncode}):\n{_tail(r.stdout or '')}"
            )

    def base_image(self, tag: str = BASE_TAG, mirror: str | None = None) -> str:
        """`tag`, made from Debian's packages unless the daemon has it already."""
        if self.has_image(tag):
            return tag
        debootstrap = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin")
        if debootstrap is None:
            raise Unavailable("no `debootstrap` (bash deploy/ci/install-tools.sh installs it)")
        mirror = mirror or apt_mirror()
        with tempfile.TemporaryDirectory(prefix="diloco-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            try:
                r = subprocess.run(
                    [
                        debootstrap,
                        "--variant=minbase",
                        f"--include={BASE_PACKAGES}",
                        "bookworm",
                        str(rootfs),
                        mirror,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=1200,
                )
            finally:
                _unmount_under(rootfs)
            if r.returncode != 0:
                raise Unavailable(
                    f"debootstrap could not make bookworm from {mirror}: {_tail(r.stdout + r.stderr, 1)}"
                )
            _prepare_rootfs(rootfs)
            tar = subprocess.Popen(
                ["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE
            )
            assert tar.stdout is not None
            try:
                self(
                    "import",
                    "--change",
                    'CMD ["bash"]',
                    "-",
                    tag,
                    stdin=tar.stdout.fileno(),
                    timeout=600,
                )
            finally:
                tar.stdout.close()
                tar.wait()
        return tag

    def build_image(
        self,
        tag: str = "diloco:latest",
        base: str = BASE_TAG,
        wheel: Path | None = None,
        verbose: bool = False,
    ) -> str:
        """deploy/docker/Dockerfile on `base`; torch from `wheel`, if given, instead of the index."""
        args = {"PYTHON_IMAGE": base}
        placed = None
        if wheel is not None:
            args["TORCH_SPEC"] = f"torch=={wheel.name.split('-')[1]}"  # torch-VERSION-TAGS.whl
            args["TORCH_INDEX_URL"] = ""
            if not (WHEELS / wheel.name).exists():
                placed = WHEELS / wheel.name
                try:
                    os.link(wheel, placed)
                except OSError:  # another file system
                    shutil.copyfile(wheel, placed)
        try:
            self.build(DOCKERFILE, tag, args, REPO, verbose)
        finally:
            if placed is not None:
                placed.unlink()
        return tag

    def build_prometheus(
        self, tag: str = "diloco-prometheus:latest", base: str = BASE_TAG, verbose: bool = False
    ) -> str:
        self.build(PROMETHEUS_DOCKERFILE, tag, {"BASE_IMAGE": base}, None, verbose)
        return tag


def apt_mirror() -> str:
    """The Debian mirror apt uses here for bookworm (sources.list or deb822 .sources)."""
    lists = [
        Path("/etc/apt/sources.list"),
        *sorted(Path("/etc/apt/sources.list.d").glob("*.sources")),
    ]
    for path in lists:
        text = path.read_text() if path.is_file() else ""
        one_line = re.search(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M)
        if one_line:
            return one_line.group(1)
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(re.findall(r"^([\w-]+):\s*(.*)$", stanza, re.M))
            if (
                "deb" in fields.get("Types", "").split()
                and "bookworm" in fields.get("Suites", "").split()
            ):
                return fields["URIs"].split()[0]
    raise Unavailable("apt has no Debian bookworm mirror here to debootstrap from")


def _prepare_rootfs(rootfs: Path) -> None:
    """What the official Debian images do (no services started by packages, no apt caches), plus
    this host's CA bundle and pip index settings, so that pip in a build reaches what pip here does."""
    policy = rootfs / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    bundle = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
    if bundle.is_file():
        shutil.copyfile(bundle, rootfs / "etc/ssl/certs/ca-certificates.crt")
    conf = ["[global]", "cert = /etc/ssl/certs/ca-certificates.crt"]
    for key in ("index-url", "extra-index-url", "trusted-host", "default-timeout"):
        value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if value:
            conf.append(f"{key} = {value}")
    (rootfs / "etc/pip.conf").write_text("\n".join(conf) + "\n")
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / cache).glob("*"):
            if p.is_file():
                p.unlink()


def torch_wheel(dirs: Sequence[Path] | None = None) -> Path | None:
    """A torch wheel for the base's Python in `dirs` (default: pip's find-links, PIP_FIND_LINKS),
    the version the Dockerfile pins first; None when there is none."""
    if dirs is None:
        links = os.environ.get("PIP_FIND_LINKS", "").split()
        dirs = [Path(link.removeprefix("file://")) for link in links]
    pin = re.search(r"^ARG TORCH_SPEC=torch==(\S+)", DOCKERFILE.read_text(), re.M)
    found = [
        w
        for d in dirs
        if d.is_dir()
        for w in sorted(d.glob(f"torch-*-{PYTHON_TAG}-*{platform.machine()}.whl"))
    ]
    pinned = [w for w in found if pin and w.name.split("-")[1].split("+")[0] == pin.group(1)]
    candidates = pinned or found
    return candidates[0] if candidates else None


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    return [p for p in points if (p + "/").startswith(prefix)]


def _unmount_under(path: Path) -> None:
    """Unmounts what debootstrap or a killed daemon left mounted below `path`, deepest first."""
    for point in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


def _client_env() -> dict[str, str]:
    env = dict(os.environ)
    buildx = subprocess.run(
        ["docker", "buildx", "version"], capture_output=True, env=env, timeout=30
    )
    if buildx.returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"  # the client's BuildKit needs the buildx plugin
    return env


@contextlib.contextmanager
def docker_daemon(root: Path | None = None) -> Iterator[Docker]:
    """The daemon already running, if one answers; else a dockerd started here with its state
    under `root` (a temporary directory, removed afterwards, when None) and stopped at the end."""
    if shutil.which("docker") is None:
        raise Unavailable(
            "no `docker` client on PATH (bash deploy/ci/install-tools.sh installs docker.io)"
        )
    env = _client_env()
    if subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=60).returncode == 0:
        yield Docker(env)
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise Unavailable(
            "no Docker daemon answers and no `dockerd` to start (bash deploy/ci/install-tools.sh installs docker.io)"
        )
    if os.geteuid() != 0:
        raise Unavailable("no Docker daemon answers, and starting dockerd needs root")
    temporary = root is None
    root = Path(tempfile.mkdtemp(prefix="diloco-docker-")) if root is None else root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    (root / "daemon.json").write_text("{}\n")  # not /etc/docker/daemon.json: these flags decide
    env["DOCKER_HOST"] = f"unix://{root / 'docker.sock'}"
    log = root / "dockerd.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                dockerd,
                "--config-file",
                str(root / "daemon.json"),
                "--data-root",
                str(root / "data"),
                "--exec-root",
                str(root / "exec"),
                "--pidfile",
                str(root / "dockerd.pid"),
                "-H",
                env["DOCKER_HOST"],
                "--iptables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--bridge=none",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while (
            subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=60).returncode
            != 0
        ):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(
                    f"dockerd could not start here: {_tail(log.read_text(errors='replace'), 1)}"
                )
            time.sleep(0.5)
        yield Docker(env, log)
    finally:
        _stop_daemon(proc, root)
        _unmount_under(root)  # dockerd leaves exec/netns/default mounted
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


def _stop_daemon(proc: subprocess.Popen[bytes], root: Path) -> None:
    """SIGTERM to dockerd (it stops its containers and its containerd), SIGKILL after 60 s; then
    the containerd it started, should that have outlived it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    pidfile = root / "exec" / "containerd" / "containerd.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text())
        if str(root) in Path(f"/proc/{pid}/cmdline").read_text():
            os.kill(pid, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="local_image.py",
        description="Build the Decoupled DiLoCo image (and a Prometheus image) on a Debian base made "
        "from Debian's packages, where no container registry is reachable.",
    )
    parser.add_argument(
        "command",
        choices=("build", "daemon"),
        help="build: the base, the image and the Prometheus image; "
        "daemon: run the daemon that holds them until Ctrl-C",
    )
    parser.add_argument(
        "--tag", default="diloco:latest", help="the image's tag (default: %(default)s)"
    )
    parser.add_argument(
        "--prometheus-tag",
        default="diloco-prometheus:latest",
        help="the Prometheus image's tag (default: %(default)s)",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path.home() / ".cache" / "diloco-docker",
        help="state of a dockerd started here (its images stay there between runs); "
        "unused where a daemon is running already (default: %(default)s)",
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        action="append",
        help="a folder with a torch wheel for Python 3.11 (default: PIP_FIND_LINKS)",
    )
    args = parser.parse_args(argv)
    try:
        with docker_daemon(args.root) as docker:
            if args.command == "daemon":
                return _serve(docker)
            t0 = time.monotonic()
            base = docker.base_image()
            print(f"local-image: base {base} ready after {time.monotonic() - t0:.0f} s", flush=True)
            wheel = torch_wheel(args.wheels)
            print(
                f"local-image: torch from {wheel or 'the torch index (no local wheel found)'}",
                flush=True,
            )
            docker.build_image(args.tag, base, wheel, verbose=True)
            docker.build_prometheus(args.prometheus_tag, base, verbose=True)
            print(
                f"local-image: built {args.tag} and {args.prometheus_tag} in {time.monotonic() - t0:.0f} s",
                flush=True,
            )
            return 0
    except Unavailable as e:
        print(f"local-image: skipped: {e}", file=sys.stderr)
        return SKIPPED


def _serve(docker: Docker) -> int:
    if docker.log is None:
        print("local-image: a Docker daemon is running already; nothing to start")
        return 0
    print(
        f"export DOCKER_HOST={docker.env['DOCKER_HOST']}  # until Ctrl-C; log: {docker.log}",
        flush=True,
    )
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
