"""Names of backends, for attn_backend("name") and ASTR_BACKEND."""

from __future__ import annotations

from typing import Dict, List, Type

from .base import AttentionBackend
from .registry import BACKEND_ALIASES, BUILTIN_BACKENDS

_SINGLETONS: Dict[type, AttentionBackend] = {}


def _instance(cls: Type[AttentionBackend]) -> AttentionBackend:
    """The one shared instance of a backend class."""
    backend = _SINGLETONS.get(cls)
    if backend is None:
        backend = _SINGLETONS[cls] = cls()
    return backend


class AttentionBackendFactory:
    """Maps names to backend classes. The built-ins are registered at import; a Python
    backend can be registered under a new name."""

    _registry: Dict[str, Type[AttentionBackend]] = {cls.name: cls for cls in BUILTIN_BACKENDS}

    @classmethod
    def register(cls, name: str, backend_cls: Type[AttentionBackend]) -> None:
        if name in cls._registry:
            raise ValueError(f"Component already registered: {name!r}")
        if not (isinstance(backend_cls, type) and issubclass(backend_cls, AttentionBackend)):
            raise TypeError("backend_cls: expected a subclass of AttentionBackend")
        cls._registry[name] = backend_cls

    @classmethod
    def list_registered(cls) -> List[str]:
        return list(cls._registry)

    @classmethod
    def get(cls, name: str) -> Type[AttentionBackend]:
        """The class registered under ``name``, or under the built-in name it is another name
        of ("sdpa": torch_native)."""
        try:
            return cls._registry[name]
        except KeyError:
            pass
        if name in BACKEND_ALIASES and name not in cls._registry:
            return cls._registry[BACKEND_ALIASES[name]]
        aliases = "".join(f", {alias} (= {name})" for alias, name in BACKEND_ALIASES.items())
        raise ValueError(
            f"Unknown component: {name!r} (registered: {', '.join(cls._registry)}{aliases})"
        )

    @classmethod
    def create(cls, name: str) -> AttentionBackend:
        return _instance(cls.get(name))
