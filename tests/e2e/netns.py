"""A network namespace whose only way out is the proxy.

The harness runs inside it (`ip netns exec`); a veth pair links it to the host, where mitmdump
listens on the host end's address. The namespace has no default route and no DNS server it can
reach, so a harness that ignored HTTPS_PROXY and dialed api.openai.com itself fails instead of
quietly succeeding (there is no internet here either, but a test must not rely on that).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

_SUBNET = "10.199.{}.{}"  # a /30 per namespace: .1 the host end, .2 the harness's end


class NetnsError(RuntimeError):
    pass


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")


def _used_subnets() -> set[int]:
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    return {int(part.split(".")[2]) for part in out.split() if part.startswith("10.199.")}


@dataclass
class Netns:
    name: str
    index: int

    @property
    def host_ip(self) -> str:
        return _SUBNET.format(self.index, 1)

    @property
    def ns_ip(self) -> str:
        return _SUBNET.format(self.index, 2)

    def wrap(self, args: list[str]) -> list[str]:
        """`args` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *args]

    def delete(self) -> None:
        # Deleting the namespace destroys its veth end, and with it the host end.
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


def create_netns(tag: str) -> Netns:
    """A fresh namespace `polar-<tag>-<pid>` with a /30 veth link to the host. Needs root (CAP_NET_ADMIN)."""
    if shutil.which("ip") is None:
        raise NetnsError("the 'ip' command (iproute2) is missing: apt-get install iproute2")
    used = _used_subnets()
    index = next((i for i in range(os.getpid() % 200 + 10, 256) if i not in used), None)
    if index is None:
        index = next(i for i in range(10, 256) if i not in used)
    name = f"polar-{tag}-{os.getpid()}"
    short = f"{os.getpid() % 100000}{tag[:3]}"
    host_if, ns_if = f"ph{short}"[:15], f"pn{short}"[:15]
    ns = Netns(name, index)
    ns.delete()  # one left behind by a run of the same pid that was killed
    subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
    try:
        _ip("netns", "add", name)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{ns.host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", name, "addr", "add", f"{ns.ns_ip}/30", "dev", ns_if)
        _ip("-n", name, "link", "set", ns_if, "up")
        _ip("-n", name, "link", "set", "lo", "up")
    except NetnsError:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        ns.delete()
        raise
    return ns
