"""The plugin host: finds plugins, calls their hooks, owns the registries.

Plugins come from the ``irgen`` entry-point group (installed distributions)
and from ``irgen --plugin MODULE_OR_FILE``; ``no:NAME`` (in ``--plugin``, the
``blocked`` argument or ``IRGEN_BLOCK_PLUGINS=a,b``) blocks one by name, as
``pytest -p no:NAME`` does. A plugin that fails to import is reported by name
on stderr and skipped, or is fatal under ``strict`` / ``IRGEN_PLUGINS_STRICT=1``;
so is one whose import or registration hook does not finish within
``IRGEN_PLUGIN_TIMEOUT`` seconds (default 60): a hanging plugin cannot hang irgen.

This module never imports tvm, torch, tensorflow or onnx.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Generic, Iterable, TypeVar

import pluggy

from irgen import envflags, hookspecs
from irgen.api import Backend, DumpReader, Frontend, IrgenError, Option, Quantizer, Serializer, Signature
from irgen.safeio import regular_file

ENTRY_POINT_GROUP = "irgen"
BLOCK_ENV = "IRGEN_BLOCK_PLUGINS"
STRICT_ENV = "IRGEN_PLUGINS_STRICT"
TIMEOUT_ENV = "IRGEN_PLUGIN_TIMEOUT"
#: seconds a plugin may take to import or to register (``IRGEN_PLUGIN_TIMEOUT``; 0: no bound)
DEFAULT_PLUGIN_TIMEOUT = 60.0

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects of one kind ("frontend", "backend", ...) by name, with their plugin."""

    def __init__(self, kind: str, cls: type[T]):
        self.kind = kind
        self.cls = cls
        self._entries: dict[str, tuple[T, str]] = {}

    def register(self, obj: T, plugin_name: str) -> None:
        """Add ``obj`` under ``obj.name``; a name already taken is an :class:`IrgenError`."""
        if not isinstance(obj, self.cls):
            raise IrgenError(
                f"plugin '{plugin_name}' registered a {type(obj).__name__} "
                f"as a {self.kind} (expected {self.cls.__name__})"
            )
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise IrgenError(f"plugin '{plugin_name}' registered a {self.kind} without a name")
        if name in self._entries:
            raise IrgenError(
                f"{self.kind} '{name}' registered by both "
                f"'{self._entries[name][1]}' and '{plugin_name}'"
            )
        self._entries[name] = (obj, plugin_name)

    def get(self, name: str) -> T:
        """The object registered as ``name``; unknown names list the available ones."""
        try:
            return self._entries[name][0]
        except KeyError:
            available = ", ".join(self.names()) or "none registered"
            shown = str(name)[:60] + ("..." if len(str(name)) > 60 else "")  # a name may come from a hostile file
            raise IrgenError(f"unknown {self.kind} '{shown}' (available: {available})") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return [(name, self._entries[name][0]) for name in self.names()]

    def owner(self, name: str) -> str:
        """The name of the plugin that registered ``name``."""
        self.get(name)
        return self._entries[name][1]

    def clear(self) -> None:
        self._entries.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class PluginInfo:
    """One plugin the host knows about, loaded or not."""

    name: str
    source: str  # "entry point", "--plugin" or "api"
    version: str | None = None
    dist: str | None = None
    status: str = "loaded"  # "loaded", "blocked" or "failed"
    error: str | None = None
    plugin: Any = field(default=None, repr=False)


# hook name -> registry kind, in the order hooks are called
_HOOK_KINDS = {
    "irgen_register_frontends": "frontend",
    "irgen_register_quantizers": "quantizer",
    "irgen_register_backends": "backend",
    "irgen_register_serializers": "serializer",
    "irgen_register_options": "option",
    "irgen_register_signatures": "signature",
    "irgen_register_dump_readers": "dump-reader",
}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _env_names(var: str) -> set[str]:
    return {n.strip() for n in os.environ.get(var, "").split(",") if n.strip()}


class PluginTimeout(Exception):
    """A plugin took longer than ``IRGEN_PLUGIN_TIMEOUT`` seconds to import or register."""


def _timeout_seconds() -> float:
    return envflags.seconds(TIMEOUT_ENV, DEFAULT_PLUGIN_TIMEOUT)


