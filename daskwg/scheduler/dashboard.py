"""daskwg on the Dask dashboard and in Prometheus: a scheduler plugin.

:class:`DashboardPlugin` runs in the scheduler (the driver installs it next to daskwg's
other scheduler plugin). It adds two routes to the scheduler's HTTP server, beside the
Dask dashboard's own pages:

* ``<dashboard>/daskwg``: an HTML page, reloading itself, with every worker group, its
  ranks and their workers, what each rank is running (on either call path, blocking
  calls included) and for how long, the calls queued behind it and each rank's last
  error;
* ``<dashboard>/daskwg/json``: the same data as JSON (:meth:`DashboardPlugin.snapshot`).

and ``daskwg_*`` series to the scheduler's ``/metrics`` (where ``prometheus_client`` is
installed in the scheduler's environment, as Dask's own series need): calls by group,
method and outcome, a call duration histogram, ranks by state, queued calls and bytes
moved.

The data comes from the workers' ``daskwg_status`` and ``daskwg_metrics`` comm handlers
(the host plugin's) and from the groups' records in the scheduler's metadata (under
``"daskwg-groups"``, written by :class:`daskwg.WorkerGroup`).
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import time
import weakref
from typing import Any

import dask.config
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web
from tornado.ioloop import PeriodicCallback

from .. import config as _config  # noqa: F401  (loads daskwg's dask.config defaults)
from ..wire.messages import Handler
from ..wire.metrics import BUCKETS
from ..wire.records import ROOT
from .metrics import merge

__all__ = ["DashboardPlugin", "PLUGIN_NAME", "render_html"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "daskwg-dashboard"

# The scheduler-metadata key the groups publish themselves under (daskwg.groups.group).


# Plugins started in this process, newest last: /metrics is one per process (Dask's
# own collectors follow the newest scheduler too, which matters only in tests that run
# several schedulers in one process).
_started: list[weakref.ref] = []
_collector_registered = False


class DashboardPlugin(SchedulerPlugin):
    """Scheduler plugin: the ``/daskwg`` page and the ``daskwg_*`` Prometheus series.

    Installed with ``client.register_plugin(DashboardPlugin())`` (idempotent: one per
    scheduler, whatever the number of drivers). Settings (Dask config, read in the
    scheduler process): ``daskwg.dashboard.refresh`` (seconds between the page's
    reloads), ``daskwg.dashboard.metrics-interval`` (seconds between the scheduler's
    queries of the workers' counters for ``/metrics``), ``daskwg.dashboard.timeout``
    (seconds one worker has to answer before it is listed as unresponsive).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.cache: dict = {"status": None, "metrics": merge([])}
        self._periodic: PeriodicCallback | None = None
        self._refreshing = False

    async def start(self, scheduler) -> None:
        """Dask's plugin hook: add the routes, register the collector, start polling."""
        self.scheduler = scheduler
        _add_routes(scheduler)
        _register_collector()
        _started.append(weakref.ref(self))
        interval = float(dask.config.get("daskwg.dashboard.metrics-interval"))
        self._periodic = PeriodicCallback(self._refresh, interval * 1000)
        self._periodic.start()

    async def close(self) -> None:
        """Dask's plugin hook (scheduler closing): stop polling the workers."""
        if self._periodic is not None:
            self._periodic.stop()
        _started[:] = [ref for ref in _started if ref() not in (None, self)]

    def groups(self) -> dict[str, dict]:
        """The groups' records in the scheduler's metadata, by metadata key (the name, with
        the owner's client id for a non-detached group: ``daskwg.wire.records.key_of``;
        shut-down ones are ``None`` there and left out)."""
        records = self.scheduler.get_metadata([ROOT], default=None) or {}
        return {name: r for name, r in records.items() if isinstance(r, dict)}

    async def _query(self, op: str) -> tuple[dict[str, Any], list[str]]:
        """Ask every worker's ``op`` handler; ``({address: answer}, [unresponsive addresses])``.

        One query per worker, each with its own timeout, rather than
        ``scheduler.broadcast``: a worker whose event loop is blocked must not blank
        the page for all the others.
        """
        timeout = float(dask.config.get("daskwg.dashboard.timeout"))
        addresses = list(self.scheduler.workers)

        async def one(address: str) -> Any:
            return await asyncio.wait_for(getattr(self.scheduler.rpc(address), op)(), timeout)

        answers = await asyncio.gather(*(one(a) for a in addresses), return_exceptions=True)
        ok, failed = {}, []
        for address, answer in zip(addresses, answers):
            if isinstance(answer, BaseException):
                # A worker without daskwg's host plugin answers "unknown operation": skip it.
                if isinstance(answer, (asyncio.TimeoutError, OSError)):
                    failed.append(address)
            else:
                ok[address] = answer
        return ok, failed

    async def snapshot(self) -> dict:
        """What every group is doing now.

        Returns:
            ``{"time": unix seconds, "groups": [{"name", "group_id", "owner",
            "detached", "world_size", "ranks": [{"rank", "worker", "state", "method",
            "seconds", "stack", "last_error", "queued": [{"method", "seconds"}],
            "concurrent": [{"method", "concurrency_group", "seconds"}]}]}],
            "unresponsive": [worker addresses]}``; ``concurrent``: calls of named
            concurrency groups running beside the rank's ``method``. ``state`` is ``"idle"``,
            ``"running"``, ``"not hosted"`` (the worker does not hold that rank: it
            restarted, or the group is being built or shut down) or
            ``"unresponsive"``.
        """
        status, unresponsive = await self._query(Handler.STATUS)
        groups: dict[str, dict] = {}
        for name, record in self.groups().items():
            workers = list(record.get("workers") or ())
            groups[record.get("group_id", name)] = {
                # Non-detached groups' keys also hold their client (daskwg.wire.records).
                "name": record.get("name") or name,
                "group_id": record.get("group_id"),
                "owner": record.get("owner"),
                "detached": bool(record.get("detached")),
                "world_size": len(workers),
                "ranks": {
                    rank: _rank_record(
                        rank, address, "unresponsive" if address in unresponsive else "not hosted"
                    )
                    for rank, address in enumerate(workers)
                },
            }
        for address, records in status.items():
            for rec in records or ():
                group = groups.setdefault(
                    rec["group_id"],
                    {
                        "name": rec["group"],
                        "group_id": rec["group_id"],
                        "owner": None,
                        "detached": None,
                        "world_size": None,
                        "ranks": {},
                    },
                )
                rank = group["ranks"].setdefault(
                    rec["rank"], _rank_record(rec["rank"], address, "not hosted")
                )
                if rec["state"] == "queued":
                    rank["queued"].append({"method": rec["method"], "seconds": rec["seconds"]})
                    continue
                if rank["state"] == "running" and rank["worker"] == address:
                    # A call of another concurrency group, running beside the rank's first one.
                    rank["concurrent"].append(
                        {k: rec.get(k) for k in ("method", "concurrency_group", "seconds")}
                    )
                    continue
                rank.update(
                    worker=address,
                    state=rec["state"],
                    method=rec["method"],
                    seconds=rec["seconds"],
                    stack=rec["stack"],
                    last_error=rec["last_error"],
                )
        out = []
        for group in sorted(groups.values(), key=lambda g: g["name"]):
            group["ranks"] = [group["ranks"][r] for r in sorted(group["ranks"])]
            out.append(group)
        return {"time": time.time(), "groups": out, "unresponsive": sorted(unresponsive)}

    async def _refresh(self) -> None:
        """Refresh what ``/metrics`` reports (on the scheduler's event loop)."""
        last = self.cache["status"]
        if self._refreshing or not (self.groups() or (last is not None and last["groups"])):
            return  # no groups now, and the last refresh already saw none
        self._refreshing = True
        try:
            counters, _ = await self._query(Handler.METRICS)
            self.cache = {"status": await self.snapshot(), "metrics": merge(counters.values())}
        except Exception:  # noqa: BLE001 - the next round tries again
            logger.debug("daskwg metrics refresh failed", exc_info=True)
        finally:
            self._refreshing = False


def _rank_record(rank: int, worker: str, state: str) -> dict:
    return {
        "rank": rank,
        "worker": worker,
        "state": state,
        "method": None,
        "seconds": None,
        "stack": None,
        "last_error": None,
        "queued": [],
        "concurrent": [],
    }


# ---- HTTP ------------------------------------------------------------------------------


def _http_prefix(app: web.Application) -> str:
    """The prefix the scheduler's routes were given (``dask scheduler
    --dashboard-prefix``), read off its ``health`` route; ``"/"`` without one."""
    try:
        for rule in app.default_router.rules:
            for inner in getattr(rule.target, "rules", ()):
                pattern = getattr(getattr(inner.matcher, "regex", None), "pattern", "")
                if pattern.endswith("health$"):
                    return pattern[: -len("health$")] or "/"
    except Exception:  # noqa: BLE001 - tornado internals; the default is right for most
        pass
    return "/"


def _add_routes(scheduler) -> None:
    app = getattr(scheduler, "http_application", None)
    if app is None:  # a scheduler started without an HTTP server
        return
    prefix = _http_prefix(app)
    kwargs = {"scheduler": scheduler}
    app.add_handlers(
        r".*$",
        [
            (prefix + "daskwg/?", _PageHandler, kwargs),
            (prefix + "daskwg/json", _JSONHandler, kwargs),
        ],
    )


class _Handler(web.RequestHandler):
    def initialize(self, scheduler) -> None:
        self.scheduler = scheduler

    async def _snapshot(self) -> dict | None:
        plugin = self.scheduler.plugins.get(PLUGIN_NAME)
        if plugin is None:
            self.set_status(404)
            self.write("daskwg's scheduler plugin is not installed")
            return None
        return await plugin.snapshot()


class _PageHandler(_Handler):
    async def get(self) -> None:
        snap = await self._snapshot()
        if snap is not None:
            self.set_header("Content-Type", "text/html; charset=utf-8")
            refresh = float(dask.config.get("daskwg.dashboard.refresh"))
            self.write(render_html(snap, refresh, self.request.path.rstrip("/") + "/json"))


class _JSONHandler(_Handler):
    async def get(self) -> None:
        snap = await self._snapshot()
        if snap is not None:
            self.set_header("Content-Type", "application/json")
            self.write(json.dumps(snap))


_STYLE = """
body { font-family: -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; }
h2 { font-size: 1.1em; margin: 1.4em 0 0.3em; }
.meta { color: #666; font-size: 0.8em; font-weight: normal; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.8em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.running { color: #0a6; font-weight: bold; }
.idle { color: #888; }
.bad { color: #c22; font-weight: bold; }
code, pre { font-family: "DejaVu Sans Mono", monospace; font-size: 0.85em; }
pre { max-width: 60em; overflow: auto; background: #f8f8f8; padding: 0.4em; }
"""


def _seconds(value: float | None) -> str:
    if value is None:
        return ""
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    return f"{minutes // 60} h {minutes % 60} min"


def render_html(snapshot: dict, refresh: float = 2.0, json_href: str = "daskwg/json") -> str:
    """The ``/daskwg`` page for one [`DashboardPlugin.snapshot`][daskwg.scheduler.dashboard.DashboardPlugin.snapshot];
    it reloads itself every ``refresh`` seconds (``0``: never) and links to the JSON at ``json_href``."""
    e = html.escape
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>daskwg: worker groups</title>",
        f"<meta http-equiv='refresh' content='{refresh:g}'>" if refresh > 0 else "",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>daskwg worker groups</h1>",
        f"<div class='meta'>{len(snapshot['groups'])} group(s) · updated "
        f"{time.strftime('%H:%M:%S', time.localtime(snapshot['time']))}"
        + (f" · reloads every {refresh:g} s" if refresh > 0 else "")
        + f" · <a href='{e(json_href)}'>json</a></div>",
    ]
    if snapshot["unresponsive"]:
        parts.append(
            "<p class='bad'>workers that did not answer: "
            + ", ".join(e(a) for a in snapshot["unresponsive"])
            + "</p>"
        )
    if not snapshot["groups"]:
        parts.append("<p>No worker groups on this cluster.</p>")
    for group in snapshot["groups"]:
        flags = []
        if group["detached"]:
            flags.append("detached")
        if group["owner"]:
            flags.append(f"driver {e(str(group['owner']))}")
        if group["group_id"]:
            flags.append(f"id {e(str(group['group_id'])[:8])}")
        parts.append(f"<h2>{e(group['name'])} <span class='meta'>{' · '.join(flags)}</span></h2>")
        parts.append(
            "<table><tr><th>rank</th><th>worker</th><th>state</th><th>call</th><th>elapsed</th>"
            "<th>queued</th><th>last error</th></tr>"
        )
        for rank in group["ranks"]:
            state = rank["state"]
            css = {"running": "running", "idle": "idle"}.get(state, "bad")
            call = e(rank["method"] or "")
            if rank["stack"]:
                call += f"<details><summary>stack</summary><pre>{e(rank['stack'])}</pre></details>"
            for c in rank.get("concurrent", ()):
                call += (
                    f"<br>{e(str(c['method']))} <span class='meta'>({e(str(c['concurrency_group']))}, "
                    f"{_seconds(c['seconds'])})</span>"
                )
            queued = "<br>".join(f"{e(str(q['method']))} ({_seconds(q['seconds'])})" for q in rank["queued"])
            error = f"<span class='bad'>{e(rank['last_error'])}</span>" if rank["last_error"] else ""
            parts.append(
                f"<tr><td>{rank['rank']}</td><td><code>{e(str(rank['worker']))}</code></td>"
                f"<td class='{css}'>{e(state)}</td><td>{call}</td><td>{_seconds(rank['seconds'])}</td>"
                f"<td>{queued}</td><td>{error}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


# ---- Prometheus ------------------------------------------------------------------------


def _current() -> DashboardPlugin | None:
    for ref in reversed(_started):
        plugin = ref()
        if plugin is not None:
            return plugin
    return None


class _Collector:
    """A ``prometheus_client`` collector of the ``daskwg_*`` series (from the newest
    plugin's cache, refreshed every ``daskwg.dashboard.metrics-interval`` seconds)."""

    def describe(self) -> list:
        # Registering must not call collect() (the plugin may not have started yet).
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        plugin = _current()
        cache = plugin.cache if plugin is not None else {"status": None, "metrics": merge([])}
        metrics, status = cache["metrics"], cache["status"]

        groups = GaugeMetricFamily("daskwg_groups", "Worker groups on this cluster")
        ranks = GaugeMetricFamily(
            "daskwg_ranks", "Ranks of worker groups by state", labels=["group", "state"]
        )
        queued = GaugeMetricFamily(
            "daskwg_queued_calls", "Calls waiting on their worker for an earlier call", labels=["group"]
        )
        if status is not None:
            groups.add_metric([], len(status["groups"]))
            for group in status["groups"]:
                by_state: dict[str, int] = {"idle": 0, "running": 0}
                for rank in group["ranks"]:
                    by_state[rank["state"]] = by_state.get(rank["state"], 0) + 1
                for state, count in sorted(by_state.items()):
                    ranks.add_metric([group["name"], state], count)
                queued.add_metric([group["name"]], sum(len(r["queued"]) for r in group["ranks"]))
        yield groups
        yield ranks
        yield queued

        calls = CounterMetricFamily(
            "daskwg_calls",
            "Calls run on ranks, by group, method and outcome",
            labels=["group", "method", "outcome"],
        )
        for (group, method, outcome), count in sorted(metrics["calls"].items()):
            calls.add_metric([group, method, outcome], count)
        yield calls

        durations = HistogramMetricFamily(
            "daskwg_call_duration_seconds",
            "Time a rank spent running a call (from its start on the worker's host thread)",
            labels=["group", "method"],
        )
        for (group, method), (counts, total) in sorted(metrics["durations"].items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*BUCKETS, float("inf")), counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
            durations.add_metric([group, method], buckets, sum_value=total)
        yield durations

        moved = CounterMetricFamily(
            "daskwg_bytes",
            "Bytes of tensors and arrays that reached ranks as arguments (in) or left them as results (out)",
            labels=["group", "direction"],
            unit="",
        )
        for (group, direction), count in sorted(metrics["bytes"].items()):
            moved.add_metric([group, direction], count)
        yield moved


def _register_collector() -> None:
    global _collector_registered
    if _collector_registered:
        return
    try:
        import prometheus_client
    except ImportError:
        logger.info("prometheus_client is not installed in the scheduler: no daskwg_* series on /metrics")
        return
    prometheus_client.REGISTRY.register(_Collector())
    _collector_registered = True
