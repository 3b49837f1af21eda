"""The embedded SQLite backend: :class:`~.store.SQLiteStore` implements the domain's port, one module per
capability named like the port's (``domain/store/<capability>.py`` is implemented in
``storage/sqlite/<capability>.py``); the tables are in ``schema.sql``."""