class _TimeBound:
    """Raise :class:`PluginTimeout` in the main thread after ``seconds`` (SIGALRM; a no-op elsewhere)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.previous: Any = None
        self.armed = False

    def __enter__(self) -> "_TimeBound":
        import signal
        import threading

        if self.seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            if signal.getitimer(signal.ITIMER_REAL)[0] == 0:  # nobody else's alarm is running
                self.previous = signal.signal(signal.SIGALRM, self._expired)
                signal.setitimer(signal.ITIMER_REAL, self.seconds)
                self.armed = True
        return self

    def _expired(self, signum, frame) -> None:
        raise PluginTimeout(f"did not finish within {self.seconds:g} s ({TIMEOUT_ENV})")

    def __exit__(self, *exc: Any) -> None:
        if self.armed:
            import signal

            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or os.sep in spec


class PluginHost:
    """A :class:`pluggy.PluginManager` for the ``irgen`` hooks plus the four registries."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.frontends: Registry[Frontend] = Registry("frontend", Frontend)
        self.quantizers: Registry[Quantizer] = Registry("quantizer", Quantizer)
        self.backends: Registry[Backend] = Registry("backend", Backend)
        self.serializers: Registry[Serializer] = Registry("serializer", Serializer)
        self.options: Registry[Option] = Registry("option", Option)
        self.signatures: Registry[Signature] = Registry("signature", Signature)
        self.dump_readers: Registry[DumpReader] = Registry("dump-reader", DumpReader)
        self.strict = False
        self._infos: dict[str, PluginInfo] = {}

    @property
    def registries(self) -> dict[str, Registry[Any]]:
        """Registries by kind: "frontend", "quantizer", "backend", "serializer", "option", "signature",
        "dump-reader"."""
        return {
            "frontend": self.frontends,
            "quantizer": self.quantizers,
            "backend": self.backends,
            "serializer": self.serializers,
            "option": self.options,
            "signature": self.signatures,
            "dump-reader": self.dump_readers,
        }

    @property
    def failures(self) -> list[PluginInfo]:
        return [i for i in self._infos.values() if i.status == "failed"]

    # -- loading -------------------------------------------------------------

    def load(
        self, extra: Iterable[str] = (), blocked: Iterable[str] = (), strict: bool = False
    ) -> PluginHost:
        """Load entry-point plugins, then ``extra`` (``--plugin`` values); fill the registries.

        ``extra`` items are dotted module names or ``.py`` paths, or ``no:NAME``
        to block a plugin. Returns ``self``.
        """
        extra = list(extra)
        env_strict = envflags.switch(STRICT_ENV)
        self.strict = strict or env_strict
        no_names = (e[3:] for e in extra if e.startswith("no:"))
        for name in {*blocked, *_env_names(BLOCK_ENV), *no_names}:
            self.pm.set_blocked(name)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist
            info = PluginInfo(
                ep.name, "entry point",
                version=dist.version if dist else None, dist=dist.name if dist else None,
            )
            self._add(info, ep.load)
        for spec in extra:
            if not spec.startswith("no:"):
                self._load_extra(spec)
        self._fill_registries()
        return self

    def _load_extra(self, spec: str) -> None:
        if _is_file_spec(spec):
            path = Path(spec)
            if not path.exists():
                raise IrgenError(f"--plugin '{spec}': no such file")
            regular_file(path, "--plugin")
            self._add(PluginInfo(path.stem, "--plugin"), lambda: _import_file(path))
            return
        self._add(PluginInfo(spec, "--plugin"), lambda: _import_module(spec))

    def _add(self, info: PluginInfo, importer: Callable[[], Any]) -> None:
        """Import a plugin (unless blocked) and register it, recording the outcome."""
        if self.pm.is_blocked(info.name):
            info.status = "blocked"
            self._infos.setdefault(info.name, info)
            return
        if info.name in self._infos:
            other = self._infos[info.name].source
            raise IrgenError(f"two plugins named '{info.name}' (from {other} and {info.source})")
        try:
            with _TimeBound(_timeout_seconds()):
                plugin = importer()
        except IrgenError:
            raise
        except (Exception, SystemExit) as exc:
            self._fail(info, "failed to load", exc)
            return
        if self.pm.is_registered(plugin):
            return  # already loaded under another name
        info.version = info.version or getattr(plugin, "__version__", None)
        self._register(plugin, info)

    def _register(self, plugin: Any, info: PluginInfo) -> None:
        try:
            self.pm.register(plugin, name=info.name)
        except pluggy.PluginValidationError as exc:
            self._fail(info, "is invalid", exc)
            return
        callers = self.pm.get_hookcallers(plugin) or []
        unknown = sorted(hc.name for hc in callers if hc.spec is None)
        if unknown:
            self.pm.unregister(plugin)
            self._fail(info, "is invalid", ValueError(f"unknown hook(s): {', '.join(unknown)}"))
            return
        info.plugin = plugin
        self._infos[info.name] = info

    def _fail(self, info: PluginInfo, what: str, exc: BaseException) -> None:
        message = f"plugin '{info.name}' {what}: {_one_line(exc)}"
        if self.strict:
            raise IrgenError(message) from exc
        print(f"irgen: warning: {message}", file=sys.stderr)
        info.status, info.error, info.plugin = "failed", _one_line(exc), None
        self._infos[info.name] = info

    def _fill_registries(self) -> None:
        """Call every register hook implementation, one plugin at a time."""
        for registry in self.registries.values():
            registry.clear()
        for hook_name, kind in _HOOK_KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.wrapper or impl.hookwrapper:
                    continue
                found: list[Any] = []
                hook_args = {"register": found.append}
                try:
                    with _TimeBound(_timeout_seconds()):
                        impl.function(*(hook_args[arg] for arg in impl.argnames))
                except (Exception, SystemExit) as exc:
                    name = impl.plugin_name
                    info = self._infos.get(name) or PluginInfo(name, "api")
                    self.pm.unregister(impl.plugin)
                    self._fail(info, f"failed in {hook_name}", exc)
                    self._fill_registries()  # drop what it registered from other hooks
                    return
                for obj in found:
                    self.registries[kind].register(obj, impl.plugin_name)

    def configure(self, options: dict[str, Any]) -> None:
        """Call every ``irgen_configure`` implementation with a read-only view of ``options``
        (every registered option present, its default when not given); a plugin that
        fails is named."""
        from types import MappingProxyType

        full = dict(options)
        for name, opt in self.options.items():
            full.setdefault(name, False if opt.kind == "flag" and opt.default is None else opt.default)
        view = MappingProxyType(full)
        for impl in self.pm.hook.irgen_configure.get_hookimpls():
            try:
                with _TimeBound(_timeout_seconds()):
                    impl.function(*(view for _ in impl.argnames))
            except IrgenError:
                raise
            except (Exception, SystemExit) as exc:
                raise IrgenError(f"plugin '{impl.plugin_name}' failed in irgen_configure: {_one_line(exc)}") from exc

    # -- test helpers ----------------------------------------------------------

    def register_plugin(self, plugin: Any, name: str) -> None:
        """Register a module or object as plugin ``name`` and refresh the registries."""
        info = PluginInfo(name, "api", version=getattr(plugin, "__version__", None))
        if name in self._infos:
            raise IrgenError(f"a plugin named '{name}' is already registered")
        self._register(plugin, info)
        self._fill_registries()

    def unregister(self, name: str) -> None:
        """Remove plugin ``name`` and everything it registered."""
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self._infos.pop(name, None)
        self._fill_registries()

    # -- listing -------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """One JSON-able dict per plugin, in load order, failed and blocked ones included."""
        rows = []
        for info in self._infos.values():
            hooks: list[str] = []
            if info.plugin is not None:
                hooks = sorted(hc.name for hc in self.pm.get_hookcallers(info.plugin) or ())
            registered = {
                kind: [n for n in reg.names() if reg.owner(n) == info.name]
                for kind, reg in self.registries.items()
            }
            registered = {kind: names for kind, names in registered.items() if names}
            descriptions = {kind: {n: _description(self.registries[kind].get(n)) for n in names}
                            for kind, names in registered.items()}
            rows.append({
                "name": info.name,
                "version": info.version,
                "dist": info.dist,
                "source": info.source,
                "status": info.status,
                "kinds": list(registered),
                "hooks": hooks,
                "registered": registered,
                "descriptions": descriptions,
                "error": info.error,
            })
        return rows


