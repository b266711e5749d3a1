"""The experiment side: experiment files (arms x seeds, expanded into cells), the runner that runs cells in
worker processes (or on Ray), and the trackers that mirror finished runs. It starts runs through
``moe_lab.rl.loop.train`` and never computes training math. (Named ``launch``, not ``experiments``: the
YAML files of the top-level experiments/ folder ship as the package data ``moe_lab.experiments``.)"""
