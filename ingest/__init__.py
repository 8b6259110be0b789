"""Data ingestion: dataset schema, split planning, Parquet decoding and batch readers.

Decoding (``decoder``) is kept apart from transport: the in-process ``reader`` and the
gRPC reader service both turn planned row ranges into :class:`neorec.ingest.batch.HostBatch`.
"""
