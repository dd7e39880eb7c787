"""Tools built on the library, not part of its API: the demo and the routing simulators.

``redis-router demo`` and ``redis-router simulate`` run them; the balancer never imports them.
"""
