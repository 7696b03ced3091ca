"""hotjax's version: what `import hotjax` shows and every checkpoint records."""

__version__ = "0.1.0"
