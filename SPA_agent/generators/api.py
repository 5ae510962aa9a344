"""Any OpenAI-compatible chat endpoint (OpenAI, DeepSeek, Together, a local `vllm serve`, ...; spec §7.3).

Each prompt's `messages` are sent as one chat-completions request. A remote model cannot be forced to open its
turn with `Prompt.response_prefix`, so the prefix is not sent; the returned text is used as the continuation
after the prefix (a leading copy of the prefix in the reply is removed, so the context manager's parser, which
prepends the prefix, sees it once). Requests run in a thread pool of `max_concurrency`; failed requests are
retried with exponential backoff. Needs `pip install 'spa-agent[api]'`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from SPA_agent.generators.base import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    GenerationError,
    MissingExtraError,
    Prompt,
)

NO_KEY = "EMPTY"  # sent to servers without authentication (api_key_env: null)


class APIGenerationError(GenerationError):
    """A request failed after its last attempt (the message names the endpoint and the cause)."""


def _import_openai():
    try:
        import openai
    except ImportError as err:
        raise MissingExtraError("the api generator needs the openai package: pip install 'spa-agent[api]'") from err
    return openai


def read_api_key(api_key_env: str | None, environ: Mapping[str, str]) -> str:
    """The key stored in the environment variable named `api_key_env` (NO_KEY when no variable is named)."""
    if not api_key_env:
        return NO_KEY
    key = environ.get(api_key_env)
    if not key:
        raise ValueError(
            f"environment variable {api_key_env} (generator.api_key_env) is not set: export the API key "
            "there, or set generator.api_key_env=null for a server without authentication"
        )
    return key


class APIGenerator:
    """Chat completions from an OpenAI-compatible server; text only (`token_ids` is None)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 400,
        max_concurrency: int = 16,
        max_retries: int = 5,
        timeout_s: float = 60,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ):
        if max_concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError(
                "generator.max_concurrency must be >= 1, max_retries >= 0 and timeout_s > 0; got "
                f"{max_concurrency}, {max_retries}, {timeout_s}"
            )
        openai = _import_openai()
        self.base_url, self.model = base_url, model
        self.sampling = dict(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens)
        self.max_concurrency, self.max_retries = max_concurrency, max_retries
        self.last_error: str | None = None  # the cause of the latest request given up with `allow_failures`
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._errors = openai
        self._client = openai.OpenAI(api_key=api_key, base_url=base_url, timeout=timeout_s, max_retries=0)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> APIGenerator:
        """Build from the `generator` config; the key is read from the variable named by `api_key_env`."""
        api_key = read_api_key(cfg.get("api_key_env"), os.environ if environ is None else environ)
        return cls(
            base_url=str(cfg["base_url"]),
            model=str(cfg["model"]),
            api_key=api_key,
            temperature=float(cfg.get("temperature", 1.0)),
            top_p=float(cfg.get("top_p", 1.0)),
            max_new_tokens=int(cfg.get("max_new_tokens", 400)),
            max_concurrency=int(cfg.get("max_concurrency", 16)),
            max_retries=int(cfg.get("max_retries", 5)),
            timeout_s=float(cfg.get("timeout_s", 60)),
            backoff_s=float(cfg.get("backoff_s", 1.0)),
            max_backoff_s=float(cfg.get("max_backoff_s", 30.0)),
        )

    def __repr__(self) -> str:  # never shows the key
        return f"APIGenerator(base_url={self.base_url!r}, model={self.model!r}, sampling={self.sampling})"

    def generate(self, prompts: list[Prompt], allow_failures: bool = False) -> list[Generation]:
        """One Generation per prompt, in order. A request that still fails after `max_retries` retries raises
        APIGenerationError, or with `allow_failures` gives `Generation("", None, "error")`."""
        results: list[Generation | None] = [None] * len(prompts)
        pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="api-generator")
        try:
            futures = {pool.submit(self._complete, prompt): index for index, prompt in enumerate(prompts)}
            for future in as_completed(futures):
                try:
                    results[futures[future]] = future.result()
                except APIGenerationError as err:
                    if not allow_failures:
                        raise
                    self.last_error = str(err)
                    results[futures[future]] = Generation("", None, FINISH_ERROR)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return results

    def _complete(self, prompt: Prompt) -> Generation:
        """One request with retries; exponential backoff between attempts."""
        for attempt in range(self.max_retries + 1):
            try:
                response = self._client.chat.completions.create(
                    model=self.model, messages=prompt.messages, **self.sampling
                )
                return self._to_generation(response.choices[0], prompt.response_prefix)
            except (self._errors.AuthenticationError, self._errors.PermissionDeniedError) as err:
                raise APIGenerationError(
                    f"{self.base_url} refused the API key ({err.status_code}): check the "
                    "variable named by generator.api_key_env"
                ) from None
            except self._errors.APIError as err:
                if attempt == self.max_retries or not self._retryable(err):
                    raise APIGenerationError(self._describe(err, attempt + 1)) from None
            time.sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
        raise AssertionError("unreachable")

    def _retryable(self, err: Exception) -> bool:
        """Connection problems, timeouts, rate limits and server errors are worth another attempt."""
        if isinstance(err, self._errors.APIConnectionError):  # includes APITimeoutError
            return True
        status = getattr(err, "status_code", None)
        return status is not None and (status == 429 or status >= 500)

    def _describe(self, err: Exception, attempts: int) -> str:
        if isinstance(err, self._errors.APITimeoutError):
            cause = "timed out"
        elif isinstance(err, self._errors.APIConnectionError):
            cause = "cannot be reached (is the server running and generator.base_url right?)"
        else:
            cause = f"answered {getattr(err, 'status_code', '?')}: {getattr(err, 'message', err)}"
        return (
            f"API endpoint {self.base_url} (model {self.model}) {cause}; gave up after {attempts} attempt(s)"
        )

    @staticmethod
    def _to_generation(choice, response_prefix: str) -> Generation:
        text = choice.message.content or ""
        if response_prefix and text.lstrip().startswith(response_prefix):
            text = text.lstrip()[len(response_prefix) :]
        finish_reason = FINISH_LENGTH if choice.finish_reason == "length" else FINISH_STOP
        return Generation(text=text, token_ids=None, finish_reason=finish_reason)
