"""`RolloutIdentityAddon`: remembers proxy credentials per client connection."""

from __future__ import annotations

import weakref

from mitmproxy import connection, http

from ..call.identity import KEY_PARAM, RolloutIdentity, proxy_user, resolve


class RolloutIdentityAddon:
    """Rule 1 of rollout identity: proxy credentials, kept per client connection."""

    def __init__(self) -> None:
        self._users: weakref.WeakKeyDictionary[connection.Client, str] = weakref.WeakKeyDictionary()

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._remember(flow)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # Plain-HTTP proxying sends the credentials with every request: take them, never forward.
        self._remember(flow)

    def _remember(self, flow: http.HTTPFlow) -> None:
        header = flow.request.headers.pop("proxy-authorization", None)
        user = proxy_user(header)
        if user:
            self._users[flow.client_conn] = user

    def identify(self, flow: http.HTTPFlow) -> RolloutIdentity:
        peer = flow.client_conn.peername
        host = str(peer[0]) if peer else "unknown"
        user = self._users.get(flow.client_conn)
        return resolve(flow.request.headers, host, user, flow.request.query.get(KEY_PARAM))
