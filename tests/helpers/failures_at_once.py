"""A pytest plugin (`-p tests.helpers.failures_at_once`): a failing test's traceback printed the moment it fails, not
in the summary at the end, so a run its time limit cuts off (scripts/gpu_check.py) still says why the tests before
the cut failed."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n--- {report.nodeid} failed ({report.when}):\n{report.longreprtext[-8000:]}\n---", flush=True)
