"""What phone-number redaction costs (issue 27, item 5), beside what it cost before, in one run.

    .venv/bin/python bench/redaction.py            # about 2 minutes on the 2-core machine
    .venv/bin/python bench/redaction.py --smoke    # seconds: checks that everything runs (figures meaningless)

Measured, in this process:

- ``cpu``: CPU seconds (``time.process_time``) to redact the worst 64 KiB we know of, in several shapes
  (dense digit groups, distinct numbers, mixed separators, digits spelled one by one, ``+1`` fragments, 7-digit
  local numbers, one long run), each with every number masked (``redact_phone_numbers`` on, the default) and
  with only the caller's own masked (off); the project's region GB and the caller's US, as for an American
  calling a British shop. The median of 5 runs each, and the largest over the shapes (target: <= 50 ms).
  Beside it, the same 64 KiB through libphonenumber's ``PhoneNumberMatcher`` read in both regions, as the code
  before issue 27 did (one run each: it takes seconds).
- ``append``: the CPU of a whole 64 KiB append of digit groups (``TranscriptService.append``: validation,
  redaction, encoding, the store write) on a private redis-server, median of 5.
- ``tenant`` (after ``settle_heap()``, as the service once it listens): another project's memory reads at a fixed rate (open loop: read ``i`` is due at ``i / rate`` and
  its latency counts from then, so a stall is counted), alone and then while two tasks append 64 KiB of digit
  groups in a loop in the same process (what one service process serving both tenants sees); p99 of each,
  paired by run, 5 runs; the median of the ratios (target: <= 1.25x).

Results: bench/results/redaction.json (or ``--output``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import phonenumbers

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from caller_memory.service.app import build_services  # noqa: E402
from caller_memory.service.config import Settings  # noqa: E402
from caller_memory.service.domain.projects import Project  # noqa: E402
from caller_memory.service.domain.redaction import Mask  # noqa: E402
from caller_memory.service.domain.redaction_batches import redact_batch  # noqa: E402
from caller_memory.service.http.app_keys import Services  # noqa: E402
from caller_memory.service.http.server import settle_heap  # noqa: E402
from in_process import commit, percentile, tenant_reads  # noqa: E402

from tests.support.redis_server import RedisServer  # noqa: E402

PSEUDONYM_KEY = b"bench-redaction-pseudonym-key-0123456789abcd"
REGIONS = ["GB", "US"]
CALLER, READER = "+14155550100", "+447700900123"
CONFIG: dict[str, Any] = {
    "memory": {
        "repeat_caller": {"state_keys": ["cheese"], "retention": "P30D", "default_region": "GB"},
        # The appenders write gigabytes in a run (words are not searched, so they go fast): no 507 here.
        "conversation": {"enabled": True, "max_transcript_bytes": 1 << 50},
    }
}
SIZE = 64 * 1024
TARGET_CPU_MS = 50.0
TARGET_TENANT_RATIO = 1.25
#: Four messages of 15,000 characters: the most content a 64 KiB body carries in whole digit groups.
MESSAGE_CHARS = 15_000


def shapes(size: int) -> dict[str, str]:
    """The costliest inputs we know of, ``size`` characters each (a fixed pseudo-random sequence)."""
    state = 12345

    def digit() -> int:
        nonlocal state
        state = (state * 1103515245 + 12345) % 2**31
        return state % 10

    def numbers(shape: str) -> str:
        parts: list[str] = []
        total = 0
        while total < size:
            d = "".join(str(digit()) for _ in range(10))
            parts.append(shape.format(d[:3], d[3:6], d[6:]))
            total += len(parts[-1])
        return "".join(parts)[:size]

    return {
        "groups": ("415 555 0100 " * (size // 13 + 1))[:size],
        "distinct": numbers("{} {} {} "),
        "mixed": numbers("{}-{}.{}/"),
        "spelled": " ".join(str(digit()) for _ in range(size // 2 + 1))[:size],
        "plus1": ("+1 415 555 01 " * (size // 14 + 1))[:size],
        "local7": numbers("{1}{2} "),
        "run": ("1234567890" * (size // 10 + 1))[:size],
    }


def before(text: str, regions: list[str], masked: Callable[[str], bool]) -> str:
    """Redaction as it was before issue 27: libphonenumber's matcher over the whole text, once per region."""
    for region in dict.fromkeys(regions):
        spans = [
            (m.start, m.end)
            for m in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.POSSIBLE)
            if masked(phonenumbers.format_number(m.number, phonenumbers.PhoneNumberFormat.E164))
        ]
        for start, end in reversed(spans):
            text = text[:start] + "[phone]" + text[end:]
    return text


