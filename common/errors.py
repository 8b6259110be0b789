"""The error family for what a user gave neorec: a config, a data set, a path, an address.

Every error that judges the user's input derives from :class:`UserError`, raised where the
input is judged; the ``neorec`` command prints such an error as one ``neorec: error: …`` line
and exits 2. Any other exception is a bug in neorec: it keeps its traceback and exits 1.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, data, paths, addresses, command-line arguments),
    with a message that names what is wrong and where."""
