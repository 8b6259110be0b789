"""Argument types, the security flags and the one-line error form shared by the ``neorec`` commands."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neorec.common.transport import ClientSecurity, ServerSecurity


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose refusal is the ``neorec`` commands' one error line
    (``neorec: error: train: argument --nproc: …``, see ``neorec train --help``) rather
    than argparse's usage block; exit status :attr:`error_status`."""

    error_status = 2

    def error(self, message: str):
        command = self.prog.removeprefix("neorec").strip()
        self.exit(self.error_status,
                  f"neorec: error: {f'{command}: ' if command else ''}{message} (see {self.prog} --help)\n")


def one_line(err: Exception) -> str:
    """An error's message on one line (a ``neorec: error: …`` line)."""
    return " ".join(str(err).split("\n")) or type(err).__name__


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside [0, 65535]")
    return port


def service_addresses(text: str) -> list[str]:
    """An argparse type: ``HOST:PORT,...``, at least one address, each checked as
    :func:`~neorec.common.addresses.check_address` does."""
    from neorec.common.addresses import AddressError, check_address

    if not text.strip():
        raise argparse.ArgumentTypeError("give at least one reader service address, HOST:PORT,...")
    try:
        return [check_address(address.strip(), "reader service address") for address in text.split(",")]
    except AddressError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite, non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def add_server_security(parser: argparse.ArgumentParser) -> None:
    from neorec.common.transport import TOKEN_ENV  # gRPC's import: when the parser is built, inside main

    parser.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--token-file", help=f"require this shared token on every call but health checks "
                                             f"(default: ${TOKEN_ENV} if set)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback --host with neither TLS nor a token")


def add_client_security(parser: argparse.ArgumentParser) -> None:
    from neorec.common.transport import TOKEN_ENV

    parser.add_argument("--tls-ca", help="PEM certificate to verify the service's TLS certificate with")
    parser.add_argument("--token-file", help=f"send this shared token (default: ${TOKEN_ENV} if set)")


def server_security(args: argparse.Namespace) -> "ServerSecurity":
    from neorec.common.transport import ServerSecurity, read_token

    return ServerSecurity(tls_cert=args.tls_cert, tls_key=args.tls_key, token=read_token(args.token_file),
                          insecure=args.insecure)


def client_security(args: argparse.Namespace) -> "ClientSecurity":
    from neorec.common.transport import ClientSecurity, read_token

    return ClientSecurity(tls_ca=args.tls_ca, token=read_token(args.token_file))
