"""The tests' helper home: what two test files share lives here, never in a test file
(tests/house_rules.py fails a test module that imports another).

- stores: chunk keys and payloads, disk-tier configs, O_DIRECT directories, loop devices.
- records: reading and corrupting a disk tier's records on disk.
- services: one builder of the service's config (`service_config`, `write_config`), and
  a running service's client, counters and stop.
- engines: a fresh vLLM engine run, and vLLM's bar for "the same answer".
- redis_servers: a redis-server (or a Redis Cluster) for one test.
- cluster: two hosts' configs and their clients, as the cluster tests use them.
- traces: block traces for the replay tests.

Fixtures stay in tests/conftest.py and call these. The tests import this package as
`support` (pytest puts tests/ on the path; the LMCache and SGLang cases files run with
PYTHONPATH=$PWD:$PWD/tests).
"""
