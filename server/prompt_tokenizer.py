"""Prompts tokenized off the event loop: a chat template or a text prompt turned into token
ids on one worker thread, so that a big prompt does not stall the server's I/O. The gateway
and the batch worker's local link each own one."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jinja2

from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.server.errors import invalid


class PromptTokenizer:
    """One thread that tokenizes prompts for ``llm``'s engine; :meth:`close` when done."""

    def __init__(self, thread_name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=thread_name)

    async def chat(self, llm: AsyncLLM, messages: list[dict[str, str]], param: str
                   ) -> list[int]:
        """The chat template applied to ``messages``; a template that refuses them is a 400
        naming ``param``."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, llm.engine.apply_chat_template,
                                              messages)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise invalid(param, f"the chat template refused the messages: {exc}") from exc

    async def text(self, llm: AsyncLLM, prompt: str) -> list[int]:
        """``prompt`` encoded as it is (no special tokens added)."""
        loop = asyncio.get_running_loop()
        encode = partial(llm.engine.tokenizer.encode, prompt, add_special_tokens=False)
        return list(await loop.run_in_executor(self._pool, encode))

    def close(self) -> None:
        """Stop the thread; prompts not yet started are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
