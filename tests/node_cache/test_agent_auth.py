"""The node agent takes signed calls (``admin_api.auth``) for its own addresses only.

Serving pods reach the agent through a Service that selects pods by label, and the operator
dials agents it found by label: a pod a namespace user labels like an agent would receive their
calls. They sign rather than send their tokens, so such a pod learns nothing it can use against
the real agent, whose ``--admin-host`` addresses (its pod IP, its Service's name) a signature
must name.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from impostors import copying_app

from loraplane.admin_api.auth import sign_request
from loraplane.node_cache.agent import NodeAgent
from loraplane.node_cache.app import create_agent_app

POD, OPERATOR = "pods-admin-token", "operators-node-cache-token"
SERVICE = "smollm2-node-cache.team-a.svc"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[NodeAgent]:
    agent = NodeAgent(tmp_path / "node", "node-1", max_bytes=None)
    agent.start()
    yield agent
    agent.close()


class Agent:
    """The agent's app, called as if dialled at ``host`` (Starlette's test client runs it in-process)."""

    def __init__(self, agent: NodeAgent, host: str) -> None:
        app = create_agent_app(agent, POD, operator_token=OPERATOR, admin_hosts=frozenset({"10.1.2.3", SERVICE}))
        self.host, self.http = f"{host}:8090", TestClient(app, base_url=f"http://{host}:8090")

    def call(self, method: str, path: str, token: str, body: object = None, *, sent: object = None) -> int:
        """The status of a call signed by ``token`` over ``body``; ``sent``: a different body put
        under that signature."""
        signed = json.dumps(body).encode() if body is not None else b""
        content = json.dumps(sent).encode() if sent is not None else signed
        headers = {"Authorization": sign_request(token, method, self.host, path, signed), "content-type": "application/json"}
        return self.http.request(method, path, content=content, headers=headers).status_code


def test_signed_calls_for_the_agents_own_addresses_are_taken(agent: NodeAgent) -> None:
    for host in (SERVICE, "10.1.2.3"):  # the pods dial the Service, the operator the pod's IP
        node = Agent(agent, host)
        assert node.call("GET", "/v1/state", POD) == 200
        assert node.call("PUT", "/v1/pins", POD, {"client": "pod-a", "sources": []}) == 204
        assert node.call("PUT", "/v1/staging", OPERATOR, {"adapters": []}) == 204
        # Each token keeps its own reach: the pods' cannot stage.
        assert node.call("PUT", "/v1/staging", POD, {"adapters": []}) == 401


def test_a_signature_for_another_address_or_by_another_token_is_refused(agent: NodeAgent) -> None:
    elsewhere = Agent(agent, "10.9.9.9")  # what a pod posing as an agent would have been sent
    assert elsewhere.call("GET", "/v1/state", POD) == 401
    assert elsewhere.call("PUT", "/v1/staging", OPERATOR, {"adapters": []}) == 401
    here = Agent(agent, SERVICE)
    assert here.call("GET", "/v1/state", "a-guess") == 401
    # A signed body cannot be swapped: the signature covers it.
    evil = {"adapters": [{"source": "s3://evil/x", "digest": "sha256:" + "0" * 64}]}
    assert here.call("PUT", "/v1/staging", OPERATOR, {"adapters": []}, sent=evil) == 401
    assert here.call("PUT", "/v1/staging", OPERATOR, evil) == 204  # the same body, signed, is taken
    # A person's bearer token still works, as before.
    assert here.http.get("/v1/state", headers={"Authorization": f"Bearer {POD}"}).status_code == 200


def test_only_the_agent_itself_can_answer_as_the_agent(agent: NodeAgent) -> None:
    """A pod posing as the agent answers with a copy of a real answer, down to its signature
    header: the operator's client finds it unproven (so it is sent no staging list), and a
    serving pod's client believes nothing it says."""
    from loraplane.admin_api.auth import RESPONSE_HEADER
    from loraplane.node_cache.client import AgentClient, AsyncAgentClient, NotTheAgent
    from loraplane.serving.http.loopback import serve_app

    real_app = create_agent_app(agent, POD, operator_token=OPERATOR)
    with serve_app(real_app, ready_path="/health") as real:
        answer = httpx.get(f"{real}/v1/state", headers={"Authorization": sign_request(POD, "GET", real[7:], "/v1/state", b"")})
        assert answer.status_code == 200 and RESPONSE_HEADER.lower() in answer.headers
        with serve_app(copying_app("/health", "/v1/state", answer), ready_path="/health") as rogue:
            assert asyncio.run(AsyncAgentClient(real, OPERATOR).proven()) is True
            assert asyncio.run(AsyncAgentClient(real, "a-guess").proven()) is False
            assert asyncio.run(AsyncAgentClient(rogue, OPERATOR).proven()) is False
            assert AgentClient(real, POD).state().node == "node-1"
            with pytest.raises(NotTheAgent):
                AgentClient(rogue, POD).state()


def test_a_body_past_the_cap_is_refused_before_anything_reads_it(agent: NodeAgent) -> None:
    """A caller without a token cannot make the agent read (to check a signature, or to parse) a
    body larger than its largest real call: 413, declared length or chunked."""
    from loraplane.node_cache.app import MAX_BODY_BYTES

    http = Agent(agent, SERVICE).http
    big = b'{"adapters": [' + b" " * MAX_BODY_BYTES + b"]}"
    headers = {"Authorization": "Loraplane-Signed nobody", "content-type": "application/json"}
    assert http.put("/v1/staging", content=big, headers=headers).status_code == 413

    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    assert http.put("/v1/staging", content=chunks(), headers=headers).status_code == 413
    assert http.put("/v1/staging", json={"adapters": []}, headers=headers).status_code == 401  # small: judged by its caller


def test_the_agents_daemon_set_bounds_its_memory() -> None:
    from loraplane.operator.api.basemodel import BaseModelSpec
    from loraplane.operator.children.node_cache import daemon_set

    spec = BaseModelSpec.model_validate({
        "source": {"uri": "embedded"}, "nodeCache": {"enabled": True, "memory": "256Mi"},
        "resources": {"nodeSelector": {"loraplane.dev/serving": "true"}},
    })  # fmt: skip
    pod = daemon_set("smollm2", "team-a", spec)["spec"]["template"]["spec"]
    for container in [*pod["initContainers"], *pod["containers"]]:
        assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["memory"]
    assert pod["containers"][0]["resources"]["limits"]["memory"] == "256Mi"
