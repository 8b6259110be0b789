"""Reader services exposed beyond loopback: TLS, a shared token, data roots, and binding
refusals, with real service processes."""

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from neorec.ingest.client import ClientOptions, IngestError, RemoteReader
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.reader import ReaderConfig
from neorec.common.transport import ClientSecurity
from neorec.ingest.wire import SERVICE_NAME
from neorec.orchestration.processes import start_reader_service
from tests.ingest.workers import DATA_ROOTS, start_worker, stop_all
from tests.cli import neorec


def _one_line_error(result, text):
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("neorec: error:")]
    assert errors and text in errors[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


def _first_batch(dataset, address, security=ClientSecurity()):
    client = ClientOptions(security=security, stall_timeout_s=3.0, backoff_s=0.05, max_backoff_s=0.2)
    with RemoteReader(dataset, "train", DecodeOptions.for_schema(dataset.schema), ReaderConfig(batch_size=64),
                      [address], client) as reader:
        return next(iter(reader.epoch(0)))


def test_tls_service_serves_verified_clients_only(criteo_dataset, certificate):
    cert, key = certificate
    worker = start_worker("--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert _first_batch(criteo_dataset, worker.address, ClientSecurity(tls_ca=str(cert))).provenance.step == 0
        with pytest.raises(IngestError, match="no reader service delivered"):  # a clear-text client gets nothing
            _first_batch(criteo_dataset, worker.address)
        status = neorec("ingest", "status", worker.address, "--tls-ca", str(cert))
        assert status.returncode == 0, status.stderr
    finally:
        stop_all([worker])


def test_token_is_required_for_reading_and_status_but_not_health(criteo_dataset, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    worker = start_worker("--token-file", str(token))
    try:
        assert _first_batch(criteo_dataset, worker.address, ClientSecurity(token="s3cret")).provenance.step == 0
        with pytest.raises(IngestError, match="UNAUTHENTICATED"):
            _first_batch(criteo_dataset, worker.address, ClientSecurity(token="guess"))
        with pytest.raises(IngestError, match="UNAUTHENTICATED"):
            _first_batch(criteo_dataset, worker.address)
        with grpc.insecure_channel(worker.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        _one_line_error(neorec("ingest", "status", worker.address), "UNAUTHENTICATED")
        assert neorec("ingest", "status", worker.address, "--token-file", str(token)).returncode == 0
    finally:
        stop_all([worker])


def test_binding_beyond_loopback_needs_tls_a_token_or_insecure(criteo_dataset, tmp_path):
    result = neorec("ingest", "serve", "--host", "0.0.0.0", "--port", "0")
    _one_line_error(result, "exposes the service beyond this machine")
    token = tmp_path / "token"
    token.write_text("s3cret")
    for flags in (["--insecure"], ["--token-file", str(token)]):
        worker = start_reader_service(*flags, host="0.0.0.0", data_roots=DATA_ROOTS)
        try:
            address = "127.0.0.1:" + worker.address.rsplit(":", 1)[1]
            security = ClientSecurity(token="s3cret" if "--token-file" in flags else None)
            assert _first_batch(criteo_dataset, address, security).provenance.step == 0
        finally:
            stop_all([worker])


def test_ports_in_use_out_of_range_and_unknown_hosts_are_one_line_errors():
    worker = start_worker()
    try:
        port = worker.address.rsplit(":", 1)[1]
        _one_line_error(neorec("ingest", "serve", "--port", port), f"cannot bind 127.0.0.1:{port}")
    finally:
        stop_all([worker])
    for bad in ("70000", "-1"):
        result = neorec("ingest", "serve", "--port", bad)
        assert result.returncode == 2 and "outside [0, 65535]" in result.stderr
    _one_line_error(neorec("ingest", "serve", "--host", "no-such-host.invalid"), "does not resolve")
    _one_line_error(neorec("ingest", "serve", "--data-root", "/no/such/dir"), "is not a directory")


def test_a_store_service_s_directories_are_checked_before_it_serves(tmp_path):
    (tmp_path / "file").write_text("")
    _one_line_error(neorec("store", "serve", "--dir", str(tmp_path / "s"), "--data-root", "/no/such/dir"),
                    "--data-root '/no/such/dir' is not a directory")
    _one_line_error(neorec("store", "serve", "--dir", str(tmp_path / "s"), "--data-root", str(tmp_path / "file")),
                    "is not a directory")
    _one_line_error(neorec("store", "serve", "--dir", ""), "--dir: name the directory")
    _one_line_error(neorec("store", "serve", "--dir", str(tmp_path / "file" / "s")),
                    f"store directory {tmp_path / 'file' / 's'} cannot be made: {tmp_path / 'file'} is a file")


def test_a_tls_file_that_is_not_pem_or_a_pair_that_does_not_match_is_named(certificate, tmp_path):
    cert, key = certificate
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    for command in (["ingest", "serve"], ["store", "serve", "--dir", str(tmp_path / "store")]):
        _one_line_error(neorec(*command, "--tls-cert", str(not_pem), "--tls-key", str(key)),
                        f"TLS certificate {not_pem} is not a PEM certificate")
        _one_line_error(neorec(*command, "--tls-cert", str(cert), "--tls-key", str(not_pem)),
                        f"TLS key {not_pem} is not a PEM private key")
    _one_line_error(neorec("ingest", "serve", "--tls-cert", str(key), "--tls-key", str(cert)),
                    f"TLS certificate {key} is not a PEM certificate")  # the two swapped
    other_key = tmp_path / "other-key.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-out", str(other_key)], check=True, capture_output=True)
    encrypted = tmp_path / "encrypted-key.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-aes128", "-pass", "pass:secret", "-out",
                    str(encrypted)], check=True, capture_output=True)
    for command in (["ingest", "serve"], ["store", "serve", "--dir", str(tmp_path / "store")]):
        for bad_key, reason in ((other_key, "the key is not the certificate's"), (encrypted, "the key is encrypted")):
            result = neorec(*command, "--tls-cert", str(cert), "--tls-key", str(bad_key))
            _one_line_error(result, f"the TLS certificate {cert} and key {bad_key} do not make a pair: {reason}")
            assert len(result.stderr.splitlines()) == 1, result.stderr  # before gRPC logs a word
    for group in ("ingest", "store"):  # a client's CA file, checked before it connects
        _one_line_error(neorec(group, "status", "127.0.0.1:1", "--tls-ca", str(not_pem)),
                        f"TLS CA certificate {not_pem} is not a PEM certificate")
