"""Request bodies validated with pydantic (the configuration document lives in domain/projects.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TokenCreate(BaseModel):
    """``POST /v1/projects/{project}/tokens``."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["agent", "analytics", "admin"]
    label: str = Field(
        default="", max_length=100, description="A note for people, e.g. 'cheese-shop agent prod'"
    )
