"""Test utilities shared by the test suites (not fixtures: those live in tests/conftest.py)."""
