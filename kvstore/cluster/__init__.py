"""Several hosts sharing one NVMe-oF array: the cross-host index and read-only peer reads.

  connection.py    one Redis or a Redis Cluster (redis+cluster://), no retries, per-shard failures
  index.py         the Redis schema: chunk locations, hosts' leases; reads within a deadline
  publisher.py     this host's disk-tier chunks into the index, from one background thread
  peer_devices.py  peers' tiers as read-only DeviceSets: where a slot lives, health, probes
  peer_reader.py   a peer's slot read into a destination and verified like a local record
  node.py          the composition TieredStore talks to (`cluster` in the config)
See docs/cluster.md.
"""