def cpu_of(call: Callable[[], object]) -> float:
    began = time.process_time()
    call()
    return time.process_time() - began


def messages_of(text: str) -> list[str]:
    return [text[i : i + MESSAGE_CHARS] for i in range(0, len(text), MESSAGE_CHARS)]


def measure_cpu(smoke: bool) -> dict[str, Any]:
    runs = 1 if smoke else 5
    own = Mask(every=False, numbers=frozenset({CALLER}))
    out: dict[str, Any] = {}
    for name, text in shapes(SIZE).items():
        texts = messages_of(text)
        every_ms = (
            statistics.median(cpu_of(lambda texts=texts: redact_batch(texts, REGIONS)) for _ in range(runs))
            * 1000
        )
        own_ms = (
            statistics.median(
                cpu_of(lambda texts=texts: redact_batch(texts, REGIONS, own)) for _ in range(runs)
            )
            * 1000
        )
        sample = text if not smoke else text[:2048]
        old_ms = (
            cpu_of(lambda sample=sample: [before(t, REGIONS, lambda e164: True) for t in messages_of(sample)])
            * 1000
        )
        out[name] = {"every_ms": every_ms, "own_only_ms": own_ms, "before_every_ms": old_ms}
        print(
            f"  cpu {name:9} every {every_ms:6.1f} ms  own-only {own_ms:6.1f} ms  before {old_ms:8.1f} ms",
            flush=True,
        )
    return out


def body(conversation: str, digits: bool = True) -> dict[str, Any]:
    text = ("415 555 0100 " if digits else "gouda brie ok ") * 1153
    return {
        "messages": [{"role": "user", "content": text, "turn_id": 1} for _ in range(4)],
        "_": conversation,
    }


async def appender(
    services: Services, shop: Project, tag: str, stop: asyncio.Event, digits: bool = True
) -> int:
    """Appends of 64 KiB of digit groups (or of words: the same size without a number), one after another,
    to conversations of its own."""
    count = 0
    while not stop.is_set():
        conversation = f"{tag}-{count // 50}"
        document = {k: v for k, v in body(conversation, digits).items() if k != "_"}
        if count % 50 == 0:  # each appender its own channel (a start supersedes the caller's live call there)
            document |= {"caller": CALLER, "channel": f"phone-{tag}"}
        await services.transcripts.append(shop, conversation, document)
        count += 1
    return count


