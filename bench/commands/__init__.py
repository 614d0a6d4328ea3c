"""The `kvstore` subcommands bench provides, registered through the `kvstore.commands`
entry-point group (pyproject.toml) so the storage package never imports bench.

Each row: (name, module with add_arguments(parser) and run(args), help text). Importing
this module imports none of the commands: torch, vLLM and matplotlib load only for the
command being run.
"""

COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("demo", "bench.commands.demo", "a real conversation on vLLM: recompute vs DRAM vs disk, turn by turn"),
    ("bench", "bench.commands.storage", "storage benchmark with fio/copy/serial baselines"),
    ("ttft", "bench.commands.ttft", "recompute vs offload TTFT, measured or estimated"),
    ("replay", "bench.commands.replay", "hit ratios (and modelled TTFT) of a request trace for given tiers"),
    ("verify", "bench.commands.verify", "the cases where KV stores served wrong KV, against vLLM's OpenAI "
     "server with kvstore, judged as vLLM's tests judge answers"),
    ("lmcache-mp", "bench.commands.lmcache_mp",
     "LMCache's MP server with kvstore on vLLM: store, restart, load; TTFT vs vLLM alone (.venv-lmcache)"),
)
