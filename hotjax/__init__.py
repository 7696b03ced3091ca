"""hotjax: hot-switched parallelism for LLaMA training on mixed-length data."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_root() -> Path:
    """Where hotjax keeps trained tokenizers and compiled programs: `$HOTJAX_CACHE`."""
    return Path(os.environ.get("HOTJAX_CACHE", "~/.cache/hotjax")).expanduser()
