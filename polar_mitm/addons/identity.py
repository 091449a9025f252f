"""`RolloutIdentityAddon`: remembers proxy credentials per client connection, and says once per
client address when that address alone names a rollout."""

from __future__ import annotations

import weakref

from mitmproxy import connection, http

from ..call.identity import CLIENT_ADDRESS, KEY_PARAM, RolloutIdentity, proxy_user, resolve
from .options import log

# Client addresses already warned about (a farm has one per container: bounded, to be safe).
_WARN_LIMIT = 4096


class RolloutIdentityAddon:
    """Rule 1 of rollout identity: proxy credentials, kept per client connection."""

    def __init__(self) -> None:
        self._users: weakref.WeakKeyDictionary[connection.Client, str] = weakref.WeakKeyDictionary()
        self._warned: set[str] = set()

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
        identity = resolve(
            flow.request.headers,
            host,
            self._users.get(flow.client_conn),
            flow.request.query.get(KEY_PARAM),
        )
        if identity.source == CLIENT_ADDRESS:
            self._warn(host, identity.rollout_id)
        return identity

    def _warn(self, host: str, rollout_id: str) -> None:
        """Once per address: every session from it is one rollout, which is not trainable."""
        if host in self._warned or len(self._warned) >= _WARN_LIMIT:
            return
        self._warned.add(host)
        log.warning(
            "polar-mitm: calls from %s carry no rollout id (no polar- API key, proxy "
            "credentials, x-polar-rollout header or session header): they all go to rollout %r, "
            "whose traces are untrainable (anonymous). Give each rollout its own id: "
            '`eval "$(polar-mitm env --rollout ID)"` (proxy credentials), or the API key '
            "polar-ID; with one container per rollout, --set polar_train_allow=anonymous "
            "allows it.",
            host,
            rollout_id,
        )
