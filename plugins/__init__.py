"""Router plugins shipped with redis-router, importable as ``redis_router.plugins.<name>``.

This folder sits at the repository's top level (classes beside their YAML configs and Lua
scripts); ``redis_router/plugins`` is a symlink to it, which the wheel build follows, so the
same import and the same ``pkg://redis_router.plugins/...`` paths work in a checkout, an
editable install and an installed wheel.
"""