async def measure_service(url: str, smoke: bool) -> dict[str, Any]:
    services = build_services(Settings(pseudonym_key=PSEUDONYM_KEY, store_url=url, store_timeout=10.0))
    await services.store.open()
    try:
        shop, _ = await services.projects.apply("shop", CONFIG, actor="bench")
        other, _ = await services.projects.apply("other", CONFIG, actor="bench")
        await services.memory.patch(other, READER, {"cheese": "gouda"})
        # The CPU of one whole append (after a first one that starts the conversation).
        first = {k: v for k, v in body("one").items() if k != "_"} | {"caller": CALLER, "channel": "phone"}
        await services.transcripts.append(shop, "cpu-0", first | {"channel": "cpu-0"})
        append_ms = []
        for i in range(1 if smoke else 5):
            document = {k: v for k, v in body("one").items() if k != "_"} | {
                "caller": CALLER,
                "channel": f"cpu-{i}",
            }
            began = time.process_time()
            await services.transcripts.append(shop, f"cpu-{i + 1}", document)
            append_ms.append((time.process_time() - began) * 1000)
        settle_heap()  # what the service does once it listens (gc.freeze, its thresholds)
        runs = 2 if smoke else 5
        seconds = 0.5 if smoke else 4.0
        rate = 200.0
        pairs = []
        await tenant_reads(services, other, READER, rate, seconds / 4)  # warm up
        for run in range(runs):
            alone = await tenant_reads(services, other, READER, rate, seconds)
            measured: dict[str, Any] = {}
            for arm, digits in (("digits", True), ("words", False)):
                stop = asyncio.Event()
                tag = f"r{run}-{arm}"
                loaders = [
                    asyncio.create_task(appender(services, shop, f"{tag}-{k}", stop, digits))
                    for k in range(2)
                ]
                await asyncio.sleep(0.05)
                beside = await tenant_reads(services, other, READER, rate, seconds)
                stop.set()
                measured[arm] = (percentile(beside, 0.99) * 1000, sum(await asyncio.gather(*loaders)))
            a = percentile(alone, 0.99) * 1000
            (b, appends), (w, word_appends) = measured["digits"], measured["words"]
            pairs.append(
                {
                    "alone_p99_ms": a,
                    "beside_p99_ms": b,
                    "ratio": b / a,
                    "appends_beside": appends,
                    "beside_words_p99_ms": w,
                    "ratio_words": w / a,
                    "appends_words": word_appends,
                }
            )
            print(
                f"  tenant run {run}: p99 alone {a:.2f} ms, beside digit appends {b:.2f} ms ({b / a:.2f}x, "
                f"{appends}), beside word appends {w:.2f} ms ({w / a:.2f}x, {word_appends})",
                flush=True,
            )
        ratio = statistics.median(p["ratio"] for p in pairs)
        words = statistics.median(p["ratio_words"] for p in pairs)
        return {
            "append_cpu_ms": {"median": statistics.median(append_ms), "runs": append_ms},
            "tenant": {
                "rate_per_s": rate,
                "appenders": 2,
                "seconds": seconds,
                "runs": pairs,
                "median_ratio": ratio,
                "median_ratio_words": words,
            },
        }
    finally:
        await services.store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--output", type=Path, default=BENCH / "results" / "redaction.json")
    args = parser.parse_args()
    started = os.getloadavg()
    print("redaction CPU, 64 KiB:", flush=True)
    cpu = measure_cpu(args.smoke)
    worst = max(max(v["every_ms"], v["own_only_ms"]) for v in cpu.values())
    worst_default = max(v["every_ms"] for v in cpu.values())
    with RedisServer() as server:
        service = asyncio.run(measure_service(server.url, args.smoke))
    ratio = service["tenant"]["median_ratio"]
    result = {
        "commit": commit(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_start": started,
            "load_end": os.getloadavg(),
            "phonenumbers": phonenumbers.__version__,
        },
        "regions": REGIONS,
        "cpu_64k": cpu,
        "worst_cpu_ms": {"every": worst_default, "any_mode": worst},
        **service,
        "targets": {
            "worst_cpu_ms": {"target": TARGET_CPU_MS, "value": worst, "pass": worst <= TARGET_CPU_MS},
            "tenant_ratio": {
                "target": TARGET_TENANT_RATIO,
                "value": ratio,
                "pass": ratio <= TARGET_TENANT_RATIO,
            },
        },
        "smoke": args.smoke,
    }
    if not args.smoke or args.output != BENCH / "results" / "redaction.json":
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    for name, target in result["targets"].items():
        verdict = "PASS" if target["pass"] else "FAIL"
        print(f"{name}: {target['value']:.2f} (target {target['target']}): {verdict}")


if __name__ == "__main__":
    main()
