"""One module per CLI subcommand (or group); each exposes ``register(subparsers)``."""
