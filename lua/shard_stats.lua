-- shard_stats.lua: a sharded pool's directory, per shard, for its status.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:"
-- Returns  flat array: field, value of P.."shards" (n:<s>, cap:<s>, in:<s>, new:<s>, at:<s>).
-- Keeps    read only.
-- Uses     lib/base
return redis.call('HGETALL', P .. 'shards')
