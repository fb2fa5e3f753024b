"""Provider of ``feather`` subcommands (see feather_gym/cli.py). Not yet implemented."""


def register(commands) -> None:
    """Add this package's subcommands to the ``feather`` command tree."""
