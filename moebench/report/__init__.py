"""HTML reports for run and compare directories (reads only the store)."""
from moebench.report.render import ReportError, render

__all__ = ["render", "ReportError"]
