"""Universal checkpoints: Orbax state in logical form that resumes on any layout (`store`,
`meta`), Hugging Face import and export, and import of foreign per-rank shard sets (`foreign`).

Import the submodules themselves: this package imports nothing, so that the shard importer's
worker processes start without JAX.
"""
