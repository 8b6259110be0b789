"""The OpenMP wait policy neorec sets for the processes it runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from neorec.common.wait_policy import WAIT_VARIABLES, prefer_passive_waiting


def test_passive_unless_the_user_chose() -> None:
    environ: dict[str, str] = {}
    assert prefer_passive_waiting(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    for name in WAIT_VARIABLES:
        chosen = {name: "7"}
        assert not prefer_passive_waiting(chosen)
        assert chosen == {name: "7"}


@pytest.mark.parametrize("preset, expected", [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE")])
def test_importing_neorec_sets_it_before_torch_loads(preset: dict[str, str], expected: str) -> None:
    """torch's OpenMP runtime reads the policy when it loads: importing neorec first must
    have set it by then, and a child process inherits it."""
    code = ("import os, neorec, torch; import subprocess, sys; "
            "print(os.environ['OMP_WAIT_POLICY']); "
            "subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"OMP_WAIT_POLICY\"])'], check=True)")
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **preset}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [expected, expected]
