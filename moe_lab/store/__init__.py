"""The run store: what a run leaves on disk and how it is read back. The run and results folders
(``run_folder``: which subfolders are runs, a cell's state, committed rows), the run log (``runlog``: rows,
manifest, config, lock), the file names of a run and the one status vocabulary, the checkpoint's committed
state (which rows it sealed), the collapse rules that read a run's health from its rows, and the machine a run
ran on. Below ``rl``: the trainer, the launcher, the analysis and the audits all read and write runs through it;
nothing here imports torch at module level, models or the trainer."""
