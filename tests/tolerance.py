"""The suite's one tolerance check: a prediction against the real run that decides it (issue 40).

Every accuracy test states its tolerance as a fraction of the measured bytes, the truth (a real CPU run through
tests/oracle.py, or a recorded GPU run); the failure message gives both figures, the difference in bytes and in
percent, and the context the test passes."""

from __future__ import annotations


def assert_within(predicted: int, measured: int, rel: float, *context: object) -> None:
    """Assert |predicted - measured| <= rel * measured (bytes are ints; `rel` a fraction: 0.001 is 0.1%)."""
    diff = predicted - measured
    assert abs(diff) <= rel * measured, (
        f"predicted {predicted:,} B, measured {measured:,} B: {diff:+,} B ({diff / measured:+.4%}), "
        f"tolerance {rel:.2%}", *context)
