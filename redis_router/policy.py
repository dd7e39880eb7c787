"""Routing policies: how a balancer places a new session.

A policy is what a router plugin supplies: an acquire script built on the shared acquire
procedure (``lib/acquiring.lua``: retries, sticky sessions, leases and counts are the same for
every policy), the request fields it reads, and how a request's fields become the script's
arguments. Every acquire path of both balancers (``acquire_server``, ``acquire``, ``lease``,
``acquire_many`` and coalesced asyncio calls) sends what the balancer's policy makes, so no
path can bypass it. A plugin is a policy plus its YAML (``policy: <name>``)::

    class Shortest(RoutingPolicy):
        name = "shortest"
        script_path = Path(__file__).with_name("shortest.lua")
        acquire_fields = ("prompt_ids",)
        arity = 1  # arguments per request after the core's four (read at ARGV[i + OWN])

        def request_args(self, fields):
            return (str(len(fields.get("prompt_ids") or ())),)

Policies are found by name under the entry-point group ``redis_router.policies``, or by a
fully qualified class name. Options a policy takes are its constructor's keyword arguments
(YAML keys beside the balancer's own).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from .scripts import Script, load, load_file

ENTRY_POINT_GROUP = "redis_router.policies"


class RoutingPolicy:
    """The base of every policy. Subclasses set the class attributes and, when ``arity`` > 0,
    override :meth:`request_args`; options are keyword arguments of ``__init__``."""

    name: ClassVar[str] = "policy"
    script_path: ClassVar[Path | None] = None  # None: the core's acquire.lua
    # A class attribute; a policy whose options add fields sets its own on the instance.
    acquire_fields: tuple[str, ...] = ()
    release_fields: ClassVar[tuple[str, ...]] = ()
    arity: ClassVar[int] = 0
    # Keys (suffixes after the balancer's prefix) that record what the replicas' KV caches
    # hold: bump_weight_version() drops them, with the core's own (docs/rl.md).
    locality_keys: ClassVar[tuple[str, ...]] = ()
    # Eviction-aware stickiness, for a policy that reads an index of what each replica's KV
    # cache holds: a sticky turn stays on its replica while the index says it holds at least
    # this share of the prompt, else the policy places it anew (its script's ``evicted``
    # procedure, lib/acquiring.lua). None: off, a session stays where it is pinned. Pinned in
    # Redis like the balancer's own settings.
    sticky_min_cached: float | None = None

    @property
    def script(self) -> Script:
        """The acquire script with every part (cached by path, so every instance shares one)."""
        return self.script_without(frozenset())

    def script_without(self, leave_out: frozenset[str]) -> Script:
        """The acquire script less the optional parts in ``leave_out`` (scripts.OPTIONAL): what
        a balancer whose pinned settings leave them off sends."""
        if self.script_path is None:
            return load("acquire", leave_out)
        return load_file(self.script_path, leave_out)

    def request_args(self, fields: Mapping[str, Any]) -> tuple[str, ...]:
        """A request's ``arity`` script arguments, from its fields. Raise TypeError or
        ValueError naming the field for bad values: nothing has been sent yet."""
        return ()

    def options(self) -> dict[str, Any]:
        """The options this instance was made with (shown by ``get_status``)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options()!r})"


class LeastLoaded(RoutingPolicy):
    """The default: a new session goes to a replica with the fewest in-flight requests, ties
    broken uniformly at random (or by rendezvous hashing under ``full_determinism``)."""

    name = "least_loaded"


def registered_policies() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def policy_class(spec: str) -> type[RoutingPolicy]:
    """The policy class named by ``spec``: a registered name or ``module.Class``."""
    registered = registered_policies()
    if spec in registered:
        obj = registered[spec].load()
    else:
        module, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
        if not module or not attr:
            raise ValueError(
                f"policy {spec!r} is neither a registered policy ({sorted(registered)}) nor a "
                "fully qualified class name (module.Class)"
            )
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"policy {spec!r} cannot be imported: {exc}") from None
    if not (isinstance(obj, type) and issubclass(obj, RoutingPolicy)):
        raise TypeError(f"policy {spec!r} is not a RoutingPolicy subclass")
    return obj


def make_policy(
    spec: RoutingPolicy | type[RoutingPolicy] | str | None,
    default: type[RoutingPolicy],
    options: Mapping[str, Any],
    core_options: list[str],
) -> RoutingPolicy:
    """Build the balancer's policy from the ``policy`` option (an instance, a class, a name or
    None for the balancer's default) and the options that are not the core's."""
    if isinstance(spec, RoutingPolicy):
        if options:
            raise TypeError(f"options {sorted(options)} given with a ready policy instance")
        return spec
    cls = default if spec is None else policy_class(spec) if isinstance(spec, str) else spec
    if not (isinstance(cls, type) and issubclass(cls, RoutingPolicy)):
        raise TypeError(
            f"policy must be a RoutingPolicy, its class or its name, got {type(spec).__name__}"
        )
    try:
        return cls(**options)
    except TypeError as exc:
        if "unexpected keyword" not in str(exc) and "takes no arguments" not in str(exc):
            raise
        raise TypeError(
            f"unknown option(s) {sorted(options)} for policy {cls.name!r}: the balancer takes "
            f"{sorted(core_options)}, and the policy its own ({exc})"
        ) from None
