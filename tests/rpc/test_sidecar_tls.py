"""TLS files a server could start with but no client could use (issue 38, item 7): a key that does
not match the certificate (reported as "cannot bind ... address is in use"), an expired certificate
and one without a subjectAltName (both started silently, then every client failed). Each is now
refused before the server starts, naming the file and the fault (``harts-planner serve``: one line,
exit code 2).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from test_sidecar_attacks import certificates  # noqa: F401 (the module's openssl-made CA and certificates)

import harts_planner as hp
from harts_planner.rpc.tls import check_server_files, server_credentials


def _serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harts_planner.cli", "serve", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_good_files_pass(certificates):  # noqa: F811
    d = certificates
    check_server_files(d / "server.pem", d / "server.key", d / "ca.pem")


def test_a_key_of_another_certificate_is_named(certificates):  # noqa: F811
    d = certificates
    with pytest.raises(hp.InvalidArgumentError) as e:
        server_credentials(d / "server.pem", d / "client.key")
    assert (
        e.value.field == "tls_key"
        and "client.key" in str(e.value)
        and "is not the private key" in str(e.value)
    )
    out = _serve("--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "client.key"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "is not the private key of the certificate" in out.stderr and "cannot bind" not in out.stderr


def test_an_expired_certificate_is_named(certificates):  # noqa: F811
    d = certificates
    with pytest.raises(hp.InvalidArgumentError) as e:
        check_server_files(d / "server.pem", d / "server.key", now=time.time() + 10 * 86400)
    assert e.value.field == "tls_cert" and "server.pem" in str(e.value) and "expired on" in str(e.value)
    with pytest.raises(hp.InvalidArgumentError, match="not valid before"):
        check_server_files(d / "server.pem", d / "server.key", now=time.time() - 10 * 86400)


def test_a_certificate_without_san_is_named(certificates):  # noqa: F811
    d = certificates  # the CA's own certificate has no subjectAltName
    out = _serve("--tls-cert", str(d / "ca.pem"), "--tls-key", str(d / "ca.key"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "ca.pem" in out.stderr and "no subjectAltName" in out.stderr


def test_a_client_ca_without_certificates_is_named(certificates):  # noqa: F811
    d = certificates
    (d / "empty-ca.pem").write_text("-----BEGIN NOTHING-----\n-----END NOTHING-----\n")
    with pytest.raises(hp.InvalidArgumentError) as e:
        check_server_files(d / "server.pem", d / "server.key", d / "empty-ca.pem")
    assert e.value.field == "tls_client_ca" and "empty-ca.pem" in str(e.value)


@pytest.mark.slow
def test_a_pem_file_over_16_mib_is_named_with_its_flag_and_the_limit(certificates, tmp_path):  # noqa: F811
    """Issue 47: a certificate after 16 MiB of PEM was read cut at 16 MiB and reported as "cannot
    bind"; now refused before anything reads it whole, naming the flag and the limit."""
    from harts_planner.rpc import tls

    d = certificates
    big = tmp_path / "big.pem"
    pad = b"# padding\n" * ((tls.MAX_PEM_BYTES + 64) // 10)
    big.write_bytes(pad + (d / "server.pem").read_bytes())
    with pytest.raises(hp.InvalidArgumentError) as e:
        server_credentials(big, d / "server.key")
    assert (
        e.value.field == "tls_cert"
        and "--tls-cert" in str(e.value)
        and f"{tls.MAX_PEM_BYTES:,}" in str(e.value)
    )
    with pytest.raises(hp.InvalidArgumentError) as e:
        check_server_files(d / "server.pem", d / "server.key", big)
    assert e.value.field == "tls_client_ca" and "16 MiB" in str(e.value)
    out = _serve("--tls-cert", str(big), "--tls-key", str(d / "server.key"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--tls-cert" in out.stderr and "over the limit" in out.stderr and "cannot bind" not in out.stderr
    # exactly at the limit is read (and then checked as usual)
    at_limit = tmp_path / "at-limit.pem"
    body = (d / "server.pem").read_bytes()
    at_limit.write_bytes(b"#" * (tls.MAX_PEM_BYTES - len(body) - 1) + b"\n" + body)
    assert tls.read_pem(at_limit, "tls_cert", "a certificate").endswith(body)


def test_a_fifo_is_not_read(tmp_path):
    import os

    from harts_planner.rpc import tls

    fifo = tmp_path / "cert.fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer held open: the reader's open returns
    try:
        with pytest.raises(hp.InvalidArgumentError) as e:
            tls.read_pem(fifo, "tls_ca", "CA certificates")
        assert (
            e.value.field == "tls_ca" and "not a regular file" in str(e.value) and "--tls-ca" in str(e.value)
        )
    finally:
        os.close(fd)
