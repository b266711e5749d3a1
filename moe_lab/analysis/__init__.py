"""Reading results: ``tables`` loads the run folders of an experiment into frames and reduces them over
steps and seeds, ``results`` summarises arms (and re-exports ``tables``), ``stability`` computes the
stability atlas's statistics, ``plots`` / ``stability_plots`` draw figures from those tables and ``figures``
writes an experiment's planned figures. Nothing here trains or imports torch."""
