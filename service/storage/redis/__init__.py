"""The Redis backend (standalone Redis and Redis Cluster): :class:`~.store.RedisStore` implements the domain's
port, one module per capability named like the port's (``domain/store/<capability>.py`` is implemented in
``storage/redis/<capability>.py``), over :mod:`.transport` (connections, scripts, the read cache), :mod:`.cluster`
and the key layout in :mod:`.keys`; each operation is one Lua script of ``lua/``."""
