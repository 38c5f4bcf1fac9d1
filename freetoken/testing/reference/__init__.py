"""NumPy references of every op (float64 where arithmetic is involved), one module per op: the oracles of the
parity cases (``freetoken.testing.cases``) and of the tests. Package code never imports them."""
