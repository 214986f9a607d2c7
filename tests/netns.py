"""Two hosts on one machine for the tests: network namespaces joined by a veth pair (iproute2),
10.77.N.1 and 10.77.N.2, each with its own loopback; the link between them can be cut and mended.

    with two_hosts() as hosts:          # pytest.skip(reason) where namespaces cannot be made
        subprocess.Popen([*hosts[1].run, sys.executable, ...])
        hosts.cut()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest


@dataclass
class Host:
    namespace: str
    interface: str
    address: str

    @property
    def run(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.namespace]


class Hosts(list):
    def cut(self) -> None:
        """The link goes down on the second host: packets stop, no connection is told."""
        _ip("-n", self[1].namespace, "link", "set", self[1].interface, "down")

    def mend(self) -> None:
        _ip("-n", self[1].namespace, "link", "set", self[1].interface, "up")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


@contextlib.contextmanager
def two_hosts(or_loopback: bool = False):
    """The two hosts; where they cannot be made, a skip with the reason (or, `or_loopback`, None:
    the caller runs on loopback instead, the reason printed)."""
    reason = unavailable()
    if reason:
        if not or_loopback:
            pytest.skip(reason)
        print(f"on loopback: {reason}")
        yield None
        return
    tag = os.getpid() % 250 + 1  # unique among concurrent test runs on this machine
    names = [f"meshlm{tag}{side}" for side in "ab"]
    links = [f"ml{tag}{side}" for side in "ab"]
    hosts = Hosts(Host(n, link, f"10.77.{tag}.{i + 1}") for i, (n, link) in enumerate(zip(names, links)))
    try:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            _ip("netns", "add", name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        reason = f"network namespaces cannot be made here: `{' '.join(e.cmd)}` said {e.stderr.strip()!r}"
        if not or_loopback:
            pytest.skip(reason)
        print(f"on loopback: {reason}")
        yield None
        return
    try:
        yield hosts
    finally:
        for name in names:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
