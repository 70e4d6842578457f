"""Security: the API key on every route but health, metrics and the API description (compared
in constant time), body and prompt length limits, no file-system paths from requests, a
loopback bind by default, and chat templates rendered in jinja2's sandbox."""

from __future__ import annotations

import hmac

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import WSServerHandshakeError
from test_reliability_support import engine_is_idle, is_openai_error, serving

from asyncllm import AsyncLLM, EngineArgs
from asyncllm.serve import make_parser
from asyncllm.server import ServerArgs

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "k3y-under-test"
OPEN_PATHS = {"/health", "/metrics", "/openapi.json", "/"}  # the chat page asks for the key


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir):
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, num_kv_blocks=256)
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    await engine.shutdown()


def routes(app) -> list[tuple[str, str]]:
    return sorted(
        (r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"
    )


async def test_every_route_but_the_open_ones_needs_the_key(engine) -> None:
    async with serving(engine, api_key=KEY) as (url, app), aiohttp.ClientSession() as s:
        guarded = [(m, p) for m, p in routes(app) if p not in OPEN_PATHS]
        assert {p for _, p in guarded} >= {"/v1/completions", "/v1/chat/completions", "/v1/stream"}
        for method, path in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                async with s.request(method, url + path, json={}, headers=headers) as r:
                    assert r.status == 401, (method, path, headers)
                    assert (await r.json())["error"]["code"] == "invalid_api_key"
        for path in OPEN_PATHS:
            async with s.get(url + path) as r:
                assert r.status == 200, path
        with pytest.raises(WSServerHandshakeError) as refused:
            await s.ws_connect(f"{url}/v1/stream")
        assert refused.value.status == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"prompt": "x", "max_tokens": 2}
        async with s.post(f"{url}/v1/completions", json=body, headers=auth) as r:
            assert r.status == 200


async def test_openapi_describes_every_route_and_is_open(engine) -> None:
    async with (
        serving(engine, api_key=KEY, root_path="/llm") as (url, app),
        aiohttp.ClientSession() as s,
        s.get(f"{url}/llm/openapi.json") as r,
    ):
        spec = await r.json()
    assert spec["openapi"].startswith("3.0") and spec["servers"] == [{"url": "/llm"}]
    described = sorted(
        (method.upper(), prefix + path)
        for path, operations in spec["paths"].items()
        for method in operations
        for prefix in ("/llm", "")  # under the root path, and without it for stripping proxies
    )
    assert described == routes(app)


async def test_the_key_is_compared_in_constant_time(engine, monkeypatch) -> None:
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    async with (
        serving(engine, api_key=KEY) as (url, _),
        aiohttp.ClientSession() as s,
        s.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"}) as r,
    ):
        assert r.status == 401
    assert compared


async def test_bodies_over_the_limit_are_413_and_frames_over_it_close_the_socket(
    engine,
) -> None:
    async with (
        serving(engine, max_request_body_bytes=2048) as (url, _),
        aiohttp.ClientSession() as s,
    ):
        big = {"prompt": "x" * 4096}
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            async with s.post(url + path, json=big) as r:
                assert r.status == 413, path
                assert is_openai_error(await r.json())
        ws = await s.ws_connect(f"{url}/v1/stream")
        await ws.send_json({"id": "big", "body": big})
        message = await ws.receive(timeout=10)
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
        async with s.get(f"{url}/health") as r:
            assert r.status == 200


async def test_prompts_too_long_to_fit_are_refused_before_tokenizing(engine, monkeypatch) -> None:
    tokenizer = engine.tokenizer
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    async with serving(engine) as (url, app), aiohttp.ClientSession() as s:
        huge = "y" * 1_000_000
        bodies = {
            "/v1/completions": {"prompt": huge},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": huge}]},
        }
        for path, body in bodies.items():
            async with s.post(url + path, json=body) as r:
                error = await r.json()
                assert r.status == 400, path
                assert error["error"]["code"] == "context_length_exceeded"


async def test_prompts_over_the_context_are_refused_after_tokenizing(engine) -> None:
    async with serving(engine) as (url, _), aiohttp.ClientSession() as s:
        for prompt in ("hello " * 300, list(range(300))):
            async with s.post(f"{url}/v1/completions", json={"prompt": prompt}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "context_length_exceeded"
    assert engine_is_idle(engine)


async def test_no_file_system_path_is_taken_from_a_request(engine, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    include = f"{{% include '{secret}' %}}"
    chat = [{"role": "user", "content": "hi"}]
    bodies = [
        ("/v1/completions", {"prompt": "x", "model": str(secret)}),
        ("/v1/completions", {"prompt": "x", "model": "/etc/passwd"}),
        (
            "/v1/chat/completions",
            {"messages": chat, "chat_template_kwargs": {"chat_template": include}},
        ),  # fmt: skip
        (
            "/v1/chat/completions",
            {"messages": chat, "chat_template_kwargs": {"chat_template": str(secret)}},
        ),  # fmt: skip
        ("/v1/chat/completions", {"messages": chat, "chat_template_kwargs": {"tokenize": True}}),
    ]
    async with serving(engine) as (url, _), aiohttp.ClientSession() as s:
        for path, body in bodies:
            async with s.post(url + path, json=body) as r:
                text = await r.text()
                assert r.status in (400, 404), body
                assert "TOP-SECRET" not in text


async def test_a_trusted_request_template_still_renders_in_the_sandbox(engine, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    escapes = [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        f"{{% include '{secret}' %}}",
        f"{{{{ open('{secret}').read() }}}}",
    ]
    chat = [{"role": "user", "content": "hi"}]
    async with (
        serving(engine, trust_request_chat_template=True) as (url, _),
        aiohttp.ClientSession() as s,
    ):
        for template in escapes:
            body = {"messages": chat, "chat_template_kwargs": {"chat_template": template}}
            async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                text = await r.text()
                assert r.status == 400, template
                assert "TOP-SECRET" not in text and "uid=" not in text
        safe = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
        body = {"messages": chat, "chat_template_kwargs": safe, "max_tokens": 2}
        async with s.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200


async def test_transformers_renders_chat_templates_in_the_immutable_sandbox() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template("{{ messages[0].content }}")
    assert isinstance(template.environment, ImmutableSandboxedEnvironment)


async def test_binds_loopback_unless_told_otherwise() -> None:
    assert make_parser().parse_args([]).host == "127.0.0.1"
    assert ServerArgs().host == "127.0.0.1"
