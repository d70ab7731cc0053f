"""A pytest plugin (gpu_check.sh: ``-p report_now``): failures reported the moment they happen (on the controller under xdist), so a GPU run cut
short by its time limit still names them and keeps their tracebacks (the second H200 run ended
with three failures and no names: -q prints them only at the end)."""
import sys


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stderr.write(f"\n!!! FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
        sys.stderr.flush()
