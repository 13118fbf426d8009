"""The ``pmakit`` subcommands, one module per room; each module's ``register(group)`` adds its commands."""
