"""The lab: the studies behind `pmakit experiment` (the paper's experiments, tuning, scaling laws, model copies).

The lab writes result files; `pmakit.report` reads them and never imports the lab.
"""
