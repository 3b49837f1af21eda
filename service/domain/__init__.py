"""Domain layer: configuration, identifiers, memory rules and use cases.

Imports neither aiohttp nor redis; storage is reached through :class:`caller_memory.service.storage.base.Store`.
"""
