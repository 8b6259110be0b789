"""The benchmarks' interleaved timing: call order and per-round rates, on a fake clock."""

from __future__ import annotations

import pytest

from neorec.benchmarks import timing


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rounds_alternate_the_candidates_after_their_warmup_and_give_each_rounds_rate(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    calls: list[tuple[str, int]] = []
    seconds_per_step = {"fast": [1.0, 1.0, 0.5], "slow": [2.0, 4.0, 2.0]}  # by round

    def candidate(name: str):
        def run(i: int) -> int:
            calls.append((name, i))
            if i >= 1:  # the warm-up step (i = 0) is not timed
                clock.now += seconds_per_step[name][(i - 1) // 2]
            return 10
        return run

    by_round = timing.interleaved_round_rates({"fast": candidate("fast"), "slow": candidate("slow")},
                                              steps=2, rounds=3, warmup=1)

    assert calls == [("fast", 0), ("slow", 0),
                     ("fast", 1), ("fast", 2), ("slow", 1), ("slow", 2),
                     ("fast", 3), ("fast", 4), ("slow", 3), ("slow", 4),
                     ("fast", 5), ("fast", 6), ("slow", 5), ("slow", 6)]
    assert by_round == {"fast": pytest.approx([10.0, 10.0, 20.0]), "slow": pytest.approx([5.0, 2.5, 5.0])}
    assert timing.medians(by_round) == {"fast": pytest.approx(10.0), "slow": pytest.approx(5.0)}
