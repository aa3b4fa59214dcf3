"""`kimi-k3-moe bench` and the pieces `tune` shares with it.

One timing method (`timing`), one set of shapes and random data (`shapes`,
`data`), the peers behind one interface (`peers`), the row runner that checks
every candidate against the float reference before timing it (`runner`) and
the report (`report`). Importing this package imports no GPU toolkit.
"""
