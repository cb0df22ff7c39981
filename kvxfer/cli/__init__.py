"""Command-line tools: ``kvxfer-bench`` (``bw``, ``lat``, ``topo``), on the public API only."""
