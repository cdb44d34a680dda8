"""Reports: the Pareto report (CSV + PNG + HTML), the per-op plan table, and atomic file writes."""
from luminal_num.report.files import atomic_dir, atomic_files, atomic_write_bytes, atomic_write_text
from luminal_num.report.pareto import ReportFiles, write_op_table, write_pareto_report

__all__ = ["ReportFiles", "atomic_dir", "atomic_files", "atomic_write_bytes", "atomic_write_text",
           "write_op_table", "write_pareto_report"]
