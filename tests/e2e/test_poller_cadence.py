"""The adaptive poller in a real Envoy (issue #19): an idle, unchanged pod is scraped at the idle
interval and is still routable (not stale) between its slow scrapes; a pod whose load keeps moving
is scraped at the fast interval.

Scrapes are counted per pod from Envoy's admin /clusters (`inference_pool_metrics::<ip:port>::
rq_total`). The bounds compare counts, with wide margins for a loaded machine; no timing is
asserted.
"""
import re
import time

import pytest
import requests

from harness import Envoy, Sim, endpoint, picker_config

FAST_MS, IDLE_MS = 200, 1600


def scrapes(envoy: Envoy) -> dict[str, int]:
    text = requests.get(envoy.admin + "/clusters", timeout=5).text
    out = {}
    for m in re.finditer(r"^inference_pool_metrics::([\d.]+:\d+)::rq_total::(\d+)$", text, re.M):
        out[m.group(1)] = int(m.group(2))
    return out


@pytest.fixture(scope="module")
def pool():
    a, b = Sim("a"), Sim("b")
    cfg = picker_config([endpoint(a), endpoint(b)])
    # stale_after_ms below the idle interval: without the per-pod staleness limit, idle pods
    # would go stale between their scrapes and requests would get 503.
    cfg["poller"] = {"interval_ms": FAST_MS, "idle_interval_ms": IDLE_MS, "timeout_ms": 500,
                     "stale_after_ms": 1000}
    envoy = Envoy(cfg, concurrency=1)
    try:
        envoy.wait_routable()
        yield envoy, a, b
    finally:
        envoy.stop()
        a.stop()
        b.stop()


def test_idle_pods_back_off_stay_routable_and_a_moving_pod_is_polled_fast(pool):
    envoy, a, b = pool
    # Back-off 200, 400, 800, 1600 ms: ~3 s; then a 4 s window of idle.
    time.sleep(4.5)
    s0 = scrapes(envoy)
    time.sleep(4.0)
    s1 = scrapes(envoy)
    idle = {k: s1.get(k, 0) - s0.get(k, 0) for k in (a.address, b.address)}
    # Fixed polling would make 20 per pod; the idle cadence about 2.5.
    assert all(1 <= n <= 6 for n in idle.values()), idle

    # Between slow scrapes (and more than stale_after_ms after one), pods are still fresh.
    codes = [envoy.chat(content=f"idle {i}").status_code for i in range(6)]
    assert codes == [200] * 6, codes

    # b's load moves every ~250 ms for 4 s: it is scraped at the fast interval again.
    time.sleep(4.0)  # a and b idle again after those requests
    s0 = scrapes(envoy)
    deadline = time.time() + 4.0
    k = 0
    while time.time() < deadline and k < 40:
        b.fake_load(wait=False, queue=k % 5 + 1, running=2, kv=0.3)
        k += 1
        time.sleep(0.25)
    s1 = scrapes(envoy)
    moving = s1.get(b.address, 0) - s0.get(b.address, 0)
    quiet = s1.get(a.address, 0) - s0.get(a.address, 0)
    assert moving >= 8 and quiet <= 6 and moving >= 2 * quiet, (moving, quiet)
