"""Embedding store: a DRAM cache over an SSD tier for tables larger than trainer memory."""
