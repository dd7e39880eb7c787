"""``python -m redis_router.verl``: print the override that points verl at the shipped config.

``--config-path`` prints the file's absolute path alone (for scripts).
"""

from __future__ import annotations

import argparse

from . import OVERRIDE_KEY, config_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m redis_router.verl",
        description="Print the verl override line that selects redis-router's verl.yaml.",
    )
    parser.add_argument(
        "--config-path", action="store_true", help="print only the file's absolute path"
    )
    args = parser.parse_args(argv)
    path = config_path()
    print(path if args.config_path else f"{OVERRIDE_KEY}={path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
