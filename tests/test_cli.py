import json
import subprocess
import sys

from support.stores import CHUNK_BYTES, disk_config, make_keys, make_payloads


def test_bench_writes_the_documented_json(disk_dir, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "--path", disk_dir, "--chunk-size", "256KiB",
         "--queue-depth", "4", "--total", "8MiB", "--fio-seconds", "1", "--json", str(out),
         "--keep"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    engines = {r["engine"] for r in results}
    assert {"uring", "threads", "uring-raw", "threads-raw", "serial", "memcpy"} <= engines
    assert {r["tier"] for r in results if r["engine"] == "memcpy"} == {"dram"}
    for row in results:
        for field in ("tier", "engine", "chunk_bytes", "queue_depth", "read_gibps", "write_gibps",
                      "cpu_s_per_gib_read", "p50_ms", "p99_ms"):
            assert field in row
        assert row["read_gibps"] > 0
    fsck = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", disk_dir, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert fsck.returncode == 0 and json.loads(fsck.stdout)["valid"] == 32
    assert "lookup of 512 keys" in done.stdout
    assert "xxh3-64 of 256KiB chunks out of cache" in done.stdout
    assert json.loads(out.read_text())["hash_cpu_s_per_gib"][str(256 << 10)]["fused"] > 0


def test_bench_reads_the_dram_tiers_old_name(tmp_path):
    """`host` named the DRAM tier and case before `dram`: a command written so still runs it."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "--tiers", "host", "--cases", "host",
         "--host-chunk-size", "256KiB", "--total", "4MiB", "--no-fio", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["tier"], r["chunk_bytes"]) for r in results] == [("dram", 256 << 10)]


def test_info_shows_tiers_and_usage(disk_dir, tmp_path, store_factory):
    store = store_factory(disk_config(disk_dir, "4MiB"))
    store.put_many(make_keys(3), make_payloads(3))
    store.close()
    config = tmp_path / "kvstore.json"
    config.write_text(json.dumps(disk_config(disk_dir, "4MiB")))
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "info", "--config", str(config),
                           "--chunk-size", str(CHUNK_BYTES), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["tiers"][0]["chunks"] == 3 and info["recovery"]["records"] == 3


def test_errors_are_one_clear_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().endswith("does not exist")
