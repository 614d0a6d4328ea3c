"""Prometheus metrics of a running service, read from the store at scrape time.

A collector, not counters updated on the data path: the store already counts
everything in `Stats`, so a scrape turns that snapshot into metric families and
the hot path pays nothing extra.
  kvstore_misses_total{tier,reason} chunks that looked present but were not served, by why
  kvstore_<counter>_total           every other Stats counter ("dram.hits" -> kvstore_dram_hits_total)
  kvstore_tier_chunks{tier}         chunks stored
  kvstore_tier_used_bytes{tier}     bytes used, metadata included
  kvstore_tier_capacity_bytes{tier}
  kvstore_read_latency_seconds{tier,quantile}  per-chunk read latency, recent samples
  kvstore_read_seconds{tier}        histogram of per-chunk read latency since start
  kvstore_disk_admission_threshold{policy}  the return rate `learned` admission asks now (and the
                                    write budget's, if higher: kvstore_disk_write_budget_threshold)
  kvstore_disk_admission_loss_budget, kvstore_disk_admission_loss_measured  the share of hits
                                    `learned` may give up, and what refusals cost lately
  kvstore_disk_write_budget_bytes_per_day, kvstore_disk_write_budget_left_bytes  with a budget
  kvstore_device_in_service{device,kind}   1 while a disk/NVMe-oF device serves, else 0
  kvstore_device_faults_total{device,kind} faulted I/Os; kvstore_device_trips_total: breaker trips
The service's own counters (`malformed.*`: input it refused; `clients.*`: connections it
refused or closed) are added to the store's, and are scraped before any engine made the
store too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvstore.store.tiered import TieredStore

QUANTILES = (0.5, 0.9, 0.99)


def _name(counter: str) -> str:
    return "kvstore_" + re.sub(r"[^a-zA-Z0-9_]", "_", counter)


class StoreCollector(Collector):
    def __init__(self, store: Callable[[], TieredStore | None],
                 own: Callable[[], Mapping[str, float]] = dict) -> None:
        self._store = store  # the service creates its store on the first worker's hello
        self._own = own  # the service's own counters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        store = self._store()
        info = store.info() if store is not None else {"tiers": [], "counters": {}}
        counters = dict(info["counters"])
        for counter, value in self._own().items():
            counters[counter] = counters.get(counter, 0) + value
        misses = CounterMetricFamily("kvstore_misses", "chunks that looked present but were not "
                                     "served (the engine recomputed them)", labels=["tier", "reason"])
        for counter, value in sorted(counters.items()):
            tier, _, reason = counter.partition(".miss.")
            if reason:
                misses.add_metric([tier, reason], value)
                continue
            family = CounterMetricFamily(_name(counter), f"kvstore counter {counter}")
            family.add_metric([], value)
            yield family
        yield misses
        if store is None:
            return
        for field, text in (("chunks", "chunks stored"), ("used_bytes", "bytes used"),
                            ("capacity_bytes", "bytes the tier may use")):
            gauge = GaugeMetricFamily(f"kvstore_tier_{field}", text, labels=["tier"])
            for tier in info["tiers"]:
                gauge.add_metric([tier["name"]], tier[field])
            yield gauge
        latency = GaugeMetricFamily("kvstore_read_latency_seconds",
                                    "per-chunk read latency over recent reads",
                                    labels=["tier", "quantile"])
        for tier in info["tiers"]:
            for quantile, ms in zip(QUANTILES, store.stats.latency_ms(f"{tier['name']}.read", QUANTILES),
                                    strict=True):
                if ms == ms:  # NaN: no samples yet
                    latency.add_metric([tier["name"], str(quantile)], ms / 1000)
        yield latency
        histogram = HistogramMetricFamily("kvstore_read_seconds", "per-chunk read latency",
                                          labels=["tier"])
        for tier in info["tiers"]:
            buckets, seconds = store.stats.histogram(f"{tier['name']}.read")
            histogram.add_metric([tier["name"]], buckets, seconds)
        yield histogram
        yield from _admission_families(info.get("admission", {}))
        yield from _device_families(info)


def _admission_families(admission: dict) -> Iterator[GaugeMetricFamily]:
    """Disk admission's threshold, loss budget and write budget (its counters are Stats counters:
    kvstore_disk_admitted_total, kvstore_disk_admission_refused_total, kvstore_disk_budget_refused_total)."""
    if "threshold" in admission:
        threshold = GaugeMetricFamily("kvstore_disk_admission_threshold",
                                      "the return rate learned disk admission asks of a chunk's bucket now",
                                      labels=["policy"])
        threshold.add_metric([admission["policy"]], admission["threshold"])
        yield threshold
    for field, name, text in (
            ("loss_budget", "kvstore_disk_admission_loss_budget",
             "the share of hits learned admission may give up"),
            ("loss_measured", "kvstore_disk_admission_loss_measured",
             "the share of hits learned admission's refusals cost lately"),
            ("budget_bytes_per_day", "kvstore_disk_write_budget_bytes_per_day", "the disk write budget"),
            ("budget_left_bytes", "kvstore_disk_write_budget_left_bytes",
             "bytes the budget lets be written now"),
            ("budget_threshold", "kvstore_disk_write_budget_threshold",
             "the return rate the write budget asks now")):
        if field in admission:
            yield GaugeMetricFamily(name, text, value=admission[field])


def _device_families(info: dict) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    devices = [d for tier in info["tiers"] for d in tier.get("devices", [])]
    labels = ["device", "kind"]
    in_service = GaugeMetricFamily("kvstore_device_in_service", "1 while the device serves chunks",
                                   labels=labels)
    faults = CounterMetricFamily("kvstore_device_faults", "I/Os that faulted", labels=labels)
    trips = CounterMetricFamily("kvstore_device_trips", "circuit-breaker trips", labels=labels)
    for device in devices:
        key = [device["label"], device["kind"]]
        in_service.add_metric(key, float(device["state"] == "in_service"))
        faults.add_metric(key, device["faults"])
        trips.add_metric(key, device["trips"])
    yield from (in_service, faults, trips)


def serve_metrics(host: str, port: int, store: Callable[[], TieredStore | None],
                  own: Callable[[], Mapping[str, float]] = dict) -> None:
    """Expose /metrics on host:port (service.metrics_host, loopback by default) from a
    daemon thread."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(StoreCollector(store, own))
    start_http_server(port, addr=host, registry=registry)
