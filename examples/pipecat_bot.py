"""A Pipecat bot with Caller Memory: the caller's name remembered from one call to the next.

The pipeline is the one a phone bot has, minus the audio: ``[user aggregator, CallerMemory, LLM, assistant
aggregator]``. ``CallerMemory`` is the one line Caller Memory adds (see docs/pipecat.md); a ``save_name``
tool writes ``conv.state``, which is persisted when the call ends. The caller's words go in as the frames an
STT and a VAD make, so it runs without a microphone, a phone line or speech services.

Offline, with nothing running (a Caller Memory service started for the demo on a temporary SQLite file,
and a scripted OpenAI-compatible model, both on loopback, from ``caller_memory.sdk.testing``; the service
must be installed beside the SDK)::

    .venv/bin/python examples/pipecat_bot.py --demo

Against your own service (an agent token of a project whose ``state_keys`` include ``caller_name`` and
with ``conversation.enabled``) and any OpenAI-compatible model::

    CALLER_MEMORY_URL=http://127.0.0.1:8080 CALLER_MEMORY_TOKEN=cm_... OPENAI_API_KEY=sk-... \\
        .venv/bin/python examples/pipecat_bot.py --llm-url https://api.openai.com/v1 --model gpt-4o-mini

``--help`` lists the options. As a template for your own bot, copy ``one_call`` and ``two_calls``; only
``--demo`` needs ``demo_support.py`` (next to this file).

Both play two calls from the same number: in the first the caller gives their name, the second is greeted
with it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

# Pipecat logs to stderr at DEBUG from its import on (its version banner first, even before --help): start
# at WARNING; main() sets the level asked for. loguru reads LOGURU_LEVEL when it is first imported.
os.environ.setdefault("LOGURU_LEVEL", "WARNING")

try:
    from caller_memory.sdk import MemoryClient
    from caller_memory.sdk.pipecat import CallerMemory
    from loguru import logger

    try:
        from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
    except ImportError:  # Pipecat 1.13 has it here (1.14 moved it; both are supported)
        from pipecat.adapters.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import (
        EndFrame,
        LLMRunFrame,
        TranscriptionFrame,
        UserStartedSpeakingFrame,
        UserStoppedSpeakingFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import (
        LLMContextAggregatorPair,
        LLMUserAggregatorParams,
    )
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies
    from pipecat.utils.time import time_now_iso8601
    from pipecat.workers.runner import WorkerRunner
except ImportError as missing:  # a bare ModuleNotFoundError would not say what to install
    sys.exit(
        f"This bot needs Pipecat and the SDK's Pipecat drop-in, and {missing.name or missing} is missing. "
        'Install the SDK with its Pipecat extra: pip install "caller-memory-sdk[pipecat]" (from a clone of '
        'the repository: pip install "./sdk[pipecat]").'
    )

#: The project configuration this bot expects.
PROJECT_CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["caller_name"], "retention": "P30D", "default_region": "US"},
        "conversation": {"enabled": True},
    }
}
INSTRUCTIONS = (
    "You answer the phone for a cheese shop. Greet a caller whose name you know by it. When the caller tells "
    "you their name, call save_name."
)
#: The demo's caller: a US test number (555-01xx), never printed.
CALLER = "+14155550100"


# The bot --------------------------------------------------------------------------------------------------


async def one_call(
    client: MemoryClient, call_id: str, caller: str, lines: list[str], *, llm_url: str, model: str
) -> None:
    """One call: the greeting, one turn per line the caller says, then the bot hangs up."""
    memory = CallerMemory(client, conversation_id=call_id, caller=caller)  # the one line
    llm = OpenAILLMService(
        api_key=os.environ.get("OPENAI_API_KEY", "sk-demo"),
        base_url=llm_url,
        settings=OpenAILLMService.Settings(model=model, system_instruction=INSTRUCTIONS),
    )
    save_name = memory.state_tool("save_name", "Remember the caller's name.", {"name": "caller_name"})
    context = LLMContext(tools=ToolsSchema(standard_tools=[save_name]))
    pair = LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(user_turn_strategies=ExternalUserTurnStrategies())
    )
    worker = PipelineWorker(
        Pipeline([pair.user(), memory, llm, pair.assistant()]), enable_rtvi=False, idle_timeout_secs=60
    )
    replies: asyncio.Queue[str] = asyncio.Queue()
    started = asyncio.Event()

    @pair.assistant().event_handler("on_assistant_turn_stopped")
    async def said(aggregator: Any, message: Any) -> None:
        if message.content:
            await replies.put(message.content)

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker: Any, frame: Any) -> None:
        started.set()

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    await asyncio.wait_for(started.wait(), 30)
    await worker.queue_frame(LLMRunFrame())  # the greeting
    print("agent:", await asyncio.wait_for(replies.get(), 30))
    for line in lines:
        print("caller:", line)
        await worker.queue_frames(
            [
                UserStartedSpeakingFrame(),  # CallerMemory prefetches the next turn's memory here
                TranscriptionFrame(text=line, user_id="caller", timestamp=time_now_iso8601()),
                UserStoppedSpeakingFrame(),
            ]
        )
        print("agent:", await asyncio.wait_for(replies.get(), 30))
    await worker.queue_frame(EndFrame())  # the bot hangs up
    await running
    # Pipecat 1.14's OpenAILLMService never closes its AsyncOpenAI client and has no public call that does:
    # without this, its connection pool is left open (a ResourceWarning at exit).
    await llm._client.close()
    result = await memory.finished()  # the end of the call, persisted (or kept in the outbox)
    if result is None:
        print("[call ended: no caller number, nothing remembered]")
    else:
        print(
            f"[call ended: persisted {list(result.persisted)}{' (queued in the outbox)' if result.queued else ''}]"
        )


async def two_calls(
    url: str, token: str, project: str, *, llm_url: str, model: str, outbox: Path | None
) -> None:
    async with MemoryClient(url, token=token, project=project, outbox_path=outbox) as client:
        print("--- call-1")
        await one_call(
            client, f"call-{secrets.token_hex(4)}", CALLER, ["My name is Ada."], llm_url=llm_url, model=model
        )
        print("--- call-2")
        await one_call(
            client, f"call-{secrets.token_hex(4)}", CALLER, ["Any gouda today?"], llm_url=llm_url, model=model
        )


async def demo() -> None:
    # Imported here, not at the top: a copy of this file used as a template runs without demo_support.py.
    from caller_memory.sdk.testing import ScriptedModel, service
    from demo_support import shop_model

    with tempfile.TemporaryDirectory() as workdir:
        async with service() as cm, ScriptedModel(shop_model()) as model:
            tokens = await cm.create_project("cheese-shop", PROJECT_CONFIG)
            await two_calls(
                cm.url,
                tokens.agent,
                "cheese-shop",
                llm_url=model.base_url,
                model="demo",
                outbox=Path(workdir) / "outbox.db",
            )


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the epilog as written."""


