"""An example model package for ``model=custom`` (docs/models.md)."""
