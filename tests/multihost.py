"""Several hosts on one machine: network namespaces on a bridge, for tests that need real
TCP between hosts and want to see which link a byte crossed.

Each host is a network namespace with one interface, ``eth0``, the end of a veth pair
whose other end is a port of a bridge. The bridge lives in a namespace of its own (the
hub), so nothing is added to the root namespace's network, and the subnet exists only
inside these namespaces. The hub end of a host's veth is named after the host: its byte
counters are the host's link counters, and taking it down is pulling the host's cable
at the switch (the host sees its carrier go, its TCP connections stall until their
timeouts). Processes run in a host through ``ip netns exec`` and, by default, in a UTS
namespace of their own whose host name is the host's name, so every host has its own
name as separate machines do.

Root only (``ip netns``, veth, bridges, ``tc``): :func:`unavailable_reason` says why not
elsewhere. Namespace names carry the owning process id and a random tag, so parallel
runs never collide; :func:`cleanup_stale` removes what a killed run left.

Typical use::

    with MultiHost(["h0", "h1", "h2", "h3"]) as net:
        scheduler = net.start_scheduler("h0")
        net.start_workers("h1", scheduler, nworkers=2)
        driver = net.start_driver("h3", "multihost_driver.py", scheduler)
        before = net.counters()
        ...
        sent = net.counters_since(before)["h0"]   # LinkBytes(sent=..., received=...)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PREFIX = "daskwg-mh"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
NETNS_ETC = "/etc/netns"
HOSTS_FILE_MODES = ("loopback", "cluster", None)
DRIVER_MARK = "@@multihost "


class MultiHostError(RuntimeError):
    """A harness step failed (a command, a process that did not start, a wait that passed its bound)."""


def unavailable_reason() -> str | None:
    """Why hosts cannot be built here, or ``None`` where they can.

    Needs root (network namespaces, veth pairs, bridges and ``tc`` need
    ``CAP_NET_ADMIN``), Linux, and the ``ip``, ``tc``, ``unshare`` and ``hostname``
    commands.
    """
    if not sys.platform.startswith("linux"):
        return "multi-host tests need Linux network namespaces"
    if os.geteuid() != 0:
        return "multi-host tests need root (ip netns, veth, bridge, tc); run them as root"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"multi-host tests need the {tool!r} command (iproute2, util-linux, hostname)"
    probe = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed here: {exc}"
    if made.returncode != 0:
        return f"`ip netns` is unavailable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def _run(argv: Sequence[str], timeout: float = 20.0, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise MultiHostError(f"`{' '.join(argv)}` did not finish within {timeout:g} s") from exc
    if check and proc.returncode != 0:
        raise MultiHostError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _namespaces() -> list[str]:
    out = _run(["ip", "-j", "netns", "list"], check=False).stdout.strip()
    try:
        return [entry["name"] for entry in json.loads(out or "[]")]
    except (ValueError, KeyError, TypeError):
        return [line.split()[0] for line in out.splitlines() if line.strip()]


def _owner_pid(netns: str, prefix: str) -> int | None:
    parts = netns[len(prefix) + 1 :].split("-")
    try:
        return int(parts[0])
    except (ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process whose network namespace is ``netns`` (what a run started there)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [
            int(p) for p in _run(["ip", "netns", "pids", netns], check=False).stdout.split() if p.isdigit()
        ]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _delete_namespace(netns: str) -> None:
    _kill_namespace_processes(netns)
    _run(["ip", "netns", "del", netns], check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, netns), ignore_errors=True)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces named ``<prefix>-<pid>-...`` whose owning process is gone (a
    killed run), with the processes still running in them and their ``/etc/netns`` files.
    Namespaces of live runs, and names without a process id after the prefix, are left
    alone. Returns the names deleted."""
    stale = []
    for netns in _namespaces():
        pid = _owner_pid(netns, prefix) if netns.startswith(prefix + "-") else None
        if pid is None or _alive(pid):
            continue
        _delete_namespace(netns)
        stale.append(netns)
    if os.path.isdir(NETNS_ETC):
        for entry in os.listdir(NETNS_ETC):
            pid = _owner_pid(entry, prefix) if entry.startswith(prefix + "-") else None
            if pid is not None and not _alive(pid):
                shutil.rmtree(os.path.join(NETNS_ETC, entry), ignore_errors=True)
    return stale


