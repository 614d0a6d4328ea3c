"""The connector's scheduler hooks under vLLM's own scheduler: malformed request params and
KV hints are counted and ignored, and a fault in kvstore is a miss for its request, never
an exception on the scheduler thread (where it would end the engine); an image is in the
keys, and a prefix-cache reset starts a new generation.

vLLM's real Scheduler runs in this process with TieredKVConnector and a real kvstore
service; nothing is computed (no model runs), so each step's plan is read from the
scheduler's output. Faults are injected by making one SchedulerCore method raise. The
service is the module's; each case has a scheduler of its own and reads the counters it
moved, so the cases pass in any order, alone or together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
from support.engines import processed_image
from support.services import counters, service_config, stop_service

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from bench.support.tiny_model import build_tiny_llama, prompt_token_ids
from engine_plugin.vllm.core.plan import StepPlan
from engine_plugin.vllm.core.scheduler_side import SchedulerCore
from kvstore.config.store import load_config
from kvstore.service.client import StoreClient

pytestmark = pytest.mark.vllm
CHUNK = BLOCK = 16
BLOCKS = 64


@pytest.fixture(scope="module")
def store_config(tmp_path_factory) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("guard")
    config = service_config(folder, chunk_tokens=CHUNK, dram="16MiB", socket="run/kvstore.sock")
    yield config
    stop_service(config)


@pytest.fixture(scope="module")
def data(store_config) -> Iterator[StoreClient]:
    """A data client: it makes the store, and stores chunks under the keys a plan names."""
    client = StoreClient(load_config(store_config), 4096)
    yield client
    client.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny model; vLLM configures its logging on the first engine config a process makes
    (and empties its loggers' children's handlers then), so one is made here, before any case
    listens to the connector's log."""
    path = str(build_tiny_llama(tmp_path_factory.mktemp("model")))
    EngineArgs(model=path, enforce_eager=True, max_model_len=1024, dtype="float16").create_engine_config()
    return path


def make_scheduler(model: str, store_config: dict, window: int | None = None, **options: object) -> Scheduler:
    """vLLM's scheduler over the model's two layers as one full-attention KV cache group, or,
    with a `window`, as a sliding-window group and a full-attention one (a hybrid model);
    `options`: the connector's."""
    args = EngineArgs(model=model, enforce_eager=True, max_model_len=1024, block_size=BLOCK,
                      dtype="float16", enable_prefix_caching=False,
                      kv_transfer_config={"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
                                          "kv_connector_extra_config": {"config": store_config, **options}})
    vllm_config = args.create_engine_config()
    vllm_config.cache_config.num_gpu_blocks = BLOCKS
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    shape = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": vllm_config.model_config.dtype}
    groups = [KVCacheGroupSpec(layers, FullAttentionSpec(**shape))]
    if window is not None:
        groups = [KVCacheGroupSpec(layers[:1], SlidingWindowSpec(**shape, sliding_window=window)),
                  KVCacheGroupSpec(layers[1:], FullAttentionSpec(**shape))]
    kv_cache = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(vllm_config, kv_cache, StructuredOutputManager(vllm_config), block_size=BLOCK)


@pytest.fixture
def scheduler(model, store_config, data) -> Scheduler:
    return make_scheduler(model, store_config)


@pytest.fixture
def counted(store_config) -> Callable[[], dict[str, int]]:
    """The service's counters as this case moved them (the service is the module's)."""
    before = counters(store_config)
    return lambda: {name: value - before.get(name, 0) for name, value in counters(store_config).items()}


def _request(req_id: str, prompt: list[int], params: object = None,
             hints: KvHintsEnvelope | None = None) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=2), None, kv_hints=hints)
    request.kv_transfer_params = params  # type: ignore[assignment]  (what the HTTP body said)
    return request


def _step(scheduler: Scheduler) -> tuple[SchedulerOutput, StepPlan]:
    output = scheduler.schedule()
    return output, output.kv_connector_metadata.plan  # type: ignore[union-attr]


def _finish(scheduler: Scheduler, *req_ids: str) -> None:
    scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)
    _step(scheduler)  # nothing left to run: an empty step


def _store(data: StoreClient, plan: StepPlan, req_id: str) -> int:
    """Store the chunks the plan saves for `req_id` (any bytes: nothing is computed here)."""
    keys = [key for save in plan.saves if save.req_id == req_id for key in save.keys[0]]
    for i in range(len(keys)):
        data.memory.slot(i)[:] = bytes([i]) * 4096
    assert data.put(keys, list(range(len(keys)))) == [True] * len(keys)
    return len(keys)


