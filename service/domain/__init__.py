"""Domain layer: configuration, identifiers, memory rules and use cases.

Imports neither aiohttp nor redis; storage is reached through the Store interface it owns
(:class:`caller_memory.service.domain.store.Store`), which the backends in service/storage implement.
"""
