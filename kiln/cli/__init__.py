"""The `kiln` command line: one module per command group, each a thin layer over the library."""
