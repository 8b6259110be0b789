"""The reader service's default limits, apart from the service itself so that the command
line shows them (``neorec ingest serve --help``) without importing gRPC, Numba and torch."""

DEFAULT_MAX_STREAMS = 64
"""Streams one reader service serves at once; more are refused with RESOURCE_EXHAUSTED."""
