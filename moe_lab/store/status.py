"""The one status vocabulary of the run store: every word a manifest, the runner, `moe-lab progress` and the
tables give a run, a cell or a folder's config, declared here once; every reader and writer takes its words from
here, and each word is spelled once (a set that shares a word names the other set's constant)."""

# A manifest's "status" (the strings committed results hold: never change one):
STATUS_DONE = "done"                # every step ran: finished and final (never recomputed)
STATUS_COLLAPSED = "collapsed"      # a collapse rule of moe_lab/store/health.py stopped it: finished and final like done
STATUS_RUNNING = "running"          # a process trains it (or did, and was killed: then a reader says STATUS_STOPPED)
STATUS_FAILED = "failed"            # an exception ended it (its traceback in the manifest); the runner resumes it
STATUS_INTERRUPTED = "interrupted"  # Ctrl-C stopped it and the runner marked it; the runner resumes it
MANIFEST_STATUSES = (STATUS_DONE, STATUS_COLLAPSED, STATUS_RUNNING, STATUS_FAILED, STATUS_INTERRUPTED)
FINISHED = (STATUS_DONE, STATUS_COLLAPSED)
# What readers and the runner say of a run, never written into a manifest:
STATUS_UNVERIFIED = "unverified"  # says finished, but its tables do not hold the rows it committed: the runner reruns it
STATUS_STOPPED = "stopped"        # says running, but no live process holds its .lock: it resumes from its checkpoint
STATUS_LOCKED = "locked"          # the runner's outcome for a cell another runner holds ('locked: <why>'; nothing written)
# A folder's config against a cell's (runlog.config_state): none yet, this very config, another one.
CONFIG_NEW, CONFIG_SAME, CONFIG_OTHER = "new", "same", "other"
# The runner's state of a cell's folder (RunFolder.cell_state): no config yet; finished (done or collapsed, its tables
# verified); anything else it runs on from its checkpoint; the folder holds another config.
CELL_NEW, CELL_DONE, CELL_RESUME, CELL_CONFLICT = CONFIG_NEW, STATUS_DONE, "resume", "conflict"
CELL_STATES = (CELL_NEW, CELL_DONE, CELL_RESUME, CELL_CONFLICT)
# `moe-lab progress`'s word for each cell, in the order it prints them: the cell states in words (done: finished,
# conflict: other config, new: not started), a resumed cell told apart by its manifest and its .lock.
PROGRESS_FINISHED, PROGRESS_CONFLICT, PROGRESS_NEW = "finished", "other config", "not started"
PROGRESS_STATES = (PROGRESS_FINISHED, STATUS_RUNNING, STATUS_STOPPED, STATUS_INTERRUPTED, STATUS_FAILED,
                   STATUS_UNVERIFIED, PROGRESS_CONFLICT, PROGRESS_NEW)
