"""A test helper: record an engine's step launches, waits and output deliveries in order."""

from collections.abc import Callable


def trace_steps(engine, log: list) -> Callable:
    """Wrap engine.runner.launch (and set engine.on_outputs) so that ("launch", n), ("wait", n)
    and ("outputs", [(request id, finished), ...]) are appended to `log` as they happen.
    Returns the original launch, to restore."""
    launch = engine.runner.launch

    def spy(sched, tables, follows=False):
        step = sum(e[0] == "launch" for e in log)
        log.append(("launch", step))
        wait = launch(sched, tables, follows)

        def traced_wait():
            log.append(("wait", step))
            return wait()

        return traced_wait

    engine.runner.launch = spy
    engine.on_outputs = lambda outs: log.append(("outputs", [(o.request_id, o.finished)
                                                             for o in outs]))  # fmt: skip
    return launch
