"""Two gateway replicas in front of one pool do not herd (`peers`, src/poll/peers.rs), in real
Envoy 1.40 running the built .wasm.

Two Envoys, each listing the other as its peer, route to the same three pods. A hot prefix's
burst is sent through both, alternating: every request shares one long system prompt. Each pod
parks what it receives (`Sim.hold`), so every request stays in flight and shows in the pods'
/metrics as an engine would queue it. The burst must be spread over more than one pod: neither
replica may keep piling onto the prefix's first holder because it cannot see what the other
sent there. A cold prompt sent after it must still go to the least-loaded pod.

Each request is sent only when the one before it is parked, so each pick follows the last one
as in a burst, and every wait is bounded and on an event.

What a replica knows of the other's requests here: their placements (`peers`, every 200 ms) and
the pods' scraped counts. It does not know the prefill the other queued on a pod until its
requests show in a scrape, and a scrape does not tell prefill from decode; so the split between
holders is uneven (docs/peers.md, "What a replica does not see"), but the burst never stays on
one pod.
"""
import concurrent.futures as cf

from harness import Envoy, Sim, endpoint, free_port, picker_config, stop_each, wait_until

TOKEN = "e2e-replica-token-0123456789"
SERVED = "x-gateway-destination-endpoint-served"
BURST = 24


def _config(sims, peer_port):
    cfg = picker_config(
        [endpoint(s) for s in sims],
        filter={"expose_served_endpoint": True},
        peers={"addresses": [f"127.0.0.1:{peer_port}"], "token": TOKEN, "interval_ms": 200,
               "timeout_ms": 200},
    )
    # Two gateway replicas poll the pool (the estimate of what the other one sent scales with it).
    cfg["poller"]["replicas"] = 2
    return cfg


def _held(sims) -> dict:
    return {s.address: s.held() for s in sims}


def test_a_hot_prefix_burst_through_two_replicas_is_spread_and_a_cold_prompt_finds_the_idle_pod():
    sims = [Sim(f"replica-{i}") for i in range(3)]
    port_a, port_b = free_port(), free_port()
    a = b = None
    pool = cf.ThreadPoolExecutor(BURST + 1)
    try:
        a = Envoy(_config(sims, port_b), port=port_a)
        b = Envoy(_config(sims, port_a), port=port_b)
        a.wait_routable()
        b.wait_routable()
        for s in sims:
            s.hold()
        system = "You are a support agent for a large retailer. Policies: " + "be kind and exact. " * 400
        sent = []
        for i in range(BURST):
            replica = a if i % 2 == 0 else b
            sent.append(pool.submit(replica.chat, content=f"{system}\nCustomer {i}: where is my order?",
                                    max_tokens=4))
            wait_until(lambda: sum(_held(sims).values()) == i + 1, 30, f"request {i} of the burst parked")
        held = _held(sims)
        assert sum(1 for n in held.values() if n > 0) > 1, f"the whole burst herded onto one pod: {held}"
        # Both replicas see every pod's queue as its /metrics reports it now: the two pollers
        # share the scrapes (`poller.replicas` 2), and 4 of them could all be one poller's, so
        # wait for enough that each has scraped every pod since the burst parked.
        for s in sims:
            s.wait_scraped(n=12, timeout=30)
        least = min(held.values())
        cold = pool.submit(a.chat, content="Translate 'good morning' into French.", max_tokens=4)
        wait_until(lambda: sum(_held(sims).values()) == BURST + 1, 30, "the cold prompt parked")
        after = _held(sims)
        target = next(addr for addr in after if after[addr] == held[addr] + 1)
        assert held[target] == least, f"the cold prompt went to {target}, load before it {held}"
        for s in sims:
            s.release()
        for f in sent + [cold]:
            r = f.result(timeout=60)
            assert r.status_code == 200, r.text
        assert cold.result().headers[SERVED] == target
    finally:
        for s in sims:
            try:
                s.release()
            except Exception:
                pass
        pool.shutdown(wait=False, cancel_futures=True)
        stop_each(a, b, sims)