@dataclasses.dataclass(frozen=True)
class Host:
    """One host: ``name`` (also its host name and the hub-side veth's name), ``netns``
    (its network namespace), ``address`` (IPv4 of ``interface`` inside it)."""

    name: str
    netns: str
    address: str
    interface: str = "eth0"


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Bytes over a host's link: ``sent`` by the host (into the bridge), ``received`` by it.
    Ethernet frames as the veth counts them (headers included)."""

    sent: int
    received: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.sent - other.sent, self.received - other.received)

    def __str__(self) -> str:
        return f"out {self.sent / (1 << 20):.2f} MiB, in {self.received / (1 << 20):.2f} MiB"


def _set_parent_death_signal() -> None:
    # A process started here gets SIGTERM when the test process dies, even by SIGKILL;
    # ip netns exec and unshare exec into the command, so this reaches it.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def dask_cli() -> list[str]:
    """The ``dask`` command of this interpreter's environment."""
    exe = shutil.which("dask", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "dask"]


class MultiHost:
    """Hosts in network namespaces on one bridge.

    Args:
        names: the hosts' names, e.g. ``["h0", "h1", "h2"]`` (at most 15 characters,
            letters, digits and ``-``), or a count ``n`` for ``h0 .. h{n-1}``.
        subnet: the first three octets of the /24 the hosts get addresses from
            (host ``i`` is ``<subnet>.<10 + i>``); it exists only in these namespaces.
        hosts_file: what each host's ``/etc/hosts`` says (through ``/etc/netns/<ns>/hosts``,
            which ``ip netns exec`` mounts over ``/etc/hosts``): ``"loopback"``, the
            Debian/Ubuntu default where the host's own name resolves to ``127.0.1.1``;
            ``"cluster"``, every host's name to its address; ``None``, the machine's own
            file (the hosts' names then do not resolve).
        uts: run processes with the host's name as their host name (a UTS namespace
            per process); ``False`` keeps the machine's host name.
        prefix: the namespaces' name prefix (:func:`cleanup_stale` removes a dead run's).
        log_dir: where the output of the processes started here goes (``<name>.log``);
            default a temporary directory that ``stop()`` removes.

    ``start()`` and ``stop()`` are idempotent; ``with MultiHost(...) as net`` does both.
    Every process started through the object is stopped by ``stop()``.
    """

    def __init__(
        self,
        names: Sequence[str] | int = 4,
        *,
        subnet: str = "10.200.20",
        hosts_file: str | None = "loopback",
        uts: bool = True,
        prefix: str = PREFIX,
        log_dir: str | os.PathLike | None = None,
    ):
        if isinstance(names, int):
            names = [f"h{i}" for i in range(names)]
        names = list(names)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct and at least one, got {names!r}")
        bad = [n for n in names if not (0 < len(n) <= 15 and n.replace("-", "").isalnum() and n != "hub")]
        if bad:
            raise ValueError(f"host names must be 1-15 letters, digits or '-' and not 'hub', got {bad!r}")
        if len(names) > 200:
            raise ValueError(f"at most 200 hosts fit in the /24, got {len(names)}")
        if hosts_file not in HOSTS_FILE_MODES:
            raise ValueError(f"hosts_file must be one of {HOSTS_FILE_MODES}, got {hosts_file!r}")
        self.prefix = prefix
        self.run_id = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.subnet = subnet
        self.hosts_file = hosts_file
        self.uts = uts
        self.hub = f"{self.run_id}-hub"
        self.hosts: dict[str, Host] = {
            name: Host(name=name, netns=f"{self.run_id}-{name}", address=f"{subnet}.{10 + i}")
            for i, name in enumerate(names)
        }
        self._own_log_dir = log_dir is None
        self.log_dir = (
            tempfile.mkdtemp(prefix=f"{self.run_id}-logs-") if log_dir is None else os.fspath(log_dir)
        )
        os.makedirs(self.log_dir, exist_ok=True)
        self._procs: list[subprocess.Popen] = []
        self._drivers: list[Driver] = []
        self._started = False

    # ---- life cycle --------------------------------------------------------------------

    def start(self) -> MultiHost:
        """Remove stale namespaces of dead runs, then build the hub and the hosts (idempotent).

        Raises:
            MultiHostError: a namespace or link could not be made (everything made is
                removed again).
        """
        if self._started:
            return self
        cleanup_stale(self.prefix)
        os.makedirs(self.log_dir, exist_ok=True)
        self._started = True
        try:
            self._add_namespace(self.hub)
            _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
            for host in self.hosts.values():
                self._add_namespace(host.netns)
                _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
                _run(
                    ["ip", "-n", self.hub, "link", "add", host.name, "type", "veth"]
                    + ["peer", "name", host.interface, "netns", host.netns]
                )
                _run(["ip", "-n", self.hub, "link", "set", host.name, "master", "br0", "up"])
                _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface])
                _run(["ip", "-n", host.netns, "link", "set", host.interface, "up"])
                self.set_hosts_file(host.name, self.hosts_file)
        except BaseException:
            self.stop()
            raise
        return self

    def _add_namespace(self, netns: str) -> None:
        _run(["ip", "netns", "add", netns])
        # No IPv6 (where the kernel has it): its router solicitations and multicast
        # reports would be link noise.
        disable = "for f in all default; do echo 1 > /proc/sys/net/ipv6/conf/$f/disable_ipv6; done"
        _run(["ip", "netns", "exec", netns, "sh", "-c", disable], check=False)

    def stop(self) -> None:
        """Stop every process and driver started here, delete the namespaces and their
        ``/etc/netns`` files (idempotent; also after a failed ``start``)."""
        stop_processes([d.proc for d in self._drivers] + self._procs[::-1], timeout=5)
        self._drivers.clear()
        self._procs.clear()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if not self._started:
            return
        for host in self.hosts.values():
            _delete_namespace(host.netns)
        _delete_namespace(self.hub)
        self._started = False

    def __enter__(self) -> MultiHost:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # ---- names and files ---------------------------------------------------------------

    def address(self, host: str) -> str:
        """The IPv4 address of ``host``'s interface."""
        return self._host(host).address

    def _host(self, host: str) -> Host:
        try:
            return self.hosts[host]
        except KeyError:
            raise KeyError(f"no host {host!r}; the hosts are {sorted(self.hosts)}") from None

    def set_hosts_file(self, host: str, mode: str | None) -> None:
        """Give ``host`` an ``/etc/hosts`` of ``mode`` (see the class). Rewritten in place,
        so processes already running there see the new contents at their next lookup (the
        file is bind-mounted into them, not copied)."""
        if mode not in HOSTS_FILE_MODES:
            raise ValueError(f"mode must be one of {HOSTS_FILE_MODES}, got {mode!r}")
        h = self._host(host)
        directory = os.path.join(NETNS_ETC, h.netns)
        path = os.path.join(directory, "hosts")
        if mode is None:
            if os.path.exists(path):
                # Running processes keep the mounted file: give it the machine's lines.
                # New ones get the machine's file itself once the directory is gone.
                with open(path, "w") as f:
                    f.write(_machine_hosts())
                shutil.rmtree(directory, ignore_errors=True)
            return
        lines = ["127.0.0.1 localhost"]
        if mode == "loopback":
            lines.append(f"127.0.1.1 {h.name}")
        else:
            lines += [f"{other.address} {other.name}" for other in self.hosts.values()]
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:  # in place: same inode as the one already mounted
            f.write("\n".join(lines) + "\n")

    @contextlib.contextmanager
    def hosts_file_mode(self, hosts: Iterable[str], mode: str | None):
        """Within the block, ``hosts`` have an ``/etc/hosts`` of ``mode``; then the
        harness's own mode again."""
        hosts = list(hosts)
        for host in hosts:
            self.set_hosts_file(host, mode)
        try:
            yield
        finally:
            for host in hosts:
                self.set_hosts_file(host, self.hosts_file)

    # ---- processes ---------------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run in ``host``: ``ip netns exec`` (network, ``/etc/hosts``)
        and, with ``uts``, a UTS namespace named after the host. Each wrapper execs into
        the next, so the process id is the command's."""
        h = self._host(host)
        wrapped = ["ip", "netns", "exec", h.netns]
        if self.uts:
            wrapped += ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', h.name]
        return wrapped + list(argv)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment with ``tests/`` first on ``PYTHONPATH`` (worker
        processes import the tests' Worker classes by reference), plus ``extra``."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [TESTS_DIR, env.get("PYTHONPATH", "")] if p)
        env.update(extra or {})
        return env

    def popen(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_name: str | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen:
        """Start ``argv`` in ``host`` (environment :meth:`env` plus ``env``); stopped by
        :meth:`stop`. Without ``stdout``/``stderr`` in ``kwargs`` both go to the file
        ``<log_dir>/<log_name>.log`` (the process's ``log_path`` attribute)."""
        if not self._started:
            raise MultiHostError("start() the hosts before starting processes in them")
        log = None
        if "stdout" not in kwargs and "stderr" not in kwargs:
            name = log_name or f"{host}-{os.path.basename(argv[0])}-{len(self._procs)}"
            log = open(os.path.join(self.log_dir, f"{name}.log"), "wb")  # noqa: SIM115 - closed below
            kwargs.update(stdout=log, stderr=subprocess.STDOUT)
        try:
            proc = subprocess.Popen(
                self.command(host, argv),
                env=self.env(env),
                preexec_fn=_set_parent_death_signal,
                **kwargs,
            )
        finally:
            if log is not None:
                log.close()
        proc.log_path = log.name if log is not None else None
        self._procs.append(proc)
        return proc

    def run(
        self,
        host: str,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``host`` to its end, output captured as text; killed after
        ``timeout`` seconds (then ``MultiHostError``). ``check``: raise on a non-zero exit."""
        proc = self.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process(proc, timeout=5)
            out, err = proc.communicate()
            raise MultiHostError(
                f"`{' '.join(argv)}` in {host} did not finish within {timeout:g} s; output:\n{out}\n{err}"
            ) from None
        finally:
            with contextlib.suppress(ValueError):
                self._procs.remove(proc)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise MultiHostError(f"`{' '.join(argv)}` in {host} exited {proc.returncode}:\n{out}\n{err}")
        return done

    def listening(self, host: str, port: int) -> bool:
        """Whether a TCP socket listens on ``port`` in ``host`` (its ``/proc/net/tcp``)."""
        h = self._host(host)
        table = _run(["ip", "netns", "exec", h.netns, "cat", "/proc/net/tcp"], check=False).stdout
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
        return False

    def start_scheduler(
        self,
        host: str,
        *,
        port: int = 8786,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> str:
        """Start ``dask scheduler`` in ``host`` on its address and ``port``; returns its
        address ``tcp://<address>:<port>`` once it listens.

        Raises:
            MultiHostError: it exited, or did not listen within ``timeout`` seconds.
        """
        h = self._host(host)
        argv = [*dask_cli(), "scheduler", "--host", h.address, "--port", str(port)]
        argv += ["--dashboard-address", ":0", *args]
        proc = self.popen(host, argv, env=env, log_name=f"{host}-scheduler-{port}")
        deadline = time.monotonic() + timeout
        while not self.listening(host, port):
            if proc.poll() is not None:
                raise MultiHostError(f"the scheduler in {host} exited {proc.returncode}: {_tail(proc)}")
            if time.monotonic() > deadline:
                raise MultiHostError(
                    f"the scheduler in {host} did not listen within {timeout:g} s: {_tail(proc)}"
                )
            time.sleep(0.2)
        return f"tcp://{h.address}:{port}"

    def start_workers(
        self,
        host: str,
        scheduler: str,
        *,
        nworkers: int = 2,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
    ) -> subprocess.Popen:
        """Start ``dask worker <scheduler> --nworkers N --nthreads 1`` (nannies) in
        ``host``, named ``<host>-0 .. <host>-{N-1}`` and listening on the host's address.
        Returns at once; wait for them through a driver (``wait_for_workers``)."""
        h = self._host(host)
        argv = [*dask_cli(), "worker", scheduler, "--nworkers", str(nworkers), "--nthreads", "1"]
        argv += ["--host", h.address, "--name", h.name, "--dashboard-address", ":0", *args]
        return self.popen(host, argv, env=env, log_name=f"{host}-workers-{len(self._procs)}")

    def start_driver(
        self,
        host: str,
        script: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Driver:
        """Start ``python <script> <args>`` in ``host`` as a :class:`Driver` (JSON lines on
        stdin/stdout); ``script`` relative to ``tests/`` unless absolute."""
        path = script if os.path.isabs(script) else os.path.join(TESTS_DIR, script)
        name = name or f"{host}-driver-{len(self._drivers)}"
        err_path = os.path.join(self.log_dir, f"{name}.log")
        with open(err_path, "wb") as err:
            proc = self.popen(
                host,
                [sys.executable, "-u", path, *args],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        driver = Driver(proc, name, err_path)
        self._drivers.append(driver)
        return driver

    # ---- links -------------------------------------------------------------------------

    def link_down(self, host: str) -> None:
        """Take ``host``'s link down at the hub (its cable pulled at the switch)."""
        _run(["ip", "-n", self.hub, "link", "set", self._host(host).name, "down"])

    def link_up(self, host: str) -> None:
        """Bring ``host``'s link back up."""
        _run(["ip", "-n", self.hub, "link", "set", self._host(host).name, "up"])

    def is_link_up(self, host: str) -> bool:
        """Whether ``host``'s link is up at the hub."""
        out = _run(["ip", "-n", self.hub, "-j", "link", "show", self._host(host).name]).stdout
        return "UP" in json.loads(out)[0].get("flags", [])

    def limit_bandwidth(self, host: str, rate: str = "200mbit", latency_ms: int = 50) -> None:
        """Cap ``host``'s link at ``rate`` (``tc`` units: ``"200mbit"``, ``"1gbit"``) in both
        directions with a token bucket (``tbf``) on each end of its veth; replaces an
        earlier cap."""
        h = self._host(host)
        burst = str(max(64 * 1024, _rate_bytes_per_s(rate) // 250))
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", f"{latency_ms}ms"]
        for netns, dev in ((self.hub, h.name), (h.netns, h.interface)):
            _run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *tbf])

    def unlimit_bandwidth(self, host: str) -> None:
        """Remove the cap of :meth:`limit_bandwidth` (no error if there is none)."""
        h = self._host(host)
        for netns, dev in ((self.hub, h.name), (h.netns, h.interface)):
            _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)

    def qdiscs(self, host: str) -> list[str]:
        """The root qdisc kinds on ``host``'s link, hub end first (``["tbf", "tbf"]`` when capped)."""
        h = self._host(host)
        kinds = []
        for netns, dev in ((self.hub, h.name), (h.netns, h.interface)):
            out = _run(["tc", "-n", netns, "-j", "qdisc", "show", "dev", dev]).stdout
            kinds += [q["kind"] for q in json.loads(out or "[]") if q.get("root")]
        return kinds

    def counters(self) -> dict[str, LinkBytes]:
        """Every host's link byte counters now, read at the hub end (``ip -s -j link``)."""
        out = _run(["ip", "-n", self.hub, "-s", "-j", "link", "show"]).stdout
        by_name = {entry["ifname"]: entry["stats64"] for entry in json.loads(out)}
        # The hub end receives what the host sends and sends what the host receives.
        return {
            name: LinkBytes(sent=by_name[name]["rx"]["bytes"], received=by_name[name]["tx"]["bytes"])
            for name in self.hosts
        }

    def counters_since(self, before: Mapping[str, LinkBytes]) -> dict[str, LinkBytes]:
        """Bytes each host's link carried since ``before`` (a :meth:`counters` reading)."""
        now = self.counters()
        return {name: now[name] - before[name] for name in self.hosts}


def _rate_bytes_per_s(rate: str) -> int:
    units = {
        "kbit": 1e3 / 8,
        "mbit": 1e6 / 8,
        "gbit": 1e9 / 8,
        "bit": 1 / 8,
        "bps": 1,
        "kbps": 1e3,
        "mbps": 1e6,
    }
    for unit in sorted(units, key=len, reverse=True):
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * units[unit])
    raise ValueError(f"rate must be a number with a tc unit (kbit, mbit, gbit, ...), got {rate!r}")


def _machine_hosts() -> str:
    try:
        with open("/etc/hosts") as f:
            return f.read()
    except OSError:
        return "127.0.0.1 localhost\n"


def _tail(proc: subprocess.Popen, chars: int = 3000) -> str:
    path = getattr(proc, "log_path", None)
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM every process of ``procs`` at once, SIGKILL those still there after
    ``timeout`` seconds."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM ``proc``, SIGKILL it if it is still there after ``timeout`` seconds."""
    stop_processes([proc], timeout)


class DriverError(RuntimeError):
    """A driver's scenario raised, the driver exited, or an answer did not come in time."""


class Driver:
    """A process in a host that runs named scenarios on request, speaking JSON lines.

    The pytest process writes ``{"run": scenario, "args": {...}, "id": n}`` or
    ``{"signal": name, "id": n, ...}`` lines to its stdin; the driver writes
    ``@@multihost {...}`` lines to stdout, each with the ``id`` of the run it belongs to:
    ``{"event": name, ...}`` while a scenario runs, then ``{"result": value}`` or
    ``{"error": type, "message": ..., "traceback": ...}``. Messages of an earlier run (one
    a failed test gave up on) are dropped, so one failure does not shift the answers of
    the next test. Other output is kept for error messages. The driver side of the
    protocol is ``multihost_driver.py``.
    """

    def __init__(self, proc: subprocess.Popen, name: str, err_path: str):
        self.proc = proc
        self.name = name
        self.err_path = err_path
        self._run = 0
        self._messages: queue.Queue = queue.Queue()
        self._output: deque[str] = deque(maxlen=200)
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # ValueError: closed by close()
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                if line.startswith(DRIVER_MARK):
                    self._messages.put(json.loads(line[len(DRIVER_MARK) :]))
                else:
                    self._output.append(line)
        self._messages.put(None)  # end of output: the process exited

    def _send(self, message: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise DriverError(f"driver {self.name} is gone ({exc}):\n{self.diagnostics()}") from None

    def start(self, scenario: str, **args: Any) -> None:
        """Begin ``scenario`` with keyword ``args`` (JSON values); returns at once. The
        driver runs one scenario at a time: this one starts when the previous one ended."""
        self._run += 1
        self._send({"run": scenario, "args": args, "id": self._run})

    def signal(self, name: str, **data: Any) -> None:
        """Tell the running scenario ``name`` (it waits for it with ``ctl.wait(name)``)."""
        self._send({"signal": name, "id": self._run, **data})

    def _next(self, timeout: float, waiting_for: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._messages.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise DriverError(
                    f"driver {self.name}: no {waiting_for} within {timeout:g} s:\n{self.diagnostics()}"
                ) from None
            if message is None:
                self._messages.put(None)
                raise DriverError(
                    f"driver {self.name} exited ({self.proc.poll()}) before {waiting_for}:\n{self.diagnostics()}"
                )
            if message.get("id", self._run) != self._run:
                continue  # from a run an earlier, failed test gave up on
            if "error" in message:
                raise DriverError(
                    f"driver {self.name}: {message['error']}: {message['message']}\n{message.get('traceback', '')}"
                )
            return message

    def expect(self, event: str, timeout: float) -> dict:
        """Wait at most ``timeout`` seconds for the running scenario's ``event``; returns its
        data. Raises :class:`DriverError` on a timeout, an error or another message."""
        message = self._next(timeout, f"event {event!r}")
        if message.get("event") != event:
            raise DriverError(f"driver {self.name}: expected event {event!r}, got {message}")
        return message

    def result(self, timeout: float) -> Any:
        """Wait at most ``timeout`` seconds for the running scenario's result (events
        before it are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            message = self._next(deadline - time.monotonic(), "a result")
            if "result" in message:
                return message["result"]

    def call(self, scenario: str, timeout: float = 120.0, **args: Any) -> Any:
        """Run ``scenario`` to its end; its result, within ``timeout`` seconds."""
        self.start(scenario, **args)
        return self.result(timeout)

    def diagnostics(self) -> str:
        try:
            with open(self.err_path, errors="replace") as f:
                err = f.read()[-4000:]
        except OSError:
            err = ""
        return "stdout:\n" + "\n".join(self._output) + "\nstderr:\n" + err

    def close(self, timeout: float = 10.0) -> None:
        """Stop the driver process (SIGTERM, then SIGKILL after ``timeout`` s); idempotent."""
        stop_process(self.proc, timeout=timeout)
