"""Shared fixtures: small synthetic datasets generated once per session."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate


def pytest_sessionstart(session: pytest.Session) -> None:
    """Let Ctrl-C reach the tests that send it. A shell starts a background job with SIGINT
    ignored, and every process it starts inherits that: ``neorec train`` then rightly
    ignores the SIGINT those tests send. A handler set here is reset to the default in the
    processes the tests start."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def demo_kernels() -> None:
    """Numba's on-disk cache holds the kernels of ``configs/demo.toml``'s runs, as a launcher
    leaves it before it starts processes. The ``neorec train`` processes a test starts then
    load them instead of compiling them (about 100 s on 2 cores with a cold cache), so that
    a test's deadline on their first steps does not also cover compilation."""
    from neorec.orchestration.config import load_config
    from neorec.trainer.run.warmup import compile_kernels

    compile_kernels(load_config(Path(__file__).parents[1] / "configs" / "demo.toml"))


@pytest.fixture(scope="session")
def criteo_dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """6,000 criteo-profile rows in row groups of 700 (several groups, ragged ends)."""
    return generate(SynthSpec(rows=6_000, row_group_rows=700, file_rows=2_100, seed=3),
                    tmp_path_factory.mktemp("criteo"))


@pytest.fixture(scope="session")
def multihot_dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return generate(SynthSpec(profile="multihot", rows=2_000, row_group_rows=500, seed=5),
                    tmp_path_factory.mktemp("multihot"))


FIXTURES = Path(__file__).parent / "fixtures"
