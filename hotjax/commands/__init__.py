"""The `hotjax` commands: thin users of the library (`hotjax.run`, `hotjax.planning`), each
option defined once in `options`. `hotjax.cli` assembles them into one parser."""
