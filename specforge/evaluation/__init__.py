"""Evaluation of speculative pipelines: τ, acceptance per position, speedup (``specforge eval``)."""

from specforge.evaluation.report import acceptance_plot, comparison_table, save, table
from specforge.evaluation.runner import EvalSettings, aggregate, evaluate, parse_arms, summarize

__all__ = ["EvalSettings", "acceptance_plot", "aggregate", "comparison_table", "evaluate", "parse_arms", "save",
           "summarize", "table"]
