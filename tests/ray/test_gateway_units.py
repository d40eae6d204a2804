"""The gateway side of scale-out without a cluster: affinity keys of HTTP requests and
WebSocket connections, replica tags on what goes back, replica resources, the documented
config."""

from __future__ import annotations

import orjson
import pytest

pytest.importorskip("ray")

from quickdraft.engine.config import EngineConfig
from quickdraft.server.ray_app import (
    CACHED_TOKENS_HEADER,
    REPLICA_HEADER,
    call_key,
    engine_limits,
    ray_options,
    tag_done,
    tag_headers,
)
from quickdraft.server.ray_proxy import CallScope


def scope(kind: str, headers: dict[str, str] | None = None, query: str = "") -> dict:
    return {"type": kind, "query_string": query.encode(),
            "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}


def test_call_keys():
    assert call_key(scope("http", {"x-session-id": "abc"})) == "session:abc"
    assert call_key(scope("http", query="session=abc")) is None  # the URL names WS sessions
    assert call_key(scope("http")) is None  # stateless: keyed by its prompt later
    assert call_key(scope("websocket", query="session=abc")) == "session:abc"
    assert call_key(scope("websocket", {"x-session-id": "h"}, "session=q")) == "session:h"
    one, two = call_key(scope("websocket")), call_key(scope("websocket"))
    assert one and two and one != two  # one key per connection


def test_tags_name_the_replica():
    call = CallScope(replicas={"resp_1": "r1", "cmpl-2": "r2"}, cached_tokens={"cmpl-2": 48},
                     last_request="cmpl-2")
    start = {"type": "http.response.start", "status": 200, "headers": []}
    tag_headers(start, call)
    assert (REPLICA_HEADER.encode(), b"r2") in start["headers"]
    assert (CACHED_TOKENS_HEADER.encode(), b"48") in start["headers"]
    done = orjson.dumps({"type": "response.done", "response": {"id": "resp_1"}}).decode()
    assert orjson.loads(tag_done(done, call))["response"]["replica"] == "r1"
    assert "resp_1" not in call.replicas  # forgotten once reported
    delta = '{"type": "response.output_text.delta", "delta": "response.done"}'
    assert tag_done(delta, call) == delta


def test_replica_resources():
    config = EngineConfig(max_num_seqs=32)
    assert engine_limits(config) == (32, 72)
    two = ray_options(config, 2, {"CPU": 2.0})
    assert two.engine_gpus == 0 and 2 * two.engine_cpus + two.gateway_cpus <= 2.0
    assert ray_options(config, 4, {"CPU": 64.0, "GPU": 4.0}).engine_cpus == 1.0
    assert ray_options(config, 4, {"CPU": 64.0, "GPU": 4.0}).engine_gpus == 1.0
    assert ray_options(EngineConfig(device="cpu"), 1, {"CPU": 8, "GPU": 1}).engine_gpus == 0


def test_the_documented_config_builds(tmp_path):
    import re
    from pathlib import Path

    import yaml
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from quickdraft.server.ray_app import app_builder, autoscaling

    doc = (Path(__file__).parents[2] / "docs" / "scale-out.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", doc, re.DOTALL)
    config = yaml.safe_load(block)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "quickdraft.server.ray_app:app_builder"
    args = app["args"]
    args["engine"]["model"] = str(tmp_path)  # nothing loads while the app is only built
    assert isinstance(app_builder(args), Application)
    scaling = autoscaling(EngineConfig(**args["engine"]), 1, 4)
    assert scaling == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 24}
