"""validate's context from /v1/models: a --model the server does not serve is named as such, with the served
ones (issue 17 item 6 said "does not report max_model_len", which misled)."""

from __future__ import annotations

import argparse

import pytest

from sglang_ssd_stream.errors import EXIT_USAGE
from sglang_ssd_stream.operate import add_operate_commands
from sglang_ssd_stream.operate.errors import ModelNotServed, ServerUnreachable
from sglang_ssd_stream.operate.validate_cli import _served_context

from .conftest import SIDES
from .test_watch import Endpoint


@pytest.fixture
def endpoint():
    e = Endpoint()
    yield e
    e.close()


def _args(endpoint, model):
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    return p.parse_args(["validate", "--url", endpoint.url, "--model", model])


def test_served_model_context(endpoint):
    endpoint.models = [{"id": "Qwen/Qwen3.6-27B-NVFP4", "max_model_len": 262144}, {"id": "other"}]
    assert _served_context(_args(endpoint, "Qwen/Qwen3.6-27B-NVFP4")) == 262144
    with pytest.raises(ServerUnreachable, match="does not report max_model_len for 'other'; pass --context-length"):
        _served_context(_args(endpoint, "other"))


def test_a_model_the_server_does_not_serve(endpoint):
    endpoint.models = [{"id": "Qwen/Qwen3.6-27B-NVFP4", "max_model_len": 262144}]
    with pytest.raises(ModelNotServed, match=r"does not serve 'qwen3\.8'; it serves: 'Qwen/Qwen3\.6-27B-NVFP4'\. "
                                             r"Pass one of those to --model") as exc:
        _served_context(_args(endpoint, "qwen3.8"))
    assert exc.value.exit_code == EXIT_USAGE
