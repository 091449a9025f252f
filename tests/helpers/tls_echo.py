"""A small HTTPS server on loopback that is not an LLM API: echoes POST bodies, serves blobs."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "echo-cert.pem", tmp / "echo-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@dataclass
class TLSEcho:
    server: ThreadingHTTPServer
    seen_paths: list[str] = field(default_factory=list)
    seen_headers: list[dict[str, str]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @staticmethod
    def blob(size: int) -> bytes:
        return bytes((i * 7 + 3) % 251 for i in range(size))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_tls_echo(tmp: Path) -> TLSEcho:
    holder: list[TLSEcho] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: bytes) -> None:
            holder[0].seen_paths.append(self.path)
            holder[0].seen_headers.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            self._send(self.rfile.read(int(self.headers.get("content-length", 0))))

        def do_GET(self) -> None:  # noqa: N802
            size = int(parse_qs(urlsplit(self.path).query).get("size", ["0"])[0])
            self._send(TLSEcho.blob(size))

    cert, key = self_signed(tmp)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    echo = TLSEcho(server)
    holder.append(echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return echo
