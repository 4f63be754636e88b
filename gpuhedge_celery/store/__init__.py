"""The Redis edge: key names, Lua scripts, the lease store and the keyspace listener."""
