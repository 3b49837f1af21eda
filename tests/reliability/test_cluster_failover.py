"""A Redis Cluster primary killed under a load of end-of-call writes: no acknowledged write is lost.

A real cluster (3 primaries, 3 replicas, the shipped ``deploy/redis.conf`` plus ``cluster-node-timeout
1000``) and the service as a real process. Ends of conversations are written continuously; the primary that
holds the project's analytics (so every end of a conversation touches it) is killed with SIGKILL. Its
replica takes over, the service finds the new primary by itself (no restart), and the crashed node is
started again as a supervisor would: it comes back as a replica of the new primary.

On a cluster the store acknowledges a write only once ``WAIT`` says a replica has it, so the promoted
replica holds every acknowledged write. While the shard has no replica (after the failover, before the
crashed node is back in sync) its writes are refused with 503: acknowledging them would promise what one
more crash could break. Every failed write is then retried, as the SDK does, and applied exactly once.

The numbers (acknowledged, failed, lost, failover and recovery times) are printed and written to
``test-artifacts/cluster-failover.json``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from caller_memory.service.storage.redis import keys

from tests.reliability.crash_load import (
    PROJECT,
    Load,
    Outcome,
    conversations_counted,
    create_project,
    end_call,
    retry_all,
    stored_values,
    value,
)
from tests.support.redis_cluster import RedisCluster
from tests.support.service_process import ServiceProcess

ACKED_BEFORE_KILL = 150
ACKED_AFTER_RECOVERY = 150
#: Writes refused while the promoted replica has no replica of its own (the test waits for this many).
REFUSED_WITHOUT_REPLICA = 10
CONNECTION_ERRORS = {"ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "TimeoutError"}
REPORT = Path(__file__).resolve().parents[2] / "test-artifacts" / "cluster-failover.json"


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    """A cluster of its own: this test kills one of its nodes."""
    with RedisCluster() as cluster:
        with cluster.nodes[0].client() as client:
            # The nodes run with the shipped durability settings, not with the helper's defaults.
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
            assert client.config_get("cluster-node-timeout") == {"cluster-node-timeout": "1000"}
        yield cluster


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


class Timed:
    """When each write was sent and answered (monotonic seconds), around :func:`end_call`."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str) -> None:
        self.session, self.base_url, self.token = session, base_url, token
        self.sent: dict[int, float] = {}
        self.answered: dict[int, float] = {}

    async def __call__(self, i: int) -> Outcome:
        self.sent[i] = time.monotonic()
        outcome = await end_call(self.session, self.base_url, self.token, i)
        self.answered[i] = time.monotonic()
        return outcome


def acknowledged(outcome: Outcome) -> bool:
    return outcome == 200


def causes(service_log: str) -> Counter[str]:
    """Why the service answered 503, from its log (one line per failed request)."""
    found: Counter[str] = Counter()
    for line in service_log.splitlines():
        if " failed: " not in line:
            continue
        if "did not confirm" in line:
            found["no replica confirmed the write (WAIT)"] += 1
        elif "cluster is down" in line:
            found["CLUSTERDOWN (failover in progress)"] += 1
        elif "connecting to" in line or "Connection" in line:
            found["connection refused or lost (the killed primary)"] += 1
        elif " within " in line:
            found["store call timed out"] += 1
        else:
            found[line.split(" failed: ", 1)[1][:80]] += 1
    return found


async def test_a_killed_primary_fails_over_and_no_acknowledged_write_is_lost(
    cluster: RedisCluster, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    victim = cluster.primary_of(keys.analytics_index_key(PROJECT, None))
    replica = cluster.replica_of(victim)
    with ServiceProcess(cluster.url, tmp_path) as service:
        token = create_project(service.url)
        timed = Timed(session, service.url, token)
        load = Load(timed, acknowledged)
        load.start()
        await load.wait_for(succeeded=True, count=ACKED_BEFORE_KILL)

        killed_at = time.monotonic()
        victim.kill()
        load.killed()
        await asyncio.to_thread(cluster.wait_for_failover, victim)
        failover_s = time.monotonic() - killed_at
        assert replica.info("replication")["role"] == "master"

        # The promoted replica has no replica: its writes are refused, not acknowledged unreplicated.
        load.phase = "no replica"
        await load.wait_for(succeeded=False, count=REFUSED_WITHOUT_REPLICA, phase="no replica")
        acked_without_replica = load.count(succeeded=True, phase="no replica")

        restarted_at = time.monotonic()
        load.phase = "restarting"
        await asyncio.to_thread(victim.start)  # what a supervisor does: same port, same directory
        await asyncio.to_thread(cluster.wait_until_ready)  # it is back, as the new primary's replica
        assert victim.info("replication")["role"] == "slave"
        load.phase = "after"
        await load.wait_for(succeeded=True, count=ACKED_AFTER_RECOVERY, phase="after")
        await load.stop()

        outcomes = load.outcomes()
        unexpected = {o: n for o, n in outcomes.items() if o not in {200, 503, *CONNECTION_ERRORS}}
        assert not unexpected, (
            f"answers that are neither an acknowledgement nor a clear failure: {unexpected}"
        )
        assert acked_without_replica == 0, "a write was acknowledged while its shard had no replica"

        acked = load.ids(succeeded=True)
        read = await stored_values(session, service.url, acked)
        lost = [i for i in acked if read[i] != value(i)]

        failed = load.ids(succeeded=False)
        # The first write acknowledged among those sent after the kill: the service works again.
        after_kill = [i for i in acked if timed.sent[i] > killed_at]
        recovered_s = min(timed.answered[i] for i in after_kill) - killed_at
        why = causes(service.log_path.read_text())
        report = {
            "writes": len(load.results),
            "acknowledged": len(acked),
            "failed": len(failed),
            "failed_by_outcome": {str(o): n for o, n in Counter(load.results[i].outcome for i in failed).items()},
            "in_flight_at_kill": {str(o): n for o, n in Counter(r.outcome for r in load.results.values() if r.in_flight_at_kill).items()},
            "failed_because": dict(why),
            "lost": len(lost),
            "failover_s": round(failover_s, 2),
            "refused_while_no_replica": load.count(succeeded=False, phase="no replica"),
            "crashed_node_restarted_at_s": round(restarted_at - killed_at, 2),
            "first_acknowledged_write_after_the_kill_s": round(recovered_s, 2),
        }  # fmt: skip
        print(f"\ncluster failover: {json.dumps(report)}\nload: {load.summary()}")
        REPORT.parent.mkdir(exist_ok=True)
        REPORT.write_text(json.dumps(report, indent=2) + "\n")
        assert not lost, f"{len(lost)} acknowledged writes are missing after the failover, e.g. {lost[:10]}"
        assert why["no replica confirmed the write (WAIT)"] > 0  # the refusals were the replication check's
        assert recovered_s > restarted_at - killed_at  # nothing acknowledged before a replica was back

        # A failed write may or may not have been applied; the client's retry settles it, exactly once.
        retried = await retry_all(session, service.url, token, failed)
        retry_outcomes = Counter(retried)
        print(f"retries of the {len(failed)} failed writes: {dict(retry_outcomes)}")
        assert set(retried) <= {200, "replayed"}, retry_outcomes
        read = await stored_values(session, service.url, failed)
        assert all(read[i] == value(i) for i in failed)
        assert await conversations_counted(session, service.url) == len(load.results)
