"""Helpers several test modules share, one module per kind of thing (see
tests/test_test_hygiene.py: no test module is another's library)."""
