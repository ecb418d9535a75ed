"""Router test fixtures: a real Redis server per test module."""

from kvferry_testing.fixtures import redis_url  # noqa: F401 (fixture)
