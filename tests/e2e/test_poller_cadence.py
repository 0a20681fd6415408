"""The adaptive poller in a real Envoy (issue #19): an idle, unchanged pod is scraped at the idle
interval and is still routable (not stale) between its slow scrapes; a pod whose load keeps moving
is scraped at the fast interval.

No clock of the test's own is used. The clock is a third pod, `clock`, whose load moves at every
scrape (the simulator's `fake-load` with `vary`: its waiting count differs from one /metrics
answer to the next), so the poller scrapes it at the fast interval throughout. Cadences are
compared within one window of the clock's scrapes, counted by the simulators (`/sim/stats`
`metrics_scrapes_total`): an idle pod at 1600 ms is scraped about once per 8 clock scrapes, a
pod polled fast about once per clock scrape. The bounds are a factor of 2 wide of either, so
a loaded machine, which delays every scrape alike, does not decide them.
"""
import pytest

from harness import Envoy, Sim, endpoint, picker_config, wait_until

FAST_MS, IDLE_MS = 200, 1600
# Below the idle interval, so that an idle pod's last scrape is often older than this: without
# the per-pod staleness limit (poll_ms + stale_after_ms / 2), idle pods would go stale between
# their scrapes and requests would avoid them.
STALE_MS = 600
# The clock's scrapes in one counting window: ~4.8 s at the fast interval.
WINDOW = 24


def scraped(sim: Sim) -> int:
    return sim.stats()["metrics_scrapes_total"]


def counts_over_window(clock: Sim, pods: list[Sim], n: int = WINDOW) -> list[int]:
    """How many times each pod is scraped while `clock` is scraped `n` times."""
    start = [scraped(p) for p in pods]
    clock.wait_scraped(n=n, timeout=60)
    return [scraped(p) - s for p, s in zip(pods, start)]


def wait_backed_off(clock: Sim, pods: list[Sim], gap: int = 5) -> None:
    """Waits (bounded) until each pod has gone `gap` clock scrapes (~1 s) without a scrape of its
    own, i.e. its interval has grown well past the fast one."""
    last = {p.name: (scraped(p), scraped(clock)) for p in pods}

    def quiet():
        now = scraped(clock)
        ok = True
        for p in pods:
            n = scraped(p)
            if n != last[p.name][0]:
                last[p.name] = (n, now)
            ok = ok and now - last[p.name][1] >= gap
        return ok
    wait_until(quiet, 60, f"{[p.name for p in pods]} backed off (no scrape in {gap} clock scrapes)", interval=0.02)


@pytest.fixture(scope="module")
def pool():
    a, b, clock = Sim("a"), Sim("b"), Sim("clock")
    cfg = picker_config([endpoint(a), endpoint(b), endpoint(clock)])
    cfg["poller"] = {"interval_ms": FAST_MS, "idle_interval_ms": IDLE_MS, "timeout_ms": 500,
                     "stale_after_ms": STALE_MS}
    # The clock looks busy (never picked while a or b is fresh) and its load moves at every scrape.
    clock.fake_load(wait=False, queue=8, running=4, kv=0.5, vary=True)
    # b looks a little busier than a, constantly: a request goes to a while a is fresh.
    b.fake_load(wait=False, queue=1)
    envoy = Envoy(cfg, concurrency=1)
    try:
        envoy.wait_routable()
        yield envoy, a, b, clock
    finally:
        envoy.stop()
        a.stop()
        b.stop()
        clock.stop()


def test_idle_pods_back_off_stay_routable_and_a_moving_pod_is_polled_fast(pool):
    envoy, a, b, clock = pool
    # Back-off 200, 400, 800, 1600 ms once the warm-up request has finished.
    wait_backed_off(clock, [a, b])
    idle = counts_over_window(clock, [a, b])
    print(f"\nidle a, b: {idle} scrapes in {WINDOW} clock scrapes")
    # Fixed polling would scrape them as often as the clock (~WINDOW); the idle cadence about
    # WINDOW / 8. Still scraped: the window is at least WINDOW × 175 ms (the fast interval less
    # its jitter), over two idle intervals.
    assert all(1 <= n <= WINDOW // 2 for n in idle), idle

    # a is fresh although its last scrape is older than stale_after_ms: a request sent now goes
    # to a (idle, and less loaded than b), not to b or the clock. 4 clock scrapes since a's last
    # scrape are at least 700 ms; a's next one is due ~1400-1600 ms after it.
    wait_backed_off(clock, [a], gap=4)
    r = envoy.chat(content="idle probe")
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "a", r.json()["served_by"]
    codes = [envoy.chat(content=f"idle {i}").status_code for i in range(5)]
    assert codes == [200] * 5, codes

    # b's load now moves at every scrape: it is scraped at the fast interval again, a is not.
    b.fake_load(wait=False, queue=1, vary=True)
    wait_backed_off(clock, [a])  # a idle again after the requests it served
    b.wait_scraped(n=2, timeout=30)  # b's first scrape since the change (at most one idle interval later)
    moving, quiet = counts_over_window(clock, [b, a])
    print(f"moving b: {moving}, quiet a: {quiet} scrapes in {WINDOW} clock scrapes")
    assert moving >= WINDOW // 2 and quiet <= WINDOW // 2 and moving >= 2 * quiet, (moving, quiet)
