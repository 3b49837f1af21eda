"""The version of both distributions, ``caller-memory-sdk`` and ``caller-memory``, written once: each project file
reads it from here when it is built, and the service depends on the SDK of exactly this version."""

__version__ = "0.1.0"
