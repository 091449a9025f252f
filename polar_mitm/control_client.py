"""The trainer's side of the control plane (`control.py` serves it): standard library only, so
the CLI (`polar-mitm end`, `status`) and a trainer's process use it without the proxy's modules.

The control token never has to be on a command line (where `ps` shows it): `control_token()`
reads it from `$POLAR_CONTROL_TOKEN`, or from the file `$POLAR_CONTROL_TOKEN_FILE` (or one given)
names; the proxy reads the same two when `polar_control_token` is not set.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

DEFAULT_HOST = "polar.control"
TOKEN_VARIABLE = "POLAR_CONTROL_TOKEN"
TOKEN_FILE_VARIABLE = "POLAR_CONTROL_TOKEN_FILE"


def control_token(file: str | os.PathLike[str] | None = None) -> str:
    """The control token: from `file` when given, else `$POLAR_CONTROL_TOKEN`, else the file
    `$POLAR_CONTROL_TOKEN_FILE` names; "" when none. A file's surrounding whitespace is dropped
    (`echo TOKEN > file` leaves a newline). Raises ValueError naming an unreadable or empty file."""
    if file is None:
        token = os.environ.get(TOKEN_VARIABLE, "").strip()
        if token:
            return token
        file = os.environ.get(TOKEN_FILE_VARIABLE, "").strip() or None
        if file is None:
            return ""
    try:
        token = Path(file).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the control token file {file}: {e}") from None
    if not token:
        raise ValueError(f"the control token file {file} is empty")
    return token


class ControlError(Exception):
    """The control plane answered with an error (or could not be reached: status 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status, self.message = status, message


class ControlClient:
    """A trainer's handle on one proxy's control plane.

        client = ControlClient(token, proxy="http://proxy-host:8080")     # via the reserved host
        client = ControlClient(token, url="http://proxy-host:8099")       # polar_control_listen
        client.pause(wait_s=60); client.set_policy_version("step-12"); client.resume()
        client.end("django-11099.3", reward=1.0)
        traces = client.traces("django-11099.3")["traces"]

    Plain HTTP with the standard library: through the proxy a request goes in absolute form
    (``GET http://polar.control/v1/...``), so no environment proxy settings are consulted.
    """

    def __init__(
        self,
        token: str,
        *,
        proxy: str | None = None,
        url: str | None = None,
        host: str = DEFAULT_HOST,
        timeout: float = 60.0,
    ) -> None:
        if (proxy is None) == (url is None):
            raise ValueError(
                "give exactly one of proxy= (the proxy's URL) or url= (the control port)"
            )
        parts = urlsplit(proxy or url or "")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{proxy or url!r} is not an http://HOST:PORT URL")
        self.token = token
        self.timeout = timeout
        self._address = (parts.hostname, parts.port or 80)
        self._via_proxy = proxy is not None
        self._host = host
        self._proxy_auth = None
        if self._via_proxy and parts.username:
            creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self._proxy_auth = "Basic " + base64.b64encode(creds.encode()).decode()

    # the API
    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")

    def policy_version(self) -> str | None:
        return self._call("GET", "/v1/policy")["policy_version"]

    def set_policy_version(self, version: str | None) -> dict[str, Any]:
        return self._call("POST", "/v1/policy", {"version": version})

    def pause(self, wait_s: float = 0.0) -> dict[str, Any]:
        """New LLM calls wait from now on; with `wait_s`, also wait (up to that long) for the
        calls in flight to finish: the answer's ``drained`` says whether they did."""
        return self._call("POST", "/v1/pause", {"wait_s": wait_s}, timeout=self.timeout + wait_s)

    def resume(self) -> dict[str, Any]:
        return self._call("POST", "/v1/resume", {})

    def rollouts(self, group: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        query = "&".join(
            f"{k}={quote(v, safe='')}" for k, v in (("group", group), ("state", state)) if v
        )
        return self._call("GET", "/v1/rollouts" + (f"?{query}" if query else ""))["rollouts"]

    def groups(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/groups")["groups"]

    def rollout(self, rollout_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/rollouts/{quote(rollout_id, safe='')}")

    def traces(self, rollout_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/rollouts/{quote(rollout_id, safe='')}/traces")

    def end(
        self, rollout_id: str, reward: float | None = None, status: str = "completed"
    ) -> dict[str, Any]:
        return self._call(
            "POST",
            f"/v1/rollouts/{quote(rollout_id, safe='')}/end",
            {"reward": reward, "status": status},
        )

    # transport
    def weights(self) -> dict[str, Any]:
        return self._call("GET", "/v1/weights")

    def push_weights(self, path: str, version: str, wait_s: float = 120.0) -> dict[str, Any]:
        """Put the checkpoint folder `path` (absolute, safetensors, untied embeddings) into the
        engine behind the proxy and stamp later calls `version`: one operation (`ControlAPI.
        push_weights`). A refused checkpoint (422) or a failed reload (502, the engine back on
        the last good weights) raises `ControlError` and leaves the version as it was."""
        return self._call(
            "POST",
            "/v1/weights",
            {"path": path, "version": version, "wait_s": wait_s},
            timeout=self.timeout + wait_s + 900,  # a restart of the engine may take minutes
        )

    def _call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}", "Host": self._host}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self._proxy_auth:
            headers["Proxy-Authorization"] = self._proxy_auth
        target = f"http://{self._host}{path}" if self._via_proxy else path
        conn = http.client.HTTPConnection(*self._address, timeout=timeout or self.timeout)
        try:
            conn.request(method, target, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except OSError as e:
            raise ControlError(
                0, f"control plane at {self._address[0]}:{self._address[1]} is not reachable: {e}"
            ) from None
        finally:
            conn.close()
        try:
            obj = json.loads(raw) if raw else {}
        except ValueError:
            obj = {"error": {"message": raw[:200].decode("utf-8", "replace")}}
        if resp.status != 200:
            error = obj.get("error") if isinstance(obj, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(obj)
            raise ControlError(resp.status, message or resp.reason)
        return obj
