"""``caller_memory.sdk.__all__``: sorted, and exactly the public API (convention 4 of the engineering guide)."""

from __future__ import annotations

import ast
import inspect
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import caller_memory.sdk as sdk
from caller_memory.sdk import conversation, errors

PACKAGE = "caller_memory.sdk"


def test_all_is_sorted_and_unique() -> None:
    assert sdk.__all__ == sorted(sdk.__all__)
    assert len(set(sdk.__all__)) == len(sdk.__all__)


def test_all_names_public_objects_of_the_sdk() -> None:
    for name in sdk.__all__:
        assert not name.startswith("_"), name
        obj = getattr(sdk, name)  # every listed name exists
        assert obj.__module__.startswith(PACKAGE + "."), (name, obj.__module__)
        assert not obj.__module__.split(".")[-1].startswith("_") or name in PUBLIC_FROM_PRIVATE, name


#: Exported objects defined in a private module (none: a public object lives in a public module).
PUBLIC_FROM_PRIVATE: set[str] = set()


def test_every_public_name_of_the_package_is_exported() -> None:
    """What the package itself offers (``from caller_memory.sdk import X`` works) is in ``__all__``, apart from
    its submodules: nothing public is importable but missing from ``import *`` and the docs."""
    offered = {
        name
        for name, value in vars(sdk).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert offered == set(sdk.__all__)


def test_every_exception_is_exported() -> None:
    raised = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__
    }
    assert raised and raised <= set(sdk.__all__)


def _hinted_types(obj: Any) -> Iterator[type]:
    """The SDK's classes named in the type hints of ``obj`` (a function, or a class's public methods,
    properties and fields)."""
    targets: list[Any] = []
    if inspect.isclass(obj):
        targets.append(obj)  # dataclass fields and class attributes
        # Its own members and those of the SDK's classes it is built on, whatever module they live in
        # (MemoryClient's outbox delivery and end, Conversation's transcript reads).
        members = {
            name: member
            for base in reversed(obj.__mro__)
            if base.__module__.startswith(PACKAGE + ".")
            for name, member in vars(base).items()
        }
        for name, member in members.items():
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(member, property):
                member = member.fget
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            if inspect.isfunction(member):
                targets.append(member)
    else:
        targets.append(obj)
    for target in targets:
        module = inspect.getmodule(target) or sdk
        for hint in typing.get_type_hints(target, vars(module)).values():
            yield from _classes(hint)


def _classes(hint: Any) -> Iterator[type]:
    # A class with a private name (the protocol a Conversation needs of its client) is deliberately not
    # part of the API; every other class of the SDK a signature names is.
    if (
        isinstance(hint, type)
        and hint.__module__.startswith(PACKAGE + ".")
        and not hint.__name__.startswith("_")
    ):
        yield hint
    for arg in typing.get_args(hint):
        yield from _classes(arg)


def test_every_sdk_type_in_a_public_signature_is_exported() -> None:
    """A class a user meets in the exported API (a parameter, a return value, a field) can be imported
    from the package by its name: the API is complete."""
    exported = {getattr(sdk, name) for name in sdk.__all__}
    missing = {
        f"{name} -> {cls.__name__}"
        for name in sdk.__all__
        for cls in _hinted_types(getattr(sdk, name))
        if cls not in exported
    }
    assert not missing


def test_conversation_does_not_import_the_client() -> None:
    """client.py imports conversation.py; the reverse, even under TYPE_CHECKING, would be an import cycle."""
    source = Path(inspect.getfile(conversation)).read_text()
    imported = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module is not None
    } | {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not {name for name in imported if name.split(".")[-1] == "client"}, imported
