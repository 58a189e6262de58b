"""Several hosts on one machine: Linux network namespaces on a bridge, links shaped with ``tc``.

:class:`EmulatedHosts` creates, from a small TOML file, N emulated hosts: one network namespace
each, joined by a veth pair to a bridge that lives in a namespace of its own (nothing is changed in
the machine's own namespace), every link rate-limited and delayed with ``tc netem``. Commands run
inside a host with :meth:`EmulatedHosts.popen`; a daemon there binds its host's address. On exit
(normal, exception, Ctrl-C) every process started in a host is stopped, and every namespace, link
and bridge removed; namespaces left by a harness process that died (SIGKILL) are removed by the
next start (:func:`remove_stale`) or by ``hmp-emulate --cleanup``.

Hosts file::

    [network]
    subnet = "10.231.7.0/24"   # the harness's own range; refused if this machine uses any of it

    [[hosts]]
    name = "h0"
    bandwidth_mbit = 1000       # each direction of the host's link
    delay_ms = 0.25             # one way, added on the host's outgoing side
    slots = 2                   # worker slots the job manager may fill here (hmp-manager; default 1)

It needs root (CAP_NET_ADMIN) and ``iproute2``; where namespaces cannot be created,
:class:`EmulationUnavailable` says why (tests skip with that reason).

CLI: ``hmp-emulate HOSTS.toml --run h0:'CMD' --run h1:'CMD' ...`` starts the hosts, runs each
command in its host (``{h0}`` in a command is replaced by that host's address), waits for all,
removes everything and exits with the worst exit code; ``hmp-emulate --cleanup`` removes stale
namespaces.

A whole topology on emulated hosts (``hmp-launch CONFIG --hosts HOSTS.toml``, ``LocalCluster(cfg,
hosts=...)``): each ``[[nodes]] host`` names a host of the hosts file (:func:`check_placement`), and
the daemons read a derived config (:func:`topology_on_hosts`) in which every node binds its host's
address.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hmp.errors import ConfigError, HmpError

#: Every namespace the harness creates starts with this, then the creating process's pid.
PREFIX = "hmpemu"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,11}$")


class EmulationUnavailable(HmpError):
    """Network namespaces cannot be created here (not root, no iproute2, a sandbox without them)."""


@dataclasses.dataclass(frozen=True)
class HostSpec:
    name: str
    bandwidth_mbit: float = 1000.0
    delay_ms: float = 0.0
    slots: int = 1  #: worker slots the job manager (hmp.manager) may fill on this host; nothing else reads it


@dataclasses.dataclass(frozen=True)
class Host:
    spec: HostSpec
    netns: str
    address: str


def load_hosts(path: str | os.PathLike) -> tuple[list[HostSpec], ipaddress.IPv4Network]:
    """Read a hosts file; every error names the file and key (exit code 2 from the CLI)."""
    p = str(path)
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(p, "<file>", f"a readable file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(p, "<file>", f"valid TOML ({exc})") from None
    unknown = sorted(set(raw) - {"network", "hosts"})
    if unknown:
        raise ConfigError(p, unknown[0], "unknown section; expected 'network' or 'hosts'")
    net = raw.get("network", {})
    if not isinstance(net, dict) or set(net) - {"subnet"}:
        raise ConfigError(p, "network", "a table with only 'subnet'")
    try:
        subnet = ipaddress.IPv4Network(net.get("subnet", "10.231.7.0/24"))
    except ValueError as exc:
        raise ConfigError(p, "network.subnet", f"an IPv4 network such as '10.231.7.0/24' ({exc})") from None
    if not subnet.is_private:
        raise ConfigError(p, "network.subnet", f"a private range, got {subnet}")
    hosts_raw = raw.get("hosts")
    if not isinstance(hosts_raw, list) or not hosts_raw:
        raise ConfigError(p, "hosts", "an array of tables ([[hosts]]) with at least one host")
    specs, seen = [], set()
    for i, h in enumerate(hosts_raw):
        key = f"hosts[{i}]"
        if not isinstance(h, dict):
            raise ConfigError(p, key, "a table")
        extra = sorted(set(h) - {"name", "bandwidth_mbit", "delay_ms", "slots"})
        if extra:
            raise ConfigError(p, f"{key}.{extra[0]}", "unknown key; expected name, bandwidth_mbit, delay_ms, slots")
        name = h.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(p, f"{key}.name", f"a short lowercase name (letter, then letters, digits or _; "
                                               f"at most 12), got {name!r}")
        if name in seen:
            raise ConfigError(p, f"{key}.name", f"a unique name; {name!r} appears twice")
        seen.add(name)
        bw, delay = h.get("bandwidth_mbit", 1000.0), h.get("delay_ms", 0.0)
        for k, v, ok in (("bandwidth_mbit", bw, lambda x: x > 0), ("delay_ms", delay, lambda x: x >= 0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ConfigError(p, f"{key}.{k}", f"a number {'> 0' if k == 'bandwidth_mbit' else '>= 0'}, "
                                                   f"got {v!r}")
        slots = h.get("slots", 1)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ConfigError(p, f"{key}.slots", f"an integer >= 1 (worker slots), got {slots!r}")
        specs.append(HostSpec(name, float(bw), float(delay), slots))
    if len(specs) > subnet.num_addresses - 2:
        raise ConfigError(p, "network.subnet", f"room for {len(specs)} hosts, {subnet} has too few addresses")
    return specs, subnet


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_list() -> list[str]:
    out = _ip("-j", "netns", "list", check=False).stdout.strip()
    return [n["name"] for n in json.loads(out)] if out else []


def _kill_netns(ns: str) -> None:
    """Stop every process still inside ``ns`` (TERM, then KILL after 3 s), then delete it."""
    pids = [int(x) for x in _ip("netns", "pids", ns, check=False).stdout.split()]
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists()]
            time.sleep(0.05)
        if not pids:
            break
    _ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Remove namespaces whose creating harness process is gone; returns their names."""
    removed = []
    for ns in _netns_list():
        m = re.match(rf"^{PREFIX}(\d+)-", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_netns(ns)
            removed.append(ns)
    return removed


def netem_available(ns: str) -> bool:
    """Whether the kernel has netem (delay); probed on a throw-away veth inside namespace ``ns``."""
    if _ip("-n", ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False).returncode:
        return False
    try:
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "probe0", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True, timeout=30)
        return r.returncode == 0
    finally:
        _ip("-n", ns, "link", "del", "probe0", check=False)


