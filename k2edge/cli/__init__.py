"""The k2edge command line: one module per command, each thin over the library."""
