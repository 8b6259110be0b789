"""Progress bars that appear only once there is progress to show: a command refused before
its work starts prints its one error line and nothing else."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


class LazyBar:
    """A :class:`tqdm` bar created at its first :meth:`update` (with the keyword arguments
    given here); a context manager that closes it, if it was ever drawn."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.bar: tqdm | None = None

    def update(self, count: int = 1) -> tqdm:
        """Advance by ``count`` (drawing the bar first if needed); returns the bar."""
        if self.bar is None:
            self.bar = tqdm(**self.options)
        self.bar.update(count)
        return self.bar

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "LazyBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
