"""`ProxySetup`: the proxy settings polar-mitm needs (lazy connections, its own CA folder, loopback)."""

from __future__ import annotations

import ipaddress

from mitmproxy import ctx

from ..certs import default_confdir
from .options import _errors, log


class ProxySetup:
    """Settings a capture proxy needs, so that users do not have to know them."""

    def configure(self, updated: set[str]) -> None:
        if ctx.options.connection_strategy != "lazy":
            # The default dials the real host at CONNECT time: with no internet that is a 502
            # before any hook runs, and captured hosts are never dialed at all.
            ctx.options.connection_strategy = "lazy"
        if "confdir" in updated and ctx.options.confdir == "~/.mitmproxy":
            # mitmproxy's own default: take polar-mitm's, the folder `polar-mitm env` and
            # `polar-mitm certs` name too ($POLAR_MITM_CONFDIR, else the user's config folder)
            ctx.options.confdir = str(default_confdir())
        if "listen_host" in updated and ctx.options.listen_host == "":
            ctx.options.listen_host = "127.0.0.1"
        if (
            "listen_host" in updated
            and not _is_loopback(ctx.options.listen_host)
            and not ctx.options.proxyauth
        ):
            log.warning(
                "polar-mitm: listening on %s without proxy authentication: anyone who can reach "
                "this port can use the proxy (set proxyauth, or listen on 127.0.0.1)",
                ctx.options.listen_host or "all interfaces",
            )

    async def running(self) -> None:
        _errors.running = True
        await self._rebind_on_loopback()

    async def _rebind_on_loopback(self) -> None:
        """mitmdump loads `-s` scripts concurrently with binding its servers, so they may already
        listen on all interfaces (listen_host "") when `configure` sets 127.0.0.1. Rebind them:
        the default must be loopback, whatever the start-up order."""
        proxyserver = ctx.master.addons.get("proxyserver")
        if proxyserver is None or not _is_loopback(ctx.options.listen_host):
            return
        wide = [a for a in proxyserver.listen_addrs() if not _is_loopback(str(a[0]))]
        if not wide:
            return
        await proxyserver.servers.update([])
        await proxyserver.setup_servers()
        log.info(
            "polar-mitm: listening on %s only (--listen-host to change)", ctx.options.listen_host
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
