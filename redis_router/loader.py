"""Choose and build a router: an explicit class, a YAML config, or the default balancer.

Priority, as in verl's ``get_router_handle``: ``load_balancer_cls`` if given, else the class
named by the YAML file at ``router_config_path``, else :class:`~redis_router.RedisLoadBalancer`.
The result is a local object in this process (no actor): every process that loads the same
config with the same Redis and balancer name shares one balancer.

How each is constructed (verl 0.9.1's conventions, so a router written for verl loads here):

- an explicit class: ``cls(servers=..., **options)``; ``full_determinism`` is passed only to
  the default balancer (:class:`~redis_router.RedisLoadBalancer` or its asyncio twin), since
  a custom class takes over routing, as verl does for its own balancer. verl also passes its
  LRU size, ``max_cache_size``, which redis-router's balancers have no use for: not passed.
- a YAML router: ``cls(servers, router_kwargs)``, positionally, where ``router_kwargs`` is the
  file's keys other than ``router_class`` (verl leaves ``router_class`` in; redis-router's
  balancers refuse keys they do not know, so it is taken out here). ``**options`` override a
  key the file also sets (a shipped config reused under another balancer name, say), and
  ``full_determinism=True`` sets ``full_determinism: true`` (verl itself never passes it to a
  plugin: write it in the file). A class whose ``router_kwargs`` is keyword-only, as
  redis-router's balancers, gets it by keyword.

Trust model: a router config names code (``router_class``) that this function imports and
runs with the caller's privileges, exactly like ``import``. Load only config files you would
execute as code: from your repository or an installed package, never from a request, a
dataset or a shared writable directory. The loader reads no path it was not given (a relative
path is resolved against the working directory) and runs no code beyond importing the named
module and constructing the class.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.resources
import inspect
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import RedisRouterError, RouterConfigError
from .protocol import METHODS, missing_methods

ENTRY_POINT_GROUP = "redis_router.routers"
PKG_SCHEME = "pkg://"


def get_router_handle(
    servers: Mapping[str, Any] | None,
    router_config_path: str | Path | None = None,
    load_balancer_cls: type | None = None,
    full_determinism: bool = False,
    **options: Any,
) -> Any:
    """Build the router for ``servers`` ({server id: handle or metadata}).

    See the module docstring for how each kind of router is constructed. Every failure to
    find or build a router raises :class:`~redis_router.RouterConfigError`.
    """
    from .aio import AsyncRedisLoadBalancer
    from .balancer import RedisLoadBalancer

    if load_balancer_cls is not None:
        where = f"load_balancer_cls {_qualname(load_balancer_cls)}"
        _check_protocol(load_balancer_cls, where)
        if load_balancer_cls in (RedisLoadBalancer, AsyncRedisLoadBalancer):
            options = {**options, "full_determinism": full_determinism}
        elif full_determinism:
            warnings.warn(
                f"full_determinism=True is not passed to {where}: a custom class decides its "
                "own routing (as in verl); give the class its own setting",
                stacklevel=2,
            )
        return _construct(load_balancer_cls, where, servers=servers, **options)
    if router_config_path is not None and str(router_config_path) != "":
        path = resolve_config_path(router_config_path)
        config = load_router_config(path)
        spec = config.pop("router_class", None)
        if not isinstance(spec, str) or not spec.strip():
            raise RouterConfigError(
                f"{path}: no router_class. Add a line such as "
                "`router_class: redis_router.RedisLoadBalancer` (a fully qualified class name) "
                "or the name of a router registered under the entry-point group "
                f"{ENTRY_POINT_GROUP!r} (installed: {sorted(registered_routers())})"
            )
        cls = resolve_router_class(spec.strip(), source=str(path))
        where = f"router_class {spec!r} in {path}"
        _check_protocol(cls, where)
        router_kwargs = _merge(config, options, full_determinism)
        if _takes_second_positional(cls):
            return _construct(cls, where, servers, router_kwargs)
        return _construct(cls, where, servers, router_kwargs=router_kwargs)
    return _construct(
        RedisLoadBalancer,
        "the default RedisLoadBalancer",
        servers=servers,
        full_determinism=full_determinism,
        **options,
    )


def resolve_config_path(path: str | Path) -> Path:
    """An absolute path: relative paths against the working directory; ``pkg://package/file``
    inside an installed package (for configs shipped in a wheel, e.g.
    ``pkg://redis_router.plugins/least_tokens.yaml``), found through importlib.resources.

    A ``pkg://`` path names a file of the package and nothing else: ``..``, ``.``, empty or
    absolute parts, and a path whose resolved file lies outside the package, are refused, so a
    config name taken from elsewhere cannot read (and run the class named in) another file."""
    text = str(path)
    if not text.startswith(PKG_SCHEME):
        return Path(text).expanduser().absolute()
    package, _, rel = text[len(PKG_SCHEME) :].partition("/")
    if not package or not rel:
        raise RouterConfigError(
            f"router config {text!r}: expected pkg://<package>/<file>, e.g. "
            "pkg://redis_router.plugins/least_tokens.yaml"
        )
    parts = rel.split("/")
    if any(part in ("", ".", "..") or "\\" in part for part in parts):
        raise RouterConfigError(
            f"router config {text!r}: a pkg:// path names a file inside the package by its "
            "relative path (no '..', '.', empty or absolute parts, no backslashes), e.g. "
            "pkg://redis_router.plugins/least_tokens.yaml; give a file path for a file "
            "elsewhere"
        )
    # The package is imported, not only found: its __init__ may extend its search path (as
    # redis_router.plugins does in a source checkout).
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as exc:
        raise RouterConfigError(
            f"router config {text!r}: {package!r} is not an installed package ({exc}); install "
            "it or give a file path"
        ) from None
    except Exception as exc:
        raise RouterConfigError(
            f"router config {text!r}: cannot import {package!r}: {exc!r}"
        ) from None
    locations = list(getattr(module, "__path__", None) or ())
    if not locations:
        raise RouterConfigError(
            f"router config {text!r}: {package!r} is a module, not a package; give a file path"
        )
    found = importlib.resources.files(module).joinpath(*parts)
    if not isinstance(found, Path):
        raise RouterConfigError(
            f"router config {text!r}: {package!r} is not installed as files (a zip?); extract "
            "the config and give its file path"
        )
    # A package whose __init__ extended its search path has files in further folders.
    candidates = [found, *(Path(d).joinpath(*parts) for d in locations)]
    target = next((p for p in candidates if p.is_file()), found)
    # A symlink inside the package may still point out of it: judge the file it resolves to.
    # (The package's own folder may be a symlink, as redis_router/plugins is in a checkout.)
    resolved = target.resolve()
    roots = [Path(d).resolve() for d in locations]
    if not any(resolved.is_relative_to(root) for root in roots):
        raise RouterConfigError(
            f"router config {text!r} resolves to a file outside package {package!r}; a "
            "pkg:// path names only the package's own files"
        )
    return target.absolute()


def load_router_config(path: Path) -> dict[str, Any]:
    """The YAML file as a plain dict with interpolations (``${oc.env:REDIS_URL,...}``) resolved.
    Hydra's ``defaults:`` composition is refused rather than silently ignored."""
    if not path.is_file():
        raise RouterConfigError(
            f"router config file not found: {path} (relative paths are resolved against the "
            f"working directory, {Path.cwd()}); fix router_config_path"
        )
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError, UnicodeDecodeError, OSError...
        raise RouterConfigError(
            f"router config {path} is not valid YAML: {exc}; fix the file"
        ) from None
    if not isinstance(raw, DictConfig):
        raise RouterConfigError(
            f"router config {path} must be a mapping of keys (router_class: ..., ...), "
            f"got a {type(raw).__name__}; fix the file"
        )
    if "defaults" in raw:
        raise RouterConfigError(
            f"router config {path} has a `defaults` key: Hydra composition is not supported "
            "here. Inline the referenced configs into this file and delete `defaults`."
        )
    try:
        resolved = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as exc:
        raise RouterConfigError(
            f"router config {path}: cannot resolve an interpolation: {exc}; set the variable "
            "or give a default, e.g. ${{oc.env:REDIS_URL,redis://localhost:6379/0}}"
        ) from None
    assert isinstance(resolved, dict)
    return {str(k): v for k, v in resolved.items()}


def registered_routers() -> dict[str, importlib.metadata.EntryPoint]:
    """Routers installed packages register under the entry-point group ``redis_router.routers``."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def resolve_router_class(spec: str, *, source: str = "router_class") -> type:
    """The class named by ``spec``: a registered router name (``least_tokens``) or a fully
    qualified name (``pkg.module.Class`` or ``pkg.module:Class``). Imports its module."""
    registered = registered_routers()
    if spec in registered:
        try:
            obj = registered[spec].load()
        except Exception as exc:
            raise RouterConfigError(
                f"{source}: router {spec!r} is registered as {registered[spec].value!r} under "
                f"{ENTRY_POINT_GROUP!r}, but loading it failed: {exc!r}; reinstall the package "
                "that registers it"
            ) from exc
        return _as_class(obj, spec, source)
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not attr:
        raise RouterConfigError(
            f"{source}: router_class {spec!r} is neither a fully qualified class name "
            f"(module.Class) nor a router registered under {ENTRY_POINT_GROUP!r} (installed: "
            f"{sorted(registered)}); fix router_class or install the package that provides it"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and f"{module_name}.".startswith(f"{exc.name}."):
            raise RouterConfigError(
                f"{source}: cannot import module {module_name!r} (for router_class {spec!r}): "
                f"no module named {exc.name!r}; check the spelling, install the package, or "
                "add its directory to PYTHONPATH"
            ) from None
        raise RouterConfigError(
            f"{source}: module {module_name!r} was found but failed to import: {exc!r}; "
            "install what it needs"
        ) from exc
    except Exception as exc:
        raise RouterConfigError(
            f"{source}: module {module_name!r} was found but failed to import: {exc!r}; fix it"
        ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise RouterConfigError(
            f"{source}: module {module_name!r} has no class {attr!r} (router_class {spec!r}); "
            f"its public names: {public}"
        ) from None
    return _as_class(obj, spec, source)


def _as_class(obj: Any, spec: str, source: str) -> type:
    if not isinstance(obj, type):
        raise RouterConfigError(
            f"{source}: router_class {spec!r} is a {type(obj).__name__}, not a class; name the "
            "router class itself"
        )
    return obj


def _check_protocol(cls: type, where: str) -> None:
    missing = missing_methods(cls)
    if missing:
        raise RouterConfigError(
            f"{where} does not implement RequestLoadBalancer: it lacks {missing} (a router "
            f"needs all of {list(METHODS)}); add them, or name another class"
        )


def _merge(
    config: dict[str, Any], options: dict[str, Any], full_determinism: bool
) -> dict[str, Any]:
    """The YAML's keys, overridden by the call's: an argument is the more specific setting
    (a shipped config reused under another balancer name, say)."""
    merged = {**config, **options}
    if full_determinism:
        merged["full_determinism"] = True
    return merged


def _takes_second_positional(cls: type) -> bool:
    """Whether ``cls(servers, router_kwargs)`` can pass the config positionally, as verl
    does; redis-router's balancers take it by keyword only."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _construct(cls: type, where: str, *args: Any, **kwargs: Any) -> Any:
    """Build the router; argument errors (unknown or mistyped options) become
    RouterConfigError naming the class, library errors (Redis down, settings pinned in Redis)
    pass through unchanged."""
    try:
        return cls(*args, **kwargs)
    except RedisRouterError:
        raise
    except (TypeError, ValueError) as exc:
        raise RouterConfigError(
            f"{where} could not be constructed: {exc}; fix its options"
        ) from exc


def _qualname(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"
