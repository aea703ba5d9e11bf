"""A dedicated deployment's merged model written once and copied to each node like a base
(``dedicated.mergedStore``): ``loraplane merge --publish``, as the operator's merge Job runs it,
fetches the adapter from the store, merges it and writes the checkpoint back with its digest; the
node agent, told by the operator's staging, copies it as it copies an s3:// base (verified,
published whole); a serving process opens it from the node's copy and answers as the shared base
with the adapter does; unstaged, it leaves the node's disk."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from engine_helpers import engine_greedy, tiny_engine
from flaky_proxy import flaky_proxy
from node_agent_process import call, node_agent
from s3_server import ACCESS, SECRET, moto_server, upload_folder
from waiting import wait_for

from loraplane.adapter_format import adapter_digest
from loraplane.cli import main
from loraplane.node_cache.base_copy import folder_digest, published_path


@pytest.fixture(scope="module")
def store(tiny_llama: Path, tiny_adapters: dict[str, Path]):
    with moto_server() as endpoint, flaky_proxy(endpoint) as proxy:
        upload_folder(endpoint, "models", "keep", tiny_llama)  # the node's base, in the bucket the merged models go to
        yield proxy, upload_folder(endpoint, "adapters", "acme/all8", tiny_adapters["all8"])


def merge(args: list[str], endpoint: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_REGION": "us-east-1", "LORAPLANE_CACHE": str(tmp_path / "job-cache")}  # fmt: skip
    return CliRunner().invoke(main, ["merge", *args, "--cache-dir", str(tmp_path)], env=env)


def state(url: str) -> dict:  # type: ignore[type-arg]
    response = call(url, "GET", "/v1/state")
    assert response.status_code == 200, response.text
    return response.json()


def test_merged_once_copied_to_the_node_and_served_from_it(store, tiny_llama, tiny_adapters, tmp_path) -> None:
    proxy, adapter_uri = store
    digest = adapter_digest(tiny_adapters["all8"])
    target = "s3://models/merged/acme/all8-v1"
    done = merge([adapter_uri, "--digest", digest, "--base", str(tiny_llama), "--publish", target,
                  "--digest-file", str(tmp_path / "termination-log")], proxy.url, tmp_path)  # fmt: skip
    assert done.exit_code == 0, done.output
    written = (tmp_path / "termination-log").read_text()
    assert written.startswith("sha256:") and done.stdout.strip().endswith(written)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("loraplane-merge-")]  # its scratch is gone

    node = tmp_path / "node"
    with node_agent(node, proxy.url, "--base-source", "s3://models/keep") as url:
        wait_for("the node's own base", lambda: state(url)["base"]["ready"], timeout=60)
        staged = {"adapters": [], "bases": [{"source": target, "digest": written}]}
        assert call(url, "PUT", "/v1/staging", staged).status_code == 204
        (copied,) = wait_for("the merged model on the node", lambda: [b for b in state(url)["bases"] if b["ready"]], timeout=60)
        assert copied == {"source": target, "digest": written, "ready": True, "error": None}
        folder = published_path(node, target)
        assert folder_digest(folder.resolve()) == written

        served = tiny_engine(folder, tmp_path / "pod", served_model_name="acme-bot", merged_lora_digest=digest)
        assert served.base.merged and served.base.shape.name == "acme-bot"
        shared = tiny_engine(tiny_llama, tmp_path / "shared", {"acme-bot": tiny_adapters["all8"]})
        prompts = [random.Random(i).choices(range(3, 320), k=9) for i in range(3)]
        got, got_logits = engine_greedy(served, [(p, None) for p in prompts], 6)
        want, want_logits = engine_greedy(shared, [(p, "acme-bot") for p in prompts], 6)
        assert got == want
        for a, b in zip(got_logits, want_logits, strict=True):
            assert (a - b).abs().max().item() < 1e-3

        # No longer staged (the adapter returned to the shared pool): gone from the node's disk.
        content = folder.resolve()
        assert call(url, "PUT", "/v1/staging", {"adapters": [], "bases": []}).status_code == 204
        wait_for("the merged model deleted", lambda: not content.exists() and not folder.is_symlink(), timeout=30)
        assert state(url)["bases"] == []
        assert published_path(node, "s3://models/keep").resolve().is_dir()  # the node's own base is never unstaged


def test_a_wrong_adapter_digest_publishes_nothing(store, tiny_llama, tmp_path) -> None:
    proxy, adapter_uri = store
    target = "s3://models/merged/acme/all8-wrong"
    done = merge([adapter_uri, "--digest", "sha256:" + "2" * 64, "--base", str(tiny_llama), "--publish", target],
                 proxy.url, tmp_path)  # fmt: skip
    assert done.exit_code != 0 and "digest" in done.output.lower()
    from s3_server import client

    endpoint = proxy.url
    assert not list(client(endpoint).list_objects("models", prefix="merged/acme/all8-wrong/", recursive=True))


def test_staging_takes_only_s3_checkpoints(store, tmp_path) -> None:
    """A staged base is an object-store prefix: never a path on the node the agent would copy."""
    proxy, _ = store
    with node_agent(tmp_path / "node", proxy.url) as url:
        for source in ("file:///etc", "/var/lib"):
            body = {"adapters": [], "bases": [{"source": source, "digest": "sha256:" + "0" * 64}]}
            refused = call(url, "PUT", "/v1/staging", body)
            assert refused.status_code == 422 and "bases" in refused.text
