"""``python -m neorec …``: the ``neorec`` command (its exit status included)."""

import sys

from neorec.orchestration.cli import main

if __name__ == "__main__":
    sys.exit(main())
