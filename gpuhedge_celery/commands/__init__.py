"""CLI sub-commands, one module each, exposing ``command`` (discovered by ``cli.LazyGroup``)."""
