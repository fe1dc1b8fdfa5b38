"""The ``dxpool`` subcommands, one module per noun."""
