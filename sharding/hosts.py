"""Which address of this host the other processes of a job reach it at.

A host's name often resolves to a loopback address (`127.0.1.1 myhost` in /etc/hosts), and a
library that advertises it (gloo's default, as PyTorch users know from GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME) leaves every other host connecting to itself. The address used here is the
one of the interface a user names (`--interface`, else $GLOO_SOCKET_IFNAME), or else the one the
routing table picks to reach the coordinator: the interface the job's own traffic already uses.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _split(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 1


def route_to(coordinator: str) -> str:
    """This host's address on the route to `coordinator` (host:port); no packet is sent."""
    host, port = _split(coordinator)
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)
            return s.getsockname()[0]
    except OSError as e:
        raise ValueError(f"--coordinator={coordinator}: no route from this host to {host} ({e.strerror or e}); "
                         "give process 0's address as the other hosts reach it") from None


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`, or `name` itself if it is an address."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    known = ", ".join(n for _, n in socket.if_nameindex())
    try:
        socket.if_nametoindex(name)
    except OSError:
        raise ValueError(f"interface {name!r}: this host has no such network interface (it has {known})") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            raise ValueError(f"interface {name!r} has no IPv4 address (this host's interfaces: {known})") from None
    return socket.inet_ntoa(packed[20:24])


def advertised(coordinator: str, interface: str | None) -> tuple[str, str]:
    """(address, how it was chosen) for this process's collectives."""
    if interface:
        return interface_address(interface), f"--interface={interface}"
    if os.environ.get(INTERFACE_ENV):
        name = os.environ[INTERFACE_ENV]
        return interface_address(name), f"{INTERFACE_ENV}={name}"
    return route_to(coordinator), f"the route to the coordinator {coordinator}"
