"""Pure statistics over kernel-call durations and serving metrics: no I/O and no dataframes. Callers hand in arrays
grouped by stratum and run and get frozen results back, so every renderer and the CI gate judge the same values. The
model is described in docs/statistics.md.

Imports run one way, each module from those above it only:
distributions (t and normal quantiles) · shares (ratios, shares) · arm_summary (one arm's calls) · widening (how far
an interval reaches) · bootstrap (paired stratified intervals) · verdicts · mcnemar (paired accuracy) ·
serving_intervals (serving means at one point, and their pooling).
"""
