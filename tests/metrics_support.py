"""Reading a daemon's Prometheus endpoint in tests (it may take a moment to come up)."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str, timeout: float = 10.0) -> list:
    """The samples served at ``http://ADDRESS/metrics``, retried until the server answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
                text = r.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]