def _addresses_in_use() -> list[ipaddress.IPv4Network]:
    used = []
    for link in json.loads(_ip("-j", "-4", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            used.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for r in json.loads(_ip("-j", "-4", "route").stdout or "[]"):
        if r.get("dst") not in (None, "default"):
            used.append(ipaddress.IPv4Network(r["dst"], strict=False))
    return used


class EmulatedHosts:
    """``with EmulatedHosts(specs) as hosts:`` N hosts on one bridge; everything removed on exit."""

    def __init__(self, specs: list[HostSpec], subnet: str | ipaddress.IPv4Network = "10.231.7.0/24") -> None:
        self.specs = list(specs)
        self.subnet = ipaddress.IPv4Network(subnet)
        self.tag = f"{PREFIX}{os.getpid()}-{os.urandom(2).hex()}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self.source = "<hosts>"  #: the hosts file, for messages
        self._created: list[str] = []
        self._lock = threading.RLock()  # close() from another thread waits for a start() in progress

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> EmulatedHosts:
        specs, subnet = load_hosts(path)
        hosts = cls(specs, subnet)
        hosts.source = str(path)
        return hosts

    @property
    def names(self) -> list[str]:
        """The hosts' names, in file order (known before :meth:`start`)."""
        return [s.name for s in self.specs]

    @property
    def started(self) -> bool:
        return bool(self.hosts)

    def __enter__(self) -> EmulatedHosts:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        with self._lock:
            self._start()

    async def start_async(self) -> None:
        """:meth:`start` off the event loop (it runs ``ip`` and ``tc`` commands). If the caller is cancelled
        meanwhile, the start still completes before the cancellation goes on, so that :meth:`close`
        removes everything it made."""
        made = asyncio.get_running_loop().run_in_executor(None, self.start)
        try:
            await asyncio.shield(made)
        except asyncio.CancelledError:
            await asyncio.wait({made})
            raise

    def _start(self) -> None:
        if self._created:
            raise RuntimeError(f"{self.tag}: already started")
        if shutil.which("ip") is None:
            raise EmulationUnavailable("iproute2's `ip` is not installed")
        remove_stale()
        clash = [n for n in _addresses_in_use() if n.overlaps(self.subnet)]
        if clash:
            raise EmulationUnavailable(f"subnet {self.subnet} is in use on this machine ({clash[0]}); "
                                       "choose another [network] subnet")
        probe = _ip("netns", "add", self.switch, check=False)
        if probe.returncode != 0:
            raise EmulationUnavailable(f"cannot create a network namespace: {probe.stderr.strip() or 'ip failed'} "
                                       "(needs root / CAP_NET_ADMIN)")
        self._created.append(self.switch)
        try:
            if any(s.delay_ms > 0 for s in self.specs) and not netem_available(self.switch):
                raise EmulationUnavailable("this kernel has no netem queueing discipline (sch_netem), so link delay "
                                           "cannot be emulated; set delay_ms = 0 (rates still apply)")
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        _ip("-n", sw, "link", "set", "lo", "up")
        addrs = list(self.subnet.hosts())
        for i, spec in enumerate(self.specs):
            ns = f"{self.tag}-{spec.name}"
            _ip("netns", "add", ns)
            self._created.append(ns)
            port = f"p{i}"
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            address = str(addrs[i])
            _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # Outgoing: the host's own delay and rate; incoming: the same rate on the bridge's side.
            self._tc(ns, "eth0", spec.bandwidth_mbit, spec.delay_ms)
            self._tc(sw, port, spec.bandwidth_mbit, 0.0)
            self.hosts[spec.name] = Host(spec, ns, address)

    @staticmethod
    def _tc(ns: str, dev: str, mbit: float, delay_ms: float) -> None:
        """Shape ``dev``'s outgoing traffic: a token bucket at ``mbit`` (burst: 4 ms of traffic, so the
        kernel timer's granularity does not cap the rate), under a netem delay when one is asked for."""
        def tc(*args: str) -> None:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", *args], capture_output=True, text=True,
                           check=True, timeout=30)

        burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"]
        if delay_ms > 0:
            tc("add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms", "limit", "100000")
            tc("add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            tc("add", "dev", dev, "root", *tbf)

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def netns(self, host: str) -> str:
        """The name of ``host``'s network namespace (``/run/netns/NAME``)."""
        if host not in self.hosts:
            raise KeyError(f"no emulated host {host!r}; hosts are {sorted(self.hosts)}")
        return self.hosts[host].netns

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside ``host``'s namespace."""
        if host not in self.hosts:
            raise KeyError(f"no emulated host {host!r}; hosts are {sorted(self.hosts)}")
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; it is stopped (SIGTERM, then SIGKILL after 5 s) at close."""
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """Stop every process started in a host and remove every namespace; safe to call twice."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self.procs.clear()
        for ns in reversed(self._created):
            _kill_netns(ns)
        self._created.clear()
        self.hosts.clear()


# ----------------------------------------------------------------------------- topologies on hosts
def check_placement(nodes: Sequence[Any], names: Sequence[str], config_path: str, hosts_file: str) -> None:
    """Every node's ``host`` names a host of the hosts file and its ``bind`` is a tcp address (the
    scheduler's with a fixed port); errors name the config file and the node's key."""
    for i, n in enumerate(nodes):
        if n.host not in names:
            raise ConfigError(config_path, f"nodes[{i}].host", f"the name of an emulated host in {hosts_file} "
                                                              f"(one of {list(names)}), got {n.host!r}")
        if not n.bind.startswith("tcp://"):
            raise ConfigError(config_path, f"nodes[{i}].bind", f"a tcp:// address on emulated hosts ({hosts_file}), "
                                                              f"got {n.bind!r}")
        if n.role == "scheduler" and _port(n.bind) == 0:
            raise ConfigError(config_path, f"nodes[{i}].bind", f"a fixed port for the scheduler on emulated hosts "
                                                              f"({hosts_file}), got {n.bind!r}")


def _port(address: str) -> int:
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else 0  # '*': any port


def topology_on_hosts(config_path: str | os.PathLike, nodes: Sequence[Any], address: dict[str, str]) -> str:
    """The config file ``config_path`` as TOML text in which each node (``nodes``: its validated
    ``[[nodes]]``, in file order) binds ``tcp://<its host's address>:<its port>`` (port 0 stays 0, and
    the node advertises what it bound; a fixed port is advertised as is), and relative data paths and
    ``[security] key_dir`` are made absolute (the text is written somewhere else, and both are relative
    to the config file's folder). ``address``: host name -> address."""
    path = Path(config_path)
    raw = tomllib.loads(path.read_text())
    raw_nodes = raw.get("nodes", [])
    if [n.get("id") for n in raw_nodes] != [n.id for n in nodes]:
        raise ConfigError(str(path), "nodes", "the nodes of the loaded config (the file changed since it was loaded)")
    for table, n in zip(raw_nodes, nodes):
        port = _port(n.bind)
        table["host"] = n.host
        table["bind"] = f"tcp://{address[n.host]}:{port}"
        table["advertise"] = table["bind"] if port else ""
    data = raw.get("data", {})
    for table, key in ((data, "path"), (data, "test_path"), (raw.get("security", {}), "key_dir")):
        if table.get(key) and not Path(table[key]).is_absolute():
            table[key] = str(path.resolve().parent / table[key])
    text = f"# {path} with every daemon bound to its emulated host's address (hmp.emulate)\n" + dumps_toml(raw)
    if tomllib.loads(text) != raw:  # the writer below knows only what config files hold
        raise ConfigError(str(path), "<file>", "values that hmp.emulate.dumps_toml can write back")
    return text


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k, ensure_ascii=False)


def dumps_toml(raw: dict[str, Any]) -> str:
    """A config file's tables as TOML: ``[section]`` tables of keys, arrays of tables (``[[nodes]]``),
    nested tables and arrays inline."""
    out = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in raw.items()
           if not isinstance(v, dict) and not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))]
    for k, v in raw.items():
        if isinstance(v, dict):
            out += ["", f"[{_toml_key(k)}]", *(f"{_toml_key(a)} = {_toml_value(b)}" for a, b in v.items())]
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for table in v:
                out += ["", f"[[{_toml_key(k)}]]", *(f"{_toml_key(a)} = {_toml_value(b)}" for a, b in table.items())]
    return "\n".join(out) + "\n"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hmp-emulate", description="Run commands on emulated hosts "
                                 "(network namespaces on a shaped bridge); everything is removed afterwards.")
    ap.add_argument("hosts", nargs="?", help="hosts TOML file")
    ap.add_argument("--run", action="append", default=[], metavar="HOST:CMD",
                    help="a shell command to run inside HOST ({NAME} is replaced by host NAME's address)")
    ap.add_argument("--timeout", type=float, default=600.0, help="stop everything after this many seconds")
    ap.add_argument("--cleanup", action="store_true", help="remove namespaces left by a killed harness, then exit")
    args = ap.parse_args(argv)
    if args.cleanup:
        for ns in remove_stale():
            print(f"removed {ns}")
        return 0
    if not args.hosts:
        ap.error("a hosts file is needed (or --cleanup)")
    try:
        hosts = EmulatedHosts.from_file(args.hosts)
        runs = []
        for r in args.run:
            host, sep, cmd = r.partition(":")
            if not sep or host not in {s.name for s in hosts.specs}:
                raise ConfigError("--run", r, f"HOST:CMD with HOST one of {[s.name for s in hosts.specs]}")
            runs.append((host, cmd))
    except ConfigError as exc:
        print(f"hmp-emulate: config error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up like Ctrl-C
    try:
        with hosts:
            table = {h.spec.name: h.address for h in hosts.hosts.values()}
            for h in hosts.hosts.values():
                print(f"{h.spec.name}\t{h.address}\t{h.spec.bandwidth_mbit} Mbit/s\t{h.spec.delay_ms} ms\t{h.netns}")
            procs = [hosts.popen(host, ["sh", "-c", cmd.format(**table)]) for host, cmd in runs]
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
            timed_out = any(p.poll() is None for p in procs)
            codes = [p.returncode if p.returncode is not None else 124 for p in procs]
        if timed_out:
            print(f"hmp-emulate: stopped after {args.timeout} s", file=sys.stderr)
        return max([abs(c) for c in codes], default=0)
    except EmulationUnavailable as exc:
        print(f"hmp-emulate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EmulatedHosts", "EmulationUnavailable", "Host", "HostSpec", "check_placement", "dumps_toml", "load_hosts",
           "main", "remove_stale", "topology_on_hosts"]
