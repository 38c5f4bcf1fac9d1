"""What the test suite and ``bench/`` share: comparison helpers, test oracles, kernel references and parity cases.

Nothing in the package imports this (tests and benchmarks do)."""

from freetoken.testing.compare import assert_close, max_error, poison, random_record

__all__ = ["assert_close", "max_error", "poison", "random_record"]
