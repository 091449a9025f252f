"""The proxy's CA, and the environment a harness container needs to trust and use the proxy.

mitmproxy keeps its CA in its confdir (`mitmproxy-ca.pem`: key + cert, mode 0600;
`mitmproxy-ca-cert.pem`: what clients trust). The proxy, `polar-mitm env` and `polar-mitm certs`
must name the same one wherever each of them runs, whatever the current directory and whether
polar-mitm is installed or checked out, so all three take it from `default_confdir()`:
`$POLAR_MITM_CONFDIR` when set (the demo sets the checkout's `certs/`), else the user's config
folder (`$XDG_CONFIG_HOME/polar-mitm`, `~/.config/polar-mitm` without it). Never a path relative
to the package (an install's is inside site-packages) nor to the current directory.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

CONFDIR_VARIABLE = "POLAR_MITM_CONFDIR"
CA_CERT = "mitmproxy-ca-cert.pem"
CA_KEY = "mitmproxy-ca.pem"
NO_PROXY = "localhost,127.0.0.1,::1"
# Every variable that some harness (Rust reqwest, Node, Python requests/httpx) reads for a CA.
CA_VARIABLES = (
    "NODE_EXTRA_CA_CERTS",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CODEX_CA_CERTIFICATE",
)


def default_confdir() -> Path:
    """The one CA folder the proxy, `env` and `certs` agree on (absolute; see the module doc)."""
    named = os.environ.get(CONFDIR_VARIABLE, "").strip()
    if named:
        return Path(named).expanduser().resolve()
    config = os.environ.get("XDG_CONFIG_HOME", "").strip() or "~/.config"
    return (Path(config).expanduser() / "polar-mitm").resolve()


def ensure_ca(confdir: str | os.PathLike[str] | None = None) -> Path:
    """Create the CA in `confdir` (default: `default_confdir()`) on first use; return the path of
    the certificate to trust."""
    from mitmproxy.certs import CertStore  # mitmproxy is heavy; only the CLI paths need it here

    path = Path(confdir).expanduser().resolve() if confdir else default_confdir()
    path.mkdir(parents=True, exist_ok=True)
    CertStore.from_store(path, "mitmproxy", 2048)
    key = path / CA_KEY
    if key.exists():
        key.chmod(0o600)
    return path / CA_CERT


def proxy_url(proxy: str, rollout: str | None = None) -> str:
    """`proxy` with the rollout id as its user name (rule 1 of rollout identity)."""
    if "://" not in proxy:
        proxy = "http://" + proxy
    parts = urlsplit(proxy)
    if not parts.hostname or not parts.port:
        raise ValueError(f"--proxy must look like http://HOST:PORT, got {proxy!r}")
    if rollout is None:
        return proxy
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = f"{quote(rollout, safe='')}:polar@{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def env_lines(proxy: str, ca_cert: Path, rollout: str | None = None) -> list[str]:
    url = proxy_url(proxy, rollout)
    values = {
        "HTTPS_PROXY": url,
        "HTTP_PROXY": url,
        "https_proxy": url,
        "http_proxy": url,
        "NO_PROXY": NO_PROXY,
        "no_proxy": NO_PROXY,
        **{name: str(ca_cert) for name in CA_VARIABLES},
    }
    return [f"export {name}={shlex.quote(value)}" for name, value in values.items()]


def existing_ca(confdir: str | os.PathLike[str]) -> Path:
    """The certificate in an existing `confdir`: `env --confdir` with a typo must not make a new
    CA that no proxy uses (the harness would trust a CA the proxy does not sign with)."""
    path = Path(confdir).expanduser().resolve()
    cert = path / CA_CERT
    if not cert.is_file():
        raise ValueError(
            f"no CA in {path} ({CA_CERT} is missing): give the proxy's confdir, or create one "
            "with `polar-mitm certs --confdir DIR`"
        )
    return cert
