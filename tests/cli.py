"""The ``neorec`` command as the tests start it: ``python -m neorec`` in a subprocess of
this interpreter, so that a test sees exactly what a user's shell would (exit status,
stdout, stderr)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

NEOREC = [sys.executable, "-m", "neorec"]
"""The command line that starts ``neorec`` (for ``Popen`` and commands built by hand)."""


def neorec(*args: object, timeout: float = 600, **options) -> subprocess.CompletedProcess:
    """Run ``neorec ARGS`` to the end, its output captured as text; ``options`` go to
    :func:`subprocess.run` (``cwd``, ``env``)."""
    return subprocess.run([*NEOREC, *map(str, args)], capture_output=True, text=True, timeout=timeout, **options)


def neorec_in_process(*args: object) -> subprocess.CompletedProcess:
    """``neorec ARGS`` run by :func:`neorec.orchestration.cli.main` in this process, its
    stdout and stderr captured: for commands that only read and refuse (a subprocess spends
    ~2 s importing torch first). Not for commands that start processes or services, nor
    to check what libraries write to the file descriptors themselves."""
    from neorec.orchestration.cli import main

    argv = [str(arg) for arg in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's refusal of the arguments
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess([*NEOREC, *argv], code, out.getvalue(), err.getvalue())
