"""The RAM tier's lifecycle: what stays in memory, what leaves and when, and how
durable an fsync is. One module per concern, each a part of its own that the
assembly (mtcfs.assembly) builds and registers for the events it reacts to:

- `copies`: where a file's copies are; whether this host's copy may go.
- `space`: eviction under pressure, writers waiting for space, ENOSPC.
- `retention`: --keep-steps, stale incomplete steps (`retired`: the steps it dropped).
- `durability`: --fsync local|replicas|gcs.
- `withdrawal`: committed steps that lost a file's last copy.
- `lags`: close -> K replicas, close -> persisted, as an operator sees them.
"""
