"""The API generator against a real OpenAI-compatible HTTP server on 127.0.0.1 (spec §7.3)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("openai")

from SPA_agent.generators import build_generator
from SPA_agent.generators.api import APIGenerationError, APIGenerator

KEY = "sk-test-secret-123"


class ChatServer(ThreadingHTTPServer):
    """/v1/chat/completions answering `echo:<last message>`; fails the first `fail_first` requests with 503,
    always fails messages containing "FAIL" with 500, sleeps `delay_s` per request."""

    daemon_threads = True

    def __init__(self, fail_first: int = 0, delay_s: float = 0.0):
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.fail_first, self.delay_s = fail_first, delay_s
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class ChatHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server: ChatServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append({"body": body, "auth": self.headers.get("Authorization")})
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
            fail = server.fail_first > 0 or "FAIL" in body["messages"][-1]["content"]
            server.fail_first -= 1
        time.sleep(server.delay_s)
        with server.lock:
            server.in_flight -= 1
        if self.path != "/v1/chat/completions" or fail:
            return self._send(
                503 if self.path.endswith("completions") else 404, {"error": {"message": "busy"}}
            )
        content = "echo:" + body["messages"][-1]["content"]
        self._send(
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": content},
                    }
                ],
            },
        )

    def _send(self, status: int, payload: dict):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    servers = []

    def start(**kwargs) -> ChatServer:
        chat_server = ChatServer(**kwargs)
        threading.Thread(target=chat_server.serve_forever, args=(0.02,), daemon=True).start()
        servers.append(chat_server)
        return chat_server

    yield start
    for chat_server in servers:
        chat_server.shutdown()
        chat_server.server_close()


def api(url: str, **kwargs) -> APIGenerator:
    settings = dict(
        model="test-model",
        api_key=KEY,
        max_new_tokens=32,
        max_retries=2,
        backoff_s=0.01,
        timeout_s=5,
        max_concurrency=4,
    )
    return APIGenerator(url, **{**settings, **kwargs})


def test_sends_messages_and_returns_texts_in_order(server, make_prompt):
    chat_server = server()
    prompts = [make_prompt(f"Turn {i}") for i in range(6)]
    generations = api(chat_server.url, temperature=0.5).generate(prompts)
    assert [g.text for g in generations] == [f"echo:Turn {i}" for i in range(6)]
    assert all(g.token_ids is None and g.finish_reason == "stop" for g in generations)
    request = chat_server.requests[0]
    assert request["auth"] == f"Bearer {KEY}"
    assert request["body"]["messages"] in [p.messages for p in prompts]  # no forced "<think>" sent
    assert (request["body"]["temperature"], request["body"]["max_tokens"]) == (0.5, 32)


def test_reply_starting_with_the_prefix_loses_it(server, make_prompt):
    chat_server = server()
    (generation,) = api(chat_server.url).generate([make_prompt("x", prefix="echo:")])
    assert generation.text == "x"


def test_retries_transient_failures(server, make_prompt):
    chat_server = server(fail_first=2)
    generations = api(chat_server.url, max_concurrency=1).generate([make_prompt("a"), make_prompt("b")])
    assert [g.text for g in generations] == ["echo:a", "echo:b"]
    assert len(chat_server.requests) == 4


def test_gives_up_after_last_retry_naming_the_endpoint(server, make_prompt):
    chat_server = server()
    with pytest.raises(APIGenerationError, match=f"{chat_server.url}.*503.*after 3 attempt"):
        api(chat_server.url).generate([make_prompt("ok"), make_prompt("FAIL")])


def test_allow_failures_marks_failed_requests(server, make_prompt):
    chat_server = server()
    generations = api(chat_server.url).generate([make_prompt("ok"), make_prompt("FAIL")], allow_failures=True)
    assert [(g.text, g.finish_reason) for g in generations] == [("echo:ok", "stop"), ("", "error")]


def test_concurrency_is_bounded(server, make_prompt):
    chat_server = server(delay_s=0.05)
    api(chat_server.url, max_concurrency=3).generate([make_prompt(str(i)) for i in range(12)])
    assert 1 < chat_server.max_in_flight <= 3


def test_timeout_is_an_error(server, make_prompt):
    chat_server = server(delay_s=1.0)
    with pytest.raises(APIGenerationError, match="timed out"):
        api(chat_server.url, timeout_s=0.2, max_retries=0).generate([make_prompt("slow")])


def test_endpoint_down_gives_one_clear_message(make_prompt):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    with pytest.raises(APIGenerationError) as info:
        api(url, max_retries=1).generate([make_prompt(str(i)) for i in range(5)])
    assert str(info.value) == (
        f"API endpoint {url} (model test-model) cannot be reached (is the server running "
        "and generator.base_url right?); gave up after 2 attempt(s)"
    )
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_key_comes_from_named_variable_and_is_never_shown(server, tiny_config, tiny_tokenizer):
    chat_server = server()
    cfg = tiny_config(
        "_2_sokoban",
        "generator=api",
        f"generator.base_url={chat_server.url}",
        "generator.api_key_env=SPA_TEST_KEY",
    ).generator
    generator = APIGenerator.from_config(cfg, environ={"SPA_TEST_KEY": KEY})
    assert KEY not in repr(generator) and KEY not in str(generator)
    with pytest.raises(ValueError, match="SPA_TEST_KEY"):
        APIGenerator.from_config(cfg, environ={})


def test_build_generator_reads_the_process_environment(
    server, tiny_config, tiny_tokenizer, make_prompt, monkeypatch
):
    chat_server = server()
    monkeypatch.setenv("SPA_TEST_KEY", KEY)
    cfg = tiny_config(
        "_2_sokoban",
        "generator=api",
        f"generator.base_url={chat_server.url}",
        "generator.api_key_env=SPA_TEST_KEY",
    ).generator
    (generation,) = build_generator(cfg, "tiny", tiny_tokenizer).generate([make_prompt("hi")])
    assert generation.text == "echo:hi" and chat_server.requests[0]["auth"] == f"Bearer {KEY}"
