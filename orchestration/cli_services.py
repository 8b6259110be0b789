"""``neorec ingest`` and ``neorec store``: run a reader or embedding store service, and read
its counters."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from neorec.common.errors import UserError, user_paths
from neorec.ingest.arrow_memory import MEMORY_POOLS, SERVICE_MEMORY_POOL, use_memory_pool
from neorec.ingest.row_group_cache import DEFAULT_CAPACITY_BYTES
from neorec.ingest.service_limits import DEFAULT_MAX_STREAMS
from neorec.orchestration.cli_args import add_client_security, add_server_security, at_least, client_security, port, \
    seconds, server_security


HOST_HELP = ("interface to bind (loopback unless told otherwise, e.g. 0.0.0.0: then TLS and/or a token, or "
             "--insecure)")


def add_service_commands(commands: "argparse._SubParsersAction") -> None:
    """The ``ingest`` and ``store`` command groups."""
    ingest = commands.add_parser("ingest", help="reader services").add_subparsers(dest="ingest", required=True)
    serve = _serve_parser(ingest, "run a reader service until SIGTERM/Ctrl-C", _ingest_serve,
                          grace_help="seconds open streams get to finish on shutdown")
    serve.add_argument("--data-root", action="append", dest="data_roots", metavar="DIR",
                       help="serve only datasets under this directory (repeatable; default: the working directory)")
    serve.add_argument("--worker-threads", dest="threads", type=at_least(1), default=2,
                       help="decode threads")
    serve.add_argument("--max-streams", type=at_least(1), default=DEFAULT_MAX_STREAMS,
                       help="open streams served at once (more are refused with RESOURCE_EXHAUSTED)")
    serve.add_argument("--row-group-cache-mib", type=at_least(0), default=DEFAULT_CAPACITY_BYTES >> 20,
                       help="memory for row groups shared by concurrent reads of one epoch")
    serve.add_argument("--memory-pool", choices=sorted(MEMORY_POOLS), default=SERVICE_MEMORY_POOL,
                       help="Arrow's allocator in the service (system: the C library's malloc, which serves "
                            "buffers freed on other threads best; mimalloc: pyarrow's default)")
    _status_parser(ingest, "print a reader service's live counters", _ingest_status)

    store = commands.add_parser("store", help="embedding store services").add_subparsers(dest="store", required=True)
    serve = _serve_parser(store, "run an embedding store service until SIGTERM/Ctrl-C", _store_serve,
                          grace_help="seconds calls in flight get on shutdown")
    serve.add_argument("--dir", required=True, help="local disk directory for the tiers' segment files")
    serve.add_argument("--direct-io", action="store_true", help="read segments with O_DIRECT (not the page cache)")
    serve.add_argument("--data-root", action="append", dest="data_roots", metavar="DIR",
                       help="Snapshot and Load only into/from directories under this one (repeatable; default: --dir)")
    serve.add_argument("--threads", type=at_least(1), default=16, help="requests served at once")
    _status_parser(store, "print a store service's counters", _store_status)


def _serve_parser(group: "argparse._SubParsersAction", help_text: str, run, grace_help: str) -> argparse.ArgumentParser:
    """A ``serve`` command with the flags every service takes: where it binds, its shutdown
    grace and its security."""
    serve = group.add_parser("serve", help=help_text)
    serve.add_argument("--port", type=port, default=0, help="0: a free port, printed once serving")
    serve.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    serve.add_argument("--grace", type=seconds, default=5.0, help=grace_help)
    add_server_security(serve)
    serve.set_defaults(run=run)
    return serve


def _status_parser(group: "argparse._SubParsersAction", help_text: str, run) -> None:
    status = group.add_parser("status", help=help_text)
    status.add_argument("address", help="host:port")
    status.add_argument("--timeout", type=seconds, default=5.0)
    add_client_security(status)
    status.set_defaults(run=run)


def _ingest_serve(args: argparse.Namespace) -> int:
    from neorec.ingest.chunks import compile_decoding
    from neorec.ingest.service import ReaderServer
    from neorec.common.transport import serve_until_signal

    use_memory_pool(args.memory_pool)
    roots = args.data_roots or ["."]
    _check_data_roots(roots)
    compile_decoding()  # before serving: no request waits for Numba
    server = ReaderServer(host=args.host, port=args.port, threads=args.threads,
                          cache_bytes=args.row_group_cache_mib << 20, max_streams=args.max_streams,
                          data_roots=roots, security=server_security(args))

    def ready(address: str) -> None:
        print(f"neorec ingest: serving on {address}", flush=True)

    serve_until_signal(server, args.grace, ready)
    return 0


def _check_data_roots(roots: list[str]) -> None:
    """A :class:`UserError` naming the first ``--data-root`` that is no directory."""
    missing = [r for r in roots if not r.strip() or not Path(r).is_dir()]
    if missing:
        raise UserError(f"--data-root {missing[0]!r} is not a directory")


def _ingest_status(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from neorec.protos import ingest_pb2, ingest_pb2_grpc

    with client_security(args).channel(args.address) as channel:
        try:
            reply = ingest_pb2_grpc.ReaderStub(channel).Status(ingest_pb2.StatusRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            raise UserError(f"{args.address}: {err.code().name}: {err.details()}") from None
    print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
    return 0


def _store_serve(args: argparse.Namespace) -> int:
    from neorec.embedding_store.service import StoreServer
    from neorec.common.transport import serve_until_signal

    if not args.dir.strip():
        raise UserError("--dir: name the directory for the tiers' segment files")
    _check_data_roots(args.data_roots or [])
    with user_paths():  # --dir: a path under a file, or a file
        server = StoreServer(args.dir, host=args.host, port=args.port, direct_io=args.direct_io,
                             threads=args.threads, security=server_security(args),
                             data_roots=[args.dir, *(args.data_roots or [])])

    def ready(address: str) -> None:
        print(f"neorec store: serving {args.dir} on {address}", flush=True)

    serve_until_signal(server, args.grace, ready)
    return 0


def _store_status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from neorec.embedding_store.client import StoreClient

    client = StoreClient(args.address, tls_ca=args.tls_ca or "", token_file=args.token_file or "")
    try:
        reply = client.status(args.timeout)  # a StoreServiceError (a user error) names what failed
    finally:
        client.close()
    print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
    return 0