def _description(obj: Any) -> str:
    """A registered object's one-line description (``description``, or an option's ``help`` with
    argparse's ``%(default)s``-style fields filled in, as ``--help`` shows it)."""
    text = str(getattr(obj, "description", None) or getattr(obj, "help", None) or "")
    if getattr(obj, "help", None) and "%(" in text:
        fields = {"default": getattr(obj, "default", None), "metavar": getattr(obj, "metavar", None),
                  "dest": getattr(obj, "name", None), "prog": "irgen"}
        try:
            text = text % fields
        except (KeyError, ValueError, TypeError):
            pass  # not argparse's fields: shown as written
    return " ".join(text.split())


def _import_module(name: str) -> ModuleType:
    """Import a ``--plugin`` module; a module that does not exist is a user error."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise IrgenError(f"--plugin '{name}': no module named '{exc.name}'") from None
        raise


def _import_file(path: Path) -> ModuleType:
    """Import a plugin ``.py`` file under a module name no other file can clash with."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    module_name = f"irgen_plugin_{re.sub(r'[^0-9a-zA-Z_]', '_', path.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickle look modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


class PluginError(IrgenError):
    """A plugin's own code failed; the message names the plugin and what it was doing."""


def call_plugin(registry: Registry[Any], name: str, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for the ``registry`` entry ``name``: a failure that is not
    already an :class:`IrgenError` becomes one line naming the plugin that owns ``name``
    (the original exception stays as ``__cause__`` for ``IRGEN_TRACEBACK=1``)."""
    try:
        return fn(*args, **kwargs)
    except IrgenError:
        raise
    except RecursionError as exc:
        raise PluginError(f"{registry.kind} {name!r} (plugin '{registry.owner(name)}') could not {action}: "
                          f"the input is nested too deeply (RecursionError)") from exc
    except MemoryError as exc:
        raise PluginError(f"{registry.kind} {name!r} (plugin '{registry.owner(name)}') could not {action}: "
                          f"out of memory") from exc
    except Exception as exc:  # noqa: BLE001  a plugin's own failure, reported with its name
        raise PluginError(f"{registry.kind} {name!r} (plugin '{registry.owner(name)}') could not {action}: "
                          f"{_one_line(exc)[:500]}") from exc

