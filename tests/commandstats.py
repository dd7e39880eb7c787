"""Script calls as the server counts them (``INFO commandstats``), whichever way they were sent:
FCALL and FCALL_RO on Redis 7+ and Valkey, EVALSHA on Redis 6.2 or with
``REDIS_ROUTER_SCRIPTS=eval``, and EVAL (the last resort after repeated flushes)."""

from __future__ import annotations

from typing import Any

SCRIPT_COMMANDS = ("evalsha", "fcall", "fcall_ro", "eval")


def script_calls(r: Any) -> int:
    """How many script calls the server ran since its last CONFIG RESETSTAT."""
    stats = r.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in SCRIPT_COMMANDS)


def script_usec(r: Any) -> float:
    """Server time (µs) spent in script calls since the last CONFIG RESETSTAT."""
    stats = r.info("commandstats")
    return sum(float(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in SCRIPT_COMMANDS)
