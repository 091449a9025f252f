"""`WarmUpAddon`: the proxy's first call costs what its later ones do (`polar_warmup`).

A fresh mitmdump answers its first HTTPS request two to four times slower than the next ones on a
fresh connection (measured: 52-146 ms against 25-50, a short chat through polar-mitm): the first
CONNECT, TLS handshake, server connection and flow run cold code paths, and each host's leaf
certificate is made on first use. In a farm the first call of every proxy is a rollout's first
turn. So at start-up, before the "capturing" line that tells scripts the proxy is ready (the
capture calls `run` from its own `running`), this addon makes the leaf certificates of the
captured hosts and sends one request through the proxy's own listener, routed like an LLM call
to the in-process gateway, which answers it 404 (no call has that id): nothing reaches the
policy server and nothing is recorded. The tokenizer is warmed by its own addon.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

import aiohttp
from cryptography import x509
from mitmproxy import ctx, http

from .options import log

if TYPE_CHECKING:
    from ..call.gateway import Gateway

WARMUP_HOST = "polar.warmup"
WARMUP_TIMEOUT_S = 10.0
_NONCE_HEADER = "x-polar-warmup"


class WarmUpAddon:
    def __init__(self) -> None:
        self.gateway: Gateway | None = None  # set while our warm-up request is under way
        self._nonce = secrets.token_hex(16)  # only our own warm-up request is routed

    def load(self, loader) -> None:
        loader.add_option(
            "polar_warmup",
            bool,
            True,
            "At start-up, make the captured hosts' certificates and send one request through the "
            "proxy to its gateway, so that the first harness call is not the slow one.",
        )

    async def run(self, gateway: Gateway, hosts: frozenset[str]) -> None:
        """Called by the capture once its gateway listens; never raises."""
        if not ctx.options.polar_warmup or gateway.port is None:
            return
        self.gateway = gateway
        started = time.perf_counter()
        try:
            self._certificates(hosts)
            status = await asyncio.wait_for(self._request(), WARMUP_TIMEOUT_S)
        except Exception as e:  # a warm-up must never stop the proxy from starting
            log.info("polar-mitm: warm-up skipped: %s", e)
            return
        finally:
            self.gateway = None
        log.info(
            "polar-mitm: warmed up in %.0f ms (the gateway answered %s)",
            1000 * (time.perf_counter() - started),
            status,
        )

    def request(self, flow: http.HTTPFlow) -> None:
        """Our warm-up request goes to the gateway, the way `CaptureAddon` sends an LLM call."""
        gateway = self.gateway
        if (
            gateway is None
            or gateway.port is None
            or flow.request.host != WARMUP_HOST
            or flow.request.headers.get(_NONCE_HEADER) != self._nonce
        ):
            return
        flow.request.scheme = "http"
        flow.request.host = "127.0.0.1"
        flow.request.port = gateway.port
        flow.request.path = "/polar-warmup"
        flow.request.headers = http.Headers(host=f"127.0.0.1:{gateway.port}", content_length="0")

    def _certificates(self, hosts: frozenset[str]) -> None:
        """The leaf certificate a harness's CONNECT to each host gets (SNI = host), made now:
        mitmproxy's cert store keys it by name, so the handshake finds it made."""
        tls = ctx.master.addons.get("tlsconfig")
        if tls is None or getattr(tls, "certstore", None) is None:
            return
        for host in sorted({*hosts, WARMUP_HOST}):
            tls.certstore.get_cert(host, [x509.DNSName(host)])

    async def _request(self) -> int:
        """GET https://polar.warmup/ through this proxy's own listener."""
        proxyserver = ctx.master.addons.get("proxyserver")
        addrs = proxyserver.listen_addrs() if proxyserver is not None else []
        if not addrs:
            raise RuntimeError("the proxy is not listening")
        host, port = addrs[0][:2]
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        async with (
            aiohttp.ClientSession(trust_env=False) as session,
            session.get(
                f"https://{WARMUP_HOST}/",
                proxy=f"http://{host}:{port}",
                headers={_NONCE_HEADER: self._nonce},
                ssl=False,  # our own CA's certificate, from our own listener
            ) as resp,
        ):
            await resp.read()
            return resp.status
