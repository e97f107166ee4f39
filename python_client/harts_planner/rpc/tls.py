"""TLS for the sidecar, through gRPC's own credentials: certificates and keys read from PEM files.

* Server: :func:`server_credentials` (``harts-planner serve --tls-cert FILE --tls-key FILE``); with
  ``client_ca`` (``--tls-client-ca FILE``) every client must present a certificate signed by it
  (mutual TLS: the planner then serves only clients holding such a certificate).
* Client: :func:`channel_credentials` (``Planner(target, tls_ca=..., tls_cert=..., tls_key=...)``):
  ``ca`` the root certificates that sign the server's certificate (None: the system's roots);
  ``cert`` and ``key`` the client's own certificate and key, for mutual TLS.

Errors name the argument: a missing or unreadable file, a file that is not PEM, a certificate
without its key (or the other way round) raise :class:`harts_planner.InvalidArgumentError` on
``tls_cert`` / ``tls_key`` / ``tls_ca`` / ``tls_client_ca``.

A server's files are checked before it starts (:func:`check_server_files`, with Python's own
``ssl``: gRPC reports a bad pair only as a failure to bind, and serves a certificate that every
client will refuse): a key that does not match the certificate, a certificate that has expired or
is not valid yet, one without a subjectAltName (gRPC clients check the server's name against the
SAN alone), a client CA file without a certificate: each refused naming the file and the fault.
"""

from __future__ import annotations

import os
import ssl
import stat
import time

import grpc

from harts_planner.errors import invalid

#: Largest PEM file read (a certificate chain is a few KiB; a CA bundle under 1 MiB).
MAX_PEM_BYTES = 16 << 20


def read_pem(path, field: str, what: str) -> bytes:
    """The bytes of a PEM file, read once and whole; InvalidArgumentError naming ``field`` (and its
    flag) when it is not a regular file (a FIFO or device would block or never end), is over
    :data:`MAX_PEM_BYTES`, cannot be read or holds no PEM block. Nothing else reads a file first
    (gRPC gets these bytes; :func:`check_server_files` runs after)."""
    if path is None:
        raise invalid(field, f"required: a PEM file with {what}")
    flag = "--" + field.replace("_", "-")
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise invalid(field, f"{str(path)!r} ({flag}) is not a regular file")
            if info.st_size > MAX_PEM_BYTES:
                raise invalid(field, _too_big(path, flag, info.st_size))
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise invalid(field, f"cannot read {str(path)!r} ({flag}): {e.strerror or e}") from None
    if len(data) > MAX_PEM_BYTES:  # grew while read
        raise invalid(field, _too_big(path, flag, len(data)))
    if b"-----BEGIN " not in data:
        raise invalid(field, f"{str(path)!r} is not a PEM file with {what}")
    return data


def _bounded_file(path, field: str) -> None:
    """InvalidArgumentError naming ``field`` unless ``path`` is a regular file of at most
    :data:`MAX_PEM_BYTES` (a missing one is left to the reader's own error)."""
    flag = "--" + field.replace("_", "-")
    try:
        info = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise invalid(field, f"{str(path)!r} ({flag}) is not a regular file")
    if info.st_size > MAX_PEM_BYTES:
        raise invalid(field, _too_big(path, flag, info.st_size))


def _too_big(path, flag: str, size: int) -> str:
    return (
        f"{str(path)!r} ({flag}) holds {size:,} bytes, over the limit of {MAX_PEM_BYTES:,} bytes "
        f"(16 MiB, tls.MAX_PEM_BYTES) of PEM"
    )


def _no_password() -> bytes:
    raise ValueError("encrypted")


def _ssl_reason(err: Exception) -> str:
    return getattr(err, "reason", None) or getattr(err, "strerror", None) or str(err)


