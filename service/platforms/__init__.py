"""Hosted voice platforms' adapters (SPEC section 15): each verifies its platform's webhooks, parses them into
the neutral records of service/domain/platforms/records.py and calls the ingestion rules; nothing
vendor-shaped reaches the domain. Their routes are in service/http/."""
