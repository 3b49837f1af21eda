"""Caller Memory Python SDK (see the SDK issue; the client arrives there)."""

__all__: list[str] = []
