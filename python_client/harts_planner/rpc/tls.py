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
"""

from __future__ import annotations

import grpc

from harts_planner.errors import invalid


def read_pem(path, field: str, what: str) -> bytes:
    """The bytes of a PEM file; InvalidArgumentError naming ``field`` when it cannot be read or
    holds no PEM block."""
    if path is None:
        raise invalid(field, f"required: a PEM file with {what}")
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 24)
    except OSError as e:
        raise invalid(field, f"cannot read {str(path)!r}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise invalid(field, f"{str(path)!r} is not a PEM file with {what}")
    return data


def server_credentials(cert, key, client_ca=None) -> grpc.ServerCredentials:
    """Credentials of a TLS server: its certificate chain and private key (PEM files); with
    ``client_ca``, clients must present a certificate signed by it (mutual TLS)."""
    chain = read_pem(cert, "tls_cert", "the server's certificate chain")
    private = read_pem(key, "tls_key", "the server's private key")
    roots = (
        None if client_ca is None else read_pem(client_ca, "tls_client_ca", "the clients' CA certificates")
    )
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


__all__ = ["channel_credentials", "read_pem", "server_credentials"]
