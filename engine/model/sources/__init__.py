"""Where a model's folder comes from: the catalog of named models (PyPI GGUF packages, fetched
and converted on first use), local GGUF files, and their chat templates."""
