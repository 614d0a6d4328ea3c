"""The `kvstore` subcommands bench provides, registered through the `kvstore.commands`
entry-point group (pyproject.toml) so the storage package never imports bench.

Each row: (name, module with add_arguments(parser) and run(args), help text). Importing
this module imports none of the commands: torch, vLLM and matplotlib load only for the
command being run.
"""

COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("demo", "bench.demo", "a real conversation on vLLM: recompute vs DRAM vs disk, turn by turn"),
    ("bench", "bench.storage", "storage benchmark with fio/copy/serial baselines"),
    ("ttft", "bench.ttft", "recompute vs offload TTFT, measured or estimated"),
    ("replay", "bench.replay_cli", "hit ratios (and modelled TTFT) of a request trace for given tiers"),
    ("verify", "bench.verify", "the cases where KV stores served wrong KV, against vLLM's OpenAI server "
     "with kvstore, judged as vLLM's tests judge answers"),
    ("lmcache-mp", "bench.lmcache_mp",
     "LMCache's MP server with kvstore on vLLM: store, restart, load; TTFT vs vLLM alone (.venv-lmcache)"),
)
