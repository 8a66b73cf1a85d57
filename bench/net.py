"""The benchmarks' network: how learner processes reach each other, at what rate, and the bytes
each one sent and received, counted where they cross its link.

Two implementations of one small interface (`Links`), chosen by `open_links`:

- `Namespaces` (root only): every learner slot gets its own network namespace with a veth pair
  into a bridge in this namespace; the Synchronizer listens on the bridge's address. Bytes are
  the veth's own interface counters (`/sys/class/net/IF/statistics`): every frame the learner
  process put on or took off its link, TCP/IP and HTTP/2 overhead, ACKs, heartbeats and
  data-parallel rendezvous included, counted by the kernel and not by the code under test. That
  is why the benchmarks prefer it: gloo (torch.distributed) opens peer-to-peer connections
  whose addresses it exchanges itself, so a proxy cannot sit in its path, but a namespace sees
  everything. `rate_bps` shapes both directions of each link with `tc tbf` (netem, for latency,
  is not in this kernel). Everything is created under a unique name prefix and removed on close.
- `Proxies` (no root needed; the test suite's path): each slot reaches the Synchronizer through
  a TCP proxy in this process that counts the bytes (TCP payload, so without the headers the
  namespace path sees) and, given `rate_bps`, limits each direction with a token bucket.
  Data-parallel ranks cannot be proxied (see above): they run on loopback unshaped, and count
  their own sockets' bytes (`socket_bytes`, from the kernel's TCP_INFO).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator


class LinkError(RuntimeError):
    """The requested network could not be set up here."""


class Links:
    """One link per learner slot. Subclasses fill in the addresses and the counters."""

    kind = "none"
    shaped_dp = False  # whether data-parallel ranks' links are shaped too

    def __init__(self, slots: int, rate_bps: float | None = None) -> None:
        self.slots = slots
        self.rate_bps = rate_bps
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    # what a process needs to run on slot i
    def bind_host(self) -> str:
        """Where the Synchronizer listens."""
        return "127.0.0.1"

    def synchronizer_address(self, slot: int, port: int) -> str:
        return f"127.0.0.1:{port}"

    def wrap(self, slot: int, cmd: list[str]) -> list[str]:
        return cmd

    def slot_host(self, slot: int) -> str:
        """The address other slots reach slot i at (data-parallel rendezvous)."""
        return "127.0.0.1"

    def gloo_ifname(self, slot: int) -> str:
        return "lo"

    def counters(self) -> list[tuple[int, int]] | None:
        """(sent, received) bytes per slot so far, or None where this path cannot count."""
        return None

    # counting over time
    def start_sampling(self, interval_s: float = 0.05) -> None:
        """Samples every slot's counters in the background (for steady-state windows)."""
        self.stop_sampling()
        self.samples = []
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                c = self.counters()
                if c is not None:
                    self.samples.append((time.time(), c))

        self._sampler = threading.Thread(target=loop, daemon=True)
        self._sampler.start()

    def stop_sampling(self) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            c = self.counters()
            if c is not None:
                self.samples.append((time.time(), c))

    def at(self, slot: int, t: float) -> tuple[float, float] | None:
        """Slot i's (sent, received) at wall time t, interpolated between samples."""
        for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:], strict=False):
            if t0 <= t <= t1:
                f = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                (s0, r0), (s1, r1) = c0[slot], c1[slot]
                return s0 + f * (s1 - s0), r0 + f * (r1 - r0)
        return None

    def close(self) -> None:
        self.stop_sampling()

    def __enter__(self) -> Links:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise LinkError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")