def check_server_files(cert, key, client_ca=None, now: float | None = None) -> None:
    """Refuse a server certificate and key that no client could use (see the module docstring);
    InvalidArgumentError naming ``tls_cert`` / ``tls_key`` / ``tls_client_ca``, the file and the
    fault. ``now``: the time to check validity at (default: now). Each file is first checked to be
    a regular file of at most :data:`MAX_PEM_BYTES` (the ``ssl`` loaders read files whole)."""
    for path, field in ((cert, "tls_cert"), (key, "tls_key"), (client_ca, "tls_client_ca")):
        if path is not None:
            _bounded_file(path, field)
    cert_name, key_name = str(cert), str(key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_name, key_name, password=_no_password)
    except ssl.SSLError as e:
        reason = _ssl_reason(e)
        if "KEY_VALUES_MISMATCH" in reason or "key values mismatch" in str(e):
            raise invalid(
                "tls_key", f"{key_name!r} is not the private key of the certificate in {cert_name!r}"
            ) from None
        field, path = ("tls_key", key_name) if "KEY" in reason.upper() else ("tls_cert", cert_name)
        raise invalid(field, f"{path!r} cannot be used ({reason})") from None
    except ValueError:  # the password callback: an encrypted key
        raise invalid("tls_key", f"{key_name!r} is encrypted; the server needs an unencrypted key") from None
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)  # CPython's PEM decoder
    if decode is not None:
        try:
            info = decode(cert_name)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise invalid("tls_cert", f"{cert_name!r} cannot be decoded ({_ssl_reason(e)})") from None
        now = time.time() if now is None else now
        if "notAfter" in info and ssl.cert_time_to_seconds(info["notAfter"]) < now:
            raise invalid(
                "tls_cert", f"{cert_name!r}: the certificate expired on {info['notAfter']}; clients refuse it"
            )
        if "notBefore" in info and ssl.cert_time_to_seconds(info["notBefore"]) > now:
            raise invalid(
                "tls_cert",
                f"{cert_name!r}: the certificate is not valid before {info['notBefore']}; clients refuse it",
            )
        if not info.get("subjectAltName"):
            raise invalid(
                "tls_cert",
                f"{cert_name!r}: the certificate has no subjectAltName, and gRPC clients check the server's "
                "name against it alone (not the CN): reissue it with the server's names, e.g. "
                "-addext subjectAltName=DNS:planner.example,IP:10.0.0.5",
            )
    if client_ca is not None:
        try:
            ssl.create_default_context(cafile=str(client_ca))
        except (ssl.SSLError, OSError) as e:
            raise invalid(
                "tls_client_ca", f"{str(client_ca)!r} holds no usable CA certificate ({_ssl_reason(e)})"
            ) from None


def server_credentials(cert, key, client_ca=None) -> grpc.ServerCredentials:
    """Credentials of a TLS server: its certificate chain and private key (PEM files); with
    ``client_ca``, clients must present a certificate signed by it (mutual TLS). The files are
    checked first (:func:`check_server_files`)."""
    chain = read_pem(cert, "tls_cert", "the server's certificate chain")
    private = read_pem(key, "tls_key", "the server's private key")
    roots = (
        None if client_ca is None else read_pem(client_ca, "tls_client_ca", "the clients' CA certificates")
    )
    check_server_files(cert, key, client_ca)
    return grpc.ssl_server_credentials(
        [(private, chain)], root_certificates=roots, require_client_auth=roots is not None
    )


def channel_credentials(ca=None, cert=None, key=None) -> grpc.ChannelCredentials:
    """Credentials of a TLS client: ``ca`` the roots that sign the server's certificate (None: the
    system's), ``cert`` and ``key`` the client's certificate and key for mutual TLS (both or none)."""
    if (cert is None) != (key is None):
        missing = "tls_key" if key is None else "tls_cert"
        raise invalid(missing, "mutual TLS needs both tls_cert and tls_key")
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca is None else read_pem(ca, "tls_ca", "CA certificates"),
        private_key=None if key is None else read_pem(key, "tls_key", "the client's private key"),
        certificate_chain=None if cert is None else read_pem(cert, "tls_cert", "the client's certificate"),
    )


__all__ = ["MAX_PEM_BYTES", "channel_credentials", "check_server_files", "read_pem", "server_credentials"]
