"""The input all-to-alls of a sharded run, kept in flight ahead of the step that needs them."""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator, TypeVar

from neorec.trainer.sharding.input_dist import LengthsInFlight, ValuesInFlight
from neorec.trainer.batch import DistributedSparse
from neorec.trainer.sharding.sharded_embedding import PreparedSparse, ShardedEmbeddingBagCollection

T = TypeVar("T")


class InputPipeline:
    """``(item, prepared)`` pairs → ``(item, distributed)`` pairs, in order.

    When a batch arrives its lengths all-to-all starts, the previous batch's ids all-to-all
    starts, and the batch before that is delivered: the collectives of two batches are in
    flight (asynchronously, on the module's ``input_group``) while the caller trains on a
    third, so they cost the step no waiting. Every rank must pass the same number of
    batches, as for any collective; all of them issue the collectives in the same order.
    """

    def __init__(self, embeddings: ShardedEmbeddingBagCollection) -> None:
        self.embeddings = embeddings

    def __call__(self, prepared: Iterable[tuple[T, PreparedSparse]]) -> Iterator[tuple[T, DistributedSparse]]:
        dist_ = self.embeddings.input_dist
        lengths_sent: deque[tuple[T, PreparedSparse, LengthsInFlight]] = deque()
        values_sent: deque[tuple[T, PreparedSparse, ValuesInFlight]] = deque()

        def advance() -> None:
            item, batch, lengths = lengths_sent.popleft()
            values_sent.append((item, batch, dist_.send_values(lengths)))

        def deliver() -> tuple[T, DistributedSparse]:
            item, batch, values = values_sent.popleft()
            return item, batch.distributed(dist_.receive(values))

        for item, batch in prepared:
            lengths_sent.append((item, batch, dist_.send_lengths(batch.routed, self.embeddings.input_group)))
            if len(lengths_sent) > 1:
                advance()
            if len(values_sent) > 1:
                yield deliver()
        while lengths_sent:
            advance()
        while values_sent:
            yield deliver()
