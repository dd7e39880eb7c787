"""`python -m redis_router ...` is the `redis-router` command, for environments whose PATH
lacks the console script."""

from .cli import main

raise SystemExit(main())
