"""The reader service's default limits, apart from the service itself so that the command
line shows them (``neorec ingest serve --help``) without importing gRPC, Numba and torch."""

DEFAULT_MAX_STREAMS = 64
"""Streams one reader service serves at once; more are refused with RESOURCE_EXHAUSTED."""
MAX_BATCH_SIZE = 1 << 20
"""Rows of one batch a reader service cuts; a trainer reading through services is refused a
larger ``train.batch_size`` or ``eval_batch_size`` before it trains."""