def test_malformed_params_and_hints_are_counted_and_the_requests_served(scheduler, counted):
    bodies = [{"kvstore_prefetch_token_ids": "x"}, {"kvstore_prefetch_token_ids": {"a": 1}},
              {"kvstore_prefetch_token_ids": 5}, {"kvstore_prefetch_token_ids": [["1", None]]},
              {"kvstore_prefetch_token_ids": [[float("inf")]]},
              {"kvstore_handoff": {"chunks": float("inf"), "last_key": "ab" * 16}},
              {"kvstore_prefetch_token_ids": [[1 << 40]]}]
    hints = KvHintsEnvelope("1", "m", [KvHintAction("a", "expect", "1", {"token_ids": [5, 6], "in_s": "abc"}),
                                        KvHintAction("b", "fetch", "1", {})])
    for i, params in enumerate(bodies):
        scheduler.add_request(_request(f"bad-{i}", prompt_token_ids(40, seed=i), params))
    scheduler.add_request(_request("hinted", prompt_token_ids(40, seed=99), None, hints))
    output, _ = _step(scheduler)
    assert set(output.num_scheduled_tokens) == {f"bad-{i}" for i in range(len(bodies))} | {"hinted"}
    _finish(scheduler, *output.num_scheduled_tokens)
    found = counted()
    assert found["malformed.kv_transfer_params"] == 6 and found["malformed.handoff"] == 1
    assert found["malformed.kv_hints"] == 2


def test_a_fault_while_planning_a_load_gives_it_up_whole(scheduler, counted, data, monkeypatch):
    prompt = prompt_token_ids(100, seed=7)  # 6 full chunks
    scheduler.add_request(_request("first", prompt))
    _, plan = _step(scheduler)
    assert _store(data, plan, "first") == 6
    _finish(scheduler, "first")

    def fault(*args: object) -> None:
        raise RuntimeError("a fault in kvstore")

    monkeypatch.setattr(SchedulerCore, "on_alloc", fault)
    scheduler.add_request(_request("faulted", prompt))
    _, plan = _step(scheduler)  # the lookup found 96 tokens; planning their load faults
    monkeypatch.undo()
    (given_up,) = [load for load in plan.loads if load.req_id == "faulted"]
    (allocated,) = scheduler.kv_cache_manager.get_block_ids("faulted")
    assert given_up.keys == () and given_up.blocks == (tuple(allocated),)  # every block: recomputed
    scheduler.add_request(_request("again", prompt))  # the connector goes on: a hit, loaded
    _, plan = _step(scheduler)
    (load,) = [load for load in plan.loads if load.req_id == "again"]
    assert len(load.keys[0]) == 6
    assert counted()["connector.faults"] == 1  # reported with the lookup just made
    _finish(scheduler, "faulted", "again")


def test_a_fault_in_one_requests_bookkeeping_leaves_the_others_plan(scheduler, monkeypatch):
    real = SchedulerCore.on_scheduled

    def fault_for_one(self, req_id, *args, **kwargs):
        if req_id == "broken":
            raise RuntimeError("a fault in kvstore")
        return real(self, req_id, *args, **kwargs)

    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    monkeypatch.setattr(SchedulerCore, "on_scheduled", fault_for_one)
    scheduler.add_request(_request("broken", prompt_token_ids(40, seed=11)))
    scheduler.add_request(_request("fine", prompt_token_ids(40, seed=12)))
    _, plan = _step(scheduler)
    assert {save.req_id for save in plan.saves} == {"fine"}
    monkeypatch.undo()

    def fault(*args: object) -> None:
        raise RuntimeError("a fault in kvstore")

    monkeypatch.setattr(SchedulerCore, "on_finished", fault)
    _finish(scheduler, "broken", "fine")  # request_finished faults: the blocks are still freed
    monkeypatch.undo()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_a_hybrid_models_failed_load_is_recomputed_retried_once_then_a_miss(model, store_config, data,
                                                                            counted, caplog):
    """With several KV cache groups the workers report a failed load per request
    (failed_recving; vLLM ends the engine on block ids there), which vLLM recomputes only
    for async loads: loads are async whatever `load_async` says. vLLM recomputes the request
    and looks it up again, so the connector plans its load once more (what did not verify
    is gone from the store); after a second failure the request is a miss and computes."""
    # The connector logs under vLLM's logger, which does not propagate: listened to directly.
    logging.getLogger("vllm.kvstore").addHandler(caplog.handler)
    try:
        scheduler = make_scheduler(model, store_config, window=32, load_async=False)
    finally:
        logging.getLogger("vllm.kvstore").removeHandler(caplog.handler)
    assert "load_async forced on: this engine has 2 KV cache groups" in caplog.text
    prompt = prompt_token_ids(100, seed=13)  # 6 full chunks
    scheduler.add_request(_request("first", prompt))
    _, plan = _step(scheduler)
    assert {save.group for save in plan.saves} == {0, 1}  # both groups' chunks stored
    _store(data, plan, "first")
    _finish(scheduler, "first")
    scheduler.add_request(_request("failing", prompt))
    for attempt in range(2):
        output, plan = _step(scheduler)
        assert {load.group for load in plan.loads if load.req_id == "failing"} == {0, 1}, attempt
        assert "failing" not in output.num_scheduled_tokens  # loading, outside the batch
        failed = KVConnectorOutput(finished_recving={"failing"}, failed_recving={"failing"})
        scheduler.update_from_output(output, ModelRunnerOutput([], {}, kv_connector_output=failed))
    output, plan = _step(scheduler)
    assert not [load for load in plan.loads if load.req_id == "failing"]
    assert output.num_scheduled_tokens["failing"] == len(prompt)  # computed whole
    _finish(scheduler, "failing")
    assert counted()["load.failed_requests"] == 2


