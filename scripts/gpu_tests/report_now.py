"""A pytest plugin (gpu_check.sh: ``-p report_now``): failures reported the moment they happen (on the controller under xdist), so a GPU run cut
short by its time limit still names them and keeps their tracebacks (the second H200 run ended
with three failures and no names: -q prints them only at the end). With ``GPU_TESTS_PASSED`` set
(gpu_check.sh: ``$RES/tests-passed.txt``) every passed test's id is appended to that file as it
passes, so a cut run also says which tests did pass (-q prints only dots)."""
import os
import sys


_WORKER = []


def pytest_configure(config):
    _WORKER.append(hasattr(config, "workerinput"))   # an xdist worker (the controller sees every worker's reports)


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stderr.write(f"\n!!! FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
        sys.stderr.flush()
    elif report.passed and report.when == "call" and os.environ.get("GPU_TESTS_PASSED") and not any(_WORKER):
        with open(os.environ["GPU_TESTS_PASSED"], "a") as f:
            f.write(report.nodeid + "\n")
