"""Caller Memory service: repeat-caller memory for voice agents."""
