"""nats-py without aiohttp until a websocket URL needs it.

`nats.aio.transport` imports aiohttp at module level (`try: import aiohttp`)
for its `WebSocketTransport` alone, the transport of `ws://` and `wss://`
servers. bcd's buses are `nats://` / `tls://`, yet every process paid for
aiohttp and its dependencies (yarl, multidict, attrs, ...): about 10 MiB of
resident memory each, a quarter of a service.

`install()` puts a finder on `sys.meta_path` that runs that one module with
`import aiohttp` failing (so it sets `aiohttp = None`, as it does when aiohttp
is not installed), and wraps `WebSocketTransport.__init__` to import aiohttp
and multidict into the module on its first construction: a `ws://` URL works
as before, it just pays on first use. Nothing is imported by `install()`
itself; it is called from the `bcd`, `services` and `shared` package inits,
so it is in place before any bcd process imports nats. A process that
imported aiohttp before nats (kubernetes_asyncio) gets the module unchanged.
"""

from __future__ import annotations

import functools
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TRANSPORT = "nats.aio.transport"


class _TransportLoader:
    """The module's own loader, with aiohttp unimportable while it runs."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        blocked = "aiohttp" not in sys.modules
        if blocked:
            sys.modules["aiohttp"] = None  # type: ignore[assignment] - `import aiohttp` raises ImportError
        try:
            self._loader.exec_module(module)
        finally:
            if blocked and "aiohttp" in sys.modules and sys.modules["aiohttp"] is None:
                del sys.modules["aiohttp"]
        if getattr(module, "aiohttp", None) is None and hasattr(module, "WebSocketTransport"):
            _import_on_first_use(module)


def _import_on_first_use(module: ModuleType) -> None:
    cls = module.WebSocketTransport
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if module.aiohttp is None:
            try:
                import aiohttp
                import multidict
            except ImportError:
                pass  # not installed: the original __init__ says so
            else:
                module.aiohttp, module.multidict = aiohttp, multidict
        init(self, *args, **kwargs)

    cls.__init__ = __init__


class _Finder:
    """Finds nothing but `nats.aio.transport`, through the normal path finder."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TRANSPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _TransportLoader(spec.loader)  # type: ignore[assignment]
        return spec


def install() -> None:
    """Idempotent; a no-op once nats' transport module is loaded."""
    if TRANSPORT in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


__all__ = ["install"]
