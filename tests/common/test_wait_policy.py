"""The OpenMP wait policy neorec sets for the processes it runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from neorec.common.wait_policy import WAIT_POLICY, WAIT_VARIABLES, prefer_short_waits


def test_short_waits_unless_the_user_chose() -> None:
    environ: dict[str, str] = {}
    assert prefer_short_waits(environ)
    assert environ == {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"} == WAIT_POLICY
    for name in WAIT_VARIABLES:
        chosen = {name: "7"}
        assert not prefer_short_waits(chosen)
        assert chosen == {name: "7"}


@pytest.mark.parametrize("preset, expected", [({}, "- 10000 0"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE - -")])
def test_importing_neorec_sets_it_before_torch_loads(preset: dict[str, str], expected: str) -> None:
    """torch's OpenMP runtime reads the policy when it loads: importing neorec first must
    have set it by then, and a child process inherits it."""
    show = "print(*(os.environ.get(n, '-') for n in %r))" % (WAIT_VARIABLES,)
    code = (f"import os, neorec, torch, subprocess, sys; {show}; "
            f"subprocess.run([sys.executable, '-c', {'import os; ' + show!r}], check=True)")
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **preset}, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == [expected, expected]
