"""`python -m redis_router.cli ...` is the `redis-router` command."""

from . import main

raise SystemExit(main())
