"""Whether the Hugging Face hub can be reached, asked once before a hub id (a model or a dataset)
is handed to transformers or datasets.

Their clients retry an unreachable hub with back-off: offline, ``kvcalib search --model mistral-7b``
printed six "Retrying in Ns" lines over 23 s before its one-line error. One HEAD request to the
endpoint, bounded by :data:`PROBE_TIMEOUT_S` (name resolution included), says the same at once;
its answer is kept for the process, so a model and a dataset from the hub probe once.
"""

from __future__ import annotations

import functools
import os
import threading
import urllib.error
import urllib.request

__all__ = ["PROBE_TIMEOUT_S", "cached", "endpoint", "offline_requested", "probe", "unreachable"]

PROBE_TIMEOUT_S = 3.0  # the hub answers a HEAD in well under a second; a dead link must fail in seconds


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline_requested() -> bool:
    """HF_HUB_OFFLINE (or the datasets / transformers spelling) is set: the clients read their
    caches only and never retry, so no probe is needed."""
    return any(_env_true(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def probe(url: str, timeout: float) -> str | None:
    """None if ``url`` answers at all (any HTTP status) within ``timeout``, else the reason.

    Runs in a daemon thread so that a slow DNS lookup cannot hold us past the timeout
    (``urlopen``'s timeout does not cover name resolution). Honours proxy variables.
    """
    result: list[str | None] = ["no answer within %.0f s" % timeout]

    def run() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result[0] = None
        except urllib.error.HTTPError:
            result[0] = None  # it answered: reachable
        except (urllib.error.URLError, OSError, ValueError) as err:
            result[0] = str(getattr(err, "reason", err))

    thread = threading.Thread(target=run, name="kvcalib-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return result[0]


@functools.lru_cache(maxsize=None)
def _unreachable(url: str) -> str | None:
    return probe(url, PROBE_TIMEOUT_S)


def unreachable() -> str | None:
    """None when the hub's endpoint answers, else why not ("<endpoint> is unreachable (reason)");
    probed once per endpoint and process."""
    reason = _unreachable(endpoint())
    return None if reason is None else f"{endpoint()} is unreachable ({reason})"


def cached(repo_id: str, filename: str = "config.json") -> bool:
    """The local Hugging Face cache (HF_HOME) holds ``filename`` of model ``repo_id``."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, filename), str)
