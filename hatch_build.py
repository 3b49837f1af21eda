"""The build hook of the service's distribution (hatchling runs it; see [tool.hatch.metadata.hooks.custom] in
pyproject.toml): its dependencies are those listed there plus the SDK of exactly its own version, so that the
version is written once (sdk/_version.py) and the two distributions can never be installed at different ones."""

from __future__ import annotations

from typing import Any

from hatchling.metadata.plugin.interface import MetadataHookInterface


class SameVersionSDK(MetadataHookInterface):
    def update(self, metadata: dict[str, Any]) -> None:
        listed = self.config.get("dependencies")
        if not isinstance(listed, list) or not all(isinstance(d, str) for d in listed):
            raise TypeError("[tool.hatch.metadata.hooks.custom] dependencies must be a list of requirements")
        metadata["dependencies"] = [*listed, f"caller-memory-sdk=={metadata['version']}"]
