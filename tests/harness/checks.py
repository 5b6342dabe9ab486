"""What the vLLM tests check, said once: prompts, transfer parameters, greedy comparison,
counter deltas, and an engine holding nothing."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from harness.offline import Gen, OfflineEngine, Req
from harness.pool import LEASE_S

MAX_TOKENS = 8
# Per token, every layer, all ranks together: qwen2 (k, v) * 2 kv heads * head_dim 32 * bf16 *
# 2 layers; mla one 576-wide latent * bf16 * 2 layers (the same on every rank).
KV_BYTES_PER_TOKEN = {"qwen2": 2 * 2 * 32 * 2 * 2, "mla": 576 * 2 * 2}


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Random token ids 3..499 (no special tokens: 0..2), one prompt per length."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def salt() -> str:
    """A fresh prefix-cache salt: a request with it hits nothing an earlier one cached."""
    return uuid.uuid4().hex


def prefill_params(transfer_id: str | None = None) -> dict[str, Any]:
    """P's side of a transfer (what the proxy sends P)."""
    return {"do_remote_decode": True, "transfer_id": transfer_id or str(uuid.uuid4())}


def pull_params(rpc_address: str, transfer_id: str | None = None) -> dict[str, Any]:
    """D's side before P answered (parallel dispatch, or a P that is gone)."""
    return {
        "do_remote_prefill": True,
        "transfer_id": transfer_id or str(uuid.uuid4()),
        "remote_rpc_address": rpc_address,
    }


def prefill(p: OfflineEngine, batch: list[list[int]]) -> list[dict[str, Any]]:
    """Prefill on P (one token, fresh salt); the params P answers, for D."""
    outs = p.generate(batch, 1, [prefill_params() for _ in batch], salt=salt())
    params = [o.kv_transfer_params for o in outs]
    assert all(param is not None for param in params)
    return params  # type: ignore[return-value]


def pd(p: OfflineEngine, d: OfflineEngine, batch: list[list[int]], d_salt: str | None = None):
    """P prefills, D pulls and decodes MAX_TOKENS; D's outputs."""
    return d.generate(batch, MAX_TOKENS, prefill(p, batch), salt=d_salt or salt())


def reference(engine: OfflineEngine, batch: list[list[int]]) -> list[Gen]:
    """One instance computing it all (fresh salt: no prefix hit, no transfer)."""
    return engine.generate(batch, MAX_TOKENS, salt=salt())


def submit_pulls(d: OfflineEngine, batch: list[list[int]], rpc_address: str, transfer_ids=None):
    tids = transfer_ids or [str(uuid.uuid4()) for _ in batch]
    reqs = [
        Req(prompt, MAX_TOKENS, pull_params(rpc_address, tid), salt())
        for prompt, tid in zip(batch, tids, strict=True)
    ]
    return d.submit(reqs), tids


def copied_tokens(num_tokens: int, p_bs: int, d_bs: int, first_block: int = 0) -> int:
    """Tokens the mapping moves: from D's first new block to num_tokens rounded up to the copy
    unit, a sub-block of the smaller block size."""
    unit = min(p_bs, d_bs)
    return -(-num_tokens // unit) * unit - first_block * d_bs


def delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Re-ask a child process until probe() is truthy (its state lives in another process and
    sends no event), backing off from 10 ms to 0.5 s."""
    deadline, delay = time.monotonic() + timeout, 0.01
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def wait_for_sends(engine: OfflineEngine, before: dict[str, int], sends: int) -> None:
    """Wait until ``engine`` counted ``sends`` more completed sends than in ``before``. D's
    report frees P's blocks before P's kvt send completes, so an idle engine may still count a
    send or two, which would then land in the next test's deltas."""

    def counted() -> bool:
        after = engine.counters()
        return delta(after, before, "sends_done") + delta(after, before, "sends_failed") >= sends

    wait_for(f"{engine.name} to count {sends} sends", counted)


def held_blocks(engine: OfflineEngine) -> int:
    s = engine.stats()
    return s["total_blocks"] - s["free_blocks"]


def assert_idle(*engines: OfflineEngine) -> None:
    """No request left and every block back in the free pool."""
    for engine in engines:

        def idle(engine: OfflineEngine = engine) -> bool:
            s = engine.stats()
            return s["requests"] == 0 and s["free_blocks"] == s["total_blocks"]

        wait_for(f"{engine.name} to hold no blocks", idle, timeout=LEASE_S + 20)


def assert_same_greedy(got: list[Gen], want: list[Gen], *, near_tie: bool) -> None:
    """Token for token; with ``near_tie``, as vLLM's own tests compare models
    (``check_logprobs_close``): equal up to the first divergence, and there each side's token is
    in the other's top logprobs."""
    for one, ref in zip(got, want, strict=True):
        assert len(one.token_ids) == len(ref.token_ids)
        if not near_tie:
            assert one.token_ids == ref.token_ids
            continue
        for i, (a, b) in enumerate(zip(one.token_ids, ref.token_ids, strict=True)):
            if a != b:
                assert a in ref.logprobs[i], (i, one.token_ids, ref.token_ids)
                assert b in one.logprobs[i], (i, one.token_ids, ref.token_ids)
                break


def assert_kvs_clean(store: Any, before: Any, *engines: OfflineEngine) -> None:
    """After a KVS test: the engines idle, no save holding vLLM's blocks, and the store back to
    ``before`` (its ``stats()`` at the test's start): no hold left for a load (they end with
    the loads, well within ``hold_s``: they do not lapse), no object leased, reserved or
    pinned that was not, and as many client connections and key subscribers as before (every
    client the connectors made for the test, closed or kept, none added)."""
    assert_idle(*engines)
    for engine in engines:
        assert engine.stats()["kvs"]["pending_saves"] == 0

    def back() -> bool:
        now = store.stats()
        return (
            now.held == 0
            and (now.leased, now.reserved, now.pinned)
            == (before.leased, before.reserved, before.pinned)
            and (now.clients, now.subscribers) == (before.clients, before.subscribers)
        )

    try:
        wait_for("the store back to its counts before the test", back, timeout=15)
    except AssertionError:
        now = store.stats()
        fields = ("held", "leased", "reserved", "pinned", "clients", "subscribers")
        # Whose holds: each engine's lookups count the objects they hold in the store.
        holds = {e.name: e.stats()["kvs"]["store_holds"] for e in engines}
        raise AssertionError(
            "the store did not come back: "
            + ", ".join(f"{f} {getattr(before, f)} -> {getattr(now, f)}" for f in fields)
            + f"; objects the engines' lookups hold: {holds}"
        ) from None
