"""Shared test helpers (servers, fixtures data) for every test suite."""
