"""``python -m neorec …``: the ``neorec`` command."""

from neorec.orchestration.cli import main

if __name__ == "__main__":
    main()
