"""Dynamic embedding tables: raw 64-bit ids mapped to a bounded number of rows (slots),
admitted after ``min_count`` sightings, evicted by recency or age, before the fused kernel.

- :mod:`~neorec.trainer.embedding.dynamic.config`: a table's settings;
- :mod:`~neorec.trainer.embedding.dynamic.admission`: the count-min sketch that admits ids;
- :mod:`~neorec.trainer.embedding.dynamic.id_map`: the id → slot map's kernels (index, LRU);
- :mod:`~neorec.trainer.embedding.dynamic.table`: a table's state and a batch's remapping;
- :mod:`~neorec.trainer.embedding.dynamic.collection`: the module in front of the embeddings.
"""