EPILOG = """environment:
  CALLER_MEMORY_URL, CALLER_MEMORY_TOKEN, CALLER_MEMORY_PROJECT  the defaults of --url, --token, --project
  OPENAI_API_KEY  the model's API key (not needed with --demo)

--demo ignores --url, --token, --project, --llm-url and --model: it starts a service (installed beside the
SDK) and a scripted model, both on loopback, and removes them when it ends."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=EPILOG, formatter_class=_Help
    )
    parser.add_argument(
        "--demo", action="store_true", help="run offline: a service started for the demo and a scripted model"
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("CALLER_MEMORY_URL", "http://127.0.0.1:8080"),
        help="the Caller Memory service",
    )
    parser.add_argument(
        "--token",
        default=argparse.SUPPRESS,  # not shown by --help: it is a secret
        help="an agent token of the project (default: $CALLER_MEMORY_TOKEN)",
    )
    parser.add_argument(
        "--project", default=os.environ.get("CALLER_MEMORY_PROJECT", "cheese-shop"), help="the project"
    )
    parser.add_argument(
        "--llm-url", default="https://api.openai.com/v1", help="an OpenAI-compatible API's base URL"
    )
    parser.add_argument("--model", default="gpt-4o-mini", help="the model's name at --llm-url")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="Pipecat's log at DEBUG (numbers masked)"
    )
    args = parser.parse_args()
    logger.remove()  # Pipecat's default sink, and the one LOGURU_LEVEL set
    logger.add(sys.stderr, level="DEBUG" if args.verbose else "WARNING")
    if args.demo:
        from caller_memory.sdk.testing import ServiceNotInstalledError

        try:
            asyncio.run(demo())
        except ServiceNotInstalledError as exc:
            sys.exit(f"--demo starts a Caller Memory service: {exc}")
        return
    token = getattr(args, "token", None) or os.environ.get("CALLER_MEMORY_TOKEN")
    if not token:
        parser.error("--token (or CALLER_MEMORY_TOKEN) is required unless --demo is given")
    asyncio.run(two_calls(args.url, token, args.project, llm_url=args.llm_url, model=args.model, outbox=None))


if __name__ == "__main__":
    main()
