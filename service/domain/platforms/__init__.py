"""Hosted voice platforms (SPEC section 15): a project's connections to them (``connections``: the body, its
rules, the stored document; ``service``: the use case, sealed secrets, audit)."""
