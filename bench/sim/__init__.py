"""The trace replay's simulator and the models it runs: the Replayer driving the store's
own TierPolicy over a request trace (replay.py), a cluster's and next-turn promotion's
replays, the TTFT and scheduler models, and the path learned admission takes. Product
models that `kvstore replay` and `kvstore ttft` run and the tests check; above the harness
(support/), below commands/ and lab/."""
