"""The benchmarks' network: how learner processes reach each other, at what rate and round-trip
time, and the bytes each one sent and received, counted where they cross its link.

Two implementations of one small interface (`Links`), chosen by `open_links`:

- `Namespaces` (root only): every learner slot gets its own network namespace with a veth pair
  into a bridge in this namespace; the Synchronizer listens on the bridge's address. Bytes are
  the veth's own interface counters (`/sys/class/net/IF/statistics`): every frame the learner
  process put on or took off its link, TCP/IP and HTTP/2 overhead, ACKs, heartbeats and
  data-parallel rendezvous included, counted by the kernel and not by the code under test. That
  is why the benchmarks prefer it: gloo (torch.distributed) opens peer-to-peer connections
  whose addresses it exchanges itself, so a proxy cannot sit in its path, but a namespace sees
  everything. `rate_bps` shapes both directions of each link with `tc tbf`. `rtt_s` (netem, for
  latency, is not in this kernel) puts a transparent delaying proxy in front of every TCP
  connection a slot opens: an iptables `nat OUTPUT` rule in the slot's namespace REDIRECTs each
  outgoing connection on eth0 (loopback and the proxy's own, marked, connections excepted) to a
  listener that this process opened *inside* that namespace (setns from one thread); the proxy
  reads the original destination (SO_ORIGINAL_DST; the NAT entry is the namespace's own, which
  is why the proxy cannot sit on the bridge), connects to it from the namespace, so the bytes
  still cross the shaped veth and are counted there, waits one RTT (the handshake) and relays
  each chunk `rtt_s / 2` after it arrived, in each direction (`Relay`). A connection is delayed
  once, at the side that opens it: learner to Synchronizer, learner to gloo master and learner
  to learner (gloo's pairs) are each `rtt_s` apart, a star of equal round trips.
- `Proxies` (no root needed; the test suite's path): each slot reaches the Synchronizer through
  a TCP proxy in this process that counts the bytes (TCP payload, so without the headers the
  namespace path sees), given `rate_bps` limits each direction with a token bucket and given
  `rtt_s` delays it like the namespaces' proxy. Data-parallel ranks cannot be proxied (see
  above): they would run on loopback, neither limited nor delayed (`Links.dp_unshaped` says why,
  and a figure measured against data parallel over limited or delayed links is then missing, not
  a number), and count their own sockets' bytes (`socket_bytes`, from the kernel's TCP_INFO).

`Links.verify` measures every link as a process on its slot sees it (round trip to the
Synchronizer's address, and to slot 0 for data parallel's peers; bulk throughput each way) and
refuses links whose round trip is far from the one asked for.

What the delay does not model: the relayed TCP connections themselves run over a link with no
round trip, so TCP's own window growth (slow start, and its restart after idle) never waits for
the emulated RTT. A real WAN makes bursty traffic (data parallel's all-reduce every step) pay
that too; here it does not, which errs in data parallel's favour.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import socket
import statistics
import struct
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class LinkError(RuntimeError):
    """The requested network could not be set up here."""


class Links:
    """One link per learner slot. Subclasses fill in the addresses and the counters."""

    kind = "none"
    shaped_dp = False  # whether data-parallel ranks' links are shaped too

    def __init__(self, slots: int, rate_bps: float | None = None, rtt_s: float = 0.0) -> None:
        if rtt_s < 0:
            raise ValueError(f"rtt_s must be >= 0, got {rtt_s}")
        self.slots = slots
        self.rate_bps = rate_bps
        self.rtt_s = rtt_s
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

    def client_socket(self, slot: int) -> socket.socket:
        """A TCP socket made where a process on slot i makes its sockets."""
        return socket.socket()

    def dp_unshaped(self) -> str | None:
        """Why data-parallel ranks' traffic would not get this link's rate and round trip, or
        None where it would (or where the links are neither limited nor delayed)."""
        return None

    # checking the links
    def measure(self, pings: int = 9) -> list[dict[str, Any]]:
        """Per slot, the link as a process on it sees it, towards the Synchronizer's address:
        `rtt_ms` (median of `pings` one-byte round trips on one connection), `up_mbit` and
        `down_mbit` (a bulk transfer each way, its time less one round trip). Run it before a
        job starts: it points the slots at a check server of its own."""
        bulk = _bulk_bytes(self.rate_bps)
        with CheckServer(socket.create_server((self.bind_host(), 0))) as server:
            out = []
            for i in range(self.slots):
                host, port = self.synchronizer_address(i, server.port).rsplit(":", 1)
                out.append(
                    {
                        "slot": i,
                        **measure_link(
                            partial(self.client_socket, i), (host, int(port)), pings, bulk
                        ),
                    }
                )
        return out

    def verify(self, tolerance_ms: float = 5.0, tolerance: float = 0.2) -> list[dict[str, Any]]:
        """`measure`, then refuse (LinkError) when any link's round trip is off the requested
        `rtt_s` by more than `tolerance_ms` and `tolerance` of it: its least round trip where
        measured (a busy machine delays the relays' threads, adding to some round trips, never
        taking from them; a link that never comes within the tolerance is not the one asked
        for), else its median. A link that carries less than 70% of `rate_bps` is flagged
        (`rate_short`), not refused: the figures say so."""
        measured = self.measure()
        want = self.rtt_s * 1e3
        allowed = max(tolerance_ms, tolerance * want)
        for m in measured:
            for median in ("rtt_ms", "peer_rtt_ms"):
                key = median.replace("rtt_ms", "rtt_min_ms")
                key = key if key in m else median
                if key in m and abs(m[key] - want) > allowed:
                    raise LinkError(
                        f"slot {m['slot']}: measured {key} {m[key]:.1f} ms, asked for {want:g} ms "
                        f"(allowed +-{allowed:.1f} ms); the links are not what the run needs"
                    )
            if self.rate_bps:
                m["rate_short"] = min(m["up_mbit"], m["down_mbit"]) < 0.7 * self.rate_bps / 1e6
        return measured

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

    def __init__(self, slots: int, rate_bps: float | None = None, rtt_s: float = 0.0) -> None:
        super().__init__(slots, rate_bps, rtt_s)
        if (
            os.geteuid() != 0
            or shutil.which("ip") is None
            or (rate_bps and shutil.which("tc") is None)
            or (rtt_s and shutil.which("iptables") is None)
        ):
            raise LinkError(
                "network namespaces need root and iproute2 (ip, tc), and iptables for rtt_s"
            )
        self.listeners: list[socket.socket] = []
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
            if self.rtt_s:
                self._delay(i)

    def _delay(self, i: int) -> None:
        """Slot i's transparent delaying proxy: a listener in its namespace and the rules that
        send every TCP connection the slot opens on eth0 to it (see the module's docstring)."""
        ns = self._ns(i)
        server = in_netns(ns, lambda: socket.create_server(("127.0.0.1", 0)))
        self.listeners.append(server)
        nat = ["ip", "netns", "exec", ns, "iptables", "-w", "-t", "nat", "-A", "OUTPUT"]
        _run(*nat, "-m", "mark", "--mark", str(_MARK), "-j", "RETURN")  # the proxy's own
        _run(
            *nat,
            "-o",
            "eth0",
            "-p",
            "tcp",
            "-j",
            "REDIRECT",
            "--to-ports",
            str(server.getsockname()[1]),
        )
        threading.Thread(target=self._accept, args=(ns, server), daemon=True).start()

    def _accept(self, ns: str, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._relay, args=(ns, client), daemon=True).start()

    def _relay(self, ns: str, client: socket.socket) -> None:
        try:
            raw = client.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
            target = (socket.inet_ntoa(raw[4:8]), struct.unpack_from("!H", raw, 2)[0])
            upstream = _connect(lambda: in_netns(ns, _marked_socket), target)
        except OSError:
            _reset(client)  # as the destination refused it (the client's connect already passed)
            return
        time.sleep(self.rtt_s)  # the handshake's round trip, which the local connect skipped
        Relay(client, upstream, self.rtt_s / 2)

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

    def client_socket(self, slot: int) -> socket.socket:
        return in_netns(self._ns(slot), socket.socket)

    def measure(self, pings: int = 9) -> list[dict[str, Any]]:
        """As `Links.measure`, and for slots 1.. also `peer_rtt_ms` to slot 0 (data parallel's
        peers talk to each other directly: their round trip must be `rtt_s` too, not twice)."""
        out = super().measure(pings)
        if self.slots > 1:
            listener = in_netns(self._ns(0), lambda: socket.create_server((self.slot_host(0), 0)))
            with CheckServer(listener) as server:
                for m in out[1:]:
                    peer = measure_link(
                        partial(self.client_socket, m["slot"]),
                        (self.slot_host(0), server.port),
                        pings,
                        0,
                    )
                    m["peer_rtt_ms"], m["peer_rtt_min_ms"] = peer["rtt_ms"], peer["rtt_min_ms"]
        return out

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
        for s in self.listeners:
            s.close()
        for kind, name in reversed(self.created):
            cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(
                cmd, capture_output=True
            )  # a veth goes with its namespace: errors are fine
        self.created = []

    # Faults on one slot's link (bench/netfaults.py times them; tests/test_netfaults.py) ----------

    def partition(self, slot: int) -> None:
        """Cuts slot i off until `heal`: the bridge's end of its veth goes down, so nothing
        crosses the link either way (frames queued in its shaping are dropped too, and the
        veth's counters stop). Connections stay open and their TCP retransmits, as across a
        real partition: neither end is told."""
        _run("ip", "link", "set", self._veth(slot), "down")

    def heal(self, slot: int) -> None:
        """Ends slot i's partition (a no-op if it has none)."""
        _run("ip", "link", "set", self._veth(slot), "up")

    def partitioned(self, slot: int) -> bool:
        """Whether slot i is cut off."""
        with open(f"/sys/class/net/{self._veth(slot)}/flags") as f:
            return not int(f.read(), 16) & 1  # IFF_UP

    def reset(self, slot: int) -> int:
        """Resets every TCP connection slot i has open across its link: `ss -K` aborts them in
        its namespace (the processes there see ECONNABORTED) and the kernel sends each peer a
        RST (ECONNRESET there). Returns how many were reset."""
        ns = self._ns(slot)
        r = subprocess.run(
            ["ip", "netns", "exec", ns, "ss", "-K", "-t", "-n", "-H", "dst", f"{self.net}.0/24"],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise LinkError(f"ss -K in {ns}: {r.stderr.strip() or r.stdout.strip()}")
        return len(r.stdout.splitlines())

    def shape(self, slot: int, rate_bps: float, burst_bytes: int = 3000) -> None:
        """Limits slot i's link to `rate_bps` each way with a bucket of `burst_bytes` (more
        than one frame): unlike the construction's 10 ms bucket, small transfers are paced too,
        so a push or a pull of a few KiB lasts long enough to be caught while it flows."""
        ns, veth = self._ns(slot), self._veth(slot)
        shape = ["root", "tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst_bytes)]
        shape += ["latency", "50ms"]
        _run("tc", "qdisc", "replace", "dev", veth, *shape)  # toward the learner
        _run("tc", "-n", ns, "qdisc", "replace", "dev", "eth0", *shape)  # from the learner


def _no_ipv6(ifname: str) -> None:
    """No router solicitations or neighbour discovery chatter in the counts."""
    with contextlib.suppress(OSError):
        with open(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6", "w") as f:
            f.write("1")


# Delay: relaying a connection with a round trip ---------------------------------------------------

_SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
_MARK = 0x5A1  # the delaying proxy's own connections, which its REDIRECT rule lets pass
_CLONE_NEWNET = 0x40000000
_CHUNK = 64 << 10
_QUEUE_CAP = 4 << 20  # bytes a direction holds before it stops reading: far above rate x delay
_CONNECT_RETRY_S = 30.0  # how long a refused destination is retried (gloo's peers start late)


def in_netns(ns: str, make: Callable[[], T]) -> T:
    """`make()` run with this thread in network namespace `ns` (an `ip netns` name): sockets
    it creates stay in that namespace. Only the calling thread moves, and it moves back."""
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(there, _CLONE_NEWNET) != 0:
            raise LinkError(f"setns into {ns}: {os.strerror(ctypes.get_errno())}")
        try:
            return make()
        finally:
            if libc.setns(here, _CLONE_NEWNET) != 0:  # a thread left elsewhere is a bug
                raise AssertionError(f"setns back from {ns}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(here)
        os.close(there)


def _marked_socket() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, _MARK)
    return s


def _connect(make: Callable[[], socket.socket], target: tuple[str, int]) -> socket.socket:
    """Connects a fresh `make()` socket to target, retrying a refusal for a while: the client
    already got its connection (to the proxy), so a refusal could not reach it as one, and
    gloo's and the TCP store's clients retry refusals themselves."""
    deadline = time.monotonic() + _CONNECT_RETRY_S
    while True:
        s = make()
        try:
            s.connect(target)
            return s
        except ConnectionRefusedError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # nothing to wait on: the destination is not listening yet
        except OSError:
            s.close()
            raise


def _reset(s: socket.socket) -> None:
    """Closes s with a reset, as a refused or broken connection."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


class _Pipe:
    """One direction of a relayed connection: a reader stamps each chunk with the time it may
    leave (now + delay) and queues it; a writer sends each chunk when its time comes (shaped by
    `bucket` if any). The delay is paid once per chunk, in parallel with the others, so a bulk
    transfer keeps its rate and only starts `delay_s` later."""

    def __init__(
        self,
        src: socket.socket,
        dst: socket.socket,
        delay_s: float,
        bucket: TokenBucket | None,
        on_sent: Callable[[int], None] | None,
        on_end: Callable[[bool], None],
    ) -> None:
        self.src, self.dst, self.delay_s, self.bucket = src, dst, delay_s, bucket
        self.on_sent, self.on_end = on_sent, on_end
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.broken = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self.src.recv(_CHUNK):
                self._put(data)
        except OSError:
            pass
        self._put(b"")  # the end of the stream

    def _put(self, data: bytes) -> None:
        with self.cond:
            while self.queued >= _QUEUE_CAP and not self.broken:
                self.cond.wait()
            self.queue.append((time.monotonic() + self.delay_s, data))
            self.queued += len(data)
            self.cond.notify_all()

    def _next(self) -> bytes:
        with self.cond:
            while True:
                if self.queue:
                    left = self.queue[0][0] - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)
                else:
                    self.cond.wait()
            _, data = self.queue.popleft()
            self.queued -= len(data)
            self.cond.notify_all()
            return data

    def _write(self) -> None:
        ok = False
        try:
            while data := self._next():
                if self.bucket is not None:
                    self.bucket.take(len(data))
                self.dst.sendall(data)
                if self.on_sent is not None:
                    self.on_sent(len(data))
            self.dst.shutdown(socket.SHUT_WR)
            ok = True
        except OSError:
            pass
        finally:
            with self.cond:
                self.broken = not ok
                self.cond.notify_all()
            self.on_end(ok)


class Relay:
    """Copies a <-> b in both directions, each chunk `delay_s` after it arrived (so a round trip
    through the relay takes 2 x delay_s more), optionally shaped by a token bucket per direction
    (0: a -> b) and counted (`count(direction, nbytes)`); closes both sockets when both
    directions have ended, and breaks both when either fails."""

    def __init__(
        self,
        a: socket.socket,
        b: socket.socket,
        delay_s: float = 0.0,
        buckets: tuple[TokenBucket | None, TokenBucket | None] = (None, None),
        count: Callable[[int, int], None] | None = None,
    ) -> None:
        self.sockets = (a, b)
        self.open = 2
        self.lock = threading.Lock()
        for s in self.sockets:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for d, (src, dst) in enumerate(((a, b), (b, a))):
            on_sent = None if count is None else partial(count, d)
            _Pipe(src, dst, delay_s, buckets[d], on_sent, self._ended)

    def _ended(self, ok: bool) -> None:
        if not ok:
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        with self.lock:
            self.open -= 1
            last = self.open == 0
        if last:
            for s in self.sockets:
                s.close()


# Checking a link: round trip and throughput -----------------------------------------------------


class CheckServer:
    """Serves link checks on a listening socket, commands one after another on a connection:
    `p` is answered `p` (a ping); `u` + an 8-byte count: reads that many bytes, answers `k`;
    `d` + a count: sends that many bytes."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.port = listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while op := conn.recv(1):
                if op == b"p":
                    conn.sendall(b"p")
                    continue
                (n,) = struct.unpack("!Q", _recv_exactly(conn, 8))
                if op == b"u":
                    while n > 0:
                        got = conn.recv(min(n, _CHUNK))
                        if not got:
                            return
                        n -= len(got)
                    conn.sendall(b"k")
                elif op == b"d":
                    _send_zeros(conn, n)
                else:
                    return

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> CheckServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise ConnectionError("the link check's peer closed early")
        buf += got
    return bytes(buf)


def _bulk_bytes(rate_bps: float | None) -> int:
    """About 0.3 s of traffic at the rate, 1-16 MiB (8 MiB unshaped)."""
    if not rate_bps:
        return 8 << 20
    return int(min(16 << 20, max(1 << 20, rate_bps / 8 * 0.3)))


def _send_zeros(s: socket.socket, n: int) -> None:
    block = bytes(_CHUNK)
    while n > 0:
        s.sendall(block[: min(n, _CHUNK)])
        n -= min(n, _CHUNK)


def measure_link(
    make: Callable[[], socket.socket], address: tuple[str, int], pings: int = 9, bulk: int = 0
) -> dict[str, float]:
    """Against a `CheckServer` at address, over one connection from a socket `make()` creates:
    `rtt_ms`, the median of `pings` one-byte round trips after a first one (which pays the
    connection's set-up), `rtt_min_ms` the least of them, and with `bulk` bytes, `up_mbit` / `down_mbit`: bulk x 8 over the
    transfer's time less that round trip (the first byte's way there and the last one's way
    back, or the request's)."""
    out: dict[str, float] = {}
    with contextlib.closing(make()) as s:
        s.settimeout(60)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.connect(address)
        times = []
        for _ in range(pings + 1):
            t = time.perf_counter()
            s.sendall(b"p")
            _recv_exactly(s, 1)
            times.append(time.perf_counter() - t)
        rtt = statistics.median(times[1:])
        out["rtt_ms"] = rtt * 1e3
        out["rtt_min_ms"] = min(times[1:]) * 1e3
        if bulk:
            t = time.perf_counter()
            s.sendall(b"u" + struct.pack("!Q", bulk))
            _send_zeros(s, bulk)
            _recv_exactly(s, 1)
            out["up_mbit"] = bulk * 8 / max(time.perf_counter() - t - rtt, 1e-6) / 1e6
            t = time.perf_counter()
            s.sendall(b"d" + struct.pack("!Q", bulk))
            got = 0
            while got < bulk:
                chunk = s.recv(_CHUNK)
                if not chunk:
                    raise ConnectionError("the link check's peer closed early")
                got += len(chunk)
            out["down_mbit"] = bulk * 8 / max(time.perf_counter() - t - rtt, 1e-6) / 1e6
    return out


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
    """Per slot a TCP proxy in this process in front of the Synchronizer: counts, limits the
    rate and delays (the same `Relay` as the namespaces' delaying proxy)."""

    kind = "proxy"

    def __init__(
        self,
        slots: int,
        rate_bps: float | None = None,
        rtt_s: float = 0.0,
        instead_of_netns: str = "",
    ) -> None:
        """`instead_of_netns`: why namespaces could not be made, where these stand in for them."""
        super().__init__(slots, rate_bps, rtt_s)
        self.instead_of_netns = instead_of_netns
        self.bytes = [[0, 0] for _ in range(slots)]
        self.lock = threading.Lock()
        self.listeners: list[socket.socket] = []
        self.ports: list[int] = []
        self.target: tuple[str, int] | None = None
        self.buckets: list[tuple[TokenBucket | None, TokenBucket | None]] = [
            (TokenBucket(rate_bps), TokenBucket(rate_bps)) if rate_bps else (None, None)
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

    def dp_unshaped(self) -> str | None:
        if not (self.rate_bps or self.rtt_s):
            return None
        why = (
            "data parallel's ranks (gloo) connect to each other directly, around the per-slot "
            "proxies, so its traffic would be neither limited nor delayed; namespace links "
            "(--net netns) need root, iproute2 and iptables (bash deploy/ci/install-tools.sh)"
        )
        if self.instead_of_netns:
            why += f"; namespaces here: {self.instead_of_netns}"
        return why

    def _count(self, slot: int, direction: int, n: int) -> None:
        """direction 0: learner -> Synchronizer (sent), 1: back (received)."""
        with self.lock:
            self.bytes[slot][direction] += n

    def _accept(self, slot: int, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed
            if self.target is None:
                client.close()
                continue
            threading.Thread(
                target=self._relay, args=(slot, client, self.target), daemon=True
            ).start()

    def _relay(self, slot: int, client: socket.socket, target: tuple[str, int]) -> None:
        try:
            upstream = socket.create_connection(target)
        except OSError:
            _reset(client)
            return
        if self.rtt_s:
            time.sleep(self.rtt_s)  # the handshake's round trip, which the local connect skipped
        Relay(
            client,
            upstream,
            self.rtt_s / 2,
            self.buckets[slot],
            lambda d, n: self._count(slot, d, n),
        )

    def close(self) -> None:
        super().close()
        for s in self.listeners:
            s.close()


def describe_links(measured: list[dict[str, Any]]) -> str:
    """One line per slot: what the link check measured."""
    lines = []
    for m in measured:
        line = f"    slot {m['slot']}: rtt {m['rtt_ms']:.1f} ms"
        if "peer_rtt_ms" in m:
            line += f" (to slot 0: {m['peer_rtt_ms']:.1f} ms)"
        line += f", up {m['up_mbit']:.1f} Mbit/s, down {m['down_mbit']:.1f} Mbit/s"
        if m.get("rate_short"):
            line += "  ** under 70% of the rate asked for **"
        lines.append(line)
    return "\n".join(lines)


def open_links(kind: str, slots: int, rate_bps: float | None = None, rtt_s: float = 0.0) -> Links:
    """kind: "netns", "proxy", or "auto" (namespaces where they can be made, else proxies).
    rate_bps limits each direction of every link; rtt_s gives each a round-trip time."""
    if kind == "proxy":
        return Proxies(slots, rate_bps, rtt_s)
    try:
        return Namespaces(slots, rate_bps, rtt_s)
    except LinkError as e:
        if kind == "netns":
            raise
        return Proxies(slots, rate_bps, rtt_s, instead_of_netns=str(e))


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
