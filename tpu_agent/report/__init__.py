"""The tune's deliverables (report.md, report.json, patch, plan, plots) and the summary `diff` compares."""
