"""The ``neorec`` command line and configuration loading."""
