"""Click "sync now" twice: the second sync is skipped, and the first can be followed by key.

Run it beside a worker: ``python quickstart_client.py``.
"""

import time

import celery_singleflight as sf

from proj import app, sync_account


def wait_until_held(key, timeout=10.0):
    """The status of ``key`` once a run holds it (a web view would poll like this)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = sf.status(app, key)
        if st is not None and st.held:
            return st
        time.sleep(0.05)
    raise TimeoutError(f"no run took {key} within {timeout}s: is a worker running?")


def main():
    first = sync_account.delay(42)
    key = sync_account.render_key(42)  # "sync:42": the key status(), watch() and the CLI take
    wait_until_held(key)

    second = sync_account.delay(42)  # the double click
    skipped = second.get(timeout=10)
    print(skipped)  # {'singleflight': 'skipped', 'key': 'sync:42', 'holder': '<first id>', 'ttl_left': 29.8}

    for event in sf.watch(app, key, timeout=30):  # history first, then live, until the run ends
        print(event.kind, event.state, event.message or "")

    done = first.get(timeout=10)
    print(done)  # {'account': 42, 'pages': 5, 'fence': 1767225600123456}
    return first.id, skipped, done


if __name__ == "__main__":
    main()