class Namespaces(Links):
    """A bridge here, and per slot a namespace joined to it by a veth pair (optionally shaped)."""

    kind = "netns"
    shaped_dp = True

    def __init__(self, slots: int, rate_bps: float | None = None) -> None:
        super().__init__(slots, rate_bps)
        if (
            os.geteuid() != 0
            or shutil.which("ip") is None
            or (rate_bps and shutil.which("tc") is None)
        ):
            raise LinkError("network namespaces need root and iproute2 (ip, tc)")
        self.prefix = f"db{os.getpid() % 10000:04d}{random.randrange(36**2):02x}"[:9]
        self.net = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
        self.bridge = f"{self.prefix}br"
        self.created: list[tuple[str, str]] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def _veth(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        _no_ipv6(self.bridge)
        _run("ip", "addr", "add", f"{self.net}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.slots):
            ns, veth = self._ns(i), self._veth(i)
            _run("ip", "netns", "add", ns)
            self.created.append(("netns", ns))
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.created.append(("link", veth))
            _no_ipv6(veth)
            _run(
                "ip",
                "netns",
                "exec",
                ns,
                "sh",
                "-c",
                "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6",
            )
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.slot_host(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate_bps:
                # burst: 10 ms of traffic, at least 32 KiB (it must exceed the MTU by far);
                # queue: 100 ms at the rate before tbf drops
                rate = int(self.rate_bps)
                burst = max(32 << 10, rate // 8 // 100)
                shape = [
                    "root",
                    "tbf",
                    "rate",
                    f"{rate}bit",
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                ]
                _run("tc", "qdisc", "add", "dev", veth, *shape)  # toward the learner
                _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *shape)  # from the learner

    def bind_host(self) -> str:
        return f"{self.net}.1"

    def synchronizer_address(self, slot: int, port: int) -> str:
        return f"{self.net}.1:{port}"

    def wrap(self, slot: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self._ns(slot), *cmd]

    def slot_host(self, slot: int) -> str:
        return f"{self.net}.{slot + 2}"

    def gloo_ifname(self, slot: int) -> str:
        return "eth0"

    def counters(self) -> list[tuple[int, int]]:
        out = []
        for i in range(self.slots):
            stats = f"/sys/class/net/{self._veth(i)}/statistics"
            # the bridge side's rx is what the learner sent, its tx what the learner received
            with open(f"{stats}/rx_bytes") as rx, open(f"{stats}/tx_bytes") as tx:
                out.append((int(rx.read()), int(tx.read())))
        return out

    def close(self) -> None:
        super().close()
        for kind, name in reversed(self.created):
            cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(
                cmd, capture_output=True
            )  # a veth goes with its namespace: errors are fine
        self.created = []


def _no_ipv6(ifname: str) -> None:
    """No router solicitations or neighbour discovery chatter in the counts."""
    with contextlib.suppress(OSError):
        with open(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6", "w") as f:
            f.write("1")


class TokenBucket:
    """rate_bps bits per second, in bursts of at most 64 KiB; thread-safe."""

    def __init__(self, rate_bps: float, burst: int = 64 << 10) -> None:
        self.rate = rate_bps / 8
        self.burst = burst
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
                self.last = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
            time.sleep(wait)


class Proxies(Links):
    """Per slot a TCP proxy in this process in front of the Synchronizer: counts and limits."""

    kind = "proxy"

    def __init__(self, slots: int, rate_bps: float | None = None) -> None:
        super().__init__(slots, rate_bps)
        self.bytes = [[0, 0] for _ in range(slots)]
        self.lock = threading.Lock()
        self.listeners: list[socket.socket] = []
        self.ports: list[int] = []
        self.target: tuple[str, int] | None = None
        self.closed = threading.Event()
        self.buckets = [
            [TokenBucket(rate_bps), TokenBucket(rate_bps)] if rate_bps else [None, None]
            for _ in range(slots)
        ]
        for i in range(slots):
            s = socket.create_server(("127.0.0.1", 0))
            self.listeners.append(s)
            self.ports.append(s.getsockname()[1])
            threading.Thread(target=self._accept, args=(i, s), daemon=True).start()

    def synchronizer_address(self, slot: int, port: int) -> str:
        self.target = ("127.0.0.1", port)
        return f"127.0.0.1:{self.ports[slot]}"

    def counters(self) -> list[tuple[int, int]]:
        with self.lock:
            return [(s, r) for s, r in self.bytes]

    def _accept(self, slot: int, server: socket.socket) -> None:
        while not self.closed.is_set():
            try:
                client, _ = server.accept()
            except OSError:
                return
            if self.target is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._pump, args=(slot, 0, client, upstream), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(slot, 1, upstream, client), daemon=True
            ).start()

    def _pump(self, slot: int, direction: int, src: socket.socket, dst: socket.socket) -> None:
        """direction 0: learner -> Synchronizer (sent), 1: back (received)."""
        bucket = self.buckets[slot][direction]
        try:
            while data := src.recv(16 << 10):
                if bucket is not None:
                    bucket.take(len(data))
                dst.sendall(data)
                with self.lock:
                    self.bytes[slot][direction] += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        super().close()
        self.closed.set()
        for s in self.listeners:
            s.close()


def open_links(kind: str, slots: int, rate_bps: float | None = None) -> Links:
    """kind: "netns", "proxy", or "auto" (namespaces where they can be made, else proxies)."""
    if kind == "proxy":
        return Proxies(slots, rate_bps)
    try:
        return Namespaces(slots, rate_bps)
    except LinkError:
        if kind == "netns":
            raise
        return Proxies(slots, rate_bps)


# A process's own TCP sockets ---------------------------------------------------------------------

# struct tcp_info (linux/tcp.h): tcpi_bytes_acked is a u64 at offset 120, tcpi_bytes_received at 128
_TCP_INFO_LEN = 136


def socket_bytes() -> tuple[int, int]:
    """(sent and acknowledged, received) payload bytes over every TCP socket this process has
    open now, from the kernel's TCP_INFO: what a process can count of itself without root."""
    sent = received = 0
    for fd in _fds():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) >= _TCP_INFO_LEN:
                acked, got = struct.unpack_from("QQ", info, 120)
                sent += acked
                received += got
        except OSError:
            pass
        finally:
            s.close()
    return sent, received


def _fds() -> Iterator[int]:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                yield int(name)
        except OSError:
            continue
