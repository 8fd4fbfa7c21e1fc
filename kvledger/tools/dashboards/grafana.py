"""Grafana dashboard JSON from small Python values: panels, rows, template variables.

A `Panel` knows its title, description, queries, unit and whether its series may
be stacked; `Dashboard.to_json()` lays panels out left to right in rows of 24
grid units and numbers them. Panels read the Prometheus data source chosen by
the `datasource` variable. Output is deterministic (same input, same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39  # Grafana 10.4 / 11.x dashboard schema
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
KINDS = ("timeseries", "stat", "bargauge")


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str
    kind: str = "timeseries"
    stack: bool = False  # only where summing the series makes sense
    width: int = 8
    height: int = 8
    min: float | None = None
    max: float | None = None
    axis_label: str = ""
    repeat: str | None = None  # a template variable: one copy of the panel per value
    mappings: tuple[dict[str, Any], ...] = ()
    thresholds: tuple[tuple[float | None, str], ...] = ((None, "green"),)
    negative_y: str | None = None  # a series-name regex drawn below the axis
    lines: str | None = None  # a series-name regex drawn as a line, outside the stack

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"panel {self.title!r}: kind={self.kind!r}, expected one of {KINDS}")
        if not self.description.strip():
            raise ValueError(f"panel {self.title!r}: every panel needs a description")
        if not self.targets:
            raise ValueError(f"panel {self.title!r}: no query")
        if not 1 <= self.width <= GRID_WIDTH:
            raise ValueError(f"panel {self.title!r}: width={self.width}, expected 1..24")

    def to_json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        defaults: dict[str, Any] = {
            "unit": self.unit,
            "thresholds": {
                "mode": "absolute",
                "steps": [{"color": c, "value": v} for v, c in self.thresholds],
            },
            "mappings": list(self.mappings),
            "color": {"mode": "palette-classic" if self.kind == "timeseries" else "thresholds"},
        }
        if self.min is not None:
            defaults["min"] = self.min
        if self.max is not None:
            defaults["max"] = self.max
        if self.kind == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 25 if self.stack else 0,
                "showPoints": "never",
                "spanNulls": False,
                "axisLabel": self.axis_label,
                "stacking": {"mode": "normal" if self.stack else "none", "group": "A"},
            }
        overrides: list[dict[str, Any]] = []
        if self.negative_y:
            overrides.append(
                {
                    "matcher": {"id": "byRegexp", "options": self.negative_y},
                    "properties": [{"id": "custom.transform", "value": "negative-Y"}],
                }
            )
        if self.lines:
            overrides.append(
                {
                    "matcher": {"id": "byRegexp", "options": self.lines},
                    "properties": [
                        {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
                        {"id": "custom.fillOpacity", "value": 0},
                        {"id": "custom.lineWidth", "value": 2},
                    ],
                }
            )
        out: dict[str, Any] = {
            "id": panel_id,
            "type": self.kind,
            "title": self.title,
            "description": self.description,
            "datasource": dict(DATASOURCE),
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": overrides},
            "options": self._options(),
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": dict(DATASOURCE),
                    "expr": t.expr,
                    "legendFormat": t.legend or "__auto",
                    "range": not t.instant,
                    "instant": t.instant,
                }
                for i, t in enumerate(self.targets)
            ],
        }
        if self.repeat:
            out["repeat"] = self.repeat
            out["repeatDirection"] = "h"
            out["maxPerRow"] = max(1, GRID_WIDTH // self.width)
        return out

    def _options(self) -> dict[str, Any]:
        if self.kind == "timeseries":
            return {
                "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull"]},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
        if self.kind == "stat":
            return {
                "reduceOptions": reduce,
                "colorMode": "value",
                "graphMode": "area",
                "textMode": "value_and_name",
                "justifyMode": "auto",
                "orientation": "auto",
            }
        return {"reduceOptions": reduce, "orientation": "horizontal", "displayMode": "gradient"}


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    description: str
    query: str = ""  # label_values(...); for the datasource variable, the default data source

    def to_json(self) -> dict[str, Any]:
        if self.name == "datasource":
            return {
                "name": self.name,
                "label": self.label,
                "description": self.description,
                "type": "datasource",
                "query": "prometheus",
                "current": {"text": self.query, "value": self.query} if self.query else {},
                "hide": 0,
                "includeAll": False,
                "multi": False,
                "options": [],
                "refresh": 1,
                "regex": "",
            }
        return {
            "name": self.name,
            "label": self.label,
            "description": self.description,
            "type": "query",
            "datasource": dict(DATASOURCE),
            "query": self.query,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0,
            "includeAll": True,
            "allValue": ".*",
            "multi": True,
            "options": [],
            "refresh": 2,
            "regex": "",
            "sort": 3,
        }


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    tags: tuple[str, ...]
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    refresh: str = "10s"
    time_from: str = "now-1h"
    links: tuple[dict[str, Any], ...] = field(default=())

    def panels(self) -> list[Panel]:
        return [p for row in self.rows for p in row.panels]

    def to_json(self) -> dict[str, Any]:
        panels: list[dict[str, Any]] = []
        next_id = 1
        y = 0
        for row in self.rows:
            panels.append(
                {
                    "id": next_id,
                    "type": "row",
                    "title": row.title,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                    "panels": [],
                }
            )
            next_id += 1
            y += 1
            x, line_height = 0, 0
            for panel in row.panels:
                if x + panel.width > GRID_WIDTH:
                    x, y, line_height = 0, y + line_height, 0
                panels.append(panel.to_json(next_id, x, y))
                next_id += 1
                x += panel.width
                line_height = max(line_height, panel.height)
            y += line_height
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "editable": True,
            "graphTooltip": 1,
            "timezone": "browser",
            "refresh": self.refresh,
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "weekStart": "",
            "links": list(self.links),
            "annotations": {
                "list": [
                    {
                        "builtIn": 1,
                        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                        "enable": True,
                        "hide": True,
                        "iconColor": "rgba(0, 211, 255, 1)",
                        "name": "Annotations & Alerts",
                        "type": "dashboard",
                    }
                ]
            },
            "templating": {"list": [v.to_json() for v in self.variables]},
            "panels": panels,
        }
