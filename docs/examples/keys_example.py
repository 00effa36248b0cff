"""Key templates and the keys they render: ``python keys_example.py`` checks every line below."""

from celery_singleflight import SingleFlightTask, hold

from proj import app, sync_account


# --8<-- [start:templates]
@app.task(base=SingleFlightTask, lock_key="report:<tenant>:<year>")
def build_report(tenant, year, fmt="pdf"):
    ...


@app.task(base=SingleFlightTask, lock_key="invoice:<invoice.id>")  # a field of a dict argument
def charge(invoice):
    ...


@app.task(base=SingleFlightTask, lock_key="cleanup:<@task>")  # the task's own name
def nightly_cleanup():
    ...


@app.task(base=SingleFlightTask, lock_key=lambda tenant, **options: f"tenant:{tenant.lower()}")
def reindex(tenant, full=False):
    ...


@app.task(base=SingleFlightTask, lock_key="pair:<a>-<b>")  # a separator a value may hold
def pair(a, b):
    ...
# --8<-- [end:templates]


def main():
    # --8<-- [start:render]
    assert sync_account.render_key(42) == "sync:42"
    assert sync_account.render_key(account_id=42) == "sync:42"  # positional or keyword: one key
    assert sync_account.render_key(42, pages=9) == "sync:42"  # parameters not in the template do not count
    assert sync_account.render_key("42") == 'sync:"42"'  # a string is not the number 42
    assert build_report.render_key("acme", 2026) == "report:acme:2026"  # a name-like string renders bare
    assert build_report.render_key("a:b", 1) == 'report:"a:b":1'  # others keep their JSON quotes
    assert build_report.render_key("true", 1) == 'report:"true":1'  # as does a string that reads as JSON
    assert charge.render_key({"id": 7, "amount": 10}) == "invoice:7"
    assert nightly_cleanup.render_key() == f"cleanup:{nightly_cleanup.name}"  # "cleanup:<module>.<name>"
    assert reindex.render_key("ACME") == "tenant:acme"
    assert pair.render_key("x-y", "z") == 'pair:"x-y"-z'  # a value holding its separator keeps its quotes
    assert pair.render_key("x", "y-z") == "pair:x-y-z"
    # --8<-- [end:render]

    # --8<-- [start:hold]
    key = build_report.render_key("acme", 2026)  # "report:acme:2026", as a person would type it
    with hold(app, key, wait=0) as lease:  # build_report("acme", 2026) cannot run meanwhile
        assert build_report.status("acme", 2026).task_id == lease.holder  # status by the task's arguments
        print(f"holding {lease.key} with fence {lease.fence}")
    # --8<-- [end:hold]
    return key


if __name__ == "__main__":
    main()