def test_a_one_group_models_failed_blocks_are_counted(scheduler, counted, data):
    """One KV cache group: failures stay block ids (vLLM keeps the prefix before the first),
    counted as `load.failed_blocks`. The hit is leased whole in DRAM: a sync load, whose
    failure is reported with no finished_recving (vLLM asserts an async one's)."""
    prompt = prompt_token_ids(100, seed=17)
    scheduler.add_request(_request("stored", prompt))
    _, plan = _step(scheduler)
    _store(data, plan, "stored")
    _finish(scheduler, "stored")
    scheduler.add_request(_request("partly", prompt))
    output, plan = _step(scheduler)
    (load,) = [load for load in plan.loads if load.req_id == "partly"]
    assert not load.load_async
    failed = KVConnectorOutput(invalid_block_ids=set(load.blocks[3]))
    scheduler.update_from_output(output, ModelRunnerOutput([], {}, kv_connector_output=failed))
    output, _ = _step(scheduler)
    assert output.num_scheduled_tokens["partly"] == len(prompt) - 3 * CHUNK  # chunks 0-2 kept
    _finish(scheduler, "partly")
    found = counted()
    assert found["load.failed_blocks"] == 1 and found.get("load.failed_requests", 0) == 0


def _image_request(req_id: str, prompt: list[int], image: int | None, offset: int) -> Request:
    """A request with one image (processed from seed `image`; None: its data not held)
    behind placeholder tokens `prompt[offset : offset + 20]`."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    data = processed_image(image) if image is not None else None
    feature = MultiModalFeatureSpec(data=data, modality="image", identifier="client-uuid",
                                    mm_position=PlaceholderRange(offset, 20))
    return Request(req_id, prompt, SamplingParams(max_tokens=2), None, mm_features=[feature])


def test_an_image_request_finds_only_the_text_before_its_image_and_a_reset_finds_nothing(
        scheduler, counted, data):
    """Keys name images (engine_plugin/vllm/request_keys.py): a prompt stored as text is found by
    a request with an image in it only up to the image's chunk; an image whose content the
    scheduler cannot name is neither looked up nor saved (counted); after vLLM resets the prefix cache
    with the connector's (a weight update), nothing stored before is found."""
    connector = scheduler.connector
    assert connector is not None
    prompt = prompt_token_ids(100, seed=21)  # 6 full chunks of 16
    scheduler.add_request(_request("text", prompt))
    _, plan = _step(scheduler)
    assert _store(data, plan, "text") == 6
    _finish(scheduler, "text")

    asked = [_request("text-again", prompt), _image_request("image-at-40", prompt, 1, 40),
             _image_request("image-at-0", prompt, 1, 0), _image_request("unnamed", prompt, None, 40)]
    found = {}
    for request in asked:
        connector.on_new_request(request)
        found[request.request_id] = connector.get_num_new_matched_tokens(request, 0)[0]
        connector.request_finished(request, [])
    assert found == {"text-again": 96, "image-at-40": 32, "image-at-0": 0, "unnamed": 0}
    assert counted()["keys.uncached_mm_data"] == 1

    assert connector.reset_cache() is True
    after = _request("after-reset", prompt)
    connector.on_new_request(after)
    assert connector.get_num_new_matched_tokens(after, 0)[0] == 0
    connector.request_finished(after, [])
